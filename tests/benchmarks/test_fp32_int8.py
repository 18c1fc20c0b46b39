"""The fp32 int8 probe's perplexity feeding: 16 tokens a forward over a cache computes what one forward computes, so
its two rows per weights setting differ only by the products' path (the decode kernel up to 16 rows, the widened
weight above)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_llama

from benchmarks.probes.fp32_int8 import DECODE_ROWS, _nll
from polykv_agents.model.quantized_linear import KERNEL_MAX_ROWS
from polykv_agents.model.weights import quantize_weights


@pytest.mark.parametrize("weights", ["native", "int8"])
def test_blocks_of_decode_rows_feed_the_document_as_one_forward_would(weights):
    assert DECODE_ROWS == KERNEL_MAX_ROWS  # each block's products take the decode path
    model = tiny_llama(num_layers=2)
    if weights != "native":
        quantize_weights(model, weights)
    doc = torch.randint(3, 320, (1, 3 * DECODE_ROWS + 5), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        in_blocks, whole = _nll(model, doc, DECODE_ROWS), _nll(model, doc, None)
    assert in_blocks == pytest.approx(whole, abs=1e-5)
    with torch.inference_mode():  # a feeding that skips a block's tokens is caught
        assert _nll(model, doc[:, DECODE_ROWS:], DECODE_ROWS) != pytest.approx(whole, abs=1e-5)
