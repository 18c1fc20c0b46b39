"""Weight-only int8 / int4 layers (``weights=``): the function each layer computes, how a model is swapped,
and that the batched runtime stays exact on a quantized model."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from tiny_models import assert_pairwise_distinct, tiny_causal_lm, tiny_gemma3, tiny_llama, tiny_sensitive_llama
from torch import nn

from polykv_agents import ChatPolyKV, Engine, PooledAgent, SharedKVPool
from polykv_agents.model import int8_tiles
from polykv_agents.model import weights as weights_module
from polykv_agents.model.fingerprint import WEIGHT_SAMPLE_ELEMENTS, model_fingerprint
from polykv_agents.model.quantized_embedding import Int8Embedding
from polykv_agents.model.quantized_linear import INT4_GROUP_SIZE, KERNEL_MAX_ROWS, Int4Linear, Int8Linear
from polykv_agents.model.weights import WEIGHTS_ENV_VAR, quantize_weights, resolve_weights, weights_of
from polykv_agents.sampling.settings import GenerationSettings

ROLES = ["planner", "critic", "summarizer", "fox", "dog"]
"""One-word system prompts that give the tiny model different answers."""


def _linear(n: int, k: int, *, bias: bool = False, seed: int = 0) -> nn.Linear:
    torch.manual_seed(seed)
    return nn.Linear(k, n, bias=bias)


@pytest.mark.parametrize("rows", [1, KERNEL_MAX_ROWS, KERNEL_MAX_ROWS + 1, 64])
def test_int8_computes_its_dequantized_weight_on_both_paths(rows):
    """The kernel (few rows) and the matrix product (many rows) compute x @ (codes * scales)^T + bias."""
    linear = _linear(48, 64, bias=True)
    layer = Int8Linear(linear)
    dequantized = layer.codes().float() * layer.scales[:, None].float()
    x = torch.randn(rows, 64)
    torch.testing.assert_close(layer(x), x @ dequantized.T + linear.bias, rtol=1e-5, atol=1e-5)
    # ... and that weight is the original to within half a step of its channel's scale.
    assert (dequantized - linear.weight).abs().max() <= 0.5 * layer.scales.max() + 1e-7


def test_int8_quantizes_a_large_matrix_in_row_blocks_exactly_as_whole(monkeypatch):
    """Blocks of rows keep the load's float32 temporaries small; the codes and scales are the same."""
    import polykv_agents.model.quantized_linear as quantized_linear

    linear = _linear(37, 64, seed=3).bfloat16()
    whole = Int8Linear(linear)
    monkeypatch.setattr(quantized_linear, "QUANTIZE_ROWS", 5)  # 8 blocks, the last one short
    blocks = Int8Linear(linear)
    assert torch.equal(blocks.codes(), whole.codes()) and torch.equal(blocks.scales, whole.scales)
    assert blocks.scales.dtype == (torch.float32 if blocks.tiled else torch.bfloat16)


def test_int8_keeps_leading_dimensions_and_the_activation_dtype():
    layer = Int8Linear(_linear(32, 64).to(torch.bfloat16))
    x = torch.randn(2, 3, 64, dtype=torch.bfloat16)
    out = layer(x)
    assert out.shape == (2, 3, 32) and out.dtype is torch.bfloat16


def test_int4_represents_weights_on_a_4_bit_grid_exactly():
    """Weights already 4-bit per group of 32 (``(code - 8) * scale + zero``, tinygemm's form of GGUF's Q4_1) come
    back exact when bf16 holds the scale, the zero and every weight, as an fp32 model's int4 layer stores
    and computes in bf16."""
    torch.manual_seed(0)
    n, k = 32, 96
    codes = torch.randint(0, 16, (n, k // INT4_GROUP_SIZE, INT4_GROUP_SIZE)).float()
    codes[..., 0], codes[..., 1] = 0, 15  # every group spans the whole grid, as a quantizer's groups do
    scale = 2.0 ** -torch.randint(7, 11, (n, k // INT4_GROUP_SIZE, 1)).float()
    zero = torch.randint(-30, 31, (n, k // INT4_GROUP_SIZE, 1)).float() * scale * 8  # few significant bits
    linear = _linear(n, k)
    linear.weight.data = ((codes - 8) * scale + zero).view(n, k)
    layer = Int4Linear(linear)
    assert layer.compute_dtype is torch.bfloat16
    identity = torch.eye(k)
    torch.testing.assert_close(layer(identity).T, linear.weight.data, rtol=0, atol=0)


@pytest.mark.parametrize("rows", [1, 40])
def test_int4_stays_within_half_a_group_step_of_any_weight(rows):
    """Within half a step of its group's grid, plus bf16's rounding (an fp32 model's int4 layer computes in
    bf16: its kernel's fp32 path is about 100x slower)."""
    linear = _linear(64, 128, bias=True, seed=1)
    layer = Int4Linear(linear)
    dequantized = layer(torch.eye(128)).T - linear.bias[:, None]  # [N, K]
    groups = linear.weight.detach().view(64, -1, INT4_GROUP_SIZE)
    step = (groups.amax(-1) - groups.amin(-1)) / 15  # [N, K/32]
    bf16_rounding = 2.0**-8 * 2 * groups.abs().amax(-1)  # of the zero and of the output, relative 2^-9 each
    error = (dequantized - linear.weight).abs().view(64, -1, INT4_GROUP_SIZE).amax(-1)
    assert torch.all(error <= 0.5 * step + bf16_rounding)
    x = torch.randn(rows, 128)
    out = layer(x)
    assert out.dtype is torch.float32  # the model's dtype, whatever the kernel ran in
    expected = x.bfloat16().float() @ dequantized.T + linear.bias
    torch.testing.assert_close(out, expected, rtol=1e-2, atol=5e-3)


@pytest.mark.parametrize("layer_type", [Int8Linear, Int4Linear])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_zero_rows_and_constant_groups_stay_exact_and_finite(layer_type, dtype):
    """Pruned or padding rows are all zeros, and a group can be constant: a zero scale would make codes 0 / 0."""
    linear = _linear(32, 64).to(dtype)
    linear.weight.data[3] = 0
    linear.weight.data[5, :32] = 0.25
    layer = layer_type(linear)
    out = layer(torch.randn(2, 64, dtype=dtype))
    assert torch.isfinite(out).all() and torch.all(out[:, 3] == 0)
    if layer_type is Int4Linear:  # a constant group comes back exactly (int8's scale is the whole row's)
        assert torch.all(layer(torch.eye(64, dtype=dtype)).T[5, :32] == 0.25)


def test_int4_refuses_shapes_its_kernel_cannot_take():
    with pytest.raises(ValueError, match="in_features % 32 == 0 and out_features % 16 == 0"):
        Int4Linear(_linear(24, 64))


def test_a_model_is_swapped_in_place_and_keeps_its_fingerprint(tiny_tok):
    model = tiny_sensitive_llama()
    before = model_fingerprint(model, tiny_tok)
    linears = sum(type(m) is nn.Linear for m in model.modules())
    assert quantize_weights(model, "int8") == linears
    assert not any(type(m) is nn.Linear for m in model.modules())
    assert isinstance(model.lm_head, Int8Linear) and weights_of(model) == "int8"
    assert model_fingerprint(model, tiny_tok) == before  # one pool serves both
    assert quantize_weights(model, "int8") == 0  # already so
    with pytest.raises(ValueError, match="already int8; load a fresh copy"):
        quantize_weights(model, "int4")
    with pytest.raises(ValueError, match="weights must be one of 'native', 'int8', 'int4', got 'fp4'"):
        quantize_weights(tiny_sensitive_llama(), "fp4")


@pytest.mark.parametrize("weights", ["int8", "int4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # bf16: the tile layout where AMX runs
def test_a_tied_embedding_reads_the_output_layer_s_codes(weights, dtype):
    """No bf16 vocabulary beside the int8 output layer: the lookup reads the layer's own buffers, and each row is
    the layer's row, within half a code of the weight it replaced (and the rounding to ``dtype``)."""
    model = tiny_sensitive_llama().to(dtype)
    model.config.tie_word_embeddings = True
    model.tie_weights()
    original = model.get_input_embeddings().weight.detach().clone()
    quantize_weights(model, weights)
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    assert isinstance(embedding, Int8Embedding) and embedding.tied
    assert embedding.qweight is head.qweight and embedding.scales is head.scales
    ids = torch.tensor([[5, 0, 319, 5], [7, 8, 9, 10]])
    rows = embedding(ids)  # [2, 4, H]
    expected = head.codes()[ids].float() * head.scales[ids, None].float()
    assert rows.shape == (2, 4, original.shape[1]) and rows.dtype == original.dtype
    assert torch.equal(rows, expected.to(original.dtype))
    half_code = original.float().abs().amax(dim=1) / 254  # [V]
    rounding = original[ids].float().abs() * torch.finfo(dtype).eps  # the row is rounded to dtype once
    assert ((rows.float() - original[ids].float()).abs() <= half_code[ids, None] * 1.001 + rounding).all()


def test_an_untied_embedding_gets_codes_of_its_own():
    model = tiny_sensitive_llama()  # untied
    original = model.get_input_embeddings().weight.detach().clone()
    quantize_weights(model, "int8")
    embedding = model.get_input_embeddings()
    assert isinstance(embedding, Int8Embedding) and not embedding.tied
    assert embedding.qweight.shape == original.shape and embedding.qweight.dtype == torch.int8
    ids = torch.arange(original.shape[0])
    half_code = original.abs().amax(dim=1, keepdim=True) / 254
    assert ((embedding(ids) - original).abs() <= half_code * 1.001).all()
    assert not torch.equal(embedding(ids), original)  # int8 rows, not the bf16 ones kept
    assert embedding(torch.tensor([], dtype=torch.long)).shape == (0, original.shape[1])


@pytest.mark.parametrize("tied", [False, True])
def test_an_int8_embedding_keeps_the_native_model_s_fingerprint(tiny_tok, tied):
    """The fingerprint samples more elements than the tiny models' embeddings hold: a larger one here, so a sample
    kept too short would show."""
    torch.manual_seed(0)
    model = tiny_llama(vocab_size=320, head_dim=64)  # 320 x 256 embedding: 81,920 elements
    assert model.get_input_embeddings().weight.numel() > WEIGHT_SAMPLE_ELEMENTS
    if tied:
        model.config.tie_word_embeddings = True
        model.tie_weights()
    native = model_fingerprint(model, tiny_tok)
    quantize_weights(model, "int8")
    assert isinstance(model.get_input_embeddings(), Int8Embedding)
    assert model_fingerprint(model, tiny_tok) == native


def test_an_embedding_that_computes_more_than_a_lookup_is_left_alone():
    """Gemma scales its rows inside the embedding: replacing that module would drop the scaling."""
    model = tiny_gemma3()
    kind = type(model.get_input_embeddings())
    quantize_weights(model, "int8")
    assert type(model.get_input_embeddings()) is kind and kind is not nn.Embedding


def test_int4_keeps_the_output_layer_in_int8():
    """As GGUF's 4-bit files do: a 4-bit output layer cost the embedded model ten times the perplexity."""
    model = tiny_sensitive_llama()
    quantize_weights(model, "int4")
    assert isinstance(model.lm_head, Int8Linear)
    assert isinstance(model.model.layers[0].mlp.up_proj, Int4Linear)


def test_layers_the_int4_kernel_cannot_take_stay_native_and_are_counted(caplog):
    model = tiny_causal_lm("gpt2")  # Conv1D projections, and a 320-token output layer
    with caplog.at_level(logging.WARNING, logger="polykv_agents.model.weights"):
        quantize_weights(model, "int4")
    assert "stay native: the int4 kernel cannot take them" in caplog.text


@pytest.mark.parametrize("weights", ["int8", "int4"])
def test_batched_agents_on_quantized_weights_match_their_sequential_answers(tiny_tok, weights):
    """Cascade attention stays exact when the projections are quantized: the runtime's batched answers equal
    each agent's answer decoded alone over a private copy of the pool, on the same quantized model."""
    model = tiny_sensitive_llama()
    native_pool = SharedKVPool.prefill(model, tiny_tok, "Keys are int8; values are three-bit codes. " * 6)
    quantize_weights(model, weights)
    pool = SharedKVPool.prefill(model, tiny_tok, "Keys are int8; values are three-bit codes. " * 6)
    assert pool.digest == native_pool.digest  # the pool's identity does not depend on how weights are stored
    settings = GenerationSettings(max_new_tokens=12)
    questions = [f"Question {i}: what are {'keys' if i % 2 else 'values'}?" for i in range(5)]
    engine = Engine()
    batched = [PooledAgent(pool, model, tiny_tok, system_prompt=ROLES[i], engine=engine) for i in range(5)]
    private = [
        PooledAgent(pool, model, tiny_tok, system_prompt=ROLES[i], engine=engine, runtime="private") for i in range(5)
    ]
    expected = [list(agent.generate_ids(q, settings)) for agent, q in zip(private, questions, strict=True)]
    assert_pairwise_distinct(expected)
    with ThreadPoolExecutor(5) as threads:
        got = list(
            threads.map(
                lambda pair: list(pair[0].generate_ids(pair[1], settings)), zip(batched, questions, strict=True)
            )
        )
    assert got == expected
    engine.close()


def test_an_engine_keeps_one_copy_per_weights_and_a_chat_model_asks_for_its_own(tiny_model_dir):
    engine = Engine()
    native, _ = engine.load_model(tiny_model_dir, weights="native")
    int8, _ = engine.load_model(tiny_model_dir, weights="int8")
    assert weights_of(native) == "native" and weights_of(int8) == "int8"
    assert engine.load_model(tiny_model_dir, weights="int8")[0] is int8 and len(engine.models) == 2
    ChatPolyKV(model=tiny_model_dir, weights="int4", max_tokens=3, engine=engine).invoke("hi")
    assert weights_of(engine.load_model(tiny_model_dir, weights="int4")[0]) == "int4" and len(engine.models) == 3
    with pytest.raises(ValueError, match="weights"):
        ChatPolyKV(weights="int2")


def test_a_chat_model_s_identity_names_its_weights_and_dtype():
    """LangChain's response cache keys on it: answers from int8 weights are not native answers."""
    native, int8 = ChatPolyKV(weights="native"), ChatPolyKV(weights="int8")
    assert native._identifying_params["weights"] == "native" and int8._identifying_params["weights"] == "int8"
    assert ChatPolyKV()._identifying_params["weights"] == "auto"  # like the dtype: what the user asked for
    assert native._identifying_params["dtype"] == "auto"


@pytest.mark.parametrize("tiles", [True, False])
@pytest.mark.parametrize("vectors", [True, False])
def test_auto_weights_are_int8_where_the_native_kernel_runs_and_native_elsewhere(tiles, vectors, monkeypatch):
    """The kernel's tiles take bfloat16 rows, its vector path float32 rows; both on the CPU only."""
    monkeypatch.delenv(WEIGHTS_ENV_VAR, raising=False)
    monkeypatch.setattr(int8_tiles, "tiles_available", lambda: tiles)
    monkeypatch.setattr(int8_tiles, "vectors_available", lambda: vectors)
    assert resolve_weights("auto", torch.bfloat16, "cpu") == ("int8" if tiles else "native")
    assert resolve_weights("auto", torch.float32, "cpu") == ("int8" if vectors else "native")
    assert resolve_weights("auto", torch.float16, "cpu") == "native"  # neither path takes float16 rows
    assert resolve_weights("auto", None, "cpu") == "native"  # the checkpoint's dtype: not known before loading
    assert resolve_weights("auto", torch.bfloat16, "cuda:0") == "native"  # the kernels are CPU kernels
    assert resolve_weights("auto", torch.float32, "cuda:0") == "native"
    assert resolve_weights("int4", torch.bfloat16, "cpu") == "int4"  # a named form is taken as it is


def test_polykv_weights_says_what_auto_means(monkeypatch):
    monkeypatch.setattr(weights_module, "kernel_runs", lambda dtype, device: True)
    monkeypatch.setenv(WEIGHTS_ENV_VAR, "native")
    assert resolve_weights("auto", torch.bfloat16, "cpu") == "native"
    assert resolve_weights("int8", torch.bfloat16, "cpu") == "int8"  # a named form wins over the variable
    monkeypatch.setenv(WEIGHTS_ENV_VAR, "int3")
    with pytest.raises(ValueError, match="POLYKV_WEIGHTS must be 'auto' or one of 'native', 'int8', 'int4'"):
        resolve_weights("auto", torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="weights must be 'auto' or one of"):
        resolve_weights("int2", torch.bfloat16, "cpu")


def test_auto_and_the_form_it_means_share_one_loaded_copy(tiny_model_dir, monkeypatch):
    monkeypatch.delenv(WEIGHTS_ENV_VAR, raising=False)
    monkeypatch.setattr(weights_module, "kernel_runs", lambda dtype, device: dtype == torch.bfloat16)
    engine = Engine()
    model, _ = engine.load_model(tiny_model_dir, dtype="bfloat16")
    assert weights_of(model) == "int8"
    assert engine.load_model(tiny_model_dir, dtype="bfloat16", weights="int8")[0] is model and len(engine.models) == 1
    assert weights_of(engine.load_model(tiny_model_dir, dtype="float32")[0]) == "native"
