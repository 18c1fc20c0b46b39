"""The compiled decode step: the same greedy tokens as eager on every family, padding rows that no row
reads, a logged fall back to eager when there is no C++ toolchain, and any other failure raised.

Most tests compile with dynamo's ``aot_eager`` backend: it captures the same graph Inductor would
(static cache, padded rows, masks passed in, dynamic slot and document dimensions) and runs it
through AOT autograd, without generating C++ (minutes on two cores for six families). Two tests
generate real Inductor kernels, on the tiny Llama: they skip only where Inductor finds no C++ compiler,
and fail if the decoder fell back to eager anyway.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from tiny_models import FAMILIES, SLIDING_WINDOW, assert_pairwise_distinct, tiny_causal_lm, tiny_sensitive_llama
from torch._dynamo.exc import BackendCompilerFailed
from torch._inductor.exc import CppCompileError, InvalidCxxCompiler

from polykv_agents import CompressionConfig, Engine, GenerationSettings, PooledAgent, SharedKVPool
from polykv_agents.runtime import cascade_attention, compiled_decode
from polykv_agents.runtime.compiled_decode import CAPACITY_STEP, batch_bucket
from polykv_agents.runtime.suffix_cache import SuffixCache

DOC = "Keys are quantised to eight bits; values use a rotated three-bit codebook."
QUESTIONS = ("What do values use?", "Summarise it.", "Which part is rotated, and why would that matter?")
NEW_TOKENS = 40
"""Past the tiny sliding window: window masks over prefix and suffix are exercised in the graph."""


@functools.cache
def model_of(family: str):
    return tiny_causal_lm(family)


def _answers(engine: Engine, pool, model, tok, questions) -> list[list[int]]:
    """Greedy answers of agents asking ``questions`` at once (one batch, rows of different lengths)."""
    agent = PooledAgent(pool, model, tok, engine=engine)
    settings = GenerationSettings(max_new_tokens=NEW_TOKENS, ignore_eos=True)
    with ThreadPoolExecutor(len(questions)) as executor:
        return list(executor.map(lambda q: list(agent.generate_ids(q, settings)), questions))


def _schedulers(engine: Engine):
    return engine.schedulers.live()


def _counting_backend() -> tuple[Callable, list]:
    """A torch.compile backend that runs each graph as captured, and the list of graphs it was given."""
    graphs = []

    def backend(graph, example_inputs):
        graphs.append(graph)
        return graph.forward

    return backend, graphs


def _require_cpp_toolchain() -> None:
    """Skip where Inductor cannot generate kernels at all; anywhere else a fall back to eager is a failure."""
    if not compiled_decode.cpp_toolchain_available():
        pytest.skip("Inductor finds no working C++ compiler here")


def test_batch_buckets():
    assert [batch_bucket(n) for n in (1, 2, 3, 4, 5, 9, 16, 17, 32)] == [1, 2, 4, 4, 8, 16, 16, 32, 32]
    assert batch_bucket(33) is None


def test_reserve_pads_rows_and_slots_and_rows_keep_their_tokens():
    cache = SuffixCache(num_layers=1, batch_size=2, capacity=4)
    new = torch.stack([torch.full((2, 3, 5), 1.0), torch.full((2, 3, 5), 2.0)])  # [2, KVH 2, 3 tokens, 5]
    cache.update(new, new, 0)
    cache.advance(3)
    cache.reserve(4, 64)
    assert cache.layers[0].keys.shape == (4, 2, 64, 5)
    assert cache.capacity == 64 and cache.batch_size == 2
    keys, _ = cache.update(torch.zeros(2, 2, 1, 5), torch.zeros(2, 2, 1, 5), 0)  # eager step on a padded cache
    assert keys.shape == (2, 2, 4, 5)  # its own rows only
    other = SuffixCache(num_layers=1, batch_size=1, capacity=4)
    other.update(torch.full((1, 2, 2, 5), 3.0), torch.full((1, 2, 2, 5), 3.0), 0)
    other.advance(2)
    cache.advance(1)
    cache.concat(other)  # the padding rows are not carried along
    assert cache.batch_size == 3
    assert cache.layers[0].keys.shape[0] == 3
    assert cache.layers[0].keys[:, 0, 0, 0].tolist() == [1.0, 2.0, 3.0]


@pytest.mark.parametrize("family", FAMILIES)
def test_compiled_steps_give_the_eager_greedy_tokens(family, tiny_tok):
    """fp32, every family: three rows, a padded bucket of four (one row alone: the Llama tests below)."""
    model = model_of(family)
    pool = SharedKVPool.prefill(model, tiny_tok, DOC, config=CompressionConfig.full_precision())
    eager, compiled = Engine(), Engine(compile_decode="aot_eager")
    try:
        expected = _answers(eager, pool, model, tiny_tok, QUESTIONS)
        assert_pairwise_distinct(expected)
        assert pool.num_tokens < SLIDING_WINDOW < len(expected[0]) + pool.num_tokens
        assert _answers(compiled, pool, model, tiny_tok, QUESTIONS) == expected
        decoders = [s.compiled for s in _schedulers(compiled)]
        assert decoders and all(d is not None and d.failed is None for d in decoders)
        assert 4 in decoders[0].compile_seconds  # compiled, not run eager
    finally:
        eager.close()
        compiled.close()


def test_inductor_kernels_give_the_eager_greedy_tokens(tiny_tok):
    """Real code generation (a C++ compiler is needed: where there is none, the fall back is tested below)."""
    _require_cpp_toolchain()
    model = tiny_sensitive_llama(seed=3)
    pool = SharedKVPool.prefill(model, tiny_tok, DOC * 3)
    questions = [f"You are agent {'number ' * i}{i}. {q}" for i, q in enumerate(QUESTIONS)]
    eager, compiled = Engine(), Engine(compile_decode=True)
    try:
        expected = _answers(eager, pool, model, tiny_tok, questions)
        assert_pairwise_distinct(expected)
        assert _answers(compiled, pool, model, tiny_tok, questions) == expected
        (scheduler,) = _schedulers(compiled)
        assert scheduler.compiled.fallback_reason is None
        assert scheduler.compiled.compile_seconds
    finally:
        eager.close()
        compiled.close()


def test_a_lone_row_decodes_through_inductor_kernels_of_the_reduced_attention(tiny_tok):
    """One row (a bucket of one) reads the prefix with the reduced formulation, compiled for real."""
    _require_cpp_toolchain()
    model = tiny_sensitive_llama(seed=5)
    pool = SharedKVPool.prefill(model, tiny_tok, DOC * 3)
    eager, compiled = Engine(), Engine(compile_decode=True)
    try:
        expected = _answers(eager, pool, model, tiny_tok, QUESTIONS[2:])
        assert _answers(compiled, pool, model, tiny_tok, QUESTIONS[2:]) == expected
        (scheduler,) = _schedulers(compiled)
        assert scheduler.compiled.fallback_reason is None
        assert set(scheduler.compiled.compile_seconds) == {1}
    finally:
        eager.close()
        compiled.close()


def _fused_kernel_calls(graph: torch.fx.GraphModule) -> int:
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    return sum(node.target in (flash, flash.default) for node in graph.graph.nodes)


def test_few_queries_per_kv_head_read_the_prefix_reduced_and_many_through_the_fused_kernel(tiny_tok):
    """The tiny Llama has 2 query heads per kv head: buckets 1 and 2 (2 and 4 queries per kv head) read the
    prefix with the reduced formulation, bucket 4 (8) with the fused kernel; suffixes are always reduced."""
    if cascade_attention._CPU_FLASH is None:
        pytest.skip("this PyTorch has no fused CPU attention kernel")
    model = tiny_sensitive_llama(seed=6)
    pool = SharedKVPool.prefill(model, tiny_tok, DOC)
    counting_backend, graphs = _counting_backend()
    engine = Engine(compile_decode=counting_backend)
    try:
        engine.warm_up_decode(model, tiny_tok, pool, buckets=(1, 2, 4))
    finally:
        engine.close()
    assert 2 * 2 <= cascade_attention.REDUCED_MAX_QUERIES < 4 * 2
    layers = model.config.num_hidden_layers
    assert [_fused_kernel_calls(graph) for graph in graphs] == [0, 0, layers]


def test_suffix_longer_than_one_capacity_step_reuses_the_graph(tiny_tok):
    """Slot capacity grows past CAPACITY_STEP mid-answer; the slot dimension is dynamic, so one graph serves."""
    model = tiny_sensitive_llama(seed=4)
    pool = SharedKVPool.prefill(model, tiny_tok, DOC)
    settings = GenerationSettings(max_new_tokens=2 * CAPACITY_STEP, ignore_eos=True)
    counting_backend, graphs = _counting_backend()
    capacities = []

    original = compiled_decode.CompiledDecoder.step

    def recording(self, ids, cache):
        logits = original(self, ids, cache)
        capacities.append(cache.capacity)
        return logits

    eager, compiled = Engine(), Engine(compile_decode=counting_backend)
    try:
        expected = list(PooledAgent(pool, model, tiny_tok, engine=eager).generate_ids("Go on.", settings))
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(compiled_decode.CompiledDecoder, "step", recording)
            answer = list(PooledAgent(pool, model, tiny_tok, engine=compiled).generate_ids("Go on.", settings))
        assert answer == expected
        assert len(set(capacities)) >= 2  # the capacity grew while compiled ...
        assert len(graphs) == 1  # ... and the one graph served every capacity
        (scheduler,) = _schedulers(compiled)
        assert scheduler.compiled.failed is None
    finally:
        eager.close()
        compiled.close()


def test_without_a_cpp_compiler_it_falls_back_to_eager_once_says_so_and_benchmarks_can_tell(tiny_tok, caplog):
    """What Inductor raises where it finds no compiler (dynamo wraps it): eager answers, one warning, and the
    reason readable by a benchmark that must not measure eager steps as compiled ones."""
    model = tiny_sensitive_llama(seed=5)
    pool = SharedKVPool.prefill(model, tiny_tok, DOC)

    def compilerless_backend(graph, example_inputs):
        raise InvalidCxxCompiler("g++")

    eager, compiled = Engine(), Engine(compile_decode=compilerless_backend)
    try:
        expected = _answers(eager, pool, model, tiny_tok, QUESTIONS)
        with caplog.at_level(logging.WARNING, logger="polykv_agents.runtime.compiled_decode"):
            assert _answers(compiled, pool, model, tiny_tok, QUESTIONS) == expected
            assert _answers(compiled, pool, model, tiny_tok, QUESTIONS[:1]) == expected[:1]
        warnings = [r for r in caplog.records if "compiled decode step unavailable" in r.getMessage()]
        assert len(warnings) == 1
        assert "Compiler: g++ is not found" in warnings[0].getMessage()
        (scheduler,) = _schedulers(compiled)
        assert scheduler.compiled.fallback_reason == "InvalidCxxCompiler: Compiler: g++ is not found."
        with pytest.raises(RuntimeError, match="fell back to eager: InvalidCxxCompiler"):
            scheduler.compiled.require_compiled()
        with pytest.raises(RuntimeError, match="fell back to eager: InvalidCxxCompiler"):
            compiled.schedulers.require_compiled()
    finally:
        eager.close()
        compiled.close()


def test_a_failure_that_is_not_the_toolchain_reaches_the_call_instead_of_decoding_eager(tiny_tok):
    """A bug in the step, the model or dynamo must not hide behind eager steps for good."""
    model = tiny_sensitive_llama(seed=5)
    pool = SharedKVPool.prefill(model, tiny_tok, DOC)

    def buggy_backend(graph, example_inputs):
        raise ValueError("a bug in the compiled step")

    engine = Engine(compile_decode=buggy_backend)
    try:
        agent = PooledAgent(pool, model, tiny_tok, engine=engine)
        settings = GenerationSettings(max_new_tokens=4, ignore_eos=True)
        with pytest.raises(BackendCompilerFailed, match="a bug in the compiled step"):
            list(agent.generate_ids(QUESTIONS[0], settings))  # its first token is eager (admission), then the step
        (scheduler,) = _schedulers(engine)
        assert scheduler.compiled.fallback_reason is None and scheduler.compiled.failed is None
        with pytest.raises(RuntimeError, match="no decode step has been compiled"):
            engine.schedulers.require_compiled()
    finally:
        engine.close()


def test_toolchain_failures_are_told_apart_through_dynamo_s_wrapping():
    compile_error = CppCompileError(["g++", "kernel.cpp"], "fatal error: Python.h: No such file or directory")
    wrapped = BackendCompilerFailed(lambda *a: None, compile_error, None)
    assert compiled_decode.toolchain_failure(wrapped) is compile_error
    try:
        try:
            raise InvalidCxxCompiler
        except InvalidCxxCompiler as missing:
            raise RuntimeError("while compiling") from missing
    except RuntimeError as chained:
        assert isinstance(compiled_decode.toolchain_failure(chained), InvalidCxxCompiler)
    assert compiled_decode.toolchain_failure(BackendCompilerFailed(lambda *a: None, ValueError("a bug"), None)) is None
    assert compiled_decode.toolchain_failure(RuntimeError("out of memory")) is None


def test_require_compiled_refuses_a_table_with_nothing_compiled(tiny_tok):
    engine = Engine(compile_decode="aot_eager")
    try:
        with pytest.raises(RuntimeError, match="no scheduler is live"):
            engine.schedulers.require_compiled()
        model = tiny_sensitive_llama(seed=6)
        pool = SharedKVPool.prefill(model, tiny_tok, DOC)
        agent = PooledAgent(pool, model, tiny_tok, engine=engine, runtime="compressed")
        list(agent.generate_ids("Hi.", GenerationSettings(max_new_tokens=3, ignore_eos=True)))
        with pytest.raises(RuntimeError, match="decodes eager by design"):
            engine.schedulers.require_compiled()
    finally:
        engine.close()


def test_a_compressed_prefix_runs_eager(tiny_tok):
    model = tiny_sensitive_llama(seed=6)
    pool = SharedKVPool.prefill(model, tiny_tok, DOC)
    engine = Engine(compile_decode="aot_eager")
    try:
        agent = PooledAgent(pool, model, tiny_tok, engine=engine, runtime="compressed")
        assert len(list(agent.generate_ids("Hi.", GenerationSettings(max_new_tokens=3, ignore_eos=True)))) == 3
        (scheduler,) = _schedulers(engine)
        assert scheduler.compiled is None
    finally:
        engine.close()


def test_warm_up_compiles_ahead_so_calls_build_no_graph(tiny_tok):
    model = tiny_sensitive_llama(seed=7)
    pool = SharedKVPool.prefill(model, tiny_tok, DOC)
    counting_backend, graphs = _counting_backend()

    eager, compiled = Engine(), Engine(compile_decode=counting_backend)
    try:
        assert eager.warm_up_decode(model, tiny_tok, pool) == {}  # nothing to compile
        assert len(eager.schedulers) == 0  # and no scheduler started before a call needs one
        seconds = compiled.warm_up_decode(model, tiny_tok, pool, buckets=(1, 2, 4))  # every bucket 3 rows can meet
        assert set(seconds) == {1, 2, 4} and len(graphs) == 3
        expected = _answers(eager, pool, model, tiny_tok, QUESTIONS)
        assert _answers(compiled, pool, model, tiny_tok, QUESTIONS[:1]) == expected[:1]
        assert _answers(compiled, pool, model, tiny_tok, QUESTIONS) == expected
        assert len(graphs) == 3  # the calls compiled nothing more
        assert compiled.warm_up_decode(model, tiny_tok, pool, buckets=(1, 2, 4)) == seconds  # done once
    finally:
        eager.close()
        compiled.close()


def test_documents_of_other_lengths_reuse_the_graph(tiny_tok):
    """The document's length is a dynamic dimension too: a second pool, longer, builds no second graph."""
    model = tiny_sensitive_llama(seed=8)
    pools = [SharedKVPool.prefill(model, tiny_tok, DOC * n) for n in (1, 3)]
    assert pools[0].num_tokens != pools[1].num_tokens
    counting_backend, graphs = _counting_backend()
    settings = GenerationSettings(max_new_tokens=4, ignore_eos=True)
    eager, compiled = Engine(), Engine(compile_decode=counting_backend)
    try:
        for pool in pools:
            expected = list(PooledAgent(pool, model, tiny_tok, engine=eager).generate_ids("Go on.", settings))
            assert (
                list(PooledAgent(pool, model, tiny_tok, engine=compiled).generate_ids("Go on.", settings)) == expected
            )
        assert len(graphs) == 1
        assert all(s.compiled.failed is None for s in _schedulers(compiled))
    finally:
        eager.close()
        compiled.close()
