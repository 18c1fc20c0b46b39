"""``python -m benchmarks compile``: the compiled decode step against eager, side by side in one run.

On the embedded model, per weights setting (native, int8), over one pool of a pydoc_data.topics document:

- speed (``kind="speed"``): ms per decode step with 1 and with N agents through the runtime, eager and
  compiled (``Engine(compile_decode=True)``), medians after a warm-up that also absorbs the compilations;
- compile cost (``kind="compile"``): the first compiled step of one agent in a fresh process, with an empty
  compile cache (``cold``) and again in another fresh process with the cache the first one left (``warm``);
- agreement (``kind="agreement"``): how many of N agents' greedy answers are token for token the same
  compiled as eager (in bf16 a fused kernel may round differently, so this is reported, not assumed).

The side processes (the compile cost) run this module as a script:

    python benchmarks/studies/compiled.py REQUEST.json RESULT.json
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, field_validator

from benchmarks.studies.side_process import run_side
from polykv_agents.bench.environment import RunInfo
from polykv_agents.bench.output import Progress, column, markdown_table
from polykv_agents.bench.suite import JsonSuite, Rendered, SuiteOptions
from polykv_agents.model.weights import check_weights

COMPILE_SIDE = Path(__file__)


class CompileOptions(SuiteOptions):
    context_tokens: int = Field(default=2048, ge=16)
    """Document tokens in the pool."""
    agents: int = Field(default=15, ge=2)
    """Agents decoding at once in the batched rows (besides one agent alone)."""
    weights: list[str] = Field(default=["native", "int8"], json_schema_extra={"flag": "--weights"})
    """Weights settings to measure (repeatable)."""
    new_tokens: int = Field(default=48, ge=8)
    """Tokens each agent decodes per run."""
    repetitions: int = Field(default=5, ge=1)
    """Timed rounds after one warm-up round (median); each round runs eager and compiled in turn."""
    backend: str = "inductor"
    """``torch.compile`` backend of the compiled steps."""
    model: str | None = None
    """Local HF model dir or cached id; default: embedded."""

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, value: str) -> str:
        import torch

        known = torch.compiler.list_backends(exclude_tags=())
        if value not in known:
            msg = f"backend must be one of {', '.join(sorted(known))}, got {value!r}"
            raise ValueError(msg)
        return value

    @field_validator("weights")
    @classmethod
    def _known_weights(cls, value: list[str]) -> list[str]:
        return [check_weights(weights) for weights in value]


class CompileResult(BaseModel):
    run_info: RunInfo
    context_tokens: int
    agents: int
    new_tokens: int
    repetitions: int
    rows: list[dict[str, Any]]


def _interleaved_medians(measures: dict[str, Callable[[], float]], repetitions: int) -> dict[str, float]:
    """Median of each measure over ``repetitions`` rounds, after one warm-up round (which absorbs the
    compilations); every round runs each measure once, in turn, so a slow phase of the machine weighs on
    all of them alike."""
    samples: dict[str, list[float]] = {name: [] for name in measures}
    for round_index in range(repetitions + 1):
        for name, measure in measures.items():
            value = measure()
            if round_index:
                samples[name].append(value)
    return {name: statistics.median(values) for name, values in samples.items()}


def _speed_rows(weights: str, model, tokenizer, options: CompileOptions, progress: Progress) -> list[dict]:
    from benchmarks.studies.crew import pool_and_roles, pooled_agents
    from polykv_agents.bench.agents import answer_all
    from polykv_agents.bench.step_costs import step_intervals_ms
    from polykv_agents.engine import Engine
    from polykv_agents.sampling.settings import GenerationSettings

    pool, roles = pool_and_roles(model, tokenizer, options.context_tokens, options.agents)
    questions = [q for _, q in roles]
    settings = GenerationSettings(max_new_tokens=options.new_tokens, ignore_eos=True)
    engines = {
        "eager": Engine(scheduler_idle_seconds=None, max_prefix_bytes=0),
        "compiled": Engine(scheduler_idle_seconds=None, max_prefix_bytes=0, compile_decode=options.backend),
    }
    rows, answers = [], {}
    try:
        for count in (1, options.agents):
            crews = {
                mode: pooled_agents(pool, model, tokenizer, roles[:count], engine) for mode, engine in engines.items()
            }
            progress(f"{weights}: {count} agent(s), eager and compiled in turn")
            ms = _interleaved_medians(
                {
                    mode: (lambda crew=crew, asked=questions[:count]: step_intervals_ms(crew, asked, settings))
                    for mode, crew in crews.items()
                },
                options.repetitions,
            )
            rows.append(
                {
                    "kind": "speed",
                    "weights": weights,
                    "agents": count,
                    "eager_ms_per_step": ms["eager"],
                    "compiled_ms_per_step": ms["compiled"],
                    "speedup": ms["eager"] / ms["compiled"],
                }
            )
        for mode, engine in engines.items():
            crew = pooled_agents(pool, model, tokenizer, roles, engine)
            answers[mode] = answer_all(crew, questions, GenerationSettings(max_new_tokens=options.new_tokens))
        engines["compiled"].schedulers.require_compiled()  # raises, naming why, if any step ran eager
    finally:
        for engine in engines.values():
            engine.close()
    same = sum(a == b for a, b in zip(answers["eager"], answers["compiled"], strict=True))
    rows.append({"kind": "agreement", "weights": weights, "agents": options.agents, "identical_answers": same})
    return rows


def _compile_rows(weights: str, options: CompileOptions) -> list[dict]:
    rows = []
    with tempfile.TemporaryDirectory() as cache_dir:  # an empty compile cache, then the one it left
        for cache in ("cold", "warm"):
            request = {
                "model": options.model,
                "weights": weights,
                "context_tokens": options.context_tokens,
                "backend": options.backend,
            }
            result = run_side(
                COMPILE_SIDE,
                request,
                what=f"the {cache} compile measurement",
                timeout_s=1800,
                env={"TORCHINDUCTOR_CACHE_DIR": cache_dir},
            )
            rows.append({"kind": "compile", "weights": weights, "cache": cache, **result})
    return rows


def run_compile(options: CompileOptions, progress: Progress = lambda _: None) -> CompileResult:
    from polykv_agents.engine import load_model

    rows = []
    for weights in options.weights:
        progress(f"{weights}: compile cost in fresh processes, cold and warm cache")
        rows += _compile_rows(weights, options)
        model, tokenizer = load_model(options.model, weights=weights)
        rows += _speed_rows(weights, model, tokenizer, options, progress)
    return CompileResult(
        run_info=RunInfo.collect(model), context_tokens=options.context_tokens, agents=options.agents,
        new_tokens=options.new_tokens, repetitions=options.repetitions, rows=rows,
    )  # fmt: skip


def render_markdown(result: CompileResult) -> str:
    speed = markdown_table(
        [r for r in result.rows if r["kind"] == "speed"],
        [
            column("weights", "weights"),
            column("agents", "agents"),
            column("eager ms/step", "eager_ms_per_step", "{:.1f}"),
            column("compiled ms/step", "compiled_ms_per_step", "{:.1f}"),
            column("speed-up", "speedup", "{:.2f}x"),
        ],
    )
    compile_cost = markdown_table(
        [r for r in result.rows if r["kind"] == "compile"],
        [
            column("weights", "weights"),
            column("compile cache", "cache"),
            column("first compiled step, s", "first_step_s", "{:.1f}"),
        ],
    )
    agreement = ", ".join(
        f"{r['weights']} {r['identical_answers']} of {r['agents']}" for r in result.rows if r["kind"] == "agreement"
    )
    info = result.run_info
    conditions = (
        info.machine_and_model() + f" Pool: {result.context_tokens} tokens of pydoc_data.topics. Each agent "
        f"decodes {result.new_tokens} tokens (EOS ignored); ms per step is the median time between an agent's "
        f"consecutive tokens, medians of {result.repetitions} rounds after 1 warm-up round (which absorbs the "
        "compilations); each round runs eager and compiled in turn. "
        f"{info.date}."
    )
    return (
        f"# The compiled decode step\n\n{conditions}\n\n{speed}\n\n"
        "The first compiled step of one agent (a batch bucket of 1), in a fresh process: with an empty "
        "compile cache, then in another fresh process with the cache the first left (model loading not "
        f"included):\n\n{compile_cost}\n\n"
        f"Greedy answers ({result.new_tokens} tokens) identical compiled and eager: {agreement}.\n"
    )


def readme_summary(result: CompileResult) -> str:
    def speed(weights: str, agents: int) -> dict:
        return next(
            r for r in result.rows if r["kind"] == "speed" and r["weights"] == weights and r["agents"] == agents
        )

    def compile_s(weights: str, cache: str) -> float:
        return next(
            r["first_step_s"]
            for r in result.rows
            if r["kind"] == "compile" and r["weights"] == weights and r["cache"] == cache
        )

    weights_measured = list(dict.fromkeys(r["weights"] for r in result.rows if r["kind"] == "speed"))
    parts = [
        f"{w} weights {speed(w, 1)['eager_ms_per_step']:.1f} → {speed(w, 1)['compiled_ms_per_step']:.1f} ms per step "
        f"for one agent and {speed(w, result.agents)['eager_ms_per_step']:.1f} → "
        f"{speed(w, result.agents)['compiled_ms_per_step']:.1f} ms for {result.agents}; its first compiled step "
        f"took {compile_s(w, 'cold'):.0f} s with an empty compile cache and {compile_s(w, 'warm'):.0f} s with a "
        "warm one"
        for w in weights_measured
    ]
    return (
        f"Compiled decode steps (`compile_decode=True`) on {result.run_info.model} ({result.run_info.dtype}, "
        f"{result.context_tokens:,}-token pool): "
        + "; ".join(parts)
        + f" (`python -m benchmarks compile`, {result.run_info.date}; [table](../benchmarks/results/compile.md))."
    )


class CompileSuite(JsonSuite[CompileResult]):
    name = "compile"
    summary = "The compiled decode step against eager: ms per step, compile time cold and warm, greedy agreement."
    result_type = CompileResult
    options = CompileOptions
    reproduce = ((),)

    def run(self, options: CompileOptions, progress: Progress) -> CompileResult:
        return run_compile(options, progress)

    def markdown(self, result: CompileResult) -> str:
        return render_markdown(result)

    def rendered(self, result: CompileResult) -> Rendered:
        body = render_markdown(result).removeprefix("# The compiled decode step\n")
        section = ["## The compiled decode step", "", "Produced by `python -m benchmarks compile`.", body.rstrip("\n")]
        return Rendered(results=section, blocks={"compile": readme_summary(result)})


SUITE = CompileSuite()


def main(request_path: str, result_path: str) -> None:
    """Side process: load the model, build the pool, and time one agent's first compiled decode step."""
    from benchmarks.studies.crew import pool_and_roles, pooled_agents
    from polykv_agents.engine import Engine
    from polykv_agents.sampling.settings import GenerationSettings

    request = json.loads(Path(request_path).read_text())
    engine = Engine(scheduler_idle_seconds=None, max_prefix_bytes=0, compile_decode=request["backend"])
    model, tokenizer = engine.load_model(request["model"], weights=request["weights"])
    pool, roles = pool_and_roles(model, tokenizer, request["context_tokens"], 1)
    (agent,) = pooled_agents(pool, model, tokenizer, roles, engine)
    list(agent.generate_ids(roles[0][1], GenerationSettings(max_new_tokens=3, ignore_eos=True)))
    (scheduler,) = engine.schedulers.live()
    scheduler.compiled.require_compiled()  # a cold compile time must come from a compile
    Path(result_path).write_text(json.dumps({"first_step_s": scheduler.compiled.compile_seconds[1]}))
    engine.close()


if __name__ == "__main__":
    main(*sys.argv[1:3])
