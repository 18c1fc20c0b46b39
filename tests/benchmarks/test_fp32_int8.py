"""The fp32 int8 probe's perplexity feeding: 16 tokens a forward over a cache is the one forward's computation for
native weights, and a different one for int8 weights in fp32 (rows rounded to bf16 up to 16 rows, not above), so
its two int8 rows measure two paths."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_llama

from benchmarks.probes.fp32_int8 import DECODE_ROWS, _nll
from polykv_agents.model.quantized_linear import KERNEL_MAX_ROWS
from polykv_agents.model.weights import quantize_weights


def test_blocks_of_decode_rows_feed_the_document_as_one_forward_would_unless_the_weights_round():
    assert DECODE_ROWS == KERNEL_MAX_ROWS  # each block's products take the decode path
    model = tiny_llama(num_layers=2)
    doc = torch.randint(3, 320, (1, 3 * DECODE_ROWS + 5), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert _nll(model, doc, DECODE_ROWS) == pytest.approx(_nll(model, doc, None), abs=1e-5)
        quantize_weights(model, "int8")
        in_blocks, whole = _nll(model, doc, DECODE_ROWS), _nll(model, doc, None)
    assert in_blocks != whole and in_blocks == pytest.approx(whole, abs=1e-2)
