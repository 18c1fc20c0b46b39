"""The models of real shapes (issue 43) have their published sizes; building them is for benchmarks, not tests."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from benchmarks.real_shapes import GGUF_TYPES, PUBLISHED, gguf_file, published_config


@pytest.mark.parametrize(
    ("name", "parameters", "kv_bytes_per_token"),
    # Parameters as their model cards give them (1.24B and 1.54B); KV per token in bf16: layers x 2 x kv heads x
    # head dim x 2 bytes (32 KiB for Llama-3.2-1B, 28 KiB for Qwen2.5-1.5B; SmolLM2-135M's is 30 KiB).
    [("Llama-3.2-1B", 1_235_814_400, 32_768), ("Qwen2.5-1.5B", 1_543_714_304, 28_672)],
)
def test_a_published_configuration_has_the_model_s_size(name, parameters, kv_bytes_per_token):
    config = published_config(name)
    with torch.device("meta"):  # shapes only: no memory, no time
        model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) == parameters
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert config.num_hidden_layers * 2 * config.num_key_value_heads * head_dim * 2 == kv_bytes_per_token


def test_unknown_models_and_gguf_types_are_refused_with_the_choices(tmp_path):
    with pytest.raises(ValueError, match=r"one of Llama-3\.2-1B, Qwen2\.5-1\.5B"):
        published_config("Llama-3.1-8B")
    with pytest.raises(ValueError, match=r"one of F16, Q8_0, Q4_0"):
        gguf_file(next(iter(PUBLISHED)), "Q5_K", tmp_path)
    assert GGUF_TYPES == ("F16", "Q8_0", "Q4_0")


def test_a_model_is_built_once_with_the_embedded_tokenizer_and_loads_like_any_local_model(tmp_path, monkeypatch):
    """A tiny stand-in with the same path through the code (the real ones are GiBs): written once, then read."""
    import benchmarks.real_shapes as real_shapes
    from polykv_agents.model.loading import load_model_uncached

    tiny = {**PUBLISHED["Llama-3.2-1B"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2}
    tiny.update(num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=50_000)
    monkeypatch.setitem(real_shapes.PUBLISHED, "tiny", tiny)
    monkeypatch.setenv("POLYKV_CACHE_DIR", str(tmp_path))
    directory = real_shapes.build("tiny")
    assert directory == tmp_path / "real-shapes" / "tiny-seed0"
    written = (directory / "model.safetensors").stat().st_mtime_ns
    assert real_shapes.build("tiny") == directory and (directory / "model.safetensors").stat().st_mtime_ns == written
    model, tokenizer = load_model_uncached(str(directory), torch.bfloat16, "cpu")
    assert model.config.vocab_size == 50_000 and len(tokenizer) == 49_152  # the published rows, SmolLM2's tokens
    assert (model.config.bos_token_id, model.config.eos_token_id) == (tokenizer.bos_token_id, tokenizer.eos_token_id)
    assert model.config.eos_token_id < len(tokenizer)  # a grammar over the tokenizer's vocabulary can name it
    again = real_shapes.random_model("tiny")
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), again.state_dict().values(), strict=True))
    llama_cpp = tmp_path / "llama.cpp"
    with pytest.raises(FileNotFoundError, match=r"no convert_hf_to_gguf\.py in"):
        real_shapes.gguf_file("tiny", "Q8_0", llama_cpp)
    llama_cpp.mkdir()
    (llama_cpp / "convert_hf_to_gguf.py").touch()
    with pytest.raises(FileNotFoundError, match="no llama-quantize under"):
        real_shapes.gguf_file("tiny", "Q8_0", llama_cpp)
