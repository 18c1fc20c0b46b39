"""One task item (a document to pool, the question a role asks over it, the references) and how an answer is
scored, as RULER and LongBench score them.

- ``all`` (RULER's ``string_match_all``): the fraction of the references that appear in the answer, case
  folded. Needle retrieval, variable tracking and common-word extraction: every value asked for must be named.
- ``part`` (RULER's ``string_match_part``): 1 if any reference appears in the answer. Extractive QA, whose
  references are alternative phrasings of one answer.
- token F1 (LongBench, SQuAD): the best F1 of the answer against any reference, after SQuAD normalisation;
  reported next to the string match for every item.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from polykv_agents.eval.agreement import token_f1

Metric = Literal["all", "part"]


@dataclass(frozen=True)
class TaskItem:
    """One question over one document. The document is what is pooled; the question is asked after it."""

    task: str
    """The task's name (``niah_single``, ``qa_squad``, ...)."""
    document: str
    question: str
    answers: tuple[str, ...]
    """The references: every one must be named (``metric="all"``) or any one (``"part"``)."""
    metric: Metric
    max_new_tokens: int
    """Tokens an answer may take: enough for every reference, as RULER's per-task budgets."""
    answer_prefix: str
    """How the answer starts (RULER's answer prefix, after its ``Answer:``): the model continues it, so a base
    model answers instead of repeating the question. It is not part of the scored answer."""


def string_match(prediction: str, answers: Sequence[str], metric: Metric) -> float:
    """RULER's string match of ``prediction`` against ``answers``, in ``[0, 1]``."""
    if not answers:
        msg = "an item needs at least one reference answer"
        raise ValueError(msg)
    text = prediction.lower()
    found = [answer.lower() in text for answer in answers]
    return sum(found) / len(found) if metric == "all" else float(any(found))


def best_f1(prediction: str, answers: Sequence[str]) -> float:
    """The highest token F1 of ``prediction`` against any reference."""
    return max(token_f1(prediction, answer) for answer in answers)
