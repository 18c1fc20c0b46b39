"""PoolStore on a tiny random Llama: exact round trips, no pickle, and every damaged file refused cleanly."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import re
import struct
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from polykv_agents import CodecConfig, CompressionConfig, LayerCodecs, SharedKVPool
from polykv_agents.codecs import EncodedTensor
from polykv_agents.pool.record import pool_from_record, pool_record
from polykv_agents.pool.store import FORMAT_VERSION, PoolFileError, PoolStore

DOC = "Shared caches let many agents read one document. " * 6
CONFIGS = {
    "default": CompressionConfig(),
    "paper": CompressionConfig.paper(),
    "full-precision": CompressionConfig.full_precision(),
    "tq4-keys": CompressionConfig(keys=CodecConfig(method="turboquant", bits=4)),
    "int4-token-keys": CompressionConfig.from_options(key_bits=4, key_granularity="token", value_bits=2, seed=7),
    "centered-pre-rope": CompressionConfig(
        keys=CodecConfig(method="centered_turboquant", bits=3, before_rope=True),
        values=CodecConfig(method="centered_turboquant", bits=2, norm_bits=16, sink_tokens=0),
    ),
    "codecs-by-layer": CompressionConfig(
        layers=[LayerCodecs(layers=(-1,), keys=CodecConfig(method="centered_turboquant", bits=4, before_rope=True))]
    ),
}


def assert_same_pool(loaded: SharedKVPool, pool: SharedKVPool) -> None:
    assert loaded.digest == pool.digest
    assert loaded.tensor_checksum() == pool.tensor_checksum()
    assert (loaded.fingerprint, loaded.config, loaded.prefix_messages) == (
        pool.fingerprint,
        pool.config,
        pool.prefix_messages,
    )
    assert (loaded.nbytes, loaded.fp16_nbytes, loaded.model_dtype_nbytes) == (
        pool.nbytes,
        pool.fp16_nbytes,
        pool.model_dtype_nbytes,
    )
    assert torch.equal(loaded.token_ids, pool.token_ids)
    for i in range(pool.num_layers):
        for got, want in zip(loaded.decompress_layer(i), pool.decompress_layer(i), strict=True):
            assert got.dtype == want.dtype
            assert torch.equal(got, want)


def header_length(data: bytes) -> int:
    """Bytes of safetensors' JSON header, which follows an 8-byte little-endian length."""
    return struct.unpack("<Q", data[:8])[0]


def rewrite(path, edit) -> None:
    """Rewrite a pool file through safetensors with ``edit(header_dict)`` applied to its polykv metadata."""
    with safe_open(str(path), framework="pt") as f:
        header = json.loads(f.metadata()["polykv"])
        names = f.keys()  # a safe_open handle has keys() but cannot be iterated itself
        tensors = {name: f.get_tensor(name) for name in names}
    edit(header)
    save_file(tensors, str(path), metadata={"polykv": json.dumps(header)})


def recompute_header_checksum(header: dict) -> None:
    """What a careful forger would do after an edit (the store's checksum of its own metadata)."""
    from polykv_agents.pool.record import _header_checksum

    header.pop("header_checksum")
    header["header_checksum"] = _header_checksum(header)


@pytest.fixture(scope="module")
def pool(tiny_model, tiny_tok) -> SharedKVPool:
    return SharedKVPool.prefill(tiny_model, tiny_tok, DOC)


@pytest.fixture
def saved(pool, tmp_path):
    store = PoolStore(tmp_path)
    return store, store.save(pool)


# ---------------------------------------------------------------- round trips


@pytest.mark.parametrize("config", CONFIGS.values(), ids=CONFIGS.keys())
def test_round_trip_is_exact(tiny_model, tiny_tok, tmp_path, config):
    pool = SharedKVPool.prefill(tiny_model, tiny_tok, DOC, config=config)
    store = PoolStore(tmp_path)
    path = store.save(pool)
    assert path == tmp_path / f"{pool.digest}.safetensors"
    assert pool.digest in store
    assert_same_pool(store.load(pool.digest), pool)


def test_round_trip_of_a_bfloat16_full_precision_pool(tiny_tok, tmp_path):
    from tiny_models import tiny_llama

    model = tiny_llama().to(torch.bfloat16)
    pool = SharedKVPool.prefill(model, tiny_tok, DOC, config=CompressionConfig.full_precision())
    assert pool.layers[0].keys.tensors["data"].dtype == torch.bfloat16
    store = PoolStore(tmp_path)
    store.save(pool)
    assert_same_pool(store.load(pool.digest), pool)


def test_round_trip_of_a_chat_messages_pool(tiny_model, tiny_tok, tmp_path):
    messages = [{"role": "system", "content": "Read this."}, {"role": "user", "content": DOC}]
    pool = SharedKVPool.prefill(tiny_model, tiny_tok, messages)
    store = PoolStore(tmp_path)
    store.save(pool)
    loaded = store.load(pool.digest)
    assert_same_pool(loaded, pool)
    assert [dict(m) for m in loaded.prefix_messages] == messages


def test_the_file_is_plain_safetensors_without_pickle(saved, pool):
    _, path = saved
    data = path.read_bytes()
    assert not data.startswith(b"\x80")  # pickle's PROTO opcode
    assert not data.startswith(b"PK\x03\x04")  # torch.save's zip container
    assert data[8:9] == b"{"  # safetensors: an 8-byte length, then a JSON header
    tensors = load_file(str(path))
    assert torch.equal(tensors["token_ids"], pool.token_ids)
    assert set(tensors) == {"token_ids"} | {
        f"layers.{i}.{kind}.{name}"
        for i, layer in enumerate(pool.layers)
        for kind, enc in (("keys", layer.keys), ("values", layer.values))
        for name in enc.tensors
    }
    with safe_open(str(path), framework="pt") as f:
        header = json.loads(f.metadata()["polykv"])
    assert header["format_version"] == FORMAT_VERSION
    assert (header["digest"], header["checksum"]) == (pool.digest, pool.tensor_checksum())
    assert header["layers"][0]["values"]["codec"] == "turboquant"


def test_the_header_keeps_the_format_1_config_layout(saved):
    """Files store the config as format 1 always did: every codec record lists every codec's fields
    (the inert ones at their defaults); a layout change would need a FORMAT_VERSION bump. Format 2
    changed only the fingerprint's weights hash and the digest (both free of the dtype)."""
    _, path = saved
    with safe_open(str(path), framework="pt") as f:
        header = json.loads(f.metadata()["polykv"])
    assert FORMAT_VERSION == 2
    assert header["config"] == {
        "keys": {"method": "int", "bits": 8, "granularity": "channel", "rotation": True, "random_signs": True},
        "values": {"method": "turboquant", "bits": 3, "granularity": "channel", "rotation": True, "random_signs": True},
        "seed": 0,
    }


def test_a_pool_s_tensors_cannot_be_replaced(saved, pool):
    """A pool's digest covers its config and tokens, not its tensors: swapping a stored tensor must be
    impossible, in a built pool and in a loaded one."""
    store, _ = saved
    for candidate in (pool, store.load(pool.digest)):
        encoded = candidate.layers[0].values
        with pytest.raises(TypeError, match="does not support item assignment"):
            encoded.tensors["codes"] = torch.zeros_like(encoded.tensors["codes"])
        with pytest.raises(TypeError):
            del encoded.tensors["norms"]
        with pytest.raises(TypeError, match="does not support item assignment"):
            encoded.params["bits"] = 2
        assert candidate.tensor_checksum() == pool.tensor_checksum()


def test_an_encoded_tensor_keeps_its_own_mappings_through_pickle(pool):
    """The record copies the caller's dicts, and pickles (Ray ships pools) back into a read-only record."""
    data = torch.ones(1, 1, 2, 4)  # [batch, kv_heads, tokens, head_dim]
    tensors, params = {"data": data}, {"note": 1}
    encoded = EncodedTensor(codec="none", shape=(1, 1, 2, 4), dtype="float32", params=params, tensors=tensors)
    tensors["data"], params["note"] = torch.zeros_like(data), 2
    assert encoded.tensors["data"] is data
    assert encoded.params == {"note": 1}
    original = pool.layers[0].values
    restored = pickle.loads(pickle.dumps(original))
    assert (restored.codec, restored.shape, restored.dtype, restored.params) == (
        original.codec,
        original.shape,
        original.dtype,
        original.params,
    )
    assert restored.tensors.keys() == original.tensors.keys()
    assert all(torch.equal(restored.tensors[name], t) for name, t in original.tensors.items())
    with pytest.raises(TypeError, match="does not support item assignment"):
        restored.tensors["codes"] = data


def test_save_is_atomic_and_lazy_about_the_directory(pool, tmp_path, monkeypatch):
    directory = tmp_path / "a" / "b"
    store = PoolStore(directory)
    assert not directory.exists()  # constructing a store touches nothing
    assert pool.digest not in store
    store.save(pool)
    assert os.listdir(directory) == [f"{pool.digest}.safetensors"]  # no temporary file left behind

    def failing_save_file(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"half a file")
        raise OSError("disk full")

    store.delete(pool.digest)
    monkeypatch.setattr("polykv_agents.pool.store.save_file", failing_save_file)
    with pytest.raises(OSError, match="disk full"):
        store.save(pool)
    assert os.listdir(directory) == []  # neither a partial target nor the temporary file

    def vanishing_save_file(tensors, filename, metadata=None):
        os.unlink(filename)  # the temporary file is gone before the cleanup looks for it
        raise OSError("disk gone")

    monkeypatch.setattr("polykv_agents.pool.store.save_file", vanishing_save_file)
    with pytest.raises(OSError, match="disk gone"):  # the save's own error, not the cleanup's
        store.save(pool)


def test_the_temporary_file_is_a_hidden_sibling_of_the_target(pool, tmp_path, monkeypatch, caplog):
    moves = []
    replace = os.replace

    def recording_replace(source, target):
        moves.append((Path(source), Path(target)))
        replace(source, target)

    monkeypatch.setattr(os, "replace", recording_replace)
    store = PoolStore(tmp_path)
    with caplog.at_level(logging.INFO, logger="polykv_agents.pool.store"):
        path = store.save(pool)
    [(temporary, target)] = moves
    assert target == path and temporary.parent == tmp_path  # one filesystem: the rename is atomic
    assert temporary.name.startswith(f".{pool.digest[:16]}.") and temporary.name.endswith(".tmp")
    assert [r.getMessage() for r in caplog.records] == [f"saved {pool!r} to {path}"]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="polykv_agents.pool.store"):
        store.load(pool.digest)
    assert [r.getMessage() for r in caplog.records] == [f"loaded {pool!r} from {path}"]
    assert repr(store) == f"PoolStore({str(tmp_path)!r})"


def test_delete_is_idempotent_and_load_of_a_missing_file_says_so(saved, pool):
    store, path = saved
    store.delete(pool.digest)
    store.delete(pool.digest)
    assert not path.exists()
    assert pool.digest not in store
    with pytest.raises(FileNotFoundError, match="no saved pool"):
        store.load(pool.digest)


@pytest.mark.parametrize(
    "digest",
    ["../x", "a/b", "../../etc/passwd", "A" * 64, "0" * 63, "0" * 65, "../" + "0" * 61, "0" * 63 + "\n", "", 42],
)
def test_malformed_digests_are_refused(tmp_path, digest):
    store = PoolStore(tmp_path)
    for call in (store.path_for, store.load, store.delete, store.__contains__):
        with pytest.raises(
            ValueError, match=r"64 lowercase hexadecimal.*; pass pool\.digest or handle\.digest unchanged$"
        ):
            call(digest)


def test_path_for_stays_inside_the_directory(tmp_path):
    path = PoolStore(tmp_path).path_for("ab" * 32)
    assert path.parent == tmp_path


# ---------------------------------------------------------------- damaged files


def test_flipped_tensor_bytes_are_refused(saved, pool):
    store, path = saved
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # tensor data fill the file after the header
    path.write_bytes(bytes(data))
    with pytest.raises(PoolFileError, match="corrupted or tampered"):
        store.load(pool.digest)


@pytest.mark.parametrize("keep", [0, 7, 100, "half-header", "all-but-one"])
def test_truncated_files_are_refused(saved, pool, keep):
    store, path = saved
    data = path.read_bytes()
    keep = {"half-header": 8 + header_length(data) // 2, "all-but-one": len(data) - 1}.get(keep, keep)
    path.write_bytes(data[:keep])
    with pytest.raises(PoolFileError, match=r"corrupted or truncated.*delete it") as info:
        store.load(pool.digest)
    assert str(path) in str(info.value)


def test_a_file_without_polykv_metadata_is_refused(saved, pool):
    store, path = saved
    save_file({"x": torch.zeros(2)}, str(path))
    with pytest.raises(PoolFileError, match=r"corrupted or truncated \(KeyError: 'polykv'\)"):
        store.load(pool.digest)


@pytest.mark.parametrize(
    "edit",
    [
        lambda h: h.update(checksum="0" * 64),
        lambda h: h["layers"][0]["keys"].update(shape=[1, 2, 10, 16]),
        lambda h: h["layers"][1]["values"]["params"].update(bits=2),
        lambda h: h["config"]["values"].update(bits=2),
    ],
    ids=["checksum", "shape", "codec-params", "config"],
)
def test_edited_metadata_is_refused(saved, pool, edit):
    store, path = saved
    rewrite(path, edit)
    remedy = r"delete it \(PoolStore\.delete\(digest\)\) or rebuild the pool from its document, which overwrites it$"
    with pytest.raises(PoolFileError, match=rf"^{re.escape(str(path))} is corrupted or tampered.*; {remedy}"):
        store.load(pool.digest)


def test_forged_metadata_with_a_recomputed_header_checksum_is_still_caught(saved, pool):
    """The digest covers config and fingerprint; the tensor checksum covers the tensor bytes."""
    store, path = saved
    rewrite(path, lambda h: (h["config"].update(seed=5), recompute_header_checksum(h)))
    with pytest.raises(PoolFileError, match="digest of the pool"):
        store.load(pool.digest)
    store.save(pool)
    rewrite(path, lambda h: (h.update(checksum="0" * 64), recompute_header_checksum(h)))
    with pytest.raises(PoolFileError, match="the tensor checksum of the pool it holds does not match"):
        store.load(pool.digest)


def test_an_edited_safetensors_dtype_is_caught(saved, pool):
    """int8 -> uint8 keeps every byte, so only the saved tensor specs can tell."""
    store, path = saved
    data = path.read_bytes()
    n = header_length(data)
    header = data[8 : 8 + n].replace(b'"dtype":"I8"', b'"dtype":"U8"', 1)
    assert header != data[8 : 8 + n]
    path.write_bytes(data[:8] + header + data[8 + n :])
    with pytest.raises(PoolFileError, match=r"is uint8\[.*\] as read but was saved as int8\["):
        store.load(pool.digest)


def test_a_file_renamed_to_another_digest_is_refused(saved, pool):
    store, path = saved
    other = "f" * 64
    os.replace(path, store.path_for(other))
    with pytest.raises(PoolFileError, match="digest"):
        store.load(other)


@pytest.mark.parametrize("forge", [False, True], ids=["plain-edit", "recomputed-header-checksum"])
def test_another_format_version_is_refused_with_both_versions_named(saved, pool, forge):
    store, path = saved
    rewrite(path, lambda h: (h.update(format_version=FORMAT_VERSION + 1), forge and recompute_header_checksum(h)))
    with pytest.raises(PoolFileError, match=rf"version {FORMAT_VERSION + 1}.*reads version {FORMAT_VERSION}.*rebuild"):
        store.load(pool.digest)


# ---------------------------------------------------------------- records (what a file or a published pool holds)


def test_the_header_checksum_is_over_canonical_json():
    """Files saved earlier stay readable only while this checksum is computed the same way."""
    from polykv_agents.pool.record import _header_checksum

    assert _header_checksum({"b": 1, "a": [1, 2]}) == hashlib.sha256(b'{"a": [1, 2], "b": 1}').hexdigest()


def _record(pool: SharedKVPool, edit=None) -> tuple[dict, dict[str, torch.Tensor]]:
    """``pool``'s record as a reader gets it, after ``edit(header, tensors)`` and a recomputed header checksum."""
    record = pool_record(pool)
    header, tensors = json.loads(json.dumps(record.header)), dict(record.tensors)
    if edit is not None:
        edit(header, tensors)
        recompute_header_checksum(header)
    return header, tensors


def _read(header: dict, tensors: dict[str, torch.Tensor]) -> SharedKVPool:
    return pool_from_record(header, tensors, source="SOURCE", remedy="REMEDY")


def test_a_record_without_a_digest_to_file_it_under_is_checked_against_its_own(pool):
    assert_same_pool(_read(*_record(pool)), pool)


def test_a_record_header_is_plain_json_and_only_pools_are_recorded(pool):
    header = pool_record(pool).header
    assert header == json.loads(json.dumps(header))  # lists, not tuples: what a reader of the JSON gets back
    with pytest.raises(TypeError, match=r"^pool must be a SharedKVPool, got str; build one with SharedKVPool"):
        pool_record("not a pool")


def _drop_layer_1_values(header: dict, tensors: dict[str, torch.Tensor]) -> None:
    for name in [n for n in tensors if n.startswith("layers.1.values.")]:
        del tensors[name], header["tensors"][name]


def _add_a_stray_tensor(header: dict, tensors: dict[str, torch.Tensor]) -> None:
    tensors["stray"] = torch.zeros(2)
    header["tensors"]["stray"] = {"dtype": "float32", "shape": [2]}


@pytest.mark.parametrize(
    ("edit", "error"),
    [
        (
            lambda h, t: t.update(stray=torch.zeros(2)),
            r"KeyError: \"stored tensors \['stray'\] disagree with the header",
        ),
        (lambda h, t: t.pop("token_ids"), r"KeyError: \"stored tensors \['token_ids'\] disagree with the header"),
        (_drop_layer_1_values, r"KeyError: 'layer 1 has no stored values tensors'"),
        (_add_a_stray_tensor, r"KeyError: \"stored tensors \['stray'\] belong to no layer"),
    ],
    ids=["unlisted-tensor", "missing-tensor", "layer-without-tensors", "tensor-of-no-layer"],
)
def test_a_record_whose_tensors_disagree_with_its_header_says_which(pool, edit, error):
    with pytest.raises(PoolFileError, match=rf"^SOURCE is corrupted or truncated \({error}.*\); REMEDY$"):
        _read(*_record(pool, edit))


def test_bad_header_messages_name_the_source_and_the_remedy(pool):
    tampered = r"^SOURCE is corrupted or tampered with: its metadata .*; REMEDY$"
    header, tensors = _record(pool)
    header["fp16_nbytes"] += 1  # no new header checksum
    with pytest.raises(PoolFileError, match=tampered):
        _read(header, tensors)
    del header["header_checksum"]
    with pytest.raises(PoolFileError, match=tampered):
        _read(header, tensors)
    header, tensors = _record(pool, lambda h, t: h.update(format_version=FORMAT_VERSION + 1))
    version = (
        rf"^SOURCE was written in pool file format version {FORMAT_VERSION + 1}, but this version of polykv_agents "
        rf"reads version {FORMAT_VERSION}; rebuild the pool from its document \(and delete the old file with "
        r"PoolStore\.delete\(digest\)\)$"
    )
    with pytest.raises(PoolFileError, match=version):
        _read(header, tensors)


@pytest.mark.parametrize(
    ("header", "error"),
    [
        ([], "TypeError: the header is JSON list, not an object"),
        ({"format_version": "1"}, "ValueError: format_version is '1', not an integer"),
        ({"format_version": True}, "ValueError: format_version is True, not an integer"),
    ],
)
def test_a_header_that_is_not_a_versioned_object_says_what_it_is(header, error):
    with pytest.raises(PoolFileError, match=rf"^SOURCE is corrupted or truncated \({error}\); REMEDY$"):
        _read(header, {})


# ---------------------------------------------------------------- fuzzing


def test_saving_and_loading_never_pickle(pool, tmp_path, monkeypatch):
    """Only safetensors and JSON: a pool file cannot run code when it is loaded."""

    def refuse(*args, **kwargs):
        raise AssertionError("a pool file must never be pickled or unpickled")

    for name in ("load", "loads", "dump", "dumps", "Unpickler", "Pickler"):
        monkeypatch.setattr(pickle, name, refuse)
    monkeypatch.setattr(torch, "load", refuse)
    monkeypatch.setattr(torch, "save", refuse)
    store = PoolStore(tmp_path)
    store.save(pool)
    assert store.load(pool.digest).tensor_checksum() == pool.tensor_checksum()


@pytest.fixture(scope="module")
def fuzz_target(pool, tmp_path_factory):
    """A store holding ``pool``, and the file's valid bytes; each example overwrites the file."""
    store = PoolStore(tmp_path_factory.mktemp("fuzz"))
    path = store.save(pool)
    return store, path, path.read_bytes()


def load_or_pool_file_error(store: PoolStore, pool: SharedKVPool) -> None:
    """Loading either fails with PoolFileError or gives back exactly ``pool``: nothing else is allowed."""
    try:
        loaded = store.load(pool.digest)
    except PoolFileError:
        return
    assert_same_pool(loaded, pool)


@settings(max_examples=50, deadline=None)
@given(junk=st.binary(max_size=4096))
def test_fuzz_random_bytes_are_refused(fuzz_target, pool, junk):
    store, path, _ = fuzz_target
    path.write_bytes(junk)
    with pytest.raises(PoolFileError):
        store.load(pool.digest)


@settings(max_examples=50, deadline=None)
@given(fraction=st.floats(min_value=0.0, max_value=1.0, exclude_max=True))
def test_fuzz_truncations_are_refused(fuzz_target, pool, fraction):
    store, path, data = fuzz_target
    path.write_bytes(data[: int(fraction * len(data))])
    with pytest.raises(PoolFileError):
        store.load(pool.digest)


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_fuzz_bit_flips_are_refused_or_harmless(fuzz_target, pool, data):
    store, path, valid = fuzz_target
    header_bits = (8 + header_length(valid)) * 8
    # Half the flips aim at the headers (a few KB), the rest anywhere (mostly tensor data).
    positions = data.draw(
        st.lists(st.one_of(st.integers(0, header_bits - 1), st.integers(0, len(valid) * 8 - 1)), min_size=1, max_size=6)
    )
    damaged = bytearray(valid)
    for bit in positions:
        damaged[bit // 8] ^= 1 << (bit % 8)
    path.write_bytes(bytes(damaged))
    load_or_pool_file_error(store, pool)
