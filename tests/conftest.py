"""Shared fixtures: tiny random models for fast tests, the real embedded model once per session."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

# Before Ray is imported anywhere: Ray's own local test clusters then live on loopback only (Ray binds its
# services to the address this setting makes it pick), and Ray sends no usage statistics.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# The suite checks exact equivalences (batched == sequential, token for token), which hold in fp32: "auto"
# means fp32 here unless a run says otherwise. Tests of bf16 ask for it by name.
os.environ.setdefault("POLYKV_DTYPE", "float32")
# GGUF files are converted once into this session's own cache (the first load of the embedded model), never
# into the user's: every later load in the session, subprocesses included, reads that conversion.
os.environ["POLYKV_CACHE_DIR"] = tempfile.mkdtemp(prefix="polykv-test-cache-")  # removed in pytest_unconfigure
os.environ.pop("POLYKV_GGUF_CACHE", None)

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))  # tests/tiny_models.py

from native_kernels import require_native_kernel
from tiny_models import tiny_llama, tiny_tokenizer

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


@pytest.fixture(params=["native kernel", "pytorch"])
def attention_path(request, monkeypatch):
    """Run a test through the native grouped-attention kernel and through the PyTorch path it falls back to."""
    if request.param == "pytorch":
        monkeypatch.setenv("POLYKV_AGENTS_KERNELS", "0")
    else:
        require_native_kernel("grouped_attention")
    return request.param


@pytest.fixture(scope="session")
def tiny_tok():
    return tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_model():
    return tiny_llama()


@pytest.fixture(scope="session")
def smollm():
    """The embedded SmolLM2-135M-Instruct (loaded once; about 20 s)."""
    from polykv_agents import load_model

    return load_model()


@pytest.fixture(scope="session")
def sample_document() -> str:
    from importlib import resources

    return resources.files("polykv_agents").joinpath("data/sample_document.md").read_text(encoding="utf-8")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> str:
    """The tiny Llama and its tokenizer saved as a local checkpoint, for APIs that take a model name."""
    directory = tmp_path_factory.mktemp("tiny-llama")
    tiny_llama().save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    return str(directory)


@pytest.fixture(scope="session")
def long_context_model_dir(tmp_path_factory) -> str:
    """The tiny Llama with room for several steps: its byte-level tokenizer spends a token per character or two."""
    directory = tmp_path_factory.mktemp("tiny-llama-4k")
    tiny_llama(max_positions=4096).save_pretrained(directory)
    tiny_tokenizer().save_pretrained(directory)
    return str(directory)


def pytest_unconfigure(config):
    shutil.rmtree(os.environ["POLYKV_CACHE_DIR"], ignore_errors=True)
