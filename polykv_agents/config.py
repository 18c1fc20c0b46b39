"""Compression configuration: one frozen, validated object for keys and one for values.

Every experiment in this project (the paper's setting, ablations, presets) is a
:class:`CompressionConfig`; codecs are built from it and pools record it, so a pool always says
how it was made.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

CodecMethod = Literal["int", "turboquant", "none"]
KeyGranularity = Literal["tensor", "channel", "token"]

# Bit widths each method supports. int: linear, symmetric; turboquant: Lloyd–Max codebooks of N(0,1).
SUPPORTED_BITS: dict[str, tuple[int, ...]] = {
    "int": (2, 3, 4, 5, 6, 7, 8),
    "turboquant": (2, 3, 4),
    "none": (16,),
}
DEFAULT_BITS: dict[str, int] = {"int": 8, "turboquant": 3}


class CodecConfig(BaseModel):
    """How one kind of tensor (keys or values) is stored."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    method: CodecMethod
    """``int``: linear integer quantisation with shared scales; ``turboquant``: normalise, rotate,
    Lloyd–Max codebook; ``none``: stored as the model produced it (full precision)."""

    bits: int = 8
    """Bits per stored coordinate. Default 8 for ``int``, 3 for ``turboquant``; always 16 for ``none``."""

    granularity: KeyGranularity = "channel"
    """``int`` only: which elements share one scale. ``tensor``: one per layer tensor (the paper);
    ``channel``: one per (head, channel) over all tokens; ``token``: one per (token, head) vector."""

    rotation: bool = True
    """``turboquant`` only: rotate before quantising so coordinates are near-Gaussian."""

    random_signs: bool = True
    """``turboquant`` only: randomise the Hadamard rotation with seeded ±1 signs. Without them a
    channel offset shared by all vectors lands on one coordinate and is clipped."""

    @model_validator(mode="before")
    @classmethod
    def _default_bits_per_method(cls, data: object) -> object:
        if isinstance(data, dict):
            method = data.get("method")
            if method == "none":
                return {**data, "bits": 16}
            if "bits" not in data and method in DEFAULT_BITS:
                return {**data, "bits": DEFAULT_BITS[method]}
        return data

    @model_validator(mode="after")
    def _check_bits(self) -> CodecConfig:
        allowed = SUPPORTED_BITS[self.method]
        if self.bits not in allowed:
            msg = f"bits={self.bits} is not supported for method={self.method!r}; choose one of {list(allowed)}."
            raise ValueError(msg)
        return self

    def label(self) -> str:
        """A short human-readable name, e.g. ``int8/channel`` or ``tq3``."""
        if self.method == "none":
            return "full"
        if self.method == "int":
            return f"int{self.bits}/{self.granularity}"
        suffix = "" if self.rotation and self.random_signs else ("-norot" if not self.rotation else "-nosigns")
        return f"tq{self.bits}{suffix}"


class CompressionConfig(BaseModel):
    """Asymmetric KV compression: keys feed the softmax, which amplifies error, so they get more bits."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    keys: CodecConfig = Field(default_factory=lambda: CodecConfig(method="int", bits=8, granularity="channel"))
    """Key codec. Default int8 with one scale per (head, channel): measured best among int8
    granularities on SmolLM2-135M (see docs/RESULTS.md)."""

    values: CodecConfig = Field(default_factory=lambda: CodecConfig(method="turboquant", bits=3))
    """Value codec. Default 3-bit TurboQuant-MSE."""

    seed: int = Field(default=0, ge=0)
    """Seed of the random rotation signs. Stored in the pool, never the rotation matrix itself."""

    @classmethod
    def paper(cls) -> CompressionConfig:
        """The PolyKV paper's setting: int8 keys with one scale per tensor, 3-bit TurboQuant values."""
        return cls(
            keys=CodecConfig(method="int", bits=8, granularity="tensor"),
            values=CodecConfig(method="turboquant", bits=3),
        )

    @classmethod
    def max_compression(cls) -> CompressionConfig:
        """The ``max`` preset: 4-bit TurboQuant keys and 3-bit TurboQuant values, the smallest pool the
        ablation found within +1% perplexity at 2K and 4K tokens (benchmarks/results/ablation.json)."""
        return cls(keys=CodecConfig(method="turboquant", bits=4), values=CodecConfig(method="turboquant", bits=3))

    @classmethod
    def preset(cls, name: str) -> CompressionConfig:
        """A named preset: one of :data:`PRESETS`."""
        try:
            factory = _PRESET_FACTORIES[name]
        except KeyError:
            msg = f"unknown compression preset {name!r}; choose one of {', '.join(PRESETS)}"
            raise ValueError(msg) from None
        return factory()

    @classmethod
    def full_precision(cls) -> CompressionConfig:
        """No compression: the pool holds the model's own KV tensors (for exactness checks and baselines)."""
        return cls(keys=CodecConfig(method="none"), values=CodecConfig(method="none"))

    @classmethod
    def from_options(
        cls,
        *,
        key_method: CodecMethod = "int",
        key_bits: int = 8,
        key_granularity: KeyGranularity = "channel",
        value_method: CodecMethod = "turboquant",
        value_bits: int = 3,
        seed: int = 0,
    ) -> CompressionConfig:
        """Flat constructor for command lines and quick experiments."""
        return cls(
            keys=CodecConfig(method=key_method, bits=key_bits, granularity=key_granularity),
            values=CodecConfig(method=value_method, bits=value_bits),
            seed=seed,
        )

    def label(self) -> str:
        """E.g. ``K:int8/channel V:tq3``."""
        return f"K:{self.keys.label()} V:{self.values.label()}"


_PRESET_FACTORIES = {
    "default": CompressionConfig,
    "paper": CompressionConfig.paper,
    "max": CompressionConfig.max_compression,
    "full": CompressionConfig.full_precision,
}
PRESETS: tuple[str, ...] = tuple(_PRESET_FACTORIES)
"""Named configs: ``default`` (int8/channel keys, tq3 values), ``paper`` (int8/tensor keys, tq3
values), ``max`` (tq4 keys, tq3 values), ``full`` (no compression)."""


def compression_config(config: object) -> CompressionConfig:
    """``config`` checked for the APIs that take one: ``None`` means the default; anything else must
    already be a :class:`CompressionConfig` (a preset name or a dict says how to make one)."""
    if config is None:
        return CompressionConfig()
    if isinstance(config, CompressionConfig):
        return config
    if isinstance(config, str):
        hint = f"CompressionConfig.preset({config!r})"
    elif isinstance(config, dict):
        hint = "CompressionConfig(**config) or CompressionConfig.model_validate(config)"
    else:
        hint = "CompressionConfig(...) or CompressionConfig.preset(name)"
    msg = f"config must be a CompressionConfig (or None for the default), got {type(config).__name__}; pass {hint}"
    raise TypeError(msg)
