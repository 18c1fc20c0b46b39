"""A pool in Ray's object store: its record (packed tensors as raw bytes, plus the JSON header), and back.

Data flow:
  SharedKVPool -> :func:`polykv_agents.pool.record.pool_record` -> :func:`to_stored`: each tensor as a
  ``uint8`` numpy array of its bytes (numpy arrays are what Ray's object store hands back without a
  copy, and bytes cover every dtype, bf16 included) + the header -> ``ray.put``
  -> on another node, ``ray.get`` -> :func:`from_stored`: each array reinterpreted, without a copy, as the
  dtype and shape the header records -> :func:`polykv_agents.pool.record.pool_from_record` (every check:
  header checksum, tensor checksum, digest) -> SharedKVPool.

On a node, the arrays ``ray.get`` returns are read-only views of the node's shared memory: every process
of that node reads the same bytes, and a pool never writes its tensors.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import torch

from polykv_agents.pool.record import PoolFileError, pool_from_record, pool_record
from polykv_agents.pool.shared_pool import SharedKVPool

_REMEDY = "publish the pool again (RayCluster.publish) or let the cluster rebuild it from its document"


def to_stored(pool: SharedKVPool) -> dict[str, Any]:
    """What ``ray.put`` stores for ``pool``: ``{"header": <JSON-able dict>, "arrays": {name: uint8 array}}``."""
    record = pool_record(pool)
    arrays = {name: t.reshape(-1).view(torch.uint8).numpy() for name, t in record.tensors.items()}  # [nbytes]
    return {"header": record.header, "arrays": arrays}


def stored_nbytes(stored: dict[str, Any]) -> int:
    """Bytes of the tensors in a stored pool (what crosses to a node that fetches it, besides the header)."""
    return sum(int(array.nbytes) for array in stored["arrays"].values())


def from_stored(stored: dict[str, Any], *, digest: str) -> SharedKVPool:
    """The pool ``ray.get`` returned, checked to be the one published under ``digest``, sharing its memory.

    Raises:
        PoolFileError: The stored pool does not check out (not a stored pool, another format version,
            corrupted, another digest).
    """
    source = f"the object-store copy of pool {digest[:12]}"
    try:
        header, tensors = stored["header"], _tensors(stored["header"]["tensors"], stored["arrays"])
    except (KeyError, TypeError, ValueError, RuntimeError) as e:
        msg = f"{source} is not a stored pool ({type(e).__name__}: {e}); {_REMEDY}"
        raise PoolFileError(msg) from e
    return pool_from_record(header, tensors, source=source, remedy=_REMEDY, digest=digest)


def _tensors(specs: dict[str, Any], arrays: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Each byte array as the dtype and shape its spec records, without a copy."""
    tensors = {}
    with warnings.catch_warnings():
        # Ray's arrays are read-only; torch warns that it cannot enforce that. The pool never writes them.
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        for name, array in arrays.items():
            dtype = getattr(torch, str(specs[name]["dtype"]), None)
            if not isinstance(dtype, torch.dtype):
                msg = f"tensor {name!r} has no torch dtype {specs[name]['dtype']!r}"
                raise TypeError(msg)
            raw = torch.from_numpy(np.asarray(array, dtype=np.uint8))  # [nbytes], no copy
            tensors[name] = raw.view(dtype).reshape(specs[name]["shape"])
    return tensors
