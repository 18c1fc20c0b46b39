"""KV tensor codecs.

Data flows one way: a ``[batch, kv_heads, tokens, head_dim]`` tensor goes into a codec's
``encode``, which returns an :class:`EncodedTensor` (packed tensors plus the JSON-able metadata
needed to decode it); ``decode`` turns that record back into a dense tensor. The primitives the
codecs are built from (bit packing, the randomized Hadamard rotation, Lloyd–Max centroids) live in
modules of their own.
"""

from __future__ import annotations

from polykv_agents.codecs.dispatch import TensorCodec, decode
from polykv_agents.codecs.encoded import EncodedTensor

__all__ = ["EncodedTensor", "TensorCodec", "decode"]
