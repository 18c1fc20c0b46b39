"""``python -m benchmarks shared_step_profile``: where a decode step's time goes when its rows come from several
pools, op by op, with the native attention kernel and with the PyTorch path.

``serve_time`` measured that a step shared by eight reviews' pools cost about 150 ms against about 56 ms for one
review's step, about 8 ms per added row against about 4 ms for a row of the same pool. Here the same number of
rows (agents) decodes over 1, 2, 4 or 8 pools of distinct pydoc_data.topics documents, one engine, under
``torch.profiler``: each step (``polykv::decode_step`` for a pool stepping alone, ``polykv::shared_step`` for
several pools in one forward) is taken apart into operator groups as the ``profile`` suite does
(:mod:`benchmarks.studies.step_profile`), and the operator calls per step are counted: each pool's group pays its
own attention operators in every layer. Each configuration runs once with the native kernel
(:mod:`polykv_agents.kernels`, one call per layer for every group) and once with ``POLYKV_AGENTS_KERNELS=0``,
interleaved in one process, so the two paths meet the same machine.
"""

from __future__ import annotations

import os
import statistics
from typing import Any

from pydantic import BaseModel, Field, field_validator

from benchmarks.studies.step_profile import operator_group, step_breakdown
from polykv_agents.bench.environment import RunInfo
from polykv_agents.bench.output import Progress, column, markdown_table
from polykv_agents.bench.suite import JsonSuite, Rendered, SuiteOptions
from polykv_agents.kernels import SWITCH
from polykv_agents.runtime.model_steps import SHARED_STEP_LABEL
from polykv_agents.runtime.scheduler import DECODE_STEP_LABEL

PATHS = ("native", "pytorch")
"""``native``: the kernel serves every group it takes; ``pytorch``: ``POLYKV_AGENTS_KERNELS=0``."""

STEP_LABELS = {DECODE_STEP_LABEL: "one pool", SHARED_STEP_LABEL: "shared"}


class SharedStepOptions(SuiteOptions):
    context_tokens: int = Field(default=2048, ge=16, json_schema_extra={"flag": "--context"})
    """Document tokens in each pool."""
    rows: int = Field(default=16, ge=1)
    """Agents decoding at once, spread over the pools in turn."""
    pools: list[int] = Field(default=[1, 2, 4, 8], json_schema_extra={"flag": "--pools"})
    """Pools (distinct documents) the rows are spread over (repeatable)."""
    paths: list[str] = Field(default=list(PATHS), json_schema_extra={"flag": "--path"})
    """Attention paths (repeatable): native, pytorch."""
    new_tokens: int = Field(default=24, ge=4)
    """Tokens each agent decodes under the profiler (after one unprofiled warm-up run)."""
    model: str | None = None
    """Local HF model dir or cached id; default: embedded."""

    @field_validator("paths")
    @classmethod
    def _known_paths(cls, paths: list[str]) -> list[str]:
        other = [path for path in paths if path not in PATHS]
        if other:
            msg = f"--path {other[0]!r} is not one of {PATHS}"
            raise ValueError(msg)
        return paths


class SharedStepResult(BaseModel):
    run_info: RunInfo
    context_tokens: int
    rows_per_step: int
    new_tokens: int
    rows: list[dict[str, Any]]


def _label_figures(events: list[Any], label: str) -> dict[str, Any] | None:
    """One step label's figures: steps, median and mean ms, ms per operator group, operator calls per step."""
    step_ms, operators, calls = step_breakdown(events, label)
    if not step_ms:
        return None
    steps, mean_step = len(step_ms), statistics.fmean(step_ms)
    groups: dict[str, float] = {}
    for name, ms in operators.items():
        groups[operator_group(name)] = groups.get(operator_group(name), 0.0) + ms / steps
    groups["outside operators"] = mean_step - sum(groups.values())
    return {
        "steps": steps, "step_ms_median": statistics.median(step_ms), "step_ms_mean": mean_step,
        "groups_ms": groups, "operator_calls_per_step": calls / steps,
    }  # fmt: skip


def profile_pools(model, tokenizer, pools, roles, *, rows: int, new_tokens: int) -> dict[str, dict[str, Any]]:
    """``rows`` agents over ``pools`` in turn decode ``new_tokens`` each at once, profiled after a warm-up run;
    per step label (``one pool``, ``shared``), its figures."""
    from torch.profiler import ProfilerActivity, profile

    from polykv_agents.agent import PooledAgent
    from polykv_agents.bench.agents import answer_all
    from polykv_agents.engine import Engine
    from polykv_agents.model.compute_thread import run_on_compute_thread
    from polykv_agents.sampling.settings import GenerationSettings

    engine = Engine(scheduler_idle_seconds=None, max_prefix_bytes=0)
    try:
        crew = [
            PooledAgent(pools[i % len(pools)], model, tokenizer, system_prompt=roles[i][0], engine=engine)
            for i in range(rows)
        ]
        questions = [question for _, question in roles[:rows]]
        settings = GenerationSettings(max_new_tokens=new_tokens, ignore_eos=True)
        answer_all(crew, questions, settings)  # warm-up: first steps, thread start, the kernel built
        profiler = profile(activities=[ProfilerActivity.CPU])
        run_on_compute_thread(profiler.__enter__)
        try:
            answer_all(crew, questions, settings)
        finally:
            run_on_compute_thread(profiler.__exit__, None, None, None)
    finally:
        engine.close()
    events = list(profiler.events())
    figures = {name: _label_figures(events, label) for label, name in STEP_LABELS.items()}
    return {name: value for name, value in figures.items() if value is not None}


def run_shared_step_profile(options: SharedStepOptions, progress: Progress = lambda _: None) -> SharedStepResult:
    from benchmarks.studies.crew import pydoc_pools
    from polykv_agents.bench.agents import role_prompts
    from polykv_agents.engine import load_model

    model, tokenizer = load_model(options.model)
    pools = pydoc_pools(model, tokenizer, options.context_tokens, max(options.pools))
    roles = role_prompts(options.rows)
    switch = os.environ.get(SWITCH)
    rows = []
    try:
        for count in options.pools:
            for path in options.paths:
                progress(f"{options.rows} rows over {count} pool(s), {path} attention")
                os.environ[SWITCH] = "1" if path == "native" else "0"
                figures = profile_pools(
                    model, tokenizer, pools[:count], roles, rows=options.rows, new_tokens=options.new_tokens
                )
                rows.extend({"pools": count, "path": path, "step": step, **f} for step, f in figures.items())
    finally:
        if switch is None:
            os.environ.pop(SWITCH, None)
        else:
            os.environ[SWITCH] = switch
    return SharedStepResult(
        run_info=RunInfo.collect(model), context_tokens=options.context_tokens, rows_per_step=options.rows,
        new_tokens=options.new_tokens, rows=rows,
    )  # fmt: skip


GROUP_ORDER = ("weights", "attention", "cache", "other operators", "outside operators")


def render_markdown(result: SharedStepResult) -> str:
    table_rows = [
        {**r, **{f"group {g}": r["groups_ms"].get(g, 0.0) for g in GROUP_ORDER}}
        for r in result.rows
        if r["step"] == "shared" or r["pools"] == 1
    ]
    table = markdown_table(
        table_rows,
        [
            column("pools", "pools"),
            column("attention path", "path"),
            column("step", "step"),
            column("steps", "steps"),
            column("step ms (median)", "step_ms_median", "{:.1f}"),
            *(column(f"{g} ms", f"group {g}", "{:.1f}") for g in GROUP_ORDER),
            column("operator calls per step", "operator_calls_per_step", "{:,.0f}"),
        ],
    )
    info = result.run_info
    conditions = (
        f"{info.machine_and_model()} {result.rows_per_step} agents decode {result.new_tokens} tokens each at once, "
        f"spread in turn over pools of {result.context_tokens:,}-token pydoc_data.topics documents, one engine, after "
        "one unprofiled warm-up run; eager steps. Figures are per step (mean over the profiled steps but the median "
        "column), in ms of the compute thread; `shared` steps ran several pools' rows in one forward (the table "
        "leaves out the steps a pool ran alone near the end, when the others had finished). `attention` includes "
        "the native kernel's calls (`polykv::grouped_attention`); `outside operators` is Python, module calls and "
        f"dispatch. The native and PyTorch rows of a pool count ran one after the other in one process. {info.date}."
    )
    return f"# A decode step over several pools\n\n{conditions}\n\n{table}\n"


def langgraph_block(result: SharedStepResult) -> str:
    """docs/LANGGRAPH.md's table: the step over the most pools, and over one, per path."""
    by_key = {(r["pools"], r["path"], r["step"]): r for r in result.rows}
    most = max(r["pools"] for r in result.rows)
    lines = [
        "| pools (rows) | attention path | step ms (median) | attention ms | other operators + outside ms "
        "| operator calls per step |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for pools, step in ((1, "one pool"), (most, "shared")):
        for path in PATHS:
            row = by_key.get((pools, path, step))
            if row is None:
                continue
            groups = row["groups_ms"]
            overhead = groups.get("other operators", 0.0) + groups.get("outside operators", 0.0)
            lines.append(
                f"| {pools} ({result.rows_per_step}) | {path} | {row['step_ms_median']:.1f} "
                f"| {groups.get('attention', 0.0):.1f} | {overhead:.1f} | {row['operator_calls_per_step']:,.0f} |"
            )
    return "\n".join(lines)


class SharedStepSuite(JsonSuite[SharedStepResult]):
    name = "shared_step_profile"
    summary = "Where a decode step over several pools' rows goes, op by op, with the native kernel and without."
    result_type = SharedStepResult
    options = SharedStepOptions
    reproduce = ((),)

    def run(self, options: SharedStepOptions, progress: Progress) -> SharedStepResult:
        return run_shared_step_profile(options, progress)

    def markdown(self, result: SharedStepResult) -> str:
        return render_markdown(result)

    def rendered(self, result: SharedStepResult) -> Rendered:
        body = render_markdown(result).removeprefix("# A decode step over several pools\n")
        section = ["## A decode step over several pools", "", "Produced by `python -m benchmarks shared_step_profile`."]
        return Rendered(results=[*section, body.rstrip("\n")], blocks={"shared_step_profile": langgraph_block(result)})


SUITE = SharedStepSuite()
