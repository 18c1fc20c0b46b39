"""Compression configs by name: what ``--config`` of ``bench quality`` and ``bench tasks`` accepts.

A name is a preset (``default``, ``paper``, ``max``, ...) or one of :data:`CONFIGS`, the codec combinations the
repository's compression frontier (``python -m benchmarks frontier``) measures; :func:`config_named` turns it
into a :class:`~polykv_agents.config.CompressionConfig`.
"""

from __future__ import annotations

from collections.abc import Iterable

from polykv_agents.config import PRESETS, CodecConfig, CompressionConfig


def ctq(bits: int, **options) -> CodecConfig:
    """Centered TurboQuant at ``bits`` (``before_rope=True`` for keys before RoPE), as the probes build it too."""
    return CodecConfig(method="centered_turboquant", bits=bits, **options)


def tq(bits: int) -> CodecConfig:
    """TurboQuant-MSE at ``bits``."""
    return CodecConfig(method="turboquant", bits=bits)


CONFIGS: dict[str, CompressionConfig] = {
    "default": CompressionConfig(),
    "keys tq4, values tq3": CompressionConfig(keys=tq(4), values=tq(3)),
    "keys tq4, values tq2": CompressionConfig(keys=tq(4), values=tq(2)),
    "keys tq3, values tq3": CompressionConfig(keys=tq(3), values=tq(3)),
    "keys ctq4 pre-RoPE, values ctq3": CompressionConfig(keys=ctq(4, before_rope=True), values=ctq(3)),
    "keys ctq4 pre-RoPE, values ctq2": CompressionConfig(keys=ctq(4, before_rope=True), values=ctq(2)),
    "keys ctq3 pre-RoPE, values ctq3": CompressionConfig(keys=ctq(3, before_rope=True), values=ctq(3)),
    "keys ctq3 pre-RoPE, values tq3": CompressionConfig(keys=ctq(3, before_rope=True), values=tq(3)),
    "keys ctq3 after RoPE, values ctq3": CompressionConfig(keys=ctq(3), values=ctq(3)),
    "keys ctq3 pre-RoPE, values ctq2": CompressionConfig(keys=ctq(3, before_rope=True), values=ctq(2)),
    "keys ctq2 pre-RoPE, values ctq2": CompressionConfig(keys=ctq(2, before_rope=True), values=ctq(2)),
}
"""Config name -> config at seed 0, from largest to smallest pool (roughly). Named by their codecs (``default``
aside), so that a name keeps meaning the same pool when a preset is re-decided."""


REFERENCE = "full"
"""The preset every compressed one is compared with: the uncompressed cache, always measured."""


def config_named(name: str) -> CompressionConfig:
    """A preset (``default``, ``max``, ...) or one of :data:`CONFIGS` by name."""
    return CompressionConfig.preset(name) if name in PRESETS else CONFIGS[name]


CONFIG_CHOICES = (
    f"choose among the presets {', '.join(p for p in PRESETS if p != REFERENCE)} or the frontier's configs: "
    f"{', '.join(map(repr, CONFIGS))}"
)
"""What a refused ``--config`` is told to choose from."""


def compressed_config_names(names: Iterable[str]) -> list[str]:
    """``names`` in order, repeats and ``full`` (the uncompressed reference, always measured) left out: the
    ``--config`` of the suites that compare pools with full precision. A ValueError lists the choices if a name
    is neither a preset nor one of :data:`CONFIGS`."""
    names = list(dict.fromkeys(name for name in names if name != REFERENCE))
    unknown = sorted(set(names) - set(PRESETS) - set(CONFIGS))
    if unknown:
        raise ValueError(f"unknown compression config(s) {unknown}; {CONFIG_CHOICES}")
    return names
