"""SharedPrefix: one copy of the decoded prefix in the model's dtype, or one decoded layer at a time."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from polykv_agents import SharedKVPool
from polykv_agents.runtime.shared_prefix import SharedPrefix

DOC = "Keys are quantised to eight bits; values use a rotated three-bit codebook. " * 3


@pytest.fixture(scope="module")
def pool(tiny_model, tiny_tok):
    return SharedKVPool.prefill(tiny_model, tiny_tok, DOC)  # a float32 model's pool


@pytest.mark.parametrize("residency", ["decompressed", "compressed"])
def test_every_residency_reads_the_prefix_in_the_model_s_dtype(pool, residency):
    reader = SimpleNamespace(dtype=torch.bfloat16, device=torch.device("cpu"))  # all SharedPrefix reads of a model
    prefix = SharedPrefix(pool, reader, residency)
    for layer_idx in range(pool.num_layers):
        keys, values = prefix.layer(layer_idx)
        expected = pool.decompress_layer(layer_idx, dtype=torch.bfloat16)
        assert keys.dtype == values.dtype == torch.bfloat16
        torch.testing.assert_close((keys, values), expected, rtol=0, atol=0)


def test_the_peak_of_decoded_bytes_is_one_layer_when_compressed_and_all_layers_when_not(pool, tiny_model):
    compressed = SharedPrefix(pool, tiny_model, "compressed")
    held = compressed.resident_nbytes  # the stored layers' float key scales, codebook and rotation
    assert compressed.peak_held_nbytes == held  # nothing decoded yet
    sizes = []
    for layer_idx in range(pool.num_layers):
        keys, values = compressed.layer(layer_idx)
        sizes.append(keys.nbytes + values.nbytes)
    assert compressed.peak_held_nbytes == held + max(sizes) and max(sizes) > 0
    assert compressed.layers() == () and compressed.resident_nbytes < pool.nbytes  # no layer kept decoded
    decompressed = SharedPrefix(pool, tiny_model, "decompressed")
    assert decompressed.peak_held_nbytes == decompressed.resident_nbytes == sum(sizes)
