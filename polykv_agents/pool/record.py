"""A pool as tensors plus one JSON header, and back: what a pool file holds, and what a pool published to
another process (Ray's object store) holds.

Data flow of :func:`pool_record`: every stored tensor of a :class:`SharedKVPool` (codes, scales, norms of
each layer, plus the token ids) -> ``tensors`` by name; everything else (fingerprint, config, per-layer codec
metadata, sizes, checksums) -> one JSON-able ``header`` with a checksum of its own. Nothing is pickled.

:func:`pool_from_record` reverses it and checks, in order: the format version, the header's own checksum,
the tensors' names, dtypes and shapes, the tensor checksum, and the digest of the rebuilt pool. Any failure
is a :class:`PoolFileError` that names the record's source and says what to do. The checks catch
corruption and careless edits, not a deliberate forgery.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field

from polykv_agents.codecs import EncodedTensor
from polykv_agents.codecs.encoded import dtype_name
from polykv_agents.config import CompressionConfig
from polykv_agents.model.fingerprint import ModelFingerprint
from polykv_agents.pool.shared_pool import EncodedLayer, SharedKVPool

FORMAT_VERSION = 2
"""Version of the record layout this module writes and reads. Bump it whenever the layout changes:
older records are then refused with a message to rebuild the pool, never misread.

2: the model fingerprint no longer depends on the dtype (its weights hash is over a bf16-rounded
sample, and the digest leaves the dtype out), so one pool serves fp32 and bf16 readers."""

_KINDS = ("keys", "values")

# Everything that can go wrong while interpreting a record: bad JSON (a ValueError), a header that fails
# validation (pydantic's ValidationError is a ValueError), missing keys, and torch refusing a tensor.
CORRUPTION_ERRORS = (ValueError, KeyError, IndexError, TypeError, RuntimeError, OverflowError)


class PoolFileError(ValueError):
    """A saved or published pool cannot be used: corrupted, truncated, tampered with, or of another format version."""


# ---------------------------------------------------------------- the JSON header


class _TensorSpec(BaseModel):
    """dtype and shape of one stored tensor, as saved: safetensors' own header is not covered by any checksum."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    dtype: str
    shape: tuple[int, ...]


class _EncodedSpec(BaseModel):
    """:class:`EncodedTensor` metadata; its tensors are named ``layers.{i}.{keys|values}.{name}``."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    codec: str
    shape: tuple[int, ...]
    dtype: str
    params: dict[str, Any]


class _LayerSpec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    keys: _EncodedSpec
    values: _EncodedSpec


class _PoolFileHeader(BaseModel):
    """The ``polykv`` metadata entry of a pool file, stored as JSON with one more key, ``header_checksum``:
    the SHA-256 of the canonical JSON (sorted keys) of everything else."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    format_version: int
    """:data:`FORMAT_VERSION` of the writer."""

    digest: str
    """``SharedKVPool.digest``; also the file's name."""

    checksum: str
    """``SharedKVPool.tensor_checksum()``: detects changed tensor bytes."""

    fingerprint: ModelFingerprint
    config: CompressionConfig
    prefix_messages: list[dict[str, str]] | None
    fp16_nbytes: int = Field(ge=0)
    model_dtype_nbytes: int = Field(ge=0)
    composition: dict[str, Any] | None = None
    """How a composed pool was made (``SharedKVPool.composition``); ``None`` for a prefilled pool."""

    tensors: dict[str, _TensorSpec]
    """Every stored tensor by name: ``token_ids`` and ``layers.{i}.{keys|values}.{name}``."""

    layers: list[_LayerSpec]
    """Codec metadata of each decoder layer's keys and values."""


def _header_checksum(header: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(header, sort_keys=True).encode()).hexdigest()


def _tensor_name(layer_idx: int, kind: str, name: str) -> str:
    return f"layers.{layer_idx}.{kind}.{name}"


@dataclass(frozen=True)
class PoolRecord:
    """A pool as a JSON-able header and its tensors (contiguous, on the CPU)."""

    header: dict[str, Any]
    """The :class:`_PoolFileHeader` fields plus ``header_checksum``."""
    tensors: dict[str, torch.Tensor]
    """``token_ids`` ``[T]`` and ``layers.{i}.{keys|values}.{name}``."""

    @property
    def digest(self) -> str:
        return self.header["digest"]


def pool_record(pool: SharedKVPool) -> PoolRecord:
    """``pool`` as tensors plus a JSON-able header (see the module docstring).

    Raises:
        TypeError: ``pool`` is not a :class:`SharedKVPool`.
    """
    if not isinstance(pool, SharedKVPool):
        msg = f"pool must be a SharedKVPool, got {type(pool).__name__}; build one with SharedKVPool.prefill(...)"
        raise TypeError(msg)
    tensors: dict[str, torch.Tensor] = {"token_ids": pool.token_ids}  # [T] int64
    layers = []
    for i, layer in enumerate(pool.layers):
        specs = {}
        for kind in _KINDS:
            encoded: EncodedTensor = getattr(layer, kind)
            for name, tensor in encoded.tensors.items():
                tensors[_tensor_name(i, kind, name)] = tensor.detach().to("cpu").contiguous()
            specs[kind] = _EncodedSpec(
                codec=encoded.codec, shape=encoded.shape, dtype=encoded.dtype, params=dict(encoded.params)
            )
        layers.append(_LayerSpec(**specs))
    header = _PoolFileHeader(
        format_version=FORMAT_VERSION,
        digest=pool.digest,
        checksum=pool.tensor_checksum(),
        fingerprint=pool.fingerprint,
        config=pool.config,
        prefix_messages=None if pool.prefix_messages is None else [dict(m) for m in pool.prefix_messages],
        fp16_nbytes=pool.fp16_nbytes,
        model_dtype_nbytes=pool.model_dtype_nbytes,
        composition=None if pool.composition is None else dict(pool.composition),
        tensors={name: _TensorSpec(dtype=dtype_name(t.dtype), shape=tuple(t.shape)) for name, t in tensors.items()},
        layers=layers,
    ).model_dump(mode="json")
    header["header_checksum"] = _header_checksum(header)
    return PoolRecord(header=header, tensors=tensors)


def pool_from_record(
    raw_header: Any, tensors: Mapping[str, torch.Tensor], *, source: str, remedy: str, digest: str | None = None
) -> SharedKVPool:
    """The pool a record holds, checked to be exactly the pool that was recorded.

    Args:
        raw_header: The header as read (``json.loads`` of what :func:`pool_record` wrote).
        tensors: The tensors as read, by name.
        source: What the record is, for messages (a file path, an object-store entry).
        remedy: What to do about a bad record, for messages.
        digest: The digest the record is filed under, if any: the rebuilt pool must have it.

    Raises:
        PoolFileError: Another format version, or corrupted, truncated or tampered with.
    """
    try:
        header = _checked_header(raw_header, source=source, remedy=remedy)
        pool = _rebuild(header, _checked_tensors(header, tensors))
    except PoolFileError:
        raise
    except CORRUPTION_ERRORS as e:
        msg = f"{source} is corrupted or truncated ({type(e).__name__}: {e}); {remedy}"
        raise PoolFileError(msg) from e
    # The digest covers fingerprint, config and token ids; the checksum covers every stored tensor byte.
    for what, found, expected in (
        ("tensor checksum", pool.tensor_checksum(), header.checksum),
        ("digest", pool.digest, header.digest if digest is None else digest),
    ):
        if found != expected:
            msg = (
                f"{source} is corrupted or tampered with: the {what} of the pool it holds does not match the "
                f"one it was saved under; {remedy}"
            )
            raise PoolFileError(msg)
    return pool


def _checked_header(raw: Any, *, source: str, remedy: str) -> _PoolFileHeader:
    if not isinstance(raw, dict):
        msg = f"the header is JSON {type(raw).__name__}, not an object"
        raise TypeError(msg)
    raw = dict(raw)
    # The version is checked before anything else: another version may lay out everything else
    # differently, and that deserves its own message rather than "corrupted".
    version = raw.get("format_version")
    if type(version) is not int:  # bool is an int subclass, and no version at all is damage too
        msg = f"format_version is {version!r}, not an integer"
        raise ValueError(msg)
    if version != FORMAT_VERSION:
        msg = (
            f"{source} was written in pool file format version {version!r}, but this version of "
            f"polykv_agents reads version {FORMAT_VERSION}; rebuild the pool from its document "
            "(and delete the old file with PoolStore.delete(digest))"
        )
        raise PoolFileError(msg)
    recorded = raw.pop("header_checksum", None)
    if recorded != _header_checksum(raw):
        msg = (
            f"{source} is corrupted or tampered with: its metadata does not match the checksum recorded "
            f"when it was saved; {remedy}"
        )
        raise PoolFileError(msg)
    return _PoolFileHeader.model_validate(raw)


def _checked_tensors(header: _PoolFileHeader, tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    names = set(tensors)
    if names != set(header.tensors):
        msg = f"stored tensors {sorted(names ^ set(header.tensors))} disagree with the header"
        raise KeyError(msg)
    for name, spec in header.tensors.items():
        # A container's own header (dtypes, shapes, offsets) has no checksum: an edit there that keeps the
        # byte count (int8 -> uint8, [2, 3] -> [3, 2]) would pass the tensor checksum unnoticed.
        tensor = tensors[name]
        if dtype_name(tensor.dtype) != spec.dtype or tuple(tensor.shape) != spec.shape:
            msg = (
                f"tensor {name!r} is {dtype_name(tensor.dtype)}{list(tensor.shape)} as read but was saved "
                f"as {spec.dtype}{list(spec.shape)}"
            )
            raise ValueError(msg)
    return {name: tensors[name] for name in sorted(names)}


def _rebuild(header: _PoolFileHeader, tensors: dict[str, torch.Tensor]) -> SharedKVPool:
    layers = []
    used = {"token_ids"}
    for i, spec in enumerate(header.layers):
        encoded = {}
        for kind in _KINDS:
            meta: _EncodedSpec = getattr(spec, kind)
            prefix = _tensor_name(i, kind, "")
            own = {name.removeprefix(prefix): t for name, t in tensors.items() if name.startswith(prefix)}
            if not own:
                msg = f"layer {i} has no stored {kind} tensors"
                raise KeyError(msg)
            used.update(prefix + name for name in own)
            encoded[kind] = EncodedTensor(
                codec=meta.codec, shape=meta.shape, dtype=meta.dtype, params=meta.params, tensors=own
            )
        layers.append(EncodedLayer(keys=encoded["keys"], values=encoded["values"]))
    if used != set(tensors):
        msg = f"stored tensors {sorted(set(tensors) - used)} belong to no layer"
        raise KeyError(msg)
    return SharedKVPool(
        layers=layers,
        token_ids=tensors["token_ids"],
        config=header.config,
        fingerprint=header.fingerprint,
        prefix_messages=header.prefix_messages,
        fp16_nbytes=header.fp16_nbytes,
        model_dtype_nbytes=header.model_dtype_nbytes,
        composition=header.composition,
    )
