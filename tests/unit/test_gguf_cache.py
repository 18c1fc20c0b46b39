"""The cache of de-quantised GGUF files: where entries live, what keys them, how they are written and read back.

A tiny Llama stands in for a model read from GGUF (the cache saves whatever transformers produced); the real
embedded model's round trip is in tests/integration/test_smollm.py."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from polykv_agents.model import gguf_cache, loading


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv(gguf_cache.CACHE_DIR_ENV_VAR, str(tmp_path / "cache"))
    monkeypatch.delenv(gguf_cache.SWITCH_ENV_VAR, raising=False)
    return tmp_path / "cache"


@pytest.fixture
def gguf_file(tmp_path):
    """Any file: the cache keys on its bytes and never parses it."""
    path = tmp_path / "models" / "tiny.Q4_1.gguf"
    path.parent.mkdir()
    path.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    return path


def test_the_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.delenv(gguf_cache.SWITCH_ENV_VAR, raising=False)
    monkeypatch.setenv(gguf_cache.CACHE_DIR_ENV_VAR, str(tmp_path / "mine"))
    assert gguf_cache.cache_root() == tmp_path / "mine" / "gguf"
    monkeypatch.delenv(gguf_cache.CACHE_DIR_ENV_VAR)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert gguf_cache.cache_root() == tmp_path / "xdg" / "polykv_agents" / "gguf"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert gguf_cache.cache_root() == tmp_path / "home" / ".cache" / "polykv_agents" / "gguf"
    for off in ("0", "off", "False"):
        monkeypatch.setenv(gguf_cache.SWITCH_ENV_VAR, off)
        assert gguf_cache.cache_root() is None


def test_an_entry_is_named_by_the_file_bytes_and_the_converters_versions(cache_dir, gguf_file):
    entry = gguf_cache.entry_for(gguf_file)
    assert entry.parent == cache_dir / "gguf"
    assert entry.name.startswith("tiny.Q4_1-") and "transformers" in entry.name and "-gguf" in entry.name
    assert gguf_cache.entry_for(gguf_file) == entry  # stable
    gguf_file.write_bytes(gguf_file.read_bytes()[:-1] + b"\x00")  # same size, other bytes
    assert gguf_cache.entry_for(gguf_file) != entry


def test_a_saved_entry_loads_as_the_same_model_and_tokenizer(cache_dir, gguf_file, tiny_model, tiny_tok):
    assert gguf_cache.cached_checkpoint(gguf_file) is None
    entry = gguf_cache.save_checkpoint(gguf_file, tiny_model, tiny_tok)
    assert entry == gguf_cache.cached_checkpoint(gguf_file)
    assert [p.name for p in entry.parent.iterdir()] == [entry.name]  # no temporary folder left behind
    model = AutoModelForCausalLM.from_pretrained(entry, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(entry, local_files_only=True)
    saved, loaded = tiny_model.state_dict(), model.state_dict()
    assert saved.keys() == loaded.keys() and all(torch.equal(saved[name], loaded[name]) for name in saved)
    assert tokenizer.get_vocab() == tiny_tok.get_vocab() and tokenizer.chat_template == tiny_tok.chat_template
    assert "quantization_config" not in (entry / "config.json").read_text()


def test_an_entry_without_its_completion_mark_is_not_used(cache_dir, gguf_file, tiny_model, tiny_tok):
    entry = gguf_cache.save_checkpoint(gguf_file, tiny_model, tiny_tok)
    (entry / "polykv-complete").unlink()
    assert gguf_cache.cached_checkpoint(gguf_file) is None


def test_a_cache_that_cannot_be_written_is_skipped_with_a_warning(tmp_path, monkeypatch, gguf_file, tiny_model, caplog):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the cache folder would go")
    monkeypatch.setenv(gguf_cache.CACHE_DIR_ENV_VAR, str(blocker))
    with caplog.at_level(logging.WARNING, logger=gguf_cache.__name__):
        assert gguf_cache.save_checkpoint(gguf_file, tiny_model, None) is None
    assert gguf_cache.CACHE_DIR_ENV_VAR in caplog.text and f"{gguf_cache.SWITCH_ENV_VAR}=0" in caplog.text


def test_a_save_that_fails_midway_leaves_nothing_and_only_warns(cache_dir, gguf_file, tiny_model, caplog):
    class BrokenTokenizer:
        def save_pretrained(self, directory):
            raise RuntimeError("tokenizer cannot be serialised")

    with caplog.at_level(logging.WARNING, logger=gguf_cache.__name__):
        assert gguf_cache.save_checkpoint(gguf_file, tiny_model, BrokenTokenizer()) is None
    assert "tokenizer cannot be serialised" in caplog.text
    assert list((cache_dir / "gguf").iterdir()) == []  # the half-written folder is removed
    assert gguf_cache.cached_checkpoint(gguf_file) is None


def test_switched_off_nothing_is_written(tmp_path, monkeypatch, gguf_file, tiny_model, tiny_tok):
    monkeypatch.setenv(gguf_cache.CACHE_DIR_ENV_VAR, str(tmp_path / "cache"))
    monkeypatch.setenv(gguf_cache.SWITCH_ENV_VAR, "0")
    assert gguf_cache.save_checkpoint(gguf_file, tiny_model, tiny_tok) is None
    assert gguf_cache.cached_checkpoint(gguf_file) is None
    assert not (tmp_path / "cache").exists()


def test_a_second_writer_of_the_same_entry_keeps_the_first(cache_dir, gguf_file, tiny_model, tiny_tok):
    first = gguf_cache.save_checkpoint(gguf_file, tiny_model, tiny_tok)
    marker = (first / "polykv-complete").stat().st_mtime_ns
    assert gguf_cache.save_checkpoint(gguf_file, tiny_model, tiny_tok) == first
    assert (first / "polykv-complete").stat().st_mtime_ns == marker
    assert [p.name for p in first.parent.iterdir()] == [first.name]


def test_loading_converts_once_then_reads_the_entry_and_converts_a_damaged_one_again(
    cache_dir, gguf_file, tiny_model, tiny_tok, monkeypatch, caplog
):
    """The loader's glue: transformers' GGUF reader is replaced by the tiny model (the real one is
    tested on the embedded model)."""
    sources = []
    real_from_pretrained = loading._from_pretrained

    def from_pretrained(source, kwargs, dtype, asked_for):
        sources.append("gguf" if "gguf_file" in kwargs else "cache")
        if "gguf_file" in kwargs:
            assert source == str(gguf_file.parent) and kwargs["gguf_file"] == gguf_file.name
            return tiny_model, tiny_tok
        return real_from_pretrained(source, kwargs, dtype, asked_for)

    monkeypatch.setattr(loading, "_from_pretrained", from_pretrained)
    loading._load_gguf(gguf_file, str(gguf_file))
    model, _ = loading._load_gguf(gguf_file, str(gguf_file))
    assert sources == ["gguf", "cache"]
    assert torch.equal(model.model.embed_tokens.weight, tiny_model.model.embed_tokens.weight)

    entry = gguf_cache.cached_checkpoint(gguf_file)
    (entry / "model.safetensors").write_bytes(b"not safetensors")
    with caplog.at_level(logging.WARNING, logger=loading.__name__):
        loading._load_gguf(gguf_file, str(gguf_file))
    assert sources == ["gguf", "cache", "cache", "gguf"] and "converting" in caplog.text
    model, _ = loading._load_gguf(gguf_file, str(gguf_file))  # the new entry is read again
    assert sources[-1] == "cache"
    assert torch.equal(model.model.embed_tokens.weight, tiny_model.model.embed_tokens.weight)


def test_an_entry_in_another_dtype_has_its_own_name_and_the_fp32_name_is_unchanged(cache_dir, gguf_file):
    fp32 = gguf_cache.entry_for(gguf_file)
    assert gguf_cache.entry_for(gguf_file, torch.float32) == fp32 and not fp32.name.endswith("float32")
    assert gguf_cache.entry_for(gguf_file, torch.bfloat16) == fp32.with_name(fp32.name + "-bfloat16")


def test_a_load_in_another_dtype_saves_that_cast_once_then_reads_it(cache_dir, gguf_file, tiny_model, monkeypatch):
    """Read in its own dtype, a checkpoint maps the file into the weights: no float32 copy beside them."""
    import copy

    from tiny_models import tiny_tokenizer

    sources = []
    real_from_pretrained = loading._from_pretrained

    def from_pretrained(source, kwargs, dtype, asked_for):
        sources.append(("gguf" if "gguf_file" in kwargs else source.rsplit("-", 1)[-1], dtype))
        if "gguf_file" in kwargs:
            return copy.deepcopy(tiny_model), tiny_tokenizer()
        return real_from_pretrained(source, kwargs, dtype, asked_for)

    monkeypatch.setattr(loading, "_from_pretrained", from_pretrained)
    first, _ = loading._load_gguf(gguf_file, str(gguf_file), torch.bfloat16)  # converted, cast, both saved
    second, _ = loading._load_gguf(gguf_file, str(gguf_file), torch.bfloat16)
    third, _ = loading._load_gguf(gguf_file, str(gguf_file), torch.float32)
    assert [dtype for _, dtype in sources] == [torch.float32, torch.bfloat16, torch.float32]
    assert sources[0][0] == "gguf" and sources[1][0] == "bfloat16" and sources[2][0] != "bfloat16"
    assert first.dtype == second.dtype == torch.bfloat16 and third.dtype == torch.float32
    for name, expected in tiny_model.state_dict().items():
        assert torch.equal(second.state_dict()[name], expected.bfloat16()), name
        assert torch.equal(third.state_dict()[name], expected), name


def test_a_quantized_model_owns_copies_of_the_tensors_it_still_reads(tiny_model):
    import copy

    model = copy.deepcopy(tiny_model)
    model.lm_head.weight = model.model.embed_tokens.weight  # tied, as the embedded model's head is
    expected = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    before = {name: p.data_ptr() for name, p in model.named_parameters()}
    loading._own_copies(model)
    assert all(p.data_ptr() != before[name] for name, p in model.named_parameters())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still one tensor, copied once
    assert all(torch.equal(model.state_dict()[name], tensor) for name, tensor in expected.items())
