"""The repository's studies end to end on a tiny random model: the rows carry what the tables and plots need,
and the measurements relate the way they must (the studies' real figures come from the embedded model, see
docs/RESULTS.md)."""

from __future__ import annotations

import pytest

from benchmarks.studies.ablation import run_ablation_suite, seed_dependent, write_ablation
from polykv_agents.config import CodecConfig, CompressionConfig, LayerCodecs
from polykv_agents.eval.corpus import pydoc_documents


@pytest.fixture(scope="module")
def texts():
    return pydoc_documents(2, chars_per_document=3000)


def test_ablation_runs_every_seed_of_seeded_configs_only(tiny_model, tiny_tok, texts, tmp_path):
    factors = {
        "default": ("baseline", CompressionConfig()),
        "values: no rotation": ("rotation", CompressionConfig(values=CodecConfig(method="turboquant", rotation=False))),
        "full": ("control", CompressionConfig.full_precision()),
    }
    result = run_ablation_suite(
        tiny_model, tiny_tok, texts, contexts=(64,), seeds=(0, 1), continuation_tokens=32, factors=factors
    )
    rows = {r["config"]: r for r in result.rows}
    assert rows["default"]["sample_count"] == 2 * 2 and rows["default"]["seeds"] == 2
    assert rows["values: no rotation"]["sample_count"] == 2 and rows["values: no rotation"]["seeds"] == 1
    # Every (document, seed) sample is kept; the interval is over the 2 documents, seeds averaged within each.
    default = rows["default"]
    assert sorted((s["document"], s["seed"]) for s in default["samples"]) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert default["documents"] == 2
    means = [sum(s["delta_pct"] for s in default["samples"] if s["document"] == d) / 2 for d in (0, 1)]
    assert default["delta_pct_mean"] == pytest.approx(sum(means) / 2)
    assert default["delta_pct_min"] == pytest.approx(min(means)) and default["delta_pct_max"] == pytest.approx(
        max(means)
    )
    assert rows["full"]["delta_pct_mean"] == pytest.approx(0.0, abs=1e-4)
    assert not seed_dependent(factors["full"][1]) and seed_dependent(CompressionConfig())
    int8 = CodecConfig(method="int", bits=8)
    tq_on_one_layer = CompressionConfig(
        keys=int8, values=int8, layers=[LayerCodecs(layers=(0,), values=CodecConfig(method="turboquant"))]
    )
    assert not seed_dependent(CompressionConfig(keys=int8, values=int8)) and seed_dependent(tq_on_one_layer)
    assert result.summary["max_preset"] is not None  # full precision is always within budget
    assert [p.name for p in write_ablation(result, tmp_path)] == ["ablation.json", "ablation.md", "ablation_64.png"]


def test_dtype_suite_compares_both_dtypes_with_one_pool_digest(tiny_model_dir, tmp_path):
    """Both dtypes measured in one run; the pools of both dtypes share one digest (asserted inside), every
    perplexity is finite, and the OpenMP team rows come from fresh processes."""
    from benchmarks.studies.dtypes import SUITE, DtypeOptions, doc_blocks, write_dtype

    options = DtypeOptions(
        model=tiny_model_dir, context=64, agents=3, new_tokens=4, documents=2, continuation_tokens=16, repetitions=1
    )
    steps = []
    result = SUITE.measure(options, steps.append)
    speed = {r["dtype"]: r for r in result.rows if r["kind"] == "speed"}
    assert set(speed) == {"float32", "bfloat16"} and all(r["ms_per_step_n"] > 0 for r in speed.values())
    ppl = [r for r in result.rows if r["kind"] == "ppl"]
    assert len(ppl) == 2 * 2 and all(r["ppl_pool_other_dtype"] > 0 for r in ppl)
    fp32 = [r for r in ppl if r["reader"] == "float32"]
    assert all(r["ppl_full"] == r["ppl_fp32_full"] for r in fp32)  # fp32 is its own reference
    assert all(r["ppl_pool_same_dtype"] != r["ppl_pool_other_dtype"] for r in ppl)  # two pools, two readings
    teams = [r for r in result.rows if r["kind"] == "teams"]
    assert [(r["dtype"], r["batch_size"]) for r in teams] == [
        ("float32", 1), ("float32", 3), ("bfloat16", 1), ("bfloat16", 3)
    ]  # fmt: skip
    assert all(r["ms_one_team"] > 0 and r["ms_after_second_team"] > 0 for r in teams)
    assert len(result.summary["ppl"]) == 2 * 3
    assert "after a second thread's tensor work ms" in write_dtype(result, tmp_path)[1].read_text()
    blocks = doc_blocks(result)
    assert "in bf16 from a pool built in fp32" in blocks["dtype"] and "bfloat16, 3 rows" in blocks["compute_thread"]


def test_weights_suite_compares_native_int8_and_int4_with_one_pool_digest(tiny_model_dir, tmp_path):
    """Every weights setting measured in one run with one pool digest (asserted inside); quantized weights are
    smaller, every perplexity is finite, and the native model is its own reference."""
    from benchmarks.studies.weights import SUITE, WeightsOptions, doc_blocks, write_weights

    options = WeightsOptions(
        model=tiny_model_dir, context=64, agents=3, new_tokens=4, documents=2, continuation_tokens=16, repetitions=1
    )
    result = SUITE.measure(options, [].append)
    speed = {r["weights"]: r for r in result.rows if r["kind"] == "speed"}
    assert list(speed) == ["native", "int8", "int4"] and all(r["ms_per_step_n"] > 0 for r in speed.values())
    assert speed["int4"]["model_mib"] < speed["int8"]["model_mib"] < speed["native"]["model_mib"]
    kernels = [(r["weights"], r["layer"], r["rows"]) for r in result.rows if r["kind"] == "kernel"]
    assert ("int8", "mlp.up_proj, every layer in turn", 3) in kernels and ("int4", "output layer", 512) in kernels
    ppl = [r for r in result.rows if r["kind"] == "ppl"]
    assert len(ppl) == 2 * 3 and all(r["ppl_pool_built_self"] > 0 for r in ppl)
    assert all(r["ppl_full"] == r["ppl_native_full"] for r in ppl if r["weights"] == "native")
    assert all(r["ppl_full"] != r["ppl_native_full"] for r in ppl if r["weights"] != "native")
    assert "int4" in doc_blocks(result)["weights"]
    assert [p.name for p in write_weights(result, tmp_path)] == ["weights.json", "weights.md"]


def test_admission_suite_times_every_setting_for_each_running_count(tiny_model_dir, tmp_path):
    from benchmarks.studies.admission import SUITE, AdmissionOptions

    options = AdmissionOptions(
        model=tiny_model_dir, context_tokens=64, prompt_tokens=300, running=[1, 3], new_tokens=12, join_after=3,
        repetitions=1,
    )  # fmt: skip
    result = SUITE.run(options, [].append)
    settings = [(128, True), (128, False), (None, False)]
    assert [(r["running_agents"], r["chunk_tokens"], r["packed"]) for r in result.rows] == [
        (count, *setting) for count in (1, 3) for setting in settings
    ]
    assert all(r["max_gap_after_ms"] > 0 and r["newcomer_ttft_s"] > 0 for r in result.rows)
    assert result.prompt_tokens == 300
    # 300 tokens go in 3 chunks of 128: the running agents get tokens while it is admitted.
    assert all(r["median_gap_during_ms"] > 0 for r in result.rows if r["chunk_tokens"])
    assert "newcomer's first token" in SUITE.rendered(result).blocks["admission"]
    assert [p.name for p in SUITE.write(result, tmp_path)] == ["admission.json", "admission.md"]
    with pytest.raises(ValueError, match="must be below new_tokens"):
        AdmissionOptions(new_tokens=8, join_after=8)


def test_reuse_suite_reads_more_with_the_tree_and_sends_both_engines_the_same_prompts(long_context_model_dir, tmp_path):
    from benchmarks.studies.reuse import SUITE, ReuseOptions

    options = ReuseOptions(model=long_context_model_dir, context_tokens=64, turns=3, new_tokens=4, roles=2, documents=1)
    result = SUITE.run(options, [].append)
    on = [r for r in result.conversation if r["tree"] == "on"]
    off = [r for r in result.conversation if r["tree"] == "off"]
    assert [r["turn"] for r in on] == [1, 2, 3]
    assert [r["prompt_tokens"] for r in on] == [r["prompt_tokens"] for r in off]  # equal work
    assert on[0]["cache_read"] == off[0]["cache_read"]  # nothing stored before the first turn
    assert all(a["cache_read"] > b["cache_read"] for a, b in zip(on[1:], off[1:], strict=True))
    stages = {(r["tree"], r["stage"]): r for r in result.review}
    assert {stage for _, stage in stages} == {"planner", "specialist", "critic", "summarizer"}
    assert stages["on", "specialist"]["calls"] == 2
    # The summarizer continues the critic's conversation: with the tree, it reads the critic's tokens.
    assert stages["on", "summarizer"]["cache_read"] > stages["off", "summarizer"]["cache_read"]
    assert stages["on", "summarizer"]["cache_read"] > stages["on", "critic"]["prompt_tokens"] - 1
    assert "summarizer read" in SUITE.rendered(result).blocks["reuse"]
    assert [p.name for p in SUITE.write(result, tmp_path)] == ["reuse.json", "reuse.md"]


def test_compile_suite_measures_eager_and_compiled_steps_and_the_compile_cost(tiny_model_dir, tmp_path):
    from benchmarks.studies.compiled import SUITE, CompileOptions

    options = CompileOptions(  # aot_eager: the suite's plumbing, without minutes of C++ compilation
        model=tiny_model_dir, context_tokens=64, agents=2, weights=["native"], new_tokens=8, repetitions=1,
        backend="aot_eager",
    )  # fmt: skip
    result = SUITE.run(options, [].append)
    speed = [r for r in result.rows if r["kind"] == "speed"]
    assert [r["agents"] for r in speed] == [1, 2]
    assert all(r["eager_ms_per_step"] > 0 and r["compiled_ms_per_step"] > 0 for r in speed)
    cost = {r["cache"]: r["first_step_s"] for r in result.rows if r["kind"] == "compile"}
    assert set(cost) == {"cold", "warm"} and all(seconds > 0 for seconds in cost.values())
    (agreement,) = [r for r in result.rows if r["kind"] == "agreement"]
    # fp32 and aot_eager: the traced step runs eager's kernels, so every greedy answer is eager's, token for token.
    assert agreement["identical_answers"] == agreement["agents"] == 2
    rendered = SUITE.rendered(result)
    assert "compile_decode=True" in rendered.blocks["compile"]
    assert rendered.results[0] == "## The compiled decode step"
    assert [p.name for p in SUITE.write(result, tmp_path)] == ["compile.json", "compile.md"]
    with pytest.raises(ValueError, match="weights must be one of"):
        CompileOptions(weights=["int9"])
    with pytest.raises(ValueError, match="backend must be one of"):
        CompileOptions(backend="gcc")


def test_blocks_suite_moves_findings_into_the_critic_and_judges_against_a_full_prefill(
    long_context_model_dir, tmp_path
):
    from benchmarks.studies.blocks import SUITE, BlocksOptions, judged_role

    options = BlocksOptions(
        model=long_context_model_dir, context_tokens=64, roles=2, finding_tokens=60, critic_tokens=4,
        fractions=[0.0, 1.0], documents=1,
    )  # fmt: skip
    result = SUITE.run(options, [].append)
    settings = {row["setting"]: row for row in result.settings}
    assert list(settings) == ["prefill", "blocks 0", "blocks 1", "exact"]
    assert {row["prompt_tokens"] for row in settings.values()} == {settings["prefill"]["prompt_tokens"]}  # equal work
    # The findings were moved, not prefilled (the tiny model's answers end in long runs of one token, which survive
    # being decoded and tokenized again inside the critic's prompt).
    assert settings["blocks 0"]["block_tokens"] >= 16
    assert settings["blocks 0"]["cache_read"] > settings["exact"]["cache_read"] > settings["prefill"]["cache_read"]
    # Everything recomputed, or nothing moved: the critic decodes what a full prefill decodes.
    for exact in ("blocks 1", "exact"):
        assert settings[exact]["agreeing_tokens"] == settings["prefill"]["agreeing_tokens"]
        assert settings[exact]["same_judge"] == 1.0
    assert judged_role("The Finance finding is weak, not legal.", ["legal", "finance"]) == "finance"
    assert judged_role("None of them.", ["legal"]) is None
    assert "was the full prefill's in" in SUITE.rendered(result).blocks["blocks"]
    slower = [r["setting"] for r in result.settings if r["ttft_s"] > settings["prefill"]["ttft_s"]]
    assert ("Slower to the first token than the full prefill" in SUITE.markdown(result)) == bool(slower)
    assert [p.name for p in SUITE.write(result, tmp_path)] == ["blocks.json", "blocks.md"]
