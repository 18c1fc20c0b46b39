"""``python -m benchmarks blocks``: the critic reading the specialists' findings moved from their own calls
(``reuse="blocks"``), against prefilling them, in time to first token and in what the critic decides.

Per document (pydoc_data.topics, the independent samples), over one pool of it:

1. ``roles`` specialists answer as the review graph asks them (``graphs/document_review.py``: their system
   prompts, the same plan focus for every role), at most ``finding_tokens`` tokens each, on an engine that keeps
   blocks. Their calls leave their tokens in it.
2. The critic's messages are built from those findings exactly as the graph builds them, and sent:
   - **prefill**: on an engine without any reuse (``max_prefix_bytes=0``): every token of its own prefilled.
     This is the reference: a full prefill of the same prompt;
   - **exact**: on the blocks engine with ``reuse="exact"``: the prefix tree's exact start, the findings
     prefilled;
   - **blocks r**: on the blocks engine with ``reuse="blocks"``, the first fraction ``r`` of each moved block
     recomputed.
   A blocks call first, at ``r = 1`` and not reported, stores the critic's exact start (its system prompt), so
   every reported setting on that engine reads the same exact start (a blocks call never stores past it);
   **exact** runs last, since it stores the whole prompt.

Per setting: the critic's time to first token (queue and prefill, composing included), its answer's greedy
tokens agreeing with the reference's, and **judge consistency**: whether the first role the critic names
(its verdict on the weakest finding) is the one it names after a full prefill (arXiv 2601.08343's caution).
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

BLOCK_BUDGET_BYTES = 1024**3
"""Blocks kept by the measured engine: enough for every call of a document, so nothing is evicted."""


class BlocksOptions(SuiteOptions):
    context_tokens: int = Field(default=2048, ge=64)
    """Document tokens in the pool."""
    roles: int = Field(default=15, ge=2, le=15)
    """Specialists whose findings the critic reads."""
    finding_tokens: int = Field(default=48, ge=16)
    """Most tokens of every finding (each ends where the model ends it)."""
    critic_tokens: int = Field(default=32, ge=1)
    """Tokens of the critic's answer (EOS ignored)."""
    fractions: list[float] = Field(default=[0.0, 0.15, 0.5, 1.0], min_length=1)
    """Fractions of each moved block recomputed, one setting each."""
    documents: int = Field(default=12, ge=1)
    """Documents measured (independent samples)."""
    graphs: Path = LANGGRAPH_JSON
    """The langgraph.json that lists document_review (default: the repository's, from its root)."""
    model: str | None = None
    """Local HF model dir or cached id; default: embedded."""


class BlocksResult(BaseModel):
    run_info: RunInfo
    context_tokens: int
    roles: int
    finding_tokens: int
    critic_tokens: int
    documents: int
    calls: list[dict[str, Any]]
    """One row per (document, setting): the critic call's figures."""
    settings: list[dict[str, Any]]
    """One row per setting: medians and shares over the documents."""


def _engine(**kwargs):
    from polykv_agents.engine import Engine

    return Engine(scheduler_idle_seconds=None, **kwargs)


def judged_role(answer: str, roles: list[str]) -> str | None:
    """The first of ``roles`` the critic's answer names (its verdict), ``None`` if it names none."""
    lowered = answer.lower()
    named = [(lowered.find(role.lower()), role) for role in roles if role.lower() in lowered]
    return min(named)[1] if named else None


def _agreeing_tokens(tokenizer, answer: str, reference: str) -> int:
    """How many leading tokens ``answer`` shares with ``reference``."""
    from polykv_agents.runtime.prefix_tree import common_length

    return common_length(tokenizer(answer).input_ids, tokenizer(reference).input_ids)


def _critic_call(chat, messages, roles: list[str], **settings) -> dict[str, Any]:
    reply = chat.invoke(messages, **settings)
    usage = reply.usage_metadata
    return {
        "ttft_s": reported_ttft(reply),
        "prompt_tokens": usage["input_tokens"],
        "cache_read": usage["input_token_details"]["cache_read"],
        "block_tokens": reply.response_metadata["block_tokens"],
        "answer": reply.text,
        "judged": judged_role(reply.text, roles),
    }


def _document_calls(document: str, model, tokenizer, workflow, roles, options: BlocksOptions) -> list[dict]:
    from langchain_core.messages import HumanMessage

    from benchmarks.studies.graph_e2e import equal_plan
    from polykv_agents.chat.chat_model import ChatPolyKV
    from polykv_agents.model.loading import DEFAULT_MODEL
    from polykv_agents.pool.shared_pool import SharedKVPool

    pool = SharedKVPool.prefill(model, tokenizer, document)
    blocks, plain = _engine(max_block_bytes=BLOCK_BUDGET_BYTES), _engine(max_prefix_bytes=0)
    name = options.model or DEFAULT_MODEL

    def chat(engine, tokens: int, ignore_eos: bool = True):
        return ChatPolyKV(model=name, max_tokens=tokens, ignore_eos=ignore_eos, engine=engine).with_pool(pool)

    focus = equal_plan(roles)
    # Findings end where the model ends them, as in the graph: decoding past the end of the turn would write
    # template markup that the critic's prompt, which holds the findings' text, does not repeat.
    specialists = chat(blocks, options.finding_tokens, ignore_eos=False)
    answers = specialists.batch([workflow.specialist_messages(r, focus[r]) for r in roles])
    findings = [{"role": role, "text": answer.text} for role, answer in zip(roles, answers, strict=True)]
    critic = workflow.critic_messages(findings, roles)
    chat(plain, 1).invoke([HumanMessage("Ready?")])  # the plain engine's scheduler starts outside the measurement
    calls = [{"setting": "prefill", **_critic_call(chat(plain, options.critic_tokens), critic, roles)}]
    critic_chat = chat(blocks, options.critic_tokens)
    _critic_call(critic_chat, critic, roles, reuse="blocks", block_recompute=1.0)  # stores the exact start
    for fraction in options.fractions:
        figures = _critic_call(critic_chat, critic, roles, reuse="blocks", block_recompute=fraction)
        calls.append({"setting": f"blocks {fraction:g}", "fraction": fraction, **figures})
    calls.append({"setting": "exact", **_critic_call(critic_chat, critic, roles)})
    reference = calls[0]
    for call in calls:
        call["same_judge"] = call["judged"] == reference["judged"]
        call["agreeing_tokens"] = _agreeing_tokens(tokenizer, call["answer"], reference["answer"])
        call["speedup"] = reference["ttft_s"] / call["ttft_s"]
    blocks.close()
    plain.close()
    return calls


def run_blocks(options: BlocksOptions, progress: Progress = lambda _: None) -> BlocksResult:
    from benchmarks.studies.graph_e2e import EXTRA_ROLES
    from benchmarks.studies.workflows import load_workflow
    from polykv_agents.eval.corpus import pydoc_documents

    model, tokenizer = load_model_for(options.model)
    workflow = load_workflow("document_review", options.graphs)
    roles = [*workflow.ROLE_PROMPTS, *EXTRA_ROLES][: options.roles]
    texts = pydoc_documents(options.documents + 1, chars_per_document=8 * options.context_tokens)
    documents = [tokenizer.decode(tokenizer(t).input_ids[: options.context_tokens]) for t in texts]
    calls = []
    for index, document in enumerate(documents):  # the first is the warm-up
        progress(f"document {index} of {options.documents} (0: warm-up)")
        figures = _document_calls(document, model, tokenizer, workflow, roles, options)
        if index:
            calls += [{"document": index, **call} for call in figures]
    return BlocksResult(
        run_info=RunInfo.collect(model), context_tokens=options.context_tokens, roles=len(roles),
        finding_tokens=options.finding_tokens, critic_tokens=options.critic_tokens, documents=options.documents,
        calls=calls, settings=_setting_rows(calls),
    )  # fmt: skip


def _setting_rows(calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
    from scipy.stats import binomtest

    rows = []
    for setting in dict.fromkeys(call["setting"] for call in calls):
        own = [call for call in calls if call["setting"] == setting]
        same = sum(call["same_judge"] for call in own)
        interval = binomtest(same, len(own)).proportion_ci(confidence_level=0.95, method="wilson")
        rows.append({
            "setting": setting,
            "documents": len(own),
            "ttft_s": statistics.median(call["ttft_s"] for call in own),
            "ttft_s_low": min(call["ttft_s"] for call in own),
            "ttft_s_high": max(call["ttft_s"] for call in own),
            "speedup": statistics.median(call["speedup"] for call in own),
            "cache_read": statistics.median(call["cache_read"] for call in own),
            "block_tokens": statistics.median(call["block_tokens"] for call in own),
            "prompt_tokens": statistics.median(call["prompt_tokens"] for call in own),
            "same_judge": same / len(own),
            "same_judge_low": interval.low,
            "same_judge_high": interval.high,
            "agreeing_tokens": statistics.median(call["agreeing_tokens"] for call in own),
            "named_a_role": sum(call["judged"] is not None for call in own) / len(own),
        })  # fmt: skip
    return rows


def render_markdown(result: BlocksResult) -> str:
    rows = [
        {**row, "ttft": f"{row['ttft_s']:.2f} ({row['ttft_s_low']:.2f}-{row['ttft_s_high']:.2f})",
         "judge": f"{row['same_judge']:.0%} ({row['same_judge_low']:.0%}-{row['same_judge_high']:.0%})"}
        for row in result.settings
    ]  # fmt: skip
    table = markdown_table(
        rows,
        [
            column("critic's setting", "setting"),
            column("prompt tokens (median)", "prompt_tokens", "{:,.0f}"),
            column("cache_read (median)", "cache_read", "{:,.0f}"),
            column("of it moved (median)", "block_tokens", "{:,.0f}"),
            column("first token, s (median, range)", "ttft"),
            column("x faster than prefill (median)", "speedup", "{:.1f}"),
            column("same verdict as prefill (95% CI)", "judge"),
            column("greedy tokens agreeing (median)", "agreeing_tokens", "{:.0f}"),
        ],
    )
    info = result.run_info
    named = {row["setting"]: row["named_a_role"] for row in result.settings}["prefill"]
    conditions = (
        info.machine_and_model() + f" Pool: {result.context_tokens:,} tokens of a pydoc_data.topics "
        f"document; {result.roles} specialists' findings of at most {result.finding_tokens} tokens each; the critic "
        f"answers {result.critic_tokens} tokens (EOS ignored). {result.documents} documents (the independent samples) "
        "after 1 warm-up document; ranges are the lowest and highest document. The verdict is the first role the "
        f"critic names; after a full prefill it named one in {named:.0%} of documents. Intervals: Wilson, 95%. "
        f"{info.date}."
    )
    prefill = next(row["ttft_s"] for row in result.settings if row["setting"] == "prefill")
    slower = [row["setting"] for row in result.settings if row["ttft_s"] > prefill]
    if slower:
        conditions += f" Slower to the first token than the full prefill: {', '.join(slower)}."
    conditions += (
        " Every figure is warm: each engine's scheduler had started before the critic's calls (the cold start, "
        "decoding the pool once, is the same for every setting)."
    )
    return f'# The critic reading moved findings (reuse="blocks")\n\n{conditions}\n\n{table}\n'


def readme_summary(result: BlocksResult) -> str:
    rows = {row["setting"]: row for row in result.settings}
    default = rows.get("blocks 0.15") or next(r for r in result.settings if r["setting"].startswith("blocks"))
    exact = rows["exact"]
    return (
        f'With `reuse="blocks"` ({default["setting"].split()[1]} of each block recomputed), the critic of a '
        f"{result.roles}-specialist review over a {result.context_tokens:,}-token pool read "
        f"{default['block_tokens']:,.0f} of its {default['prompt_tokens'] - result.context_tokens:,.0f} own tokens "
        f"moved from the specialists' calls and got its first token {default['speedup']:.1f}x as fast as a full "
        f"prefill of its prompt. Its verdict (the first role it names, or none) was the full prefill's in "
        f"{default['same_judge']:.0%} of {result.documents} documents (95% CI {default['same_judge_low']:.0%}-"
        f"{default['same_judge_high']:.0%}), and its answer kept the full prefill's first "
        f"{default['agreeing_tokens']:.0f} tokens (median). With exact reuse only: {exact['speedup']:.1f}x, the "
        f"same verdict in {exact['same_judge']:.0%} and {exact['agreeing_tokens']:.0f} tokens (bf16 rounding differs "
        "between the two engines' batches) (`python -m benchmarks blocks`; [table](../benchmarks/results/blocks.md))."
    )


class BlocksSuite(JsonSuite[BlocksResult]):
    name = "blocks"
    summary = "The critic reading the specialists' findings moved from their calls: first token and verdict."
    result_type = BlocksResult
    options = BlocksOptions
    reproduce = ((),)

    def run(self, options: BlocksOptions, progress: Progress) -> BlocksResult:
        return run_blocks(options, progress)

    def markdown(self, result: BlocksResult) -> str:
        return render_markdown(result)

    def rendered(self, result: BlocksResult) -> Rendered:
        title = '# The critic reading moved findings (reuse="blocks")\n'
        section = [
            '## The critic reading moved findings (reuse="blocks")',
            "",
            "Produced by `python -m benchmarks blocks`.",
            render_markdown(result).removeprefix(title).rstrip("\n"),
        ]
        return Rendered(results=section, blocks={"blocks": readme_summary(result)})


SUITE = BlocksSuite()
