"""``dtype="auto"``: bf16 where the device computes it natively, fp32 elsewhere; POLYKV_DTYPE pins it."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_llama

from polykv_agents import ChatPolyKV
from polykv_agents.engine import Engine
from polykv_agents.model import dtype as dtype_module
from polykv_agents.model.dtype import DTYPE_ENV_VAR, resolve_dtype


@pytest.mark.parametrize(("native", "expected"), [(True, torch.bfloat16), (False, torch.float32)])
def test_auto_follows_the_cpu(monkeypatch, native, expected):
    monkeypatch.delenv(DTYPE_ENV_VAR, raising=False)
    monkeypatch.setattr(dtype_module, "native_bf16", lambda device: native)
    assert resolve_dtype("auto", "cpu") is expected


def test_auto_on_a_gpu_without_bf16_is_fp16(monkeypatch):
    monkeypatch.delenv(DTYPE_ENV_VAR, raising=False)
    monkeypatch.setattr(dtype_module, "native_bf16", lambda device: False)
    assert resolve_dtype("auto", "cuda") is torch.float16


def test_the_environment_says_what_auto_means_and_an_explicit_dtype_wins(monkeypatch):
    monkeypatch.setenv(DTYPE_ENV_VAR, "bfloat16")
    assert resolve_dtype("auto", "cpu") is torch.bfloat16
    assert resolve_dtype("float32", "cpu") is torch.float32
    assert resolve_dtype(torch.float16, "cpu") is torch.float16
    assert resolve_dtype(None, "cpu") is None  # the checkpoint's own


def test_unknown_names_are_refused_with_the_choices(monkeypatch):
    with pytest.raises(ValueError, match=r"dtype must be one of 'auto', 'float32', 'bfloat16', 'float16'; got 'fp8'"):
        resolve_dtype("fp8", "cpu")
    monkeypatch.setenv(DTYPE_ENV_VAR, "half")
    with pytest.raises(ValueError, match=rf"{DTYPE_ENV_VAR} must be one of .*got 'half'"):
        resolve_dtype("auto", "cpu")
    with pytest.raises(ValueError, match="dtype"):
        ChatPolyKV(dtype="half")


def test_auto_and_the_dtype_it_means_share_one_loaded_copy(monkeypatch, tiny_model_dir):
    monkeypatch.setenv(DTYPE_ENV_VAR, "bfloat16")
    engine = Engine()
    model, _ = engine.load_model(tiny_model_dir)
    assert model.dtype is torch.bfloat16
    assert engine.load_model(tiny_model_dir, dtype=torch.bfloat16)[0] is model
    assert engine.load_model(tiny_model_dir, dtype="float32")[0].dtype is torch.float32
    assert len(engine.models) == 2


def test_a_chat_model_loads_its_dtype(monkeypatch, tiny_model_dir):
    monkeypatch.delenv(DTYPE_ENV_VAR, raising=False)
    engine = Engine()
    chat = ChatPolyKV(model=tiny_model_dir, dtype="bfloat16", max_tokens=3, engine=engine)
    chat.invoke("hi")
    ((model, _),) = [engine.load_model(tiny_model_dir, dtype="bfloat16")]
    assert model.dtype is torch.bfloat16 and len(engine.models) == 1
    assert tiny_llama().dtype is torch.float32  # the tiny models themselves stay fp32
