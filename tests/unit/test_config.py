"""CompressionConfig / CodecConfig: defaults, presets, validation messages, labels, persistence."""

from __future__ import annotations

import pydantic
import pytest

from polykv_agents.config import PRESETS, SUPPORTED_BITS, CodecConfig, CompressionConfig


def test_defaults_are_int8_channel_keys_and_tq3_values() -> None:
    """The default is the measured-best setting: int8 keys with per-channel scales, 3-bit TurboQuant
    values with rotation and random signs, seed 0."""
    config = CompressionConfig()
    assert config.keys == CodecConfig(method="int", bits=8, granularity="channel")
    assert config.values.method == "turboquant"
    assert config.values.bits == 3
    assert config.values.rotation is True
    assert config.values.random_signs is True
    assert config.seed == 0
    assert config.label() == "K:int8/channel V:tq3"


def test_paper_preset_uses_one_scale_per_tensor() -> None:
    """The PolyKV paper quantises keys with a single per-tensor scale; only that differs from the default."""
    paper = CompressionConfig.paper()
    assert paper.keys == CodecConfig(method="int", bits=8, granularity="tensor")
    assert paper.values == CompressionConfig().values
    assert paper.label() == "K:int8/tensor V:tq3"
    assert paper != CompressionConfig()


def test_full_precision_preset() -> None:
    """No compression on either side; the bit width is reported as 16."""
    full = CompressionConfig.full_precision()
    assert full.keys.method == full.values.method == "none"
    assert full.keys.bits == full.values.bits == 16
    assert full.label() == "K:full V:full"


def test_from_options_builds_the_nested_config() -> None:
    config = CompressionConfig.from_options(
        key_method="int", key_bits=4, key_granularity="token", value_method="turboquant", value_bits=2, seed=9
    )
    assert config.keys == CodecConfig(method="int", bits=4, granularity="token")
    assert config.values == CodecConfig(method="turboquant", bits=2)
    assert config.seed == 9
    assert config.label() == "K:int4/token V:tq2"
    # Its defaults are the class defaults.
    assert CompressionConfig.from_options() == CompressionConfig()


def test_from_options_validates() -> None:
    with pytest.raises(pydantic.ValidationError, match="bits=5"):
        CompressionConfig.from_options(value_bits=5)


def test_none_method_always_reports_16_bits() -> None:
    """For full precision the bit width is meaningless and forced to 16, whatever was passed."""
    assert CodecConfig(method="none").bits == 16
    assert CodecConfig(method="none", bits=4).bits == 16
    assert CodecConfig(method="none").label() == "full"


def test_configs_are_frozen() -> None:
    """Pools record their config; it must not change after the pool was built."""
    config = CompressionConfig()
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        config.seed = 3
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        config.keys.bits = 4
    assert config == CompressionConfig()


def test_configs_are_hashable_values() -> None:
    """Frozen configs compare and hash by value, so they can key caches and dicts."""
    assert hash(CompressionConfig()) == hash(CompressionConfig())
    assert len({CompressionConfig(), CompressionConfig(), CompressionConfig.paper()}) == 2


@pytest.mark.parametrize(
    ("method", "bits"),
    [("turboquant", 5), ("turboquant", 8), ("turboquant", 1), ("int", 1), ("int", 9), ("int", 16)],
)
def test_unsupported_bits_name_the_problem(method: str, bits: int) -> None:
    """The error names the rejected width and lists the allowed ones, so the user can fix it."""
    with pytest.raises(pydantic.ValidationError) as info:
        CodecConfig(method=method, bits=bits)
    message = str(info.value)
    assert f"bits={bits}" in message
    assert repr(method) in message
    assert str(list(SUPPORTED_BITS[method])) in message


def test_turboquant_error_lists_allowed_bits() -> None:
    with pytest.raises(ValueError, match=r"bits=5 .*turboquant.*\[2, 3, 4\]"):
        CodecConfig(method="turboquant", bits=5)


def test_validation_error_is_a_value_error() -> None:
    """Callers may catch plain ValueError (pydantic's ValidationError subclasses it)."""
    assert issubclass(pydantic.ValidationError, ValueError)
    with pytest.raises(ValueError):
        CompressionConfig.from_options(key_bits=1)


@pytest.mark.parametrize(
    ("kwargs", "fragment"),
    [
        ({"method": "zstd"}, "method"),
        ({"method": "int", "granularity": "row"}, "granularity"),
        ({"method": "int", "bits": 8.5}, "bits"),
        ({"method": "int", "colour": "red"}, "colour"),
    ],
)
def test_invalid_codec_fields_are_rejected(kwargs: dict, fragment: str) -> None:
    """Unknown methods and granularities, fractional bits and unknown fields (typos) all fail,
    naming the offending field."""
    with pytest.raises(pydantic.ValidationError, match=fragment):
        CodecConfig(**kwargs)


def test_negative_seed_and_unknown_fields_are_rejected() -> None:
    with pytest.raises(pydantic.ValidationError, match="seed"):
        CompressionConfig(seed=-1)
    with pytest.raises(pydantic.ValidationError, match="value"):
        CompressionConfig(value=CodecConfig(method="none"))  # typo for `values`


@pytest.mark.parametrize(
    ("codec", "label"),
    [
        (CodecConfig(method="int", bits=8, granularity="channel"), "int8/channel"),
        (CodecConfig(method="int", bits=2, granularity="tensor"), "int2/tensor"),
        (CodecConfig(method="turboquant", bits=3), "tq3"),
        (CodecConfig(method="turboquant", bits=4, random_signs=False), "tq4-nosigns"),
        (CodecConfig(method="turboquant", bits=2, rotation=False), "tq2-norot"),
        (CodecConfig(method="turboquant", bits=2, rotation=False, random_signs=False), "tq2-norot"),
        (CodecConfig(method="none"), "full"),
    ],
)
def test_codec_labels(codec: CodecConfig, label: str) -> None:
    """Labels name the ablation: rotation off wins over signs off (no rotation, no signs)."""
    assert codec.label() == label


def test_compression_label_combines_both_sides() -> None:
    config = CompressionConfig(
        keys=CodecConfig(method="int", bits=4, granularity="token"),
        values=CodecConfig(method="turboquant", bits=2, random_signs=False),
    )
    assert config.label() == "K:int4/token V:tq2-nosigns"


@pytest.mark.parametrize(
    "config",
    [
        CompressionConfig(),
        CompressionConfig.paper(),
        CompressionConfig.full_precision(),
        CompressionConfig(
            keys=CodecConfig(method="turboquant", bits=4, rotation=False),
            values=CodecConfig(method="int", bits=3, granularity="token"),
            seed=12345,
        ),
    ],
    ids=["default", "paper", "full", "mixed"],
)
def test_json_round_trip(config: CompressionConfig) -> None:
    """Pools store their config as JSON; reading it back gives an equal config."""
    text = config.model_dump_json()
    restored = CompressionConfig.model_validate_json(text)
    assert restored == config
    assert restored.label() == config.label()
    assert restored.model_dump_json() == text


def test_json_is_validated_on_load() -> None:
    """A corrupted or hand-edited header is validated like constructor arguments."""
    text = CompressionConfig().model_dump_json().replace('"bits":3', '"bits":5')
    assert '"bits":5' in text
    with pytest.raises(pydantic.ValidationError, match="bits=5"):
        CompressionConfig.model_validate_json(text)


def test_turboquant_without_bits_gets_a_supported_default() -> None:
    assert CodecConfig(method="turboquant").bits in SUPPORTED_BITS["turboquant"]


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_builds_a_valid_config(name):
    assert isinstance(CompressionConfig.preset(name), CompressionConfig)


def test_presets_are_what_their_names_promise():
    assert CompressionConfig.preset("default") == CompressionConfig()
    assert CompressionConfig.preset("paper").keys.granularity == "tensor"
    max_keys = CompressionConfig.preset("max").keys
    assert (max_keys.method, max_keys.bits) == ("turboquant", 4)
    assert CompressionConfig.preset("full").keys.method == "none"


def test_an_unknown_preset_names_the_known_ones():
    with pytest.raises(ValueError, match="default, paper, max, full"):
        CompressionConfig.preset("tiny")
