"""PoolStore: pools on disk as safetensors files named by their digest, so a fresh process can reload one.

Data flow of :meth:`PoolStore.save`: the pool's record (:func:`polykv_agents.pool.record.pool_record`:
every stored tensor, plus one JSON header with fingerprint, config, per-layer codec metadata, sizes and
checksums) -> one safetensors file ``<digest>.safetensors``, the header stored as the file's ``polykv``
metadata entry, written to a temporary file in the same directory and moved into place, so a reader never
sees half a file. Nothing is ever pickled: loading a file cannot run code.

:meth:`PoolStore.load` reads the file back and hands it to
:func:`polykv_agents.pool.record.pool_from_record`, which checks the format version, the header's own
checksum, the stored tensors' names, dtypes and shapes, the tensor checksum, and that the rebuilt pool has
the digest the file is named by. Any failure is a :class:`PoolFileError` saying which file is bad and what
to do about it. The checks catch corruption and careless edits, not a deliberate forgery: treat a store
directory like a model cache you trust.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import tempfile
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from polykv_agents.pool.record import CORRUPTION_ERRORS, FORMAT_VERSION, PoolFileError, pool_from_record, pool_record
from polykv_agents.pool.shared_pool import SharedKVPool

logger = logging.getLogger(__name__)

_METADATA_KEY = "polykv"
_SUFFIX = ".safetensors"
_DIGEST = re.compile(r"[0-9a-f]{64}")
_REMEDY = "delete it (PoolStore.delete(digest)) or rebuild the pool from its document, which overwrites it"

# What reading a file's bytes can raise besides the record's own checks: safetensors' errors too.
_CORRUPTION_ERRORS = (SafetensorError, *CORRUPTION_ERRORS)

__all__ = ["FORMAT_VERSION", "PoolFileError", "PoolStore"]


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
        record = pool_record(pool)
        path = self.path_for(pool.digest)
        self.directory.mkdir(parents=True, exist_ok=True)
        # A temporary file in the same directory, so os.replace is an atomic rename on one filesystem:
        # a concurrent reader sees the old file or the new one, never a partial write.
        fd, tmp_name = tempfile.mkstemp(dir=self.directory, prefix=f".{pool.digest[:16]}.", suffix=".tmp")
        os.close(fd)
        try:
            save_file(record.tensors, tmp_name, metadata={_METADATA_KEY: json.dumps(record.header)})
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
            raw_header, tensors = self._read(path)
        except _CORRUPTION_ERRORS as e:
            msg = f"{path} is corrupted or truncated ({type(e).__name__}: {e}); {_REMEDY}"
            raise PoolFileError(msg) from e
        pool = pool_from_record(raw_header, tensors, source=str(path), remedy=_REMEDY, digest=digest)
        logger.info("loaded %r from %s", pool, path)
        return pool

    @staticmethod
    def _read(path: Path) -> tuple[Any, dict[str, torch.Tensor]]:
        """The ``polykv`` metadata entry (parsed JSON) and every stored tensor (contiguous, on the CPU)."""
        with safe_open(str(path), framework="pt", device="cpu") as f:
            raw = json.loads((f.metadata() or {})[_METADATA_KEY])
            tensors = {name: f.get_tensor(name).to("cpu").contiguous() for name in f.keys()}  # noqa: SIM118
        return raw, tensors
