"""PoolStore: pools on disk as safetensors files named by their digest, so a fresh process can reload one.

Data flow of :meth:`PoolStore.save`: every stored tensor of a :class:`SharedKVPool` (codes, scales,
norms of each layer, plus the token ids) -> one safetensors file ``<digest>.safetensors``, written
to a temporary file in the same directory and moved into place, so a reader never sees half a file.
Everything else (fingerprint, config, per-layer codec metadata, sizes, checksums) goes into one
JSON header stored as the file's ``polykv`` metadata entry. Nothing is ever pickled: loading a file
cannot run code.

:meth:`PoolStore.load` reverses this and then checks, in order: the format version, the header's
own checksum, the stored tensors' names, dtypes and shapes, the tensor checksum, and that the pool
rebuilt from the file has the digest the file is named by. Any failure is a :class:`PoolFileError`
saying which file is bad and what to do about it. The checks catch corruption and careless edits,
not a deliberate forgery: treat a store directory like a model cache you trust.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, ConfigDict, Field
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from polykv_agents.codecs import EncodedTensor
from polykv_agents.codecs.encoded import dtype_name
from polykv_agents.config import CompressionConfig
from polykv_agents.fingerprint import ModelFingerprint
from polykv_agents.pool import EncodedLayer, SharedKVPool

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
"""Version of the file layout this module writes and reads. Bump it whenever the layout changes:
older files are then refused with a message to rebuild the pool, never misread."""

_METADATA_KEY = "polykv"
_SUFFIX = ".safetensors"
_DIGEST = re.compile(r"[0-9a-f]{64}")
_KINDS = ("keys", "values")

# Everything that can go wrong while interpreting a file's bytes: safetensors' own errors, bad JSON
# (a ValueError), a header that fails validation (pydantic's ValidationError is a ValueError),
# missing keys, and torch refusing a tensor.
_CORRUPTION_ERRORS = (SafetensorError, ValueError, KeyError, IndexError, TypeError, RuntimeError, OverflowError)


class PoolFileError(ValueError):
    """A saved pool file cannot be used: corrupted, truncated, tampered with, or of another format version."""


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

    tensors: dict[str, _TensorSpec]
    """Every stored tensor by name: ``token_ids`` and ``layers.{i}.{keys|values}.{name}``."""

    layers: list[_LayerSpec]
    """Codec metadata of each decoder layer's keys and values."""


def _header_checksum(header: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(header, sort_keys=True).encode()).hexdigest()


def _tensor_name(layer_idx: int, kind: str, name: str) -> str:
    return f"layers.{layer_idx}.{kind}.{name}"


# ---------------------------------------------------------------- the store


class PoolStore:
    """A directory of saved pools, one ``<digest>.safetensors`` file each.

    Constructing a store touches nothing on disk; :meth:`save` creates the directory when needed.
    Files are content-addressed, so saving a pool twice writes the same file twice, and several
    processes may share one directory.

    Args:
        directory: Where the files live.
    """

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)

    def __repr__(self) -> str:
        return f"PoolStore({str(self.directory)!r})"

    def path_for(self, digest: str) -> Path:
        """The file of pool ``digest``, inside :attr:`directory`.

        Raises:
            ValueError: ``digest`` is not 64 lowercase hex characters (a pool's ``digest``), which
                also keeps names like ``../../etc/passwd`` from leaving the directory.
        """
        if not isinstance(digest, str) or _DIGEST.fullmatch(digest) is None:
            msg = (
                f"digest must be 64 lowercase hexadecimal characters (a SharedKVPool.digest), got {digest!r}; "
                "pass pool.digest or handle.digest unchanged"
            )
            raise ValueError(msg)
        return self.directory / f"{digest}{_SUFFIX}"

    def __contains__(self, digest: object) -> bool:
        """Whether a file for ``digest`` exists (``ValueError`` for a malformed digest, as :meth:`path_for`)."""
        return self.path_for(digest).is_file()  # type: ignore[arg-type]

    def delete(self, digest: str) -> None:
        """Remove the file of ``digest``; nothing happens if there is none."""
        self.path_for(digest).unlink(missing_ok=True)

    # ---------------------------------------------------------------- writing

    def save(self, pool: SharedKVPool) -> Path:
        """Write ``pool`` to ``<digest>.safetensors`` atomically and return the path.

        Raises:
            TypeError: ``pool`` is not a :class:`SharedKVPool`.
            OSError: The directory or file cannot be written.
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
            tensors={name: _TensorSpec(dtype=dtype_name(t.dtype), shape=tuple(t.shape)) for name, t in tensors.items()},
            layers=layers,
        ).model_dump(mode="json")
        header["header_checksum"] = _header_checksum(header)

        path = self.path_for(pool.digest)
        self.directory.mkdir(parents=True, exist_ok=True)
        # A temporary file in the same directory, so os.replace is an atomic rename on one filesystem:
        # a concurrent reader sees the old file or the new one, never a partial write.
        fd, tmp_name = tempfile.mkstemp(dir=self.directory, prefix=f".{pool.digest[:16]}.", suffix=".tmp")
        os.close(fd)
        try:
            save_file(tensors, tmp_name, metadata={_METADATA_KEY: json.dumps(header)})
            with open(tmp_name, "rb") as f:
                os.fsync(f.fileno())  # the data must be on disk before the rename makes it visible
            os.replace(tmp_name, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp_name)
            raise
        logger.info("saved %r to %s", pool, path)
        return path

    # ---------------------------------------------------------------- reading

    def load(self, digest: str) -> SharedKVPool:
        """Read pool ``digest`` back and check it is exactly the pool that was saved.

        Raises:
            ValueError: ``digest`` is malformed (see :meth:`path_for`).
            FileNotFoundError: There is no file for ``digest``.
            PoolFileError: The file is corrupted, truncated or tampered with, or was written in another
                format version; the message names the file and says to delete it or rebuild the pool.
        """
        path = self.path_for(digest)
        if not path.is_file():
            msg = f"no saved pool {path.name} in {self.directory}; build it with SharedKVPool.prefill and save it"
            raise FileNotFoundError(msg)
        try:
            header, tensors = self._read(path)
            pool = self._rebuild(header, tensors)
        except PoolFileError:
            raise
        except _CORRUPTION_ERRORS as e:
            msg = (
                f"{path} is corrupted or truncated ({type(e).__name__}: {e}); delete it "
                "(PoolStore.delete(digest)) or rebuild the pool from its document, which overwrites it"
            )
            raise PoolFileError(msg) from e
        # The digest covers fingerprint, config and token ids; the checksum covers every stored tensor byte.
        for what, found, expected in (
            ("tensor checksum", pool.tensor_checksum(), header.checksum),
            ("digest", pool.digest, digest),
        ):
            if found != expected:
                msg = (
                    f"{path} is corrupted or tampered with: the {what} of the pool it holds does not match the "
                    "one it was saved under; delete it (PoolStore.delete(digest)) or rebuild the pool from its document"
                )
                raise PoolFileError(msg)
        logger.info("loaded %r from %s", pool, path)
        return pool

    def _read(self, path: Path) -> tuple[_PoolFileHeader, dict[str, torch.Tensor]]:
        """The validated header and every stored tensor (contiguous, on the CPU) of the file at ``path``."""
        with safe_open(str(path), framework="pt", device="cpu") as f:
            raw = json.loads((f.metadata() or {})[_METADATA_KEY])
            if not isinstance(raw, dict):
                msg = f"the {_METADATA_KEY!r} metadata is JSON {type(raw).__name__}, not an object"
                raise TypeError(msg)
            # The version is checked before anything else: another version may lay out everything else
            # differently, and that deserves its own message rather than "corrupted".
            version = raw.get("format_version")
            if type(version) is not int:  # bool is an int subclass, and no version at all is damage too
                msg = f"format_version is {version!r}, not an integer"
                raise ValueError(msg)
            if version != FORMAT_VERSION:
                msg = (
                    f"{path} was written in pool file format version {version!r}, but this version of "
                    f"polykv_agents reads version {FORMAT_VERSION}; rebuild the pool from its document "
                    "(and delete the old file with PoolStore.delete(digest))"
                )
                raise PoolFileError(msg)
            recorded = raw.pop("header_checksum", None)
            if recorded != _header_checksum(raw):
                msg = (
                    f"{path} is corrupted or tampered with: its metadata does not match the checksum recorded "
                    "when it was saved; delete it (PoolStore.delete(digest)) or rebuild the pool from its document"
                )
                raise PoolFileError(msg)
            header = _PoolFileHeader.model_validate(raw)
            names = set(f.keys())
            if names != set(header.tensors):
                msg = f"stored tensors {sorted(names ^ set(header.tensors))} disagree with the header"
                raise KeyError(msg)
            tensors = {name: f.get_tensor(name).to("cpu").contiguous() for name in sorted(names)}
        for name, spec in header.tensors.items():
            # safetensors' own header (dtypes, shapes, offsets) has no checksum: an edit there that keeps the
            # byte count (int8 -> uint8, [2, 3] -> [3, 2]) would pass the tensor checksum unnoticed.
            tensor = tensors[name]
            if dtype_name(tensor.dtype) != spec.dtype or tuple(tensor.shape) != spec.shape:
                msg = (
                    f"tensor {name!r} is {dtype_name(tensor.dtype)}{list(tensor.shape)} in the file but was saved "
                    f"as {spec.dtype}{list(spec.shape)}"
                )
                raise ValueError(msg)
        return header, tensors

    @staticmethod
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
        )
