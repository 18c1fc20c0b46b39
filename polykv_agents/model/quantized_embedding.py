"""An input embedding read from int8 codes, so a model with int8 weights keeps no bf16 copy of its vocabulary.

A model whose output layer is tied to its input embedding (SmolLM2, Llama-3.2-1B, Qwen2.5-1.5B, Gemma 3) stores one
matrix. Quantizing the output layer to int8 (every quantized setting does: see
:func:`~polykv_agents.model.weights.quantize_weights`) left the embedding in bf16 beside the layer's int8 codes:
525 MB of Llama-3.2-1B's 1.76 GB of weights, 54 MiB of the embedded model's 183 MiB. :class:`Int8Embedding` reads
the rows of the output layer's own codes instead (no copy: the same buffers), or, where the two are not tied,
codes of its own, the same int8 quantization (one scale per row) as the linear layers'. llama.cpp's Q8_0 files do
the same with one tensor for both.

A lookup costs a gather of ``T`` rows and one multiply, against a gather alone: nothing next to a step. The rows it
returns differ from the bf16 ones by the int8 rounding (at most half a code, ``max |row| / 254``).

The pool's fingerprint samples the embedding (:mod:`~polykv_agents.model.fingerprint`): the module keeps that
sample of the weights it replaced (:data:`~polykv_agents.model.fingerprint.WEIGHT_SAMPLE_ELEMENTS`, 128 KiB in
bf16), so a model keeps its fingerprint whichever way its weights are stored, as it did when the embedding stayed
bf16.
"""

from __future__ import annotations

import torch
from torch import nn

from polykv_agents.model.fingerprint import WEIGHT_SAMPLE_ELEMENTS
from polykv_agents.model.int8_tiles import unpack_rows
from polykv_agents.model.quantized_linear import Int8Linear, quantize_rows_int8


class Int8Embedding(nn.Module):
    """``ids [...]`` -> ``[..., embedding_dim]`` rows of int8 codes times their row's scale, in the replaced
    weight's dtype.

    Buffers: ``qweight`` and ``scales``, the tied output layer's own tensors (its tile layout where it is tiled) or
    codes ``[V, H]`` and scales ``[V]`` of its own; ``fingerprint_sample``, the first
    :data:`~polykv_agents.model.fingerprint.WEIGHT_SAMPLE_ELEMENTS` of the replaced weight, flattened (its dtype
    is the rows' dtype: it follows ``.to()``).
    """

    def __init__(self, embedding: nn.Embedding, head: Int8Linear | None = None) -> None:
        """``head``: the int8 output layer ``embedding`` is tied to (its codes are read), or ``None`` (quantize
        ``embedding``'s own rows)."""
        super().__init__()
        weight = embedding.weight.detach()
        self.num_embeddings, self.embedding_dim = weight.shape
        self.padding_idx = embedding.padding_idx
        self.tied = head is not None
        if head is not None:
            self.tiled = head.tiled
            self.register_buffer("qweight", head.qweight)  # the same tensors: tied, as the weights were
            self.register_buffer("scales", head.scales)
        else:
            codes, scales = quantize_rows_int8(weight)
            self.tiled = False
            self.register_buffer("qweight", codes)
            self.register_buffer("scales", scales)
        self.register_buffer("fingerprint_sample", weight.flatten()[:WEIGHT_SAMPLE_ELEMENTS].clone())

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)  # [T]
        codes = unpack_rows(self.qweight, flat, self.embedding_dim) if self.tiled else self.qweight[flat]  # [T, H]
        rows = codes.float() * self.scales[flat, None].float()  # as the linear layer scales its sums: in float32
        return rows.to(self.fingerprint_sample.dtype).view(*ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, tied={self.tied}, tiled={self.tiled}"
