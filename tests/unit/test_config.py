"""CompressionConfig / CodecConfig: defaults, presets, validation messages, labels, persistence, digests."""

from __future__ import annotations

import pydantic
import pytest
import torch

from polykv_agents.codecs.full_precision import FullPrecisionCodec
from polykv_agents.codecs.int_linear import IntLinearCodec
from polykv_agents.codecs.turboquant import TurboQuantCodec
from polykv_agents.config import (
    CODEC_CONFIGS,
    CODEC_METHODS,
    PRESETS,
    SEED_MAX,
    CodecConfig,
    CompressionConfig,
    FullPrecisionCodecConfig,
    IntCodecConfig,
    LayerCodecs,
    TurboQuantCodecConfig,
    codec_config_class,
    describe_codecs,
)
from polykv_agents.model.fingerprint import ModelFingerprint
from polykv_agents.pool.shared_pool import pool_digest


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


def test_none_method_reports_16_bits_and_refuses_others() -> None:
    """For full precision the bit width is reported as 16; another width is a mistake, not a setting."""
    assert CodecConfig(method="none").bits == 16
    assert CodecConfig(method="none").label() == "full"
    with pytest.raises(
        pydantic.ValidationError, match=r"bits=4 is not supported for method='none'; choose one of \[16\]"
    ):
        CodecConfig(method="none", bits=4)


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
    assert str(list(codec_config_class(method).supported_bits)) in message


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
    assert CodecConfig(method="turboquant").bits in TurboQuantCodecConfig.supported_bits


@pytest.mark.parametrize("name", PRESETS)
def test_every_preset_builds_a_valid_config(name):
    assert isinstance(CompressionConfig.preset(name), CompressionConfig)


def test_presets_are_what_their_names_promise():
    assert CompressionConfig.preset("default") == CompressionConfig()
    assert CompressionConfig.preset("paper").keys.granularity == "tensor"
    max_keys = CompressionConfig.preset("max").keys
    assert (max_keys.method, max_keys.bits, max_keys.before_rope) == ("centered_turboquant", 4, True)
    assert CompressionConfig.preset("full").keys.method == "none"


def test_an_unknown_preset_names_the_known_ones():
    with pytest.raises(ValueError, match="default, paper, max, full"):
        CompressionConfig.preset("tiny")


# ---------------------------------------------------------------- one config class per codec


@pytest.mark.parametrize(
    ("fields", "config_class"),
    [
        ({"method": "int", "bits": 4, "granularity": "token"}, IntCodecConfig),
        ({"method": "turboquant", "bits": 2, "rotation": False}, TurboQuantCodecConfig),
        ({"method": "none"}, FullPrecisionCodecConfig),
    ],
)
def test_codec_config_validates_into_the_codec_s_own_class(fields: dict, config_class: type) -> None:
    """``CodecConfig(method=...)`` (the flat constructor of old) returns the codec's own class, equal to
    constructing that class directly; every codec config is a ``CodecConfig``."""
    config = CodecConfig(**fields)
    assert type(config) is config_class
    assert isinstance(config, CodecConfig)
    assert config == config_class(**fields)
    assert CompressionConfig(keys=fields).keys == config  # a dict for a field picks the class the same way
    assert CodecConfig.model_validate(fields) == config == CodecConfig.model_validate_json(config.model_dump_json())


@pytest.mark.parametrize(
    ("fields", "owner"),
    [
        ({"method": "turboquant", "granularity": "token"}, "'int'"),
        ({"method": "turboquant", "granularity": "channel"}, "'int'"),  # even the value that used to be ignored
        ({"method": "int", "rotation": False}, "'turboquant'"),
        ({"method": "int", "random_signs": True}, "'turboquant'"),
        ({"method": "none", "granularity": "tensor"}, "'int'"),
    ],
)
def test_a_setting_of_another_codec_names_the_field_and_the_fix(fields: dict, owner: str) -> None:
    """The flat config of old silently ignored settings of other methods; now they are refused."""
    name = next(k for k in fields if k != "method")
    with pytest.raises(pydantic.ValidationError) as info:
        CodecConfig(**fields)
    message = str(info.value)
    assert f"{name}={fields[name]!r} does not apply to method={fields['method']!r}" in message
    assert f"only to method {owner}; remove {name}, or choose that method" in message


def test_from_options_leaves_unset_options_to_the_codec() -> None:
    """``None`` (the command line's default) means the codec's own default, so ``--key-method
    turboquant`` alone is valid, and a granularity given for TurboQuant is refused, not dropped."""
    assert CompressionConfig.from_options(key_method="turboquant").keys == TurboQuantCodecConfig(bits=3)
    assert CompressionConfig.from_options(key_method="none", value_method="none") == CompressionConfig.full_precision()
    with pytest.raises(pydantic.ValidationError, match="granularity='token' does not apply to method='turboquant'"):
        CompressionConfig.from_options(key_method="turboquant", key_granularity="token")


@pytest.mark.parametrize(
    ("config", "codec_class", "attributes"),
    [
        (IntCodecConfig(bits=4, granularity="token"), IntLinearCodec, {"bits": 4, "granularity": "token"}),
        (
            TurboQuantCodecConfig(bits=2, rotation=True, random_signs=False),
            TurboQuantCodec,
            {"bits": 2, "rotation": True, "random_signs": False, "seed": 11},
        ),
        (FullPrecisionCodecConfig(), FullPrecisionCodec, {}),
    ],
)
def test_each_config_builds_its_codec(config: CodecConfig, codec_class: type, attributes: dict) -> None:
    codec = config.build(seed=11)
    assert type(codec) is codec_class
    assert codec.name == config.method
    assert {name: getattr(codec, name) for name in attributes} == attributes


def test_the_registration_lists_every_codec_once() -> None:
    """Methods, help text and decoding all read the one union; each codec's name is its method."""
    assert CODEC_METHODS == ("int", "turboquant", "centered_turboquant", "none")
    assert [c.codec_class().name for c in CODEC_CONFIGS] == list(CODEC_METHODS)
    assert describe_codecs() == (
        "int (bits 2-8, default 8; granularity: tensor, channel, token); "
        "turboquant (bits 2-4, default 3); centered_turboquant (bits 2-4, default 3; norm_bits: 8, 16); none (bits 16)"
    )
    with pytest.raises(
        ValueError, match="unknown codec method 'zstd'; choose one of int, turboquant, centered_turboquant, none"
    ):
        codec_config_class("zstd")


# ---------------------------------------------------------------- stable dumps and digests

# Recorded before the per-codec classes replaced the flat CodecConfig (pool format 1). A pool's digest
# hashes this dump: changing it orphans every stored pool, so it needs a FORMAT_VERSION bump instead.
# The digests were re-pinned once, for format 2 (the digest leaves the model's dtype out); the dumps did not change.
_FORMAT_1_DUMPS = {
    "default": '{"keys":{"method":"int","bits":8,"granularity":"channel","rotation":true,"random_signs":true},'
    '"values":{"method":"turboquant","bits":3,"granularity":"channel","rotation":true,"random_signs":true},"seed":0}',
    "paper": '{"keys":{"method":"int","bits":8,"granularity":"tensor","rotation":true,"random_signs":true},'
    '"values":{"method":"turboquant","bits":3,"granularity":"channel","rotation":true,"random_signs":true},"seed":0}',
    "tq4 keys (max in 0.1)": '{"keys":{"method":"turboquant","bits":4,"granularity":"channel","rotation":true,'
    '"random_signs":true},'
    '"values":{"method":"turboquant","bits":3,"granularity":"channel","rotation":true,"random_signs":true},"seed":0}',
    "full": '{"keys":{"method":"none","bits":16,"granularity":"channel","rotation":true,"random_signs":true},'
    '"values":{"method":"none","bits":16,"granularity":"channel","rotation":true,"random_signs":true},"seed":0}',
}
_FORMAT_2_DIGESTS = {
    "default": "8a8ee3bf6417a9948c7cef4f7a5712e9ad35034ffbd826524c59bc479f334640",
    "paper": "c7cf478fa7e9451ea640bdf16c8b81fe1030cfefa7ad592453d132f6ac7f5994",
    "tq4 keys (max in 0.1)": "406d11cc696b8ce92a9babc7744612d7bd5618be16e34b05dc3c022a156170a9",
    "full": "98032737b687ffbae43e0c03bbad227414af1f9af3c1384617ed7e0bc6a58796",
}
_FINGERPRINT = ModelFingerprint(
    name="m", architecture="A", num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32", vocab_size=10,
    weights_sha="w", tokenizer_sha="t",
)  # fmt: skip


_PINNED_CONFIGS = {
    "default": CompressionConfig.preset("default"),
    "paper": CompressionConfig.preset("paper"),
    "tq4 keys (max in 0.1)": CompressionConfig(
        keys=TurboQuantCodecConfig(bits=4), values=TurboQuantCodecConfig(bits=3)
    ),
    "full": CompressionConfig.preset("full"),
}
"""The configs of the format-1 records: the presets of 0.1 (``max`` was re-decided in 0.2, a new config)."""


@pytest.mark.parametrize("name", _PINNED_CONFIGS)
def test_preset_dumps_and_digests_are_pinned(name: str) -> None:
    """Each config dumps exactly as before, so pools saved in this format keep their digests and file names."""
    config = _PINNED_CONFIGS[name]
    assert config.model_dump_json() == _FORMAT_1_DUMPS[name]
    assert pool_digest(_FINGERPRINT, config, torch.arange(5), chat_prefix=False) == _FORMAT_2_DIGESTS[name]


def test_the_max_preset_of_0_2_is_pinned_in_its_own_codec_layout() -> None:
    """Centered TurboQuant is not in the format-1 layout: its records carry its own fields only."""
    config = CompressionConfig.preset("max")
    assert config.model_dump_json() == (
        '{"keys":{"method":"centered_turboquant","bits":4,"sink_tokens":4,"norm_bits":8,"before_rope":true},'
        '"values":{"method":"centered_turboquant","bits":3,"sink_tokens":4,"norm_bits":8,"before_rope":false},'
        '"seed":0}'
    )
    assert pool_digest(_FINGERPRINT, config, torch.arange(5), chat_prefix=False) == (
        "9a7e7ed7e0ed7c5211a73d3c482c2c5eb1fa83f955295774e770783f7005e318"
    )
    assert CompressionConfig.model_validate_json(config.model_dump_json()) == config


@pytest.mark.parametrize("name", _PINNED_CONFIGS)
def test_a_format_1_record_reads_back_as_the_same_config(name: str) -> None:
    """The stored layout carries every codec's fields; read back, the inert ones are dropped."""
    config = CompressionConfig.model_validate_json(_FORMAT_1_DUMPS[name])
    assert config == _PINNED_CONFIGS[name]
    assert CodecConfig(**config.values.model_dump()) == config.values


def test_a_format_1_record_with_a_live_foreign_setting_is_refused() -> None:
    """Only the inert defaults of other codecs' fields are dropped; anything else was a mistake."""
    text = _FORMAT_1_DUMPS["default"].replace('"bits":3,"granularity":"channel"', '"bits":3,"granularity":"token"')
    with pytest.raises(pydantic.ValidationError, match="granularity='token' does not apply to method='turboquant'"):
        CompressionConfig.model_validate_json(text)


# ---------------------------------------------------------------- seed range


def test_the_largest_seed_builds_both_codecs() -> None:
    """Values are rotated with ``seed + 1``: at the bound both rotations still exist."""
    config = CompressionConfig(keys=TurboQuantCodecConfig(), seed=SEED_MAX)
    x = torch.randn(1, 1, 2, 8)  # [batch, kv_heads, tokens, head_dim]
    for codec in (config.keys.build(config.seed), config.values.build(config.seed + 1)):
        assert codec.decode(codec.encode(x)).shape == x.shape


@pytest.mark.parametrize("seed", [SEED_MAX + 1, 2**63, -1])
def test_a_seed_out_of_range_is_refused_at_construction(seed: int) -> None:
    with pytest.raises(
        pydantic.ValidationError, match=rf"seed={seed} is out of range; choose a seed in 0..2\*\*63 - 2"
    ):
        CompressionConfig(seed=seed)
    with pytest.raises(pydantic.ValidationError, match="out of range"):
        CompressionConfig.paper().with_seed(seed)


def test_with_seed_keeps_the_codecs() -> None:
    paper = CompressionConfig.paper()
    assert paper.with_seed(5) == CompressionConfig(keys=paper.keys, values=paper.values, seed=5) != paper


def test_a_pool_builds_at_the_largest_seed(tiny_model, tiny_tok) -> None:
    """The pool rotates keys with ``seed`` and values with ``seed + 1``: the bound leaves room for both."""
    from polykv_agents import SharedKVPool

    config = CompressionConfig.max_compression().with_seed(SEED_MAX)
    pool = SharedKVPool.prefill(tiny_model, tiny_tok, "A short document about shared caches.", config=config)
    assert pool.layers[0].values.params["seed"] == SEED_MAX + 1


# ---------------------------------------------------------------- codecs by layer

_CTQ3_PRE_ROPE = CodecConfig(method="centered_turboquant", bits=3, before_rope=True)
_CTQ4_PRE_ROPE = CodecConfig(method="centered_turboquant", bits=4, before_rope=True)
MIXED = CompressionConfig(
    keys=_CTQ3_PRE_ROPE,
    values=CodecConfig(method="centered_turboquant", bits=3),
    layers=[
        LayerCodecs(layers=(0, 1, -1), keys=_CTQ4_PRE_ROPE),
        LayerCodecs(layers=(5,), values=CodecConfig(method="centered_turboquant", bits=2)),
    ],
)


def test_layer_codecs_replace_the_config_s_codecs_on_their_layers_only() -> None:
    keys = [MIXED.keys_for(layer, 8).bits for layer in range(8)]
    values = [MIXED.values_for(layer, 8).bits for layer in range(8)]
    assert keys == [4, 4, 3, 3, 3, 3, 3, 4]  # -1: the last layer, whatever the depth
    assert values == [3, 3, 3, 3, 3, 2, 3, 3]  # an entry without keys keeps the config's keys there
    assert [MIXED.keys_for(layer, 30).bits for layer in (0, 1, 2, 28, 29)] == [4, 4, 3, 3, 4]


def test_a_config_with_layer_codecs_is_labelled_dumped_and_read_back() -> None:
    assert MIXED.label() == "K:ctq3/pre-rope V:ctq3 [L0-1,-1 K:ctq4/pre-rope] [L5 V:ctq2]"
    assert LayerCodecs(layers=(4, 5, 6, 9, -3, -2), values=MIXED.values).label() == "L4-6,9,-3,-2 V:ctq3"
    assert CompressionConfig.model_validate_json(MIXED.model_dump_json()) == MIXED
    assert MIXED.with_seed(4).layers == MIXED.layers
    assert len(set(MIXED.codec_configs())) == 4
    assert "layers" not in CompressionConfig().model_dump()  # the dump every earlier pool digest hashed


@pytest.mark.parametrize(
    ("layers", "fragment"),
    [
        ([{"layers": [0]}], "sets neither keys nor values"),
        ([{"layers": [2, 2], "keys": {"method": "int"}}], "lists a layer twice"),
        ([{"layers": [1], "keys": {"method": "int"}}, {"layers": [1, 2], "keys": {"method": "int"}}], "keys from two"),
        (
            [{"layers": [3], "values": {"method": "int"}}, {"layers": [3], "values": {"method": "int"}}],
            "values from two",
        ),
        ([{"layers": [0], "values": {"method": "centered_turboquant", "before_rope": True}}], "key codec only"),
        ([{"layers": [], "keys": {"method": "int"}}], "at least 1 item"),
    ],
)
def test_bad_layer_codecs_are_refused_with_the_fix(layers: list, fragment: str) -> None:
    with pytest.raises(pydantic.ValidationError, match=fragment):
        CompressionConfig(layers=layers)


def test_a_layer_the_model_does_not_have_is_refused_when_the_codecs_are_chosen() -> None:
    with pytest.raises(ValueError, match=r"names layer 8, but the model has 8 layers"):
        CompressionConfig(layers=[LayerCodecs(layers=(8,), keys=_CTQ4_PRE_ROPE)]).keys_for(0, 8)
    int4 = CodecConfig(method="int", bits=4)
    twice = CompressionConfig(layers=[LayerCodecs(layers=(0,), keys=int4), LayerCodecs(layers=(-8,), keys=int4)])
    assert twice.codecs_by_layer(9)[0] == (int4, twice.values)  # in 9 layers, -8 is layer 1
    with pytest.raises(ValueError, match="layer 0 of 8 gets keys from more than one entry"):
        twice.codecs_by_layer(8)  # the whole model is refused, whichever layer is asked for
    with pytest.raises(ValueError, match="layer 8 is out of range for a model with 8 layers"):
        CompressionConfig().keys_for(8, 8)


def test_one_layer_may_take_its_keys_and_its_values_from_two_entries() -> None:
    int4, int6 = CodecConfig(method="int", bits=4), CodecConfig(method="int", bits=6)
    config = CompressionConfig(layers=[LayerCodecs(layers=(0, 1), keys=int4), LayerCodecs(layers=(-4,), values=int6)])
    assert (config.keys_for(0, 4), config.values_for(0, 4)) == (int4, int6)
    assert (config.keys_for(1, 4), config.values_for(1, 4)) == (int4, config.values)
