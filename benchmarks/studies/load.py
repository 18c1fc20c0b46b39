"""Load: many concurrent chat calls over one pool must each give exactly the answer they give alone.

Data flow of :func:`run_load`:
  ``n`` cases = (role prompt, question) pairs over ``len(roles)`` roles, all different prompts
  -> the sequential reference: each case invoked alone, one after the other (greedy)
  -> all ``n`` cases invoked at once, from threads (``Runnable.batch`` with ``max_concurrency=n``)
     and from asyncio (``asyncio.gather`` of ``ainvoke``), through the pool's batched scheduler
  -> every concurrent answer compared with its reference: any difference is cross-talk between
     agents (or a broken row), and is counted.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

from langchain_core.language_models import BaseChatModel
from langchain_core.messages import BaseMessage, HumanMessage, SystemMessage

QUESTIONS = (
    "What is this document about?",
    "Name one thing the document defines.",
    "What would a newcomer find hardest here?",
    "Give one example from the document.",
    "What is the most important rule in it?",
    "Which term appears most often?",
    "What does the document leave out?",
    "Summarise the first part in one sentence.",
    "What is a common mistake it warns about?",
    "Who is the document written for?",
    "What should be checked first?",
    "Quote one short phrase from it.",
    "What changes if the rule is ignored?",
    "List two keywords.",
)


@dataclass(frozen=True)
class LoadCase:
    role: str
    question: str

    def messages(self) -> list[BaseMessage]:
        return [
            SystemMessage(f"You are the {self.role}. Answer from the document, briefly."),
            HumanMessage(self.question),
        ]


def load_cases(n: int, roles: Sequence[str]) -> list[LoadCase]:
    """``n`` distinct cases cycling over ``roles`` (so every role is used) and :data:`QUESTIONS`."""
    if n > len(roles) * len(QUESTIONS):
        msg = f"at most {len(roles) * len(QUESTIONS)} distinct cases with {len(roles)} roles; pass more roles"
        raise ValueError(msg)
    return [LoadCase(roles[i % len(roles)], QUESTIONS[(i // len(roles)) % len(QUESTIONS)]) for i in range(n)]


@dataclass(frozen=True)
class LoadResult:
    mode: str
    """``sequential``, ``threads`` or ``asyncio``."""
    calls: int
    seconds: float
    mismatches: int
    """Answers that differ from the same case invoked alone (0 for ``sequential``, the reference)."""
    output_chars: int


def _invoke_sequential(chat: BaseChatModel, cases: Sequence[LoadCase]) -> list[str]:
    return [str(chat.invoke(case.messages()).content) for case in cases]


def _invoke_threads(chat: BaseChatModel, cases: Sequence[LoadCase]) -> list[str]:
    messages = [case.messages() for case in cases]
    return [str(m.content) for m in chat.batch(messages, config={"max_concurrency": len(cases)})]


def _invoke_asyncio(chat: BaseChatModel, cases: Sequence[LoadCase]) -> list[str]:
    async def all_at_once() -> list[str]:
        replies = await asyncio.gather(*(chat.ainvoke(case.messages()) for case in cases))
        return [str(m.content) for m in replies]

    return asyncio.run(all_at_once())


_MODES = {"sequential": _invoke_sequential, "threads": _invoke_threads, "asyncio": _invoke_asyncio}


def run_load(
    chat: BaseChatModel, cases: Sequence[LoadCase], modes: Sequence[str] = ("threads", "asyncio")
) -> tuple[list[LoadResult], dict[str, list[str]]]:
    """Run ``cases`` alone one by one, then all at once per mode; returns results and every answer by mode."""
    answers: dict[str, list[str]] = {}
    results = []
    for mode in ("sequential", *modes):
        started = time.perf_counter()
        answers[mode] = _MODES[mode](chat, cases)
        seconds = time.perf_counter() - started
        mismatches = sum(a != b for a, b in zip(answers[mode], answers["sequential"], strict=True))
        results.append(LoadResult(mode, len(cases), seconds, mismatches, sum(map(len, answers[mode]))))
    return results, answers
