"""``python -m benchmarks profile``: where one decode step's time goes, op by op, from PyTorch's profiler.

On the embedded model over one pool of a pydoc_data.topics document, per weights setting and agent count,
eager by default: agents decode through the runtime under ``torch.profiler``, and every batched step the
scheduler labels (``polykv::decode_step``) is taken apart into the self time of each operator it ran. What no
operator accounts for is the step's time outside operators: Python, module calls, dispatch, and in compiled
steps the guards and the graph's own bookkeeping.

Operators are also grouped, by name, into what they do: projections (``weights``: the linear layers' matrix
products, int8/int4 kernels included), ``attention`` (the fused kernel or its matmul-softmax-matmul, and
the cascade merge's exp/max/logsumexp), ``cache`` (writing new keys and values), and ``other operators``
(norms, RoPE, activations, casts, copies). With ``--compile-decode`` the steps are compiled: the compiled
graph's own time is its ``generated kernels`` (Inductor's fusions of norms, RoPE, the reduced attention, the
merge), dynamo's guard checks and graph entry are ``graph entry``, and the matrix products and the fused
attention kernel stay library calls in their groups.
"""

from __future__ import annotations

import statistics
from typing import Any

from pydantic import BaseModel, Field, field_validator

from polykv_agents.bench.environment import RunInfo
from polykv_agents.bench.output import Progress, column, markdown_table
from polykv_agents.bench.suite import JsonSuite, Rendered, SuiteOptions
from polykv_agents.model.weights import check_weights
from polykv_agents.runtime.scheduler import DECODE_STEP_LABEL as STEP_LABEL

TOP_OPERATORS = 12
"""Operators listed per configuration, by self time (the rest are summed into groups)."""

_WEIGHT_PRODUCTS = ("aten::mm", "aten::addmm", "aten::_weight_int8pack_mm", "aten::_weight_int4pack_mm_for_cpu")
_NATIVE_INT8 = "polykv::int8_linear"
"""The native int8 kernel's eager calls and operators, both paths (``polykv_agents/model/int8_tiles.py``)."""

_GROUPS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("weights", (*_WEIGHT_PRODUCTS, _NATIVE_INT8)),
    ("attention", ("attention", "aten::bmm", "softmax", "logsumexp", "aten::exp", "aten::amax", "aten::maximum")),
    ("cache", ("aten::index_put", "aten::cat", "aten::scatter")),
    ("generated kernels", ("CompiledFxGraph", "cpp_fused")),
    ("graph entry", ("TorchDynamo Cache Lookup", "Torch-Compiled Region", "Pregraph bytecode", "AOTDispatcher")),
)


def operator_group(name: str) -> str:
    """What an operator named ``name`` does in a decode step (see the module's notes)."""
    for group, patterns in _GROUPS:
        if any(pattern in name for pattern in patterns):
            return group
    return "other operators"


class ProfileOptions(SuiteOptions):
    context_tokens: list[int] = Field(default=[4096], json_schema_extra={"flag": "--context"})
    """Document tokens in the pool (repeatable)."""
    agents: list[int] = Field(default=[1, 15], json_schema_extra={"flag": "--agents"})
    """Agents decoding at once (repeatable)."""
    weights: list[str] = Field(default=["native", "int8"], json_schema_extra={"flag": "--weights"})
    """Weights settings (repeatable)."""
    new_tokens: int = Field(default=24, ge=4)
    """Tokens each agent decodes under the profiler (after one unprofiled warm-up run)."""
    model: str | None = None
    """Local HF model dir or cached id; default: embedded."""
    compile_decode: bool = False
    """Profile compiled decode steps (compiled in the warm-up run)."""

    @field_validator("weights")
    @classmethod
    def _known_weights(cls, value: list[str]) -> list[str]:
        return [check_weights(weights) for weights in value]


class ProfileResult(BaseModel):
    run_info: RunInfo
    new_tokens: int
    compile_decode: bool = False
    rows: list[dict[str, Any]]


def step_breakdown(events: list[Any], label: str = STEP_LABEL) -> tuple[list[float], dict[str, float], int]:
    """``(each step's wall ms, self ms per operator summed over the steps, operator calls in all steps)`` from the
    profiler's events, for the steps recorded under ``label``."""
    steps = [e for e in events if e.name == label]
    operators: dict[str, float] = {}
    calls = 0
    for step in steps:
        start, end = step.time_range.start, step.time_range.end
        for event in events:
            inside = start <= event.time_range.start and event.time_range.end <= end
            if event is step or not inside or event.thread != step.thread or event.name == label:
                continue
            operators[event.name] = operators.get(event.name, 0.0) + event.self_cpu_time_total / 1000
            calls += 1
    return [s.cpu_time_total / 1000 for s in steps], operators, calls


def grouped_ms(per_step: dict[str, float], mean_step: float) -> dict[str, float]:
    """Per step ms of each operator group, and ``outside operators``: the step's time no operator accounts for."""
    groups: dict[str, float] = {}
    for name, ms in per_step.items():
        groups[operator_group(name)] = groups.get(operator_group(name), 0.0) + ms
    groups["outside operators"] = mean_step - sum(per_step.values())
    return groups


def profile_rows(
    model, tokenizer, pool, roles, *, agents: int, new_tokens: int, compile_decode: bool = False
) -> dict[str, Any]:
    """One configuration's profile: agents decode ``new_tokens`` each at once, profiled after a warm-up run
    (which compiles the step's bucket with ``compile_decode``)."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.studies.crew import pooled_agents
    from polykv_agents.bench.agents import answer_all
    from polykv_agents.engine import Engine
    from polykv_agents.model.compute_thread import run_on_compute_thread
    from polykv_agents.sampling.settings import GenerationSettings

    engine = Engine(scheduler_idle_seconds=None, max_prefix_bytes=0, compile_decode=compile_decode)
    try:
        crew = pooled_agents(pool, model, tokenizer, roles[:agents], engine)
        questions = [q for _, q in roles[:agents]]
        settings = GenerationSettings(max_new_tokens=new_tokens)
        answer_all(crew, questions, settings)  # warm-up: first steps, thread start
        # The profiler records the operators of the thread that starts it: the compute thread, where steps run.
        profiler = profile(activities=[ProfilerActivity.CPU])
        run_on_compute_thread(profiler.__enter__)
        try:
            answer_all(crew, questions, settings)
        finally:
            run_on_compute_thread(profiler.__exit__, None, None, None)
        if compile_decode:  # a profile labelled compiled must not come from eager steps
            engine.schedulers.require_compiled()
    finally:
        engine.close()
    step_ms, operators, _ = step_breakdown(list(profiler.events()))
    steps = len(step_ms)
    if steps == 0:
        msg = f"no {STEP_LABEL!r} range was recorded; the profiler saw no batched decode step"
        raise RuntimeError(msg)
    per_step = {name: ms / steps for name, ms in operators.items()}
    mean_step = statistics.fmean(step_ms)
    groups = grouped_ms(per_step, mean_step)
    top = sorted(per_step.items(), key=lambda item: -item[1])[:TOP_OPERATORS]
    return {
        "steps": steps,
        "step_ms_median": statistics.median(step_ms),
        "step_ms_mean": mean_step,
        "groups_ms": groups,
        "top_operators_ms": dict(top),
    }


def run_profile(options: ProfileOptions, progress: Progress = lambda _: None) -> ProfileResult:
    from benchmarks.studies.crew import pool_and_roles
    from polykv_agents.engine import load_model

    rows = []
    model = None
    for weights in options.weights:
        model, tokenizer = load_model(options.model, weights=weights)
        for context in options.context_tokens:
            pool, roles = pool_and_roles(model, tokenizer, context, max(options.agents))
            for agents in options.agents:
                progress(f"{weights}: {context} tokens, {agents} agent(s)")
                figures = profile_rows(
                    model, tokenizer, pool, roles, agents=agents, new_tokens=options.new_tokens,
                    compile_decode=options.compile_decode,
                )  # fmt: skip
                rows.append({"weights": weights, "context_tokens": context, "agents": agents, **figures})
    return ProfileResult(
        run_info=RunInfo.collect(model), new_tokens=options.new_tokens, compile_decode=options.compile_decode,
        rows=rows,
    )  # fmt: skip


GROUP_ORDER = (
    "weights", "attention", "cache", "generated kernels", "graph entry", "other operators", "outside operators",
)  # fmt: skip
GROUP_LABELS = {"weights": "projections (weights)"}


def shown_groups(result: ProfileResult) -> list[str]:
    """The groups of :data:`GROUP_ORDER` that some profiled step had (an eager step has no generated kernels)."""
    return [group for group in GROUP_ORDER if any(group in row["groups_ms"] for row in result.rows)]


def render_markdown(result: ProfileResult) -> str:
    table_rows = [
        {
            "weights": r["weights"], "context": r["context_tokens"], "agents": r["agents"],
            "step": r["step_ms_mean"], **{f"group {g}": r["groups_ms"].get(g, 0.0) for g in GROUP_ORDER},
        }
        for r in result.rows
    ]  # fmt: skip
    groups = markdown_table(
        table_rows,
        [
            column("weights", "weights"),
            column("context", "context", "{:,}"),
            column("agents", "agents"),
            column("step ms (mean)", "step", "{:.1f}"),
            *(column(f"{GROUP_LABELS.get(g, g)} ms", f"group {g}", "{:.1f}") for g in shown_groups(result)),
        ],
    )
    tops = []
    for r in result.rows:
        listed = ", ".join(f"`{name}` {ms:.2f}" for name, ms in r["top_operators_ms"].items())
        tops.append(f"- {r['weights']}, {r['context_tokens']:,} tokens, {r['agents']} agent(s): {listed}")
    info = result.run_info
    conditions = (
        info.machine_and_model() + f" {'Compiled' if result.compile_decode else 'Eager'} decode steps. "
        f"Each agent decodes {result.new_tokens} tokens under "
        "`torch.profiler` after one unprofiled warm-up run; figures are per batched decode step (mean over the "
        f"profiled steps), in ms of the compute thread. {info.date}."
    )
    return (
        f"# Where a decode step's time goes\n\n{conditions}\n\n{groups}\n\n"
        "The operators with the most self time per step (ms):\n\n" + "\n".join(tops) + "\n"
    )


class ProfileSuite(JsonSuite[ProfileResult]):
    name = "profile"
    summary = "Where one decode step's time goes: self time per operator and per group, from torch.profiler."
    result_type = ProfileResult
    options = ProfileOptions
    reproduce = ((),)

    def run(self, options: ProfileOptions, progress: Progress) -> ProfileResult:
        return run_profile(options, progress)

    def markdown(self, result: ProfileResult) -> str:
        return render_markdown(result)

    def rendered(self, result: ProfileResult) -> Rendered:
        body = render_markdown(result).removeprefix("# Where a decode step's time goes\n")
        section = ["## Where a decode step's time goes", "", "Produced by `python -m benchmarks profile`."]
        return Rendered(results=[*section, body.rstrip("\n")])


SUITE = ProfileSuite()
