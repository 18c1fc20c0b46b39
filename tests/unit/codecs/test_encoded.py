"""The encoded record: read-only copies of its mappings, sizes, and a pickle round trip."""

from __future__ import annotations

import pickle

import pytest
import torch

from polykv_agents.codecs.encoded import EncodedTensor, dtype_name


def _record() -> EncodedTensor:
    codes = torch.arange(6, dtype=torch.uint8)
    norms = torch.ones(1, 1, 2, dtype=torch.float16)  # [batch, kv_heads, tokens]
    return EncodedTensor(
        codec="turboquant",
        shape=(1, 1, 2, 4),
        dtype="bfloat16",
        params={"bits": 3, "seed": 5},
        tensors={"codes": codes, "norms": norms},
    )


def test_pickle_round_trip_rebuilds_a_read_only_record() -> None:
    original = _record()
    restored = pickle.loads(pickle.dumps(original))
    assert type(restored) is EncodedTensor
    assert (restored.codec, restored.shape, restored.dtype) == ("turboquant", (1, 1, 2, 4), "bfloat16")
    assert dict(restored.params) == {"bits": 3, "seed": 5}
    assert list(restored.tensors) == ["codes", "norms"]
    assert all(torch.equal(restored.tensors[k], original.tensors[k]) for k in original.tensors)
    with pytest.raises(TypeError, match="does not support item assignment"):
        restored.params["bits"] = 2
    with pytest.raises(TypeError, match="does not support item assignment"):
        restored.tensors["codes"] = torch.zeros(1)


def test_sizes_and_dtype() -> None:
    record = _record()
    assert record.nbytes == 6 + 2 * 2
    assert record.numel == 8
    assert record.torch_dtype is torch.bfloat16
    assert dtype_name(torch.float16) == "float16"
