"""``bench tasks``: options are checked before anything is measured, every preset answers every item, and the
summaries pair each preset's answer with the full-precision answer to the same item."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from polykv_agents.bench import tasks as suite
from polykv_agents.bench.journal import Journal, JournalMismatchError
from polykv_agents.bench.tasks import TaskAnswer, TasksOptions, run_tasks, summary_rows

RESULTS = Path(__file__).resolve().parents[3] / "benchmarks" / "results"


def test_unknown_tasks_and_presets_are_refused_with_the_choices():
    with pytest.raises(ValidationError, match="niah_single"):
        TasksOptions(tasks=["needle"])
    with pytest.raises(ValidationError, match=r"choose among the presets default.*'keys tq4, values tq3'"):
        TasksOptions(configs=["tiny"])
    assert TasksOptions(configs=["keys tq4, values tq3"]).configs == ["full", "keys tq4, values tq3"]


def test_compressed_configs_are_paired_against_each_other_on_the_same_items():
    scores = {"full": (1, 1, 1), "default": (1, 0, 1), "max": (0, 0, 1), "small": (1, 1, 0)}
    answers = [_answer(item, config, score) for config, row in scores.items() for item, score in enumerate(row)]
    answers.append(_answer(0, "max", 1.0, context=1024))  # another length: not paired with 512's items
    rows = {(r["config"], r["against"]): r for r in suite.pairwise_rows(answers, 512)}
    assert list(rows) == [("max", "default"), ("small", "default"), ("small", "max")]
    assert rows[("max", "default")]["difference"]["mean"] == pytest.approx(-100 / 3)
    assert (rows[("max", "default")]["difference"]["better"], rows[("max", "default")]["difference"]["worse"]) == (0, 1)
    assert rows[("small", "max")]["difference"]["mean"] == pytest.approx(100 / 3)  # +1, +1, -1
    assert (rows[("small", "max")]["difference"]["better"], rows[("small", "max")]["difference"]["worse"]) == (2, 1)
    assert rows[("small", "max")]["difference"]["n"] == 3
    answers.append(_answer(0, "default", 0.0, context=1024))  # item 0 again, at another length: its own pair
    every = {(r["config"], r["against"]): r for r in suite.pairwise_rows(answers, None)}
    assert every[("max", "default")]["difference"]["n"] == 4
    assert every[("max", "default")]["difference"]["mean"] == pytest.approx(0)  # -100 at 512, +100 at 1024
    assert every[("small", "default")]["difference"]["n"] == 3  # small has no answer at 1024


def test_full_precision_is_always_the_first_preset_scored():
    assert TasksOptions(configs=["max", "full", "default"]).configs == ["full", "max", "default"]
    assert TasksOptions(configs=[]).configs == ["full"]
    assert TasksOptions().configs == ["full", "default", "paper", "max"]


def _answer(item: int, config: str, score: float, task: str = "niah_single", context: int = 512) -> TaskAnswer:
    return TaskAnswer(
        context=context, item=item, task=task, config=config, document_tokens=500, compression_ratio=1.0,
        answer="", references=["1"], score=score, f1=score,
    )  # fmt: skip


def test_a_presets_delta_is_paired_with_the_same_items_full_precision_score():
    answers = [_answer(0, "full", 1.0), _answer(0, "max", 0.0), _answer(1, "full", 0.0), _answer(1, "max", 0.0)]
    answers += [_answer(2, "full", 0.5), _answer(2, "max", 1.0)]
    rows = {row["config"]: row for row in summary_rows(answers, "context")}
    assert rows["full"]["delta"] is None and rows["full"]["score"]["mean"] == pytest.approx(50.0)
    assert rows["max"]["score"]["mean"] == pytest.approx(100 / 3)
    assert rows["max"]["delta"]["mean"] == pytest.approx((-100 + 0 + 50) / 3)
    assert rows["max"]["delta"]["n"] == 3


def test_summaries_by_task_pool_the_contexts():
    answers = [_answer(0, "full", 1.0, context=512), _answer(0, "full", 0.0, context=1024)]
    answers += [_answer(0, "max", 1.0, context=512), _answer(0, "max", 1.0, context=1024)]
    rows = {row["config"]: row for row in summary_rows(answers, "task")}
    assert rows["max"]["delta"]["mean"] == pytest.approx(50.0) and rows["max"]["score"]["n"] == 2


def test_every_preset_answers_every_item_and_is_scored_against_its_references(tiny_model_dir, monkeypatch):
    asked = []

    def answer_item(model, tokenizer, item, configs, runtime):
        asked.append(item)
        # full precision names the first reference, the others name nothing
        return [(c, 300, 1.0 if c == "full" else 3.0, item.answers[0] if c == "full" else "no idea") for c in configs]

    monkeypatch.setattr(suite, "answer_item", answer_item)
    options = TasksOptions(
        contexts=[256], items=4, tasks=["niah_single", "niah_multivalue"], configs=["max"], model=tiny_model_dir
    )
    result = run_tasks(options)
    assert [a.task for a in asked] == ["niah_single", "niah_multivalue"] * 2
    assert [(a.item, a.config) for a in result.answers] == [(i, c) for i in range(4) for c in ("full", "max")]
    scores = {(a.task, a.config): a.score for a in result.answers}
    assert scores[("niah_single", "full")] == 1.0 and scores[("niah_multivalue", "full")] == 0.25
    assert scores[("niah_single", "max")] == 0.0
    assert "reference" in suite.render_markdown(result)
    assert run_tasks(options).answers == result.answers  # the same seed: the same items


def test_a_real_pool_answers_through_the_fact_finder(tiny_model, tiny_tok):
    from polykv_agents.eval.tasks import TaskItem

    item = TaskItem("niah_single", "The magic number is 1234567. " * 20, "What is the magic number?", ("1234567",),
                    "all", 4, "The magic number is")  # fmt: skip
    smallest = "keys ctq3 pre-RoPE, values ctq3"  # a frontier config, by name
    answers = suite.answer_item(tiny_model, tiny_tok, item, ["full", "max", smallest])
    assert [config for config, *_ in answers] == ["full", "max", smallest]
    (_, tokens, full_ratio, _), (_, _, max_ratio, _), (_, _, smallest_ratio, _) = answers
    assert tokens > 100 and smallest_ratio > max_ratio > full_ratio
    # the fact finder's answer continues the item's answer prefix
    from polykv_agents import CompressionConfig, PooledAgent, SharedKVPool

    pool = SharedKVPool.prefill(tiny_model, tiny_tok, suite.pool_document(tiny_tok, item.document),
                                config=CompressionConfig.full_precision())  # fmt: skip
    agent = PooledAgent(pool, tiny_model, tiny_tok, system_prompt=suite.FACT_FINDER_PROMPT, runtime="private")
    assert answers[0][3] == agent.generate(item.question, max_new_tokens=4, answer_prefix=item.answer_prefix)
    assert answers[0][3] != agent.generate(item.question, max_new_tokens=4)
    assert all(isinstance(answer, str) for *_, answer in answers)


def test_the_answers_are_decoded_by_the_runtime_asked_for(tiny_model, tiny_tok, tiny_model_dir, monkeypatch):
    from polykv_agents import agent as agent_module
    from polykv_agents.eval.tasks import TaskItem

    runtimes = []

    class RecordingAgent(agent_module.PooledAgent):
        def __init__(self, *args, runtime, **kwargs):
            runtimes.append(runtime)
            super().__init__(*args, runtime=runtime, **kwargs)

    monkeypatch.setattr(agent_module, "PooledAgent", RecordingAgent)
    item = TaskItem("niah_single", "The magic number is 1234567. " * 5, "What is the magic number?", ("1234567",),
                    "all", 2, "The magic number is")  # fmt: skip
    suite.answer_item(tiny_model, tiny_tok, item, ["full", "max"], "private")
    suite.answer_item(tiny_model, tiny_tok, item, ["full"])
    assert runtimes == ["private", "private", "decompressed"]  # the graphs' agents' runtime by default
    runtimes.clear()
    options = TasksOptions(contexts=[256], items=1, tasks=["niah_single"], configs=[], model=tiny_model_dir)
    private = run_tasks(options.model_copy(update={"runtime": "private"}))
    assert private.options["runtime"] == "private" and runtimes == ["private"]
    model = private.options["model"]
    assert f"`polykv-agents bench tasks --model {model} --runtime private`" in suite.readme_table(private)
    assert "by the `private` runtime" in suite.render_markdown(private)
    assert f"tasks --model {model}`" in suite.readme_table(run_tasks(options))  # the default runtime: no flag
    assert TasksOptions().runtime == "decompressed"
    with pytest.raises(ValidationError, match="runtime"):
        TasksOptions(runtime="batched")


def test_results_name_a_local_model_by_its_file_name_and_render_each_model_in_its_own_section(
    tiny_model_dir, monkeypatch, tmp_path
):
    def answer_item(model, tokenizer, item, configs, runtime):
        return [(config, 9, 1.0, "") for config in configs]

    monkeypatch.setattr(suite, "answer_item", answer_item)
    result = run_tasks(TasksOptions(contexts=[256], items=1, tasks=["niah_single"], model=tiny_model_dir))
    assert result.options["model"] == tiny_model_dir.rstrip("/").rsplit("/", 1)[-1]
    suite.SUITE.write(result, tmp_path)
    suite.SUITE.write(result, tmp_path / "second-model")
    rendered = suite.SUITE.render(tmp_path)
    headings = [line for line in rendered.results if line.startswith("## ")]
    assert len(headings) == 2 and f"--model {result.options['model']}" in "\n".join(rendered.results)
    assert rendered.blocks["tasks"].count("| preset |") == 2
    # each model's score-against-bytes plot, in its own folder, linked from its own section
    assert (tmp_path / "tasks_score_vs_bytes.png").exists() and (
        tmp_path / "second-model/tasks_score_vs_bytes.png"
    ).exists()
    text = "\n".join(rendered.results)
    assert "(../benchmarks/results/tasks_score_vs_bytes.png)" in text
    assert "(../benchmarks/results/second-model/tasks_score_vs_bytes.png)" in text


def test_reworded_answers_count_the_items_whose_text_differs_from_full_precision():
    answers = [_answer(item, config, 1.0) for item in range(3) for config in ("full", "max")]
    answers[1] = answers[1].model_copy(update={"answer": "the same fact, other words"})  # item 0's max answer
    assert suite.reworded_answers(answers, "max", 512) == 1
    assert suite.reworded_answers(answers, "max", 1024) == 0  # no items at that length


def test_the_readme_table_has_a_column_per_context_and_a_ratio_range_where_the_contexts_differ(tiny_model):
    from polykv_agents.bench.environment import RunInfo

    answers = [
        _answer(item, config, 1.0, context=c) for c in (512, 1024) for item in range(2) for config in ("full", "max")
    ]
    answers = [  # max's scales weigh a little more in the shorter pool; its answer to item 0 at 1024 is reworded
        a.model_copy(update={"compression_ratio": 4.31 if a.context == 512 else 4.36})
        if a.config == "max" else a for a in answers
    ]  # fmt: skip
    answers[5] = answers[5].model_copy(update={"answer": "other words"})
    answers[6] = answers[6].model_copy(update={"score": 0.0})  # full misses item 1 at 1024, max finds it
    options = TasksOptions(configs=["max"], items=2).model_dump()
    table = suite.readme_table(
        suite.TasksResult(run_info=RunInfo.collect(tiny_model), options=options, answers=answers)
    )
    assert (
        "| preset | x vs fp16 | score at 512 tokens (vs full) | score at 1,024 tokens (vs full) "
        "| every context pooled, 4 items (vs full) |" in table
    )
    assert "| full | 1.00x | 100.0 | 50.0 | 75.0 |" in table
    assert (
        "| max | 4.31–4.36x | 100.0, +0.0 (+0.0 to +0.0; 0 up, 0 down) | 100.0, +50.0 (+0.0 to +100.0; 1 up, 0 down) "
        in table
    )
    assert "| 100.0, +25.0 (+0.0 to +75.0; 1 up, 0 down) |" in table  # +100 on one of the 4 items
    assert "leave out" not in table  # full precision scores 10 points or more everywhere
    assert "(of 2 per context): max: 0 at 512, 1 at 1,024." in table


def test_pooled_figures_leave_out_the_floor_and_paired_cells_count_the_items_that_rose_and_fell(tiny_model):
    """At 2,048 tokens full precision finds 2 of 40 facts (5 points): its two losses there stay out of the pooled
    column. At 512, 3 of 100 items differ: a bootstrap over items gives an interval of nonzero width, and the cell
    names those 3 items; at 1,024 none differ, and the cell says so beside its zero-width interval."""
    from polykv_agents.bench.environment import RunInfo

    full = {512: set(range(20)), 1024: set(range(10)), 2048: {0, 1}}  # the items full precision gets right
    changed = {(512, 0): 0.0, (512, 1): 0.0, (512, 30): 1.0, (2048, 0): 0.0, (2048, 1): 0.0}  # max's differences
    items = {512: 100, 1024: 40, 2048: 40}
    answers = [
        _answer(i, config, changed.get((c, i) if config == "max" else None, float(i in full[c])), context=c)
        for c, n in items.items() for i in range(n) for config in ("full", "max")
    ]  # fmt: skip
    assert suite.pooled_answers(answers)[1] == {2048: pytest.approx(5.0)}
    result = suite.TasksResult(
        run_info=RunInfo.collect(tiny_model),
        options=TasksOptions(configs=["max"], items=40).model_dump(),
        answers=answers,
    )
    table = suite.readme_table(result)
    assert "leave out 2,048 tokens, where full precision scores under 10 points (5.0)" in table
    assert "| 512 and 1,024 tokens pooled, 140 items (vs full) |" in table
    cells = next(line for line in table.splitlines() if line.startswith("| max |")).split(" | ")[2:]
    assert cells[0].startswith("19.0, -1.0 (") and cells[0].endswith("; 1 up, 2 down)")
    assert cells[1] == "25.0, +0.0 (+0.0 to +0.0; 0 up, 0 down)"
    assert cells[2].endswith("; 0 up, 2 down)")
    assert cells[3].startswith("20.7, -0.7 (") and cells[3].endswith("; 1 up, 2 down) |")  # without 2,048's losses
    low, high = (float(x) for x in cells[0].split("(")[1].split(";")[0].split(" to "))
    assert low <= -2.0 and high >= 0.0 and high - low >= 2.0  # not a collapsed interval
    markdown = suite.render_markdown(result)
    assert "## Contexts pooled (512 and 1,024 tokens), all tasks" in markdown
    assert "; 1 up, 2 down, p=1) |" in markdown  # the exact sign test of 1 against 2


def test_a_stopped_run_continues_from_its_journal_with_the_answers_of_an_unstopped_one(
    tiny_model_dir, monkeypatch, tmp_path
):
    asked = []

    def answer_item(model, tokenizer, item, configs, runtime):
        asked.append(item.question)
        return [(c, 300, 1.0, f"{c}: {item.answers[0]}") for c in configs]

    monkeypatch.setattr(suite, "answer_item", answer_item)
    options = {"contexts": [256], "items": 4, "tasks": ["niah_single"], "configs": ["max"], "model": tiny_model_dir}
    whole = run_tasks(TasksOptions(**options)).answers
    asked.clear()

    journal = tmp_path / "runs" / "tasks.jsonl"

    def stop_at_the_third_item(step: str) -> None:
        if step.startswith("context 256: item 3/4"):
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_tasks(TasksOptions(**options, journal=journal), stop_at_the_third_item)
    assert len(asked) == 2 and len(journal.read_text().splitlines()) == 1 + 2  # the header, then 2 items
    with journal.open("a") as file:
        file.write('{"key": "256/2", "records": [{"TORN')  # the line being written when the run was killed
    steps = []
    resumed = run_tasks(TasksOptions(**options, journal=journal), steps.append)
    assert resumed.answers == whole
    assert len(asked) == 2 + 2  # only the two items missing were answered
    assert [s.endswith("from the journal") for s in steps] == [True, True, False, False]
    assert len(journal.read_text().splitlines()) == 1 + 4 and "TORN" not in journal.read_text()
    assert "journal" not in resumed.options  # no machine's path in the committed results
    assert run_tasks(TasksOptions(**options, journal=journal)).answers == whole and len(asked) == 4  # all there

    with pytest.raises(JournalMismatchError, match=r"options differ in: seed\); give this run another --journal"):
        run_tasks(TasksOptions(**options, seed=1, journal=journal))


def test_a_journal_drops_a_whole_record_that_lost_its_line_end(tmp_path):
    """A record cut just before its newline parses, but the next one would be appended to its line."""
    journal = Journal(tmp_path / "j.jsonl", "tasks", {"seed": 0})
    journal.append("256/0", [{"score": 1.0}])
    with journal.path.open("a") as file:
        file.write('{"key": "256/1", "records": []}')
    reopened = Journal(tmp_path / "j.jsonl", "tasks", {"seed": 0})
    assert reopened.done == {"256/0": [{"score": 1.0}]}
    reopened.append("256/1", [{"score": 0.0}])
    again = Journal(tmp_path / "j.jsonl", "tasks", {"seed": 0})
    assert again.done == {"256/0": [{"score": 1.0}], "256/1": [{"score": 0.0}]}
    with pytest.raises(JournalMismatchError, match=r"its 'tasks' options differ in: the suite\)"):
        Journal(tmp_path / "j.jsonl", "frontier", {"seed": 0})


def test_a_run_adding_a_context_reuses_an_earlier_result_and_its_journal(tiny_model_dir, monkeypatch, tmp_path):
    """Item ``i`` at context ``c`` is the same question whatever else a run covers, so a result's items and a
    journal written for other contexts (or fewer items) are answers this run would have made."""
    asked = []

    def answer_item(model, tokenizer, item, configs, runtime):
        asked.append(item.question)
        return [(c, 300, 1.0, f"{c}: {item.answers[0]}") for c in configs]

    monkeypatch.setattr(suite, "answer_item", answer_item)
    same = {"tasks": ["niah_single", "variable_tracking"], "configs": ["max"], "model": tiny_model_dir}
    whole = run_tasks(TasksOptions(**same, contexts=[256, 384], items=3)).answers
    asked.clear()

    earlier = tmp_path / "tasks.json"
    earlier.write_text(run_tasks(TasksOptions(**same, contexts=[256], items=2)).model_dump_json())
    journal = tmp_path / "tasks.jsonl"
    run_tasks(TasksOptions(**same, contexts=[384], items=1, journal=journal))
    assert len(asked) == 2 + 1
    steps = []
    extended = run_tasks(
        TasksOptions(**same, contexts=[256, 384], items=3, reuse=[earlier], journal=journal), steps.append
    )
    assert extended.answers == whole
    assert len(asked) == 2 + 1 + 3  # 256's third item and 384's last two
    assert [s.rsplit(", ", 1)[-1] for s in steps if ", from" in s] == ["from an earlier result"] * 2 + [
        "from the journal"
    ]
    assert extended.options["contexts"] == [256, 384] and "reuse" not in extended.options

    with pytest.raises(ValidationError, match=r"reuse.0\n  Path does not point to a file"):
        TasksOptions(**same, reuse=[tmp_path / "nowhere.json"])
    (tmp_path / "other.json").write_text('{"run_info": {}}')
    with pytest.raises(ValueError, match=r"other.json is not a `bench tasks` result \(\d+ errors, the first: Field"):
        run_tasks(TasksOptions(**same, contexts=[256], items=2, reuse=[tmp_path / "other.json"]))
    with pytest.raises(ValueError, match=r"tasks.json answered other questions \(its options differ in: seed\)"):
        run_tasks(TasksOptions(**same, contexts=[256], items=2, seed=1, reuse=[earlier]))
    monkeypatch.setattr(suite, "load_model_for", lambda name, weights: pytest.fail("loaded before refusing the result"))
    with pytest.raises(ValueError, match=r"differ in: configs\)"):
        run_tasks(TasksOptions(**{**same, "configs": ["default"]}, contexts=[256], items=2, reuse=[earlier]))
    monkeypatch.setattr(suite, "load_model_for", lambda name, weights: (_Bf16(), None))
    with pytest.raises(ValueError, match=r"tasks.json answered other questions \(its options differ in: dtype\)"):
        run_tasks(TasksOptions(**same, contexts=[256], items=2, reuse=[earlier]))


class _Bf16:
    dtype = "torch.bfloat16"


def test_the_weights_are_part_of_a_run_and_a_result_from_before_the_option_ran_native(
    tiny_model_dir, monkeypatch, tmp_path
):
    loaded = []
    load = suite.load_model_for

    def recording_load(name, weights):
        loaded.append(weights)
        return load(name, weights)

    monkeypatch.setattr(suite, "load_model_for", recording_load)
    monkeypatch.setattr(
        suite, "answer_item", lambda model, tok, item, configs, runtime: [(c, 9, 1.0, "") for c in configs]
    )
    same = {"tasks": ["niah_single"], "configs": ["max"], "model": tiny_model_dir, "contexts": [256], "items": 1}
    int8 = run_tasks(TasksOptions(**same, weights="int8"))
    assert loaded == ["int8"] and int8.options["weights"] == "int8"
    assert ", int8 weights;" in suite.render_markdown(int8) and "--weights int8`" in suite.readme_table(int8)
    native = run_tasks(TasksOptions(**same))
    assert "weights" not in suite.render_markdown(native).split("runtime")[1].split(";")[0]
    older = native.model_dump()
    del older["options"]["weights"]  # a result committed before the option existed
    path = tmp_path / "tasks.json"
    path.write_text(json.dumps(older))
    assert run_tasks(TasksOptions(**same, reuse=[path])).answers == native.answers  # taken as the native run it was
    with pytest.raises(ValueError, match=r"differ in: weights\)"):
        run_tasks(TasksOptions(**same, weights="int8", reuse=[path]))
    with pytest.raises(ValidationError, match="weights"):
        TasksOptions(weights="int3")


@pytest.mark.parametrize("result", ["tasks.json", "gemma-3-270m-q4_k_m/tasks.json"])
def test_the_committed_task_results_hold_what_the_planned_run_answers(result, monkeypatch):
    """`bench plan` (run by run_all.sh, whose Gemma line repeats its options with `--model`) must rerun what the
    committed results hold: the same contexts, item count, tasks and configs. Options are read through the CLI
    as a user's run reads them; the run itself is replaced."""
    from typer.testing import CliRunner

    from polykv_agents.cli.main import app

    planned: list[TasksOptions] = []

    def capture(options: TasksOptions, progress) -> None:
        planned.append(options)
        raise KeyboardInterrupt  # stop before anything is measured or written

    monkeypatch.setattr(suite.SUITE, "run", capture)
    for arguments in suite.SUITE.reproduce:
        CliRunner().invoke(app, ["bench", "tasks", *arguments])
    assert len(planned) == 1, "one planned task run"
    committed = {**suite.DEFAULTS_OF_LATER_OPTIONS, **json.loads((RESULTS / result).read_text("utf-8"))["options"]}
    assert planned[0].model_dump(exclude={"model"}) == {k: v for k, v in committed.items() if k != "model"}
