"""``python -m benchmarks reuse``: what exact reuse of earlier calls' tokens (the pool's prefix tree) saves.

Two workloads over one pool of a pydoc_data.topics document on the embedded model, each with the prefix tree
on (the default engine) and off (``Engine(max_prefix_bytes=0)``: every call prefills all of its own tokens):

- **conversation**: a ``turns``-turn conversation with a pooled ChatPolyKV, each turn the whole history so
  far plus a new question (a follow-up turn on a LangGraph thread; a ReAct loop's steps grow the same way).
  Equal work: the tree-on run decides the answers, and the tree-off run is sent exactly the same messages.
  Per turn: time to first token (the engine's queue and prefill seconds), prompt tokens and ``cache_read``.
- **review**: the document-review graph (``graphs/document_review.py``, ``roles`` specialists). Per stage:
  ``cache_read`` and prefill seconds of its calls. The summarizer continues the critic's conversation, so with
  the tree it prefills only its own turn.

Every answer is ``new_tokens`` long (EOS ignored). Medians over ``documents`` documents (independent
samples), after one warm-up run on another document.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from benchmarks.studies.workflows import LANGGRAPH_JSON
from polykv_agents.bench.environment import RunInfo
from polykv_agents.bench.output import Progress, column, markdown_table
from polykv_agents.bench.suite import JsonSuite, Rendered, SuiteOptions, load_model_for
from polykv_agents.bench.ttft import reported_ttft

QUESTIONS = (
    "What is this document about?",
    "Which term does it define first?",
    "Give one example it uses.",
    "What does it say about errors?",
    "Which statement does it describe?",
    "What would a beginner find hardest here?",
    "Name one keyword it mentions.",
    "What does it say about scope?",
    "Summarise the last answer in one line.",
    "What is missing from the document?",
    "Which part would you test first?",
    "What is the most important sentence?",
)
"""The conversation's questions, one per turn, in order."""

SYSTEM_PROMPT = "You are a careful assistant. You answer from the document."


class ReuseOptions(SuiteOptions):
    context_tokens: int = Field(default=2048, ge=64)
    """Document tokens in the pool."""
    turns: int = Field(default=10, ge=2, le=len(QUESTIONS))
    """Turns of the conversation."""
    new_tokens: int = Field(default=32, ge=1)
    """Tokens of every answer (EOS ignored)."""
    roles: int = Field(default=5, ge=1, le=15)
    """Specialists in the review."""
    documents: int = Field(default=3, ge=1)
    """Documents measured (independent samples; medians over them)."""
    graphs: Path = LANGGRAPH_JSON
    """The langgraph.json that lists document_review (default: the repository's, from its root)."""
    model: str | None = None
    """Local HF model dir or cached id; default: embedded."""


class ReuseResult(BaseModel):
    run_info: RunInfo
    context_tokens: int
    new_tokens: int
    documents: int
    roles: int
    conversation: list[dict[str, Any]]
    """One row per (turn, tree): medians over the documents."""
    review: list[dict[str, Any]]
    """One row per (stage, tree): medians over the documents of the stage's calls."""


def _engines() -> dict[str, Any]:
    from polykv_agents.engine import Engine

    return {"on": Engine(scheduler_idle_seconds=None), "off": Engine(scheduler_idle_seconds=None, max_prefix_bytes=0)}


def _chat(options: ReuseOptions, engine):
    """Every call's chat model: greedy, ``new_tokens`` long whatever the model says."""
    from polykv_agents.chat.chat_model import ChatPolyKV
    from polykv_agents.model.loading import DEFAULT_MODEL

    model = options.model or DEFAULT_MODEL
    return ChatPolyKV(model=model, max_tokens=options.new_tokens, ignore_eos=True, engine=engine)


def _call_figures(message) -> dict[str, float]:
    usage = message.usage_metadata
    return {
        "ttft_s": reported_ttft(message),
        "prompt_tokens": usage["input_tokens"],
        "cache_read": usage["input_token_details"]["cache_read"],
    }


def _conversation(pool, engines: dict[str, Any], options: ReuseOptions) -> dict[str, list[dict[str, float]]]:
    """Per tree setting, the figures of every turn; the tree-on run's answers are the history of both."""
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage

    chats = {name: _chat(options, engine).with_pool(pool) for name, engine in engines.items()}
    history: list = [SystemMessage(SYSTEM_PROMPT)]
    figures: dict[str, list[dict[str, float]]] = {name: [] for name in chats}
    for question in QUESTIONS[: options.turns]:
        history.append(HumanMessage(question))
        replies = {name: chat.invoke(history) for name, chat in chats.items()}
        for name, reply in replies.items():
            figures[name].append(_call_figures(reply))
        history.append(AIMessage(replies["on"].text))
    return figures


def _review(document: str, engines: dict[str, Any], options: ReuseOptions, graphs: Path):
    """Per tree setting, per stage, the figures of the stage's calls in one review run."""
    from benchmarks.studies.workflows import load_workflow

    workflow = load_workflow("document_review", graphs)
    roles = list(workflow.ROLE_PROMPTS)[: options.roles]
    figures: dict[str, dict[str, list[dict[str, float]]]] = {}
    for name, engine in engines.items():
        chat = _chat(options, engine)
        state = workflow.build_graph(chat=chat, engine=engine).invoke({"document": document, "roles": roles})
        by_stage: dict[str, list[dict[str, float]]] = {}
        for message in state["messages"]:
            stage = "specialist" if message.name in roles else message.name
            by_stage.setdefault(stage, []).append(_call_figures(message))
        figures[name] = by_stage
    return figures


def run_reuse(options: ReuseOptions, progress: Progress = lambda _: None) -> ReuseResult:
    from polykv_agents.eval.corpus import pydoc_documents
    from polykv_agents.pool.shared_pool import SharedKVPool

    model, tokenizer = load_model_for(options.model)
    texts = pydoc_documents(options.documents + 1, chars_per_document=8 * options.context_tokens)
    documents = [tokenizer.decode(tokenizer(t).input_ids[: options.context_tokens]) for t in texts]
    turns: dict[str, list[list[dict[str, float]]]] = {"on": [], "off": []}
    stages: dict[str, list[dict[str, list[dict[str, float]]]]] = {"on": [], "off": []}
    engines = _engines()  # each document has pools, so trees, of its own
    for index, document in enumerate(documents):  # the first is the warm-up
        progress(f"document {index} of {options.documents} (0: warm-up)")
        pool = SharedKVPool.prefill(model, tokenizer, document)
        conversation = _conversation(pool, engines, options)
        review = _review(document, engines, options, options.graphs)
        if index == 0:
            continue
        for name in turns:
            turns[name].append(conversation[name])
            stages[name].append(review[name])
    for engine in engines.values():
        engine.close()
    return ReuseResult(
        run_info=RunInfo.collect(model), context_tokens=options.context_tokens, new_tokens=options.new_tokens,
        documents=options.documents, roles=options.roles, conversation=_turn_rows(turns), review=_stage_rows(stages),
    )  # fmt: skip


def _median_of(calls: list[dict[str, float]], key: str) -> float:
    return statistics.median(call[key] for call in calls)


def _summarised(per_document: list[list[dict[str, float]]]) -> dict[str, float]:
    """Every figure's median over all calls, and the range over documents (the independent samples) of the
    first-token time: the lowest and highest per-document median."""
    calls = [call for document in per_document for call in document]
    ttft = [_median_of(document, "ttft_s") for document in per_document]
    return {**{key: _median_of(calls, key) for key in calls[0]}, "ttft_s_low": min(ttft), "ttft_s_high": max(ttft)}


def _turn_rows(turns: dict[str, list[list[dict[str, float]]]]) -> list[dict[str, Any]]:
    return [
        {"tree": name, "turn": turn + 1, **_summarised([[run[turn]] for run in runs])}
        for name, runs in turns.items()
        for turn in range(len(runs[0]))
    ]


def _stage_rows(stages: dict[str, list[dict[str, list[dict[str, float]]]]]) -> list[dict[str, Any]]:
    return [
        {"tree": name, "stage": stage, "calls": len(runs[0][stage]), **_summarised([run[stage] for run in runs])}
        for name, runs in stages.items()
        for stage in runs[0]
    ]


def _ttft(row: dict[str, Any]) -> str:
    """``median (low-high)`` seconds to the first token."""
    return f"{row['ttft_s']:.2f} ({row['ttft_s_low']:.2f}-{row['ttft_s_high']:.2f})"


def render_markdown(result: ReuseResult) -> str:
    on = {r["turn"]: r for r in result.conversation if r["tree"] == "on"}
    off = {r["turn"]: r for r in result.conversation if r["tree"] == "off"}
    turn_rows = [
        {"turn": t, "prompt": on[t]["prompt_tokens"], "read_on": on[t]["cache_read"], "ttft_on": _ttft(on[t]),
         "read_off": off[t]["cache_read"], "ttft_off": _ttft(off[t])}
        for t in sorted(on)
    ]  # fmt: skip
    turns = markdown_table(
        turn_rows,
        [
            column("turn", "turn"),
            column("prompt tokens (pool + own)", "prompt", "{:,.0f}"),
            column("cache_read, tree on", "read_on", "{:,.0f}"),
            column("first token, tree on, s", "ttft_on"),
            column("cache_read, tree off", "read_off", "{:,.0f}"),
            column("first token, tree off, s", "ttft_off"),
        ],
    )
    review = markdown_table(
        [{**row, "ttft": _ttft(row)} for row in result.review],
        [
            column("prefix tree", "tree"),
            column("stage", "stage"),
            column("calls", "calls"),
            column("prompt tokens (median)", "prompt_tokens", "{:,.0f}"),
            column("cache_read (median)", "cache_read", "{:,.0f}"),
            column("first token, s (median, range)", "ttft"),
        ],
    )
    info = result.run_info
    conditions = (
        info.machine_and_model() + f" Pool: {result.context_tokens} tokens of a pydoc_data.topics document. "
        f"Every answer {result.new_tokens} tokens (EOS ignored). Medians over {result.documents} documents after "
        "1 warm-up document; a range is the lowest and highest per-document median. Turn 1 and the planner are "
        f"cold for both engines: each one's scheduler decodes the new pool inside them. {info.date}."
    )
    with_tree = {r["stage"]: r["ttft_s"] for r in result.review if r["tree"] == "on"}
    off_wins = [r["stage"] for r in result.review if r["tree"] == "off" and r["ttft_s"] < with_tree[r["stage"]]]
    if off_wins:
        conditions += (
            f" Without the tree, the first token came sooner for: {', '.join(off_wins)} (their calls read next to "
            "nothing stored; concurrent calls' first tokens also depend on how they are grouped into admissions)."
        )
    return (
        f"# Exact reuse of earlier calls' tokens\n\n{conditions}\n\n"
        "## A conversation over the pool, turn by turn\n\nEach turn sends the whole history and a new question; "
        "the tree-off engine gets exactly the same messages.\n\n"
        f"{turns}\n\n## The document review, stage by stage ({result.roles} specialists)\n\n{review}\n"
    )


def readme_summary(result: ReuseResult) -> str:
    on = [r for r in result.conversation if r["tree"] == "on"]
    off = [r for r in result.conversation if r["tree"] == "off"]
    last = len(on)
    summarizer = {r["tree"]: r for r in result.review if r["stage"] == "summarizer"}
    return (
        f"A {last}-turn conversation over a {result.context_tokens:,}-token pool on {result.run_info.model} "
        f"({result.run_info.dtype}): turn {last}'s first token after {on[-1]['ttft_s']:.2f} s with the prefix tree "
        f"(turn 1: {on[0]['ttft_s']:.2f} s) against {off[-1]['ttft_s']:.2f} s without it; in the review, the "
        f"summarizer read {summarizer['on']['cache_read']:,.0f} of {summarizer['on']['prompt_tokens']:,.0f} tokens "
        f"(without the tree: {summarizer['off']['cache_read']:,.0f}) and its first token came after "
        f"{summarizer['on']['ttft_s']:.2f} s against {summarizer['off']['ttft_s']:.2f} s "
        f"(`python -m benchmarks reuse`, medians of {result.documents} documents; "
        "[table](../benchmarks/results/reuse.md))."
    )


class ReuseSuite(JsonSuite[ReuseResult]):
    name = "reuse"
    summary = "Exact reuse of earlier calls' tokens: a conversation turn by turn, and the review stage by stage."
    result_type = ReuseResult
    options = ReuseOptions
    reproduce = ((),)

    def run(self, options: ReuseOptions, progress: Progress) -> ReuseResult:
        return run_reuse(options, progress)

    def markdown(self, result: ReuseResult) -> str:
        return render_markdown(result)

    def rendered(self, result: ReuseResult) -> Rendered:
        body = render_markdown(result).removeprefix("# Exact reuse of earlier calls' tokens\n")
        section = [
            "## Exact reuse of earlier calls' tokens",
            "",
            "Produced by `python -m benchmarks reuse`.",
            body.replace("\n## ", "\n### ").rstrip("\n"),
        ]
        return Rendered(results=section, blocks={"reuse": readme_summary(result)})


SUITE = ReuseSuite()
