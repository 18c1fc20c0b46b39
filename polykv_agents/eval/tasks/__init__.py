"""Long-context tasks with known answers: does an agent over a pooled document still find the fact?

RULER's synthetic tasks (:mod:`.synthetic`) and extractive QA (:mod:`.qa`), each item a document to pool and a
question a role asks over it, scored by string match and token F1 (:mod:`.items`).
"""

from __future__ import annotations

from polykv_agents.eval.tasks.haystack import Haystack
from polykv_agents.eval.tasks.items import TaskItem, best_f1, string_match
from polykv_agents.eval.tasks.qa import QADataMissingError, qa_hotpotqa, qa_squad
from polykv_agents.eval.tasks.synthetic import SYNTHETIC_TASKS, Generator

TASKS: dict[str, Generator] = {**SYNTHETIC_TASKS, "qa_squad": qa_squad, "qa_hotpotqa": qa_hotpotqa}
"""Every task by name: the synthetic ones, then the QA ones (which need the QA data installed)."""

__all__ = ["TASKS", "Haystack", "QADataMissingError", "TaskItem", "best_f1", "string_match"]
