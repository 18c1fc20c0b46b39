"""Identity codec and the encoded record: exact round trips, copies, dtypes and byte counts."""

from __future__ import annotations

import pytest
import torch

from polykv_agents import codecs
from polykv_agents.codecs.encoded import EncodedTensor, dtype_name
from polykv_agents.codecs.full_precision import FullPrecisionCodec


def _x(dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(2, 3, 5, 8, generator=torch.Generator().manual_seed(0)).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_round_trip_is_exact_and_the_record_describes_it(dtype: torch.dtype) -> None:
    x = _x(dtype)
    codec = FullPrecisionCodec()
    enc = codec.encode(x)
    assert enc.codec == "none"
    assert enc.shape == (2, 3, 5, 8)
    assert enc.dtype == dtype_name(dtype)
    assert dict(enc.params) == {}
    assert list(enc.tensors) == ["data"]
    assert enc.nbytes == x.nbytes
    out = codec.decode(enc)
    assert out.dtype == dtype
    assert torch.equal(out, x)
    assert torch.equal(codecs.decode(enc), x)


def test_encode_stores_a_private_contiguous_copy() -> None:
    """The pool must not alias a cache that the model may still write into."""
    base = _x()
    x = base.transpose(2, 3)  # [2, 3, 8, 5], non-contiguous view
    enc = FullPrecisionCodec().encode(x)
    data = enc.tensors["data"]
    assert data.is_contiguous()
    assert data.data_ptr() != base.data_ptr()
    base.zero_()
    assert data.abs().max() > 0


def test_encode_detaches_from_autograd() -> None:
    x = _x().requires_grad_()
    data = FullPrecisionCodec().encode(x).tensors["data"]
    assert not data.requires_grad
    assert data.grad_fn is None


def test_decode_casts_only_when_asked() -> None:
    codec = FullPrecisionCodec()
    enc = codec.encode(_x(torch.bfloat16))
    data = enc.tensors["data"]
    # No dtype, or the stored dtype: the stored tensor itself (no copy on the hot path).
    assert codec.decode(enc) is data
    assert codec.decode(enc, torch.bfloat16) is data
    out = codec.decode(enc, torch.float32)
    assert out.dtype == torch.float32
    assert torch.equal(out, data.float())
    assert codecs.decode(enc, torch.float32).dtype == torch.float32


def test_from_params_builds_the_identity_codec() -> None:
    assert isinstance(FullPrecisionCodec.from_params({}), FullPrecisionCodec)
    assert FullPrecisionCodec.name == "none"


def test_encoded_tensor_properties() -> None:
    enc = EncodedTensor(
        codec="none",
        shape=(2, 1, 3, 4),
        dtype="bfloat16",
        params={},
        tensors={"a": torch.zeros(5, dtype=torch.uint8), "b": torch.zeros(3, dtype=torch.float16)},
    )
    assert enc.numel == 24
    assert isinstance(enc.numel, int)
    assert enc.nbytes == 5 + 6
    assert enc.torch_dtype is torch.bfloat16
    with pytest.raises(AttributeError):
        enc.codec = "int"  # type: ignore[misc]


def test_dtype_name() -> None:
    assert dtype_name(torch.float32) == "float32"
    assert dtype_name(torch.bfloat16) == "bfloat16"
    assert dtype_name(torch.uint8) == "uint8"
