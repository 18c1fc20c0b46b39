"""The identity codec: stores the model's own tensor. Used for exactness checks and baselines."""

from __future__ import annotations

import torch

from polykv_agents.codecs.encoded import EncodedTensor, dtype_name


class FullPrecisionCodec:
    """Keeps the tensor as it is, in the model's dtype."""

    name = "none"

    @classmethod
    def from_params(cls, params: dict) -> FullPrecisionCodec:
        return cls()

    def encode(self, x: torch.Tensor) -> EncodedTensor:
        # A private contiguous copy: the pool must not alias a cache that someone else may still write.
        return EncodedTensor(
            codec=self.name,
            shape=tuple(x.shape),
            dtype=dtype_name(x.dtype),
            params={},
            tensors={"data": x.detach().clone().contiguous()},
        )

    def decode(self, enc: EncodedTensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        # Returned without a copy: callers (cache layers) concatenate, they never write in place.
        data = enc.tensors["data"]
        return data if dtype is None or dtype == data.dtype else data.to(dtype)
