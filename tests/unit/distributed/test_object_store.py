"""A pool as the object store holds it (byte arrays + the JSON header), without a Ray cluster: exact round trips
for every dtype, zero copies on the way back, and a damaged object refused cleanly."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tiny_models import tiny_llama, tiny_tokenizer

from polykv_agents import CompressionConfig, SharedKVPool
from polykv_agents.pool.store import PoolFileError

# Without the ray extra these tests are reported as skipped, with this reason (polykv_agents.distributed imports Ray).
pytest.importorskip("ray", reason='needs Ray, the ray extra: pip install "polykv-agents[ray]"')

from polykv_agents.distributed.object_store import from_stored, stored_nbytes, to_stored

DOC = "Shared caches let many agents read one document. " * 6


def read_only(stored: dict) -> dict:
    """What ray.get hands back: the same arrays, read-only."""
    arrays = {}
    for name, array in stored["arrays"].items():
        copy = array.copy()
        copy.flags.writeable = False
        arrays[name] = copy
    return {"header": stored["header"], "arrays": arrays}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("config", [CompressionConfig(), CompressionConfig.full_precision()], ids=["default", "full"])
def test_a_stored_pool_comes_back_exactly(dtype, config):
    model = tiny_llama().to(dtype)
    pool = SharedKVPool.prefill(model, tiny_tokenizer(), DOC, config=config)
    stored = read_only(to_stored(pool))
    assert all(array.dtype == np.uint8 for array in stored["arrays"].values())
    back = from_stored(stored, digest=pool.digest)
    assert (back.digest, back.tensor_checksum(), back.nbytes) == (pool.digest, pool.tensor_checksum(), pool.nbytes)
    for i in range(pool.num_layers):
        for got, want in zip(back.decompress_layer(i), pool.decompress_layer(i), strict=True):
            assert got.dtype == want.dtype == dtype and torch.equal(got, want)
    assert stored_nbytes(stored) == pool.nbytes + pool.token_ids.nbytes


def test_the_pool_shares_the_stored_bytes_instead_of_copying_them():
    pool = SharedKVPool.prefill(tiny_llama(), tiny_tokenizer(), DOC)
    stored = read_only(to_stored(pool))
    back = from_stored(stored, digest=pool.digest)
    addresses = {array.__array_interface__["data"][0] for array in stored["arrays"].values()}
    shared = [t.data_ptr() in addresses for layer in back.layers for t in layer.keys.tensors.values()]
    assert shared and all(shared)


def test_a_damaged_or_foreign_object_is_refused():
    pool = SharedKVPool.prefill(tiny_llama(), tiny_tokenizer(), DOC)
    stored = to_stored(pool)
    with pytest.raises(PoolFileError, match="does not match the one it was saved under"):
        from_stored(stored, digest="0" * 64)  # filed under another digest
    flipped = {**stored, "arrays": {**stored["arrays"]}}
    name = next(n for n in stored["arrays"] if n != "token_ids")
    flipped["arrays"][name] = stored["arrays"][name].copy()
    flipped["arrays"][name][0] ^= 1
    with pytest.raises(PoolFileError, match="tensor checksum"):
        from_stored(flipped, digest=pool.digest)
    with pytest.raises(PoolFileError, match="not a stored pool"):
        from_stored({"header": {}, "arrays": {"x": np.zeros(3, np.uint8)}}, digest=pool.digest)
