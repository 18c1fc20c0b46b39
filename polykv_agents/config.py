"""Compression configuration: one frozen, validated object for keys and one for values.

Every experiment in this project (the paper's setting, ablations, presets) is a
:class:`CompressionConfig`; codecs are built from it and pools record it, so a pool always says
how it was made.

Each codec has a config class of its own (:class:`IntCodecConfig`, :class:`TurboQuantCodecConfig`,
:class:`FullPrecisionCodecConfig`) that owns its fields, its supported and default bit widths, its
label and how to build its codec. :data:`AnyCodecConfig`, a union discriminated by ``method``, is the
one registration point: ``CompressionConfig.keys``/``values``, :func:`~polykv_agents.codecs.decode`
and the command-line help all read it. Calling the shared base class, ``CodecConfig(method="int",
bits=8)``, validates into the matching class.

``CompressionConfig.layers`` gives listed layers other codecs (:class:`LayerCodecs`: mixed precision by layer);
the pool resolves them once per model depth with :meth:`CompressionConfig.codecs_by_layer`.

Pool digests hash ``CompressionConfig.model_dump()``; to keep the digests of pools built before the
per-codec classes existed, the three original classes dump in the one-record layout of that time
(every codec record carries ``method, bits, granularity, rotation, random_signs``, the fields of other
codecs at their inert defaults), and exactly such a record is read back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Annotated, Any, ClassVar, Literal, get_args

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    TypeAdapter,
    field_validator,
    model_serializer,
    model_validator,
)

if TYPE_CHECKING:
    from polykv_agents.codecs.dispatch import TensorCodec

SEED_MAX = 2**63 - 2
"""Largest :attr:`CompressionConfig.seed`: values use ``seed + 1`` and rotation seeds must be below 2**63."""

# The record layout every codec config dumped in before the per-codec classes (pool format 1).
_SHARED_LAYOUT = ("method", "bits", "granularity", "rotation", "random_signs")


class _CodecConfigMeta(type(BaseModel)):  # type: ignore[misc]
    """Lets the shared base class be called like the flat config it replaced."""

    def __call__(cls, *args: Any, **fields: Any) -> Any:
        if cls is CodecConfig:  # choose the codec's own class by `method`
            return _CODEC_CONFIG_ADAPTER.validate_python(fields)
        return super().__call__(*args, **fields)


class CodecConfig(BaseModel, metaclass=_CodecConfigMeta):
    """How one kind of tensor (keys or values) is stored: the base of every codec's config class.

    ``CodecConfig(method="int", bits=8)`` returns an :class:`IntCodecConfig`; each subclass is also
    constructed directly (``TurboQuantCodecConfig(bits=4)``). A subclass defines ``method`` (a
    one-value ``Literal``, the codec's name), ``bits`` (default: the codec's default width), its own
    fields, :attr:`supported_bits`, :meth:`label` and :meth:`codec_class`; :meth:`build` passes the
    fields to the codec's constructor.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    supported_bits: ClassVar[tuple[int, ...]] = ()
    """Bit widths the codec can store."""

    shared_layout_fillers: ClassVar[Mapping[str, object]] = MappingProxyType({})
    """Fields of other codecs this one dumps at their inert defaults (format-1 layout, stable digests)."""

    method: str
    bits: int

    @classmethod
    def model_validate(cls, obj: Any, **kwargs: Any) -> CodecConfig:
        """Like pydantic's; on :class:`CodecConfig` itself it validates into the class ``method`` names."""
        if cls is CodecConfig:
            return _CODEC_CONFIG_ADAPTER.validate_python(obj, **kwargs)
        return super().model_validate(obj, **kwargs)

    @classmethod
    def model_validate_json(cls, json_data: str | bytes | bytearray, **kwargs: Any) -> CodecConfig:
        """Like pydantic's; on :class:`CodecConfig` itself it validates into the class ``method`` names."""
        if cls is CodecConfig:
            return _CODEC_CONFIG_ADAPTER.validate_json(json_data, **kwargs)
        return super().model_validate_json(json_data, **kwargs)

    @classmethod
    def method_name(cls) -> str:
        """The value of ``method`` that selects this class."""
        return cls.model_fields["method"].default

    @classmethod
    def default_bits(cls) -> int:
        return cls.model_fields["bits"].default

    @classmethod
    def codec_class(cls) -> type[TensorCodec]:
        """The codec this config builds (imported on first use: the codecs import this module)."""
        raise NotImplementedError

    def codec_kwargs(self, seed: int) -> dict[str, Any]:
        """Constructor arguments of :meth:`codec_class`; default: every field but ``method``."""
        return {name: getattr(self, name) for name in type(self).model_fields if name != "method"}

    def build(self, seed: int = 0) -> TensorCodec:
        """The codec this config describes; ``seed`` drives any randomness it has (rotation signs)."""
        return self.codec_class()(**self.codec_kwargs(seed))

    def label(self) -> str:
        """A short human-readable name, e.g. ``int8/channel`` or ``tq3``."""
        raise NotImplementedError

    @classmethod
    def describe(cls) -> str:
        """One line for command-line help, e.g. ``int (bits 2-8, default 8; granularity: tensor, channel, token)``."""
        bits = cls.supported_bits
        parts = [f"bits {bits[0]}" if len(bits) == 1 else f"bits {bits[0]}-{bits[-1]}, default {cls.default_bits()}"]
        for name, field in cls.model_fields.items():
            choices = get_args(field.annotation)
            if name not in ("method", "bits") and choices:
                parts.append(f"{name}: {', '.join(map(str, choices))}")
        return f"{cls.method_name()} ({'; '.join(parts)})"

    @model_validator(mode="before")
    @classmethod
    def _fields_of_other_codecs(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        if set(data) == set(_SHARED_LAYOUT):  # a record in the format-1 layout: drop its inert fillers
            data = {k: v for k, v in data.items() if cls.shared_layout_fillers.get(k, object()) != v}
        method = cls.method_name()
        for name in data:
            owners = [c.method_name() for c in CODEC_CONFIGS if name in c.model_fields]
            if name not in cls.model_fields and owners:
                msg = (
                    f"{name}={data[name]!r} does not apply to method={method!r}, only to method "
                    f"{' or '.join(map(repr, owners))}; remove {name}, or choose that method"
                )
                raise ValueError(msg)
        return data

    @model_validator(mode="after")
    def _check_bits(self) -> CodecConfig:
        if self.bits not in self.supported_bits:
            msg = (
                f"bits={self.bits} is not supported for method={self.method!r}; "
                f"choose one of {list(self.supported_bits)}."
            )
            raise ValueError(msg)
        return self

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if not self.shared_layout_fillers:
            return data
        merged = {**self.shared_layout_fillers, **data}
        return {name: merged[name] for name in _SHARED_LAYOUT if name in merged}


class IntCodecConfig(CodecConfig):
    """Linear integer quantisation with shared absmax scales; builds an ``IntLinearCodec``."""

    supported_bits: ClassVar[tuple[int, ...]] = (2, 3, 4, 5, 6, 7, 8)  # symmetric, one sign bit
    shared_layout_fillers: ClassVar[Mapping[str, object]] = MappingProxyType({"rotation": True, "random_signs": True})

    method: Literal["int"] = "int"
    bits: int = 8
    """Bits per stored coordinate."""

    granularity: Literal["tensor", "channel", "token"] = "channel"
    """Which elements share one scale. ``tensor``: one per layer tensor (the paper); ``channel``: one
    per (head, channel) over all tokens; ``token``: one per (token, head) vector."""

    @classmethod
    def codec_class(cls) -> type[TensorCodec]:
        from polykv_agents.codecs.int_linear import IntLinearCodec

        return IntLinearCodec

    def label(self) -> str:
        return f"int{self.bits}/{self.granularity}"


class TurboQuantCodecConfig(CodecConfig):
    """Normalise, rotate, Lloyd–Max codebook of N(0, 1); builds a ``TurboQuantCodec``."""

    supported_bits: ClassVar[tuple[int, ...]] = (2, 3, 4)  # Lloyd–Max codebooks computed for these
    shared_layout_fillers: ClassVar[Mapping[str, object]] = MappingProxyType({"granularity": "channel"})

    method: Literal["turboquant"] = "turboquant"
    bits: int = 3
    """Bits per stored coordinate."""

    rotation: bool = True
    """Rotate before quantising so coordinates are near-Gaussian."""

    random_signs: bool = True
    """Randomise the Hadamard rotation with seeded ±1 signs. Without them a channel offset shared by
    all vectors lands on one coordinate and is clipped."""

    @classmethod
    def codec_class(cls) -> type[TensorCodec]:
        from polykv_agents.codecs.turboquant import TurboQuantCodec

        return TurboQuantCodec

    def codec_kwargs(self, seed: int) -> dict[str, Any]:
        return {**super().codec_kwargs(seed), "seed": seed}

    def label(self) -> str:
        suffix = "" if self.rotation and self.random_signs else ("-norot" if not self.rotation else "-nosigns")
        return f"tq{self.bits}{suffix}"


class CenteredTurboQuantCodecConfig(CodecConfig):
    """TurboQuant of what is left after the outliers every KV tensor has: builds a ``CenteredTurboQuantCodec``.

    The first ``sink_tokens`` tokens (attention sinks, far from every other vector) are stored as they
    are; the per-channel mean over the other tokens is stored and removed; what remains is normalised,
    rotated and Lloyd–Max quantised as by ``turboquant``, with ``norm_bits``-bit norms. For keys,
    ``before_rope`` compresses them before their rotary position embedding, where a channel keeps one
    orientation for every token, so the mean removes its offset (after RoPE it spins with the position).
    """

    supported_bits: ClassVar[tuple[int, ...]] = (2, 3, 4)  # Lloyd–Max codebooks computed for these

    method: Literal["centered_turboquant"] = "centered_turboquant"
    bits: int = 3
    """Bits per stored coordinate."""

    sink_tokens: int = Field(default=4, ge=0)
    """Leading tokens stored in the model's dtype: attention sinks, whose vectors are unlike the rest."""

    norm_bits: Literal[8, 16] = 8
    """Bits per vector norm: 16 (fp16), or 8 (log-spaced between each head's smallest and largest norm)."""

    before_rope: bool = False
    """Keys only: remove the rotary position embedding before compressing and apply it again when decoding."""

    @classmethod
    def codec_class(cls) -> type[TensorCodec]:
        from polykv_agents.codecs.centered_turboquant import CenteredTurboQuantCodec

        return CenteredTurboQuantCodec

    def codec_kwargs(self, seed: int) -> dict[str, Any]:
        return {**super().codec_kwargs(seed), "seed": seed}

    def label(self) -> str:
        suffix = "/pre-rope" if self.before_rope else ""
        return f"ctq{self.bits}{suffix}"


class FullPrecisionCodecConfig(CodecConfig):
    """Stored as the model produced it; builds a ``FullPrecisionCodec``."""

    supported_bits: ClassVar[tuple[int, ...]] = (16,)
    shared_layout_fillers: ClassVar[Mapping[str, object]] = MappingProxyType(
        {"granularity": "channel", "rotation": True, "random_signs": True}
    )

    method: Literal["none"] = "none"
    bits: int = 16
    """Always 16: reported for tables; the tensors keep the model's dtype."""

    @classmethod
    def codec_class(cls) -> type[TensorCodec]:
        from polykv_agents.codecs.full_precision import FullPrecisionCodec

        return FullPrecisionCodec

    def codec_kwargs(self, seed: int) -> dict[str, Any]:
        return {}

    def label(self) -> str:
        return "full"


# The registry of codecs: a new codec adds its config class here (and its codec module).
AnyCodecConfig = Annotated[
    IntCodecConfig | TurboQuantCodecConfig | CenteredTurboQuantCodecConfig | FullPrecisionCodecConfig,
    Field(discriminator="method"),
]
"""Any codec's config, chosen by ``method``: the type of ``CompressionConfig.keys`` and ``values``."""

CODEC_CONFIGS: tuple[type[CodecConfig], ...] = get_args(get_args(AnyCodecConfig)[0])
"""Every codec config class, in registration order."""

CODEC_METHODS: tuple[str, ...] = tuple(c.method_name() for c in CODEC_CONFIGS)
"""Every codec's ``method`` name."""

_CODEC_CONFIG_ADAPTER: TypeAdapter[CodecConfig] = TypeAdapter(AnyCodecConfig, config=ConfigDict(title="CodecConfig"))


def codec_config_class(method: str) -> type[CodecConfig]:
    """The config class whose ``method`` is ``method``."""
    for config_class in CODEC_CONFIGS:
        if config_class.method_name() == method:
            return config_class
    msg = f"unknown codec method {method!r}; choose one of {', '.join(CODEC_METHODS)}"
    raise ValueError(msg)


def describe_codecs() -> str:
    """Every codec with its bit widths and options, for command-line help."""
    return "; ".join(c.describe() for c in CODEC_CONFIGS)


def _layer_list(layers: Sequence[int]) -> str:
    """``0-2,5,-2,-1`` for ``(0, 1, 2, 5, -2, -1)``: runs of consecutive indices joined (negative ones listed)."""
    runs: list[list[int]] = []
    for layer in layers:
        if runs and layer == runs[-1][-1] + 1 and runs[-1][-1] >= 0:
            runs[-1].append(layer)
        else:
            runs.append([layer])
    return ",".join(str(run[0]) if len(run) == 1 else f"{run[0]}-{run[-1]}" for run in runs)


class LayerCodecs(BaseModel):
    """Other codecs for some layers: mixed precision by layer (more bits where the model is sensitive).

    ``layers`` are decoder-layer indices; a negative index counts from the last layer (``-1``: the last), so
    one config fits models of any depth. ``keys`` and ``values`` replace the config's codecs on those layers;
    ``None`` keeps them.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    layers: tuple[int, ...] = Field(min_length=1)
    keys: AnyCodecConfig | None = None
    values: AnyCodecConfig | None = None

    @model_validator(mode="after")
    def _replaces_something(self) -> LayerCodecs:
        if self.keys is None and self.values is None:
            msg = f"LayerCodecs(layers={list(self.layers)}) sets neither keys nor values; give it one or both"
            raise ValueError(msg)
        if len(set(self.layers)) != len(self.layers):
            msg = f"LayerCodecs lists a layer twice: {list(self.layers)}; list each layer once"
            raise ValueError(msg)
        return self

    def label(self) -> str:
        """E.g. ``L0-1,-1 K:ctq4/pre-rope``."""
        parts = [f"K:{self.keys.label()}" if self.keys else "", f"V:{self.values.label()}" if self.values else ""]
        return f"L{_layer_list(self.layers)} {' '.join(p for p in parts if p)}"


class CompressionConfig(BaseModel):
    """Asymmetric KV compression: keys feed the softmax, which amplifies error, so they get more bits."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    keys: AnyCodecConfig = Field(default_factory=lambda: IntCodecConfig(bits=8, granularity="channel"))
    """Key codec. Default int8 with one scale per (head, channel): measured best among int8
    granularities on SmolLM2-135M (see docs/RESULTS.md)."""

    values: AnyCodecConfig = Field(default_factory=lambda: TurboQuantCodecConfig(bits=3))
    """Value codec. Default 3-bit TurboQuant-MSE."""

    seed: int = 0
    """Seed of the random rotation signs (keys use ``seed``, values ``seed + 1``), in ``0 ..``
    :data:`SEED_MAX`. Stored in the pool, never the rotation matrix itself."""

    layers: tuple[LayerCodecs, ...] = ()
    """Per-layer exceptions to ``keys`` and ``values``, e.g. 4-bit keys on the first and last layers of a
    3-bit pool. A layer's keys (or values) may come from one of them only. Left out of the config's dump when empty, so
    pools made before it existed keep their digests."""

    @field_validator("seed")
    @classmethod
    def _seed_in_range(cls, seed: int) -> int:
        if not 0 <= seed <= SEED_MAX:
            msg = (
                f"seed={seed} is out of range; choose a seed in 0..2**63 - 2 (values are rotated with "
                "seed + 1, and rotation seeds must be below 2**63)"
            )
            raise ValueError(msg)
        return seed

    @model_validator(mode="after")
    def _rope_is_on_keys_only(self) -> CompressionConfig:
        if any(getattr(values, "before_rope", False) for values in (self.values, *(o.values for o in self.layers))):
            msg = "values carry no rotary position embedding: before_rope=True applies to the key codec only"
            raise ValueError(msg)
        return self

    @model_validator(mode="after")
    def _one_codec_per_layer(self) -> CompressionConfig:
        for kind in ("keys", "values"):
            seen: set[int] = set()
            for override in (o for o in self.layers if getattr(o, kind) is not None):
                twice = seen & set(override.layers)
                if twice:
                    msg = (
                        f"layer {sorted(twice)[0]} gets {kind} from two entries of layers; give each layer's "
                        f"{kind} one LayerCodecs"
                    )
                    raise ValueError(msg)
                seen |= set(override.layers)
        return self

    @model_serializer(mode="wrap")
    def _dump(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if not self.layers:  # the layout of every pool digest made before per-layer codecs
            data.pop("layers", None)
        return data

    def codecs_by_layer(self, num_layers: int) -> tuple[tuple[CodecConfig, CodecConfig], ...]:
        """``(key codec, value codec)`` of each decoder layer of a model with ``num_layers`` layers: the listed
        indices resolved once (negative ones from the end), each checked against the model's depth."""
        chosen: list[dict[str, CodecConfig]] = [{} for _ in range(num_layers)]
        for override in self.layers:
            for listed in override.layers:
                if not -num_layers <= listed < num_layers:
                    msg = (
                        f"config.layers names layer {listed}, but the model has {num_layers} layers "
                        f"(indices 0..{num_layers - 1}, or -{num_layers}..-1 from the end); fix the LayerCodecs"
                    )
                    raise ValueError(msg)
                for kind in ("keys", "values"):
                    if (codec := getattr(override, kind)) is None:
                        continue
                    if kind in chosen[listed]:  # e.g. 0 and -num_layers: one layer, which validation cannot see
                        msg = (
                            f"layer {listed % num_layers} of {num_layers} gets {kind} from more than one entry of "
                            "config.layers; name it once"
                        )
                        raise ValueError(msg)
                    chosen[listed][kind] = codec
        return tuple((layer.get("keys", self.keys), layer.get("values", self.values)) for layer in chosen)

    def keys_for(self, layer: int, num_layers: int) -> CodecConfig:
        """The key codec of decoder layer ``layer`` in a model of ``num_layers`` layers."""
        return self._layer(layer, num_layers)[0]

    def values_for(self, layer: int, num_layers: int) -> CodecConfig:
        """The value codec of decoder layer ``layer`` in a model of ``num_layers`` layers."""
        return self._layer(layer, num_layers)[1]

    def _layer(self, layer: int, num_layers: int) -> tuple[CodecConfig, CodecConfig]:
        if not 0 <= layer < num_layers:
            msg = f"layer {layer} is out of range for a model with {num_layers} layers"
            raise ValueError(msg)
        return self.codecs_by_layer(num_layers)[layer]

    def codec_configs(self) -> tuple[CodecConfig, ...]:
        """Every codec config this config uses, on some layer: keys, values, then the per-layer ones."""
        overrides = (c for o in self.layers for c in (o.keys, o.values) if c is not None)
        return (self.keys, self.values, *overrides)

    @classmethod
    def paper(cls) -> CompressionConfig:
        """The PolyKV paper's setting: int8 keys with one scale per tensor, 3-bit TurboQuant values."""
        return cls(keys=IntCodecConfig(bits=8, granularity="tensor"), values=TurboQuantCodecConfig(bits=3))

    @classmethod
    def max_compression(cls) -> CompressionConfig:
        """The ``max`` preset: 4-bit centered TurboQuant keys compressed before RoPE and 3-bit centered TurboQuant
        values. The frontier study (``python -m benchmarks frontier``) measured it the smallest pool within +1%
        perplexity on SmolLM2-135M at 2K tokens (4.36x), and better than 4-bit TurboQuant keys (the ``max`` of 0.1)
        on SmolLM2 and Gemma-3-270M at the same size (benchmarks/results/frontier.json and
        gemma-3-270m-q4_k_m/frontier.json)."""
        return cls(
            keys=CenteredTurboQuantCodecConfig(bits=4, before_rope=True), values=CenteredTurboQuantCodecConfig(bits=3)
        )

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
        return cls(keys=FullPrecisionCodecConfig(), values=FullPrecisionCodecConfig())

    @classmethod
    def from_options(
        cls,
        *,
        key_method: str = "int",
        key_bits: int | None = None,
        key_granularity: str | None = None,
        value_method: str = "turboquant",
        value_bits: int | None = None,
        seed: int = 0,
    ) -> CompressionConfig:
        """Flat constructor for command lines and quick experiments; ``None`` means the codec's default."""
        keys: dict[str, Any] = {"method": key_method, "bits": key_bits, "granularity": key_granularity}
        values: dict[str, Any] = {"method": value_method, "bits": value_bits}
        return cls(
            keys={k: v for k, v in keys.items() if v is not None},
            values={k: v for k, v in values.items() if v is not None},
            seed=seed,
        )

    def with_seed(self, seed: int) -> CompressionConfig:
        """This config with another seed, validated (``model_copy(update=...)`` does not validate)."""
        return type(self)(keys=self.keys, values=self.values, seed=seed, layers=self.layers)

    def label(self) -> str:
        """E.g. ``K:int8/channel V:tq3``, or ``K:ctq3/pre-rope V:ctq3 [L0-1 K:ctq4/pre-rope]`` with per-layer codecs."""
        overrides = "".join(f" [{override.label()}]" for override in self.layers)
        return f"K:{self.keys.label()} V:{self.values.label()}{overrides}"


_PRESET_FACTORIES = {
    "default": CompressionConfig,
    "paper": CompressionConfig.paper,
    "max": CompressionConfig.max_compression,
    "full": CompressionConfig.full_precision,
}
PRESETS: tuple[str, ...] = tuple(_PRESET_FACTORIES)
"""Named configs: ``default`` (int8/channel keys, tq3 values), ``paper`` (int8/tensor keys, tq3
values), ``max`` (centered tq4 keys before RoPE, centered tq3 values), ``full`` (no compression)."""


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
