import json
import multiprocessing
import os
import signal
import time

import numpy as np
import pytest
import torch
import zarr

from dflash_eval.storage.feature_store import FEATURES_DIRNAME, FeatureMissing, FeatureStore, _chunk_rows
from tests import storage_workers
from tests.storage_workers import hidden_for, rows_for

SPAWN = multiprocessing.get_context("spawn")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


def _assert_bit_exact(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.equal(_bits(actual), _bits(expected))


class Raw:
    """The keys of a feature store as files or objects, for tests that damage or inspect them."""

    def __init__(self, location):
        self.location = location  # a folder, or an s3:// URL

    @property
    def storage(self):
        from dflash_eval.storage.object_storage import ObjectStorage

        return ObjectStorage(self.location) if isinstance(self.location, str) else None

    def zarr_store(self):
        return self.storage.zarr_store() if self.storage else zarr.storage.LocalStore(self.location)

    def keys(self, prefix: str) -> list[str]:
        if self.storage:
            return [m["path"] for m in self.storage.objects(prefix)]
        return [p.relative_to(self.location).as_posix() for p in (self.location / prefix).rglob("*") if p.is_file()]

    def read(self, key: str) -> bytes:
        return self.storage.get(key)[0] if self.storage else (self.location / key).read_bytes()

    def write(self, key: str, data: bytes) -> None:
        if self.storage:
            self.storage.put(key, data)
        else:
            (self.location / key).write_bytes(data)

    def delete(self, key: str) -> None:
        if self.storage:
            self.storage.delete([key])
        else:
            (self.location / key).unlink()

    def identity(self, key: str):
        if self.storage:
            return self.storage.head(key)["e_tag"]
        stat = os.stat(self.location / key)
        return stat.st_ino, stat.st_mtime_ns


@pytest.fixture(params=["local", "s3"])
def raw(request, tmp_path):
    """Where the feature store under test lives: a folder, then a prefix on the S3 server."""
    if request.param == "local":
        return Raw(tmp_path / FEATURES_DIRNAME)
    request.getfixturevalue("s3_server")
    from tests.s3_server import fresh_prefix

    return Raw(fresh_prefix(request.node.name) + "/" + FEATURES_DIRNAME)


# ---------------------------------------------------------------- round trips


def test_bf16_round_trip_is_bit_exact_for_every_bit_pattern(tmp_path):
    # All 65536 bf16 values: NaNs with every payload and sign, +-inf, -0, every subnormal.
    every = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).reshape(256, 256)
    assert torch.isnan(every).any() and torch.isinf(every).any()
    store = FeatureStore(tmp_path / FEATURES_DIRNAME)
    store.write(7, 0, every)
    back = store.read_layer(7, 0, verify=True)
    _assert_bit_exact(back, every)
    array = zarr.open_array(tmp_path / FEATURES_DIRNAME / "layer_7" / "seq_0", mode="r")
    assert array.dtype == np.uint16
    assert array.attrs["dtype"] == "bfloat16" and array.attrs["complete"] is True


def test_float32_round_trip_is_bit_exact(tmp_path):
    special = [float("nan"), float("inf"), -float("inf"), -0.0, 0.0, 1e-45, -1e-40, 3.4e38, 1.17549435e-38]
    as_numpy = np.array(special * 4, dtype=np.float32).reshape(6, 6)
    as_numpy.view(np.uint32)[0, 0] = 0x7FC01234  # a NaN with a payload
    store = FeatureStore(tmp_path / FEATURES_DIRNAME)
    store.write(0, 0, as_numpy)
    store.write(0, 1, torch.from_numpy(as_numpy.copy()))
    for seq in (0, 1):
        back = store.read_layer(0, seq, verify=True)
        assert back.dtype == torch.float32
        assert np.array_equal(back.numpy().view(np.uint32), as_numpy.view(np.uint32))


def test_unsupported_inputs_are_refused(raw):
    store = FeatureStore(raw.location)
    with pytest.raises(TypeError, match="float16 overflows"):
        store.write(0, 0, torch.zeros(2, 2, dtype=torch.float16))
    with pytest.raises(TypeError, match="numpy hidden states must be float32"):
        store.write(0, 0, np.zeros((2, 2), dtype=np.uint16))
    with pytest.raises(ValueError, match=r"\[T, H\]"):
        store.write(0, 0, torch.zeros(1, 2, 2))
    with pytest.raises(ValueError, match=r"\[T, H\]"):
        store.write(0, 0, torch.zeros(0, 2))
    with pytest.raises(ValueError, match="non-negative"):
        store.write(-2, 0, torch.zeros(2, 2))  # (-1 is TARGET_PROBS: the target's probabilities, not a layer)


def test_read_stacks_layers_in_the_requested_order(raw):
    store = FeatureStore(raw.location)
    stacked = torch.stack([hidden_for(layer, 3, 20, 8) for layer in (16, 1, 31)])
    store.write_layers([16, 1, 31], 3, stacked)
    _assert_bit_exact(store.read([1, 31], 3), torch.stack([hidden_for(1, 3, 20, 8), hidden_for(31, 3, 20, 8)]))
    store.write(5, 3, hidden_for(5, 3, 21, 8))
    with pytest.raises(ValueError, match="layer 5 is"):
        store.read([1, 5], 3)


def test_chunks_fit_the_data(tmp_path):
    assert _chunk_rows(1000, 100, 1 << 30) == 1000  # one chunk when it fits
    assert _chunk_rows(1000, 100, 40_000) == 334  # 3 chunks of 334 rows, not 400 + 400 + 200 stored as 3 x 400
    assert _chunk_rows(1, 10**9, 1) == 1
    store = FeatureStore(tmp_path / FEATURES_DIRNAME, max_chunk_bytes=40_000)
    store.write(0, 0, torch.zeros(1000, 50, dtype=torch.bfloat16))
    array = zarr.open_array(tmp_path / FEATURES_DIRNAME / "layer_0" / "seq_0", mode="r")
    assert array.chunks == (334, 50)
    chunk_files = [p for p in (tmp_path / FEATURES_DIRNAME / "layer_0" / "seq_0" / "c").rglob("*") if p.is_file()]
    assert len(chunk_files) == 3  # all-zero chunks are written too (write_empty_chunks)
    assert sum(p.stat().st_size for p in chunk_files) == 3 * 334 * 50 * 2


# ---------------------------------------------------------------- misses


def test_missing_array_raises_naming_layer_and_sequence(raw):
    store = FeatureStore(raw.location)
    with pytest.raises(FeatureMissing, match="layer 3, sequence 7: absent") as info:
        store.read([3], 7)
    assert (info.value.layer_id, info.value.seq_index) == (3, 7)
    store.write(3, 0, hidden_for(3, 0, 5, 4))
    with pytest.raises(FeatureMissing, match="layer 9, sequence 0: absent"):
        store.read([3, 9], 0)
    assert not store.has(3, 7) and store.has(3, 0)


def test_layer_level_reuse_extracts_only_new_layers(raw):
    store = FeatureStore(raw.location)
    for seq in range(3):
        store.write_layers([1, 16], seq, torch.stack([hidden_for(layer, seq, 10, 4) for layer in (1, 16)]))
    assert store.missing([1, 16], 3) == []
    assert store.missing([1, 16, 31], 3) == [(31, 0), (31, 1), (31, 2)]


def test_chunks_without_marker_read_as_incomplete_never_as_zeros(raw):
    store = FeatureStore(raw.location)
    store.write(2, 0, hidden_for(2, 0, 30, 4))
    # What a writer killed after its chunks but before its marker leaves (here: half the chunks).
    partial = zarr.open_group(raw.zarr_store(), mode="r+")["layer_2"].create_array(
        "seq_1", shape=(30, 4), chunks=(10, 4), dtype="uint16", compressors=None, fill_value=0,
        attributes={"complete": False, "dtype": "bfloat16"},
    )
    partial[:10] = hidden_for(2, 1, 30, 4)[:10].view(torch.int16).numpy().view(np.uint16)
    assert not store.has(2, 1)
    with pytest.raises(FeatureMissing, match="layer 2, sequence 1: incomplete"):
        store.read_layer(2, 1)
    assert store.missing([2], 2) == [(2, 1)]
    store.write(2, 1, hidden_for(2, 1, 30, 4))
    _assert_bit_exact(store.read_layer(2, 1), hidden_for(2, 1, 30, 4))


def test_multi_chunk_arrays_read_back_and_a_lost_chunk_is_an_error_not_zeros(raw):
    store = FeatureStore(raw.location, max_chunk_bytes=1000)
    hidden = hidden_for(0, 0, 97, 16)  # 32 B rows: 4 chunks of 25 rows, the last one padded
    store.write(0, 0, hidden)
    _assert_bit_exact(store.read_layer(0, 0), hidden)
    # a chunk file lost after completion (a disk error, a careless cleanup): zarr would read zeros
    raw.delete("layer_0/seq_0/c/2/0")
    with pytest.raises(FeatureMissing, match="layer 0, sequence 0: chunk 2 is missing"):
        store.read_layer(0, 0)


def test_arrays_in_other_zarr_layouts_are_read_through_zarr(raw):
    # e.g. compressed by another tool: not the layout `write` produces, still a complete array
    hidden = hidden_for(1, 0, 40, 8)
    group = zarr.open_group(raw.zarr_store(), mode="w").create_group("layer_1")
    array = group.create_array("seq_0", shape=(40, 8), chunks=(16, 8), dtype="uint16", fill_value=0,
                               compressors=zarr.codecs.BloscCodec(cname="lz4"))
    array[...] = hidden.view(torch.int16).numpy().view(np.uint16)
    array.update_attributes({"complete": True, "format": 1, "dtype": "bfloat16", "shape": [40, 8]})
    _assert_bit_exact(FeatureStore(raw.location).read_layer(1, 0), hidden)


def test_rewrite_replaces_shape_and_verify_catches_corruption(raw):
    store = FeatureStore(raw.location)
    store.write(0, 0, hidden_for(0, 0, 40, 4))
    store.write(0, 0, hidden_for(0, 99, 12, 4))
    _assert_bit_exact(store.read_layer(0, 0), hidden_for(0, 99, 12, 4))
    (chunk,) = raw.keys("layer_0/seq_0/c/")
    data = bytearray(raw.read(chunk))
    data[5] ^= 0x01
    raw.write(chunk, bytes(data))
    with pytest.raises(FeatureMissing, match="corrupt"):
        store.read_layer(0, 0, verify=True)


# ---------------------------------------------------------------- processes


def _zarr_json(layer, seq):
    return f"layer_{layer}/seq_{seq}/zarr.json"


def _has_chunks_without_marker(raw, layer, seq) -> bool:
    try:
        marker = json.loads(raw.read(_zarr_json(layer, seq)))["attributes"]
        has_chunks = bool(raw.keys(f"layer_{layer}/seq_{seq}/c/"))
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    return has_chunks and marker.get("complete") is not True


@pytest.mark.slow  # starts processes or waits on purpose
def test_killed_writer_leaves_nothing_complete_and_rerun_fills_only_the_missing(raw):
    path = raw.location
    layers, n_sequences, width, rows = [0, 4], 12, 256, 1024
    # Small chunks: each array takes many chunk writes, so the kill lands inside one.
    writer = SPAWN.Process(
        target=storage_workers.write_sequences, args=(path, layers, range(n_sequences), width, 8 * 1024, None, rows)
    )
    writer.start()
    store = FeatureStore(path)
    caught_mid_array = False
    deadline = time.monotonic() + 120
    try:
        while not store.has(4, 2) and writer.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        while writer.is_alive() and time.monotonic() < deadline:
            if any(_has_chunks_without_marker(raw, layer, seq) for seq in range(3, n_sequences) for layer in layers):
                caught_mid_array = True
                break
        os.kill(writer.pid, signal.SIGKILL)
    finally:
        writer.join(timeout=30)
    print(f"writer killed mid-array: {caught_mid_array}")

    everything = [(layer, seq) for layer in layers for seq in range(n_sequences)]
    complete = [pair for pair in everything if store.has(*pair)]
    missing = store.missing(layers, n_sequences)
    assert sorted(complete + missing) == sorted(everything)
    assert missing, "the writer finished before it was killed: nothing tested"
    for layer, seq in complete:  # everything that claims completeness is exact
        _assert_bit_exact(store.read_layer(layer, seq, verify=True), hidden_for(layer, seq, rows, width))
    for layer, seq in missing:
        with pytest.raises(FeatureMissing, match=f"layer {layer}, sequence {seq}: (absent|incomplete)"):
            store.read_layer(layer, seq)

    # Rerun: only the missing arrays are written; complete ones keep their files untouched.
    before = {pair: raw.identity(_zarr_json(*pair)) for pair in complete}
    for layer, seq in missing:
        store.write(layer, seq, hidden_for(layer, seq, rows, width))
    for pair, identity in before.items():
        assert raw.identity(_zarr_json(*pair)) == identity
    assert store.missing(layers, n_sequences) == []
    for layer, seq in everything:
        _assert_bit_exact(store.read_layer(layer, seq, verify=True), hidden_for(layer, seq, rows, width))


@pytest.mark.slow  # starts processes or waits on purpose
def test_two_processes_write_different_sequences_at_once(raw):
    path = raw.location
    layers, n_sequences, width = [2, 5, 9], 16, 64
    barrier = SPAWN.Barrier(2)
    # Both start on an empty directory at the same moment: they race to create the root and layer groups too.
    writers = [
        SPAWN.Process(
            target=storage_workers.write_sequences,
            args=(path, layers, range(parity, n_sequences, 2), width, 2048, barrier),
        )
        for parity in (0, 1)
    ]
    for w in writers:
        w.start()
    for w in writers:
        w.join(timeout=180)
    assert [w.exitcode for w in writers] == [0, 0]
    store = FeatureStore(path)
    assert store.missing(layers, n_sequences) == []
    for seq in range(n_sequences):
        expected = torch.stack([hidden_for(layer, seq, rows_for(seq), width) for layer in layers])
        _assert_bit_exact(store.read(layers, seq, verify=True), expected)


def test_arrays_lists_every_array_folder_complete_or_not(raw):
    store = FeatureStore(raw.location)
    store.write(1, 0, hidden_for(1, 0, 5, 4))
    store.write(12, 3, hidden_for(12, 3, 5, 4))
    store._clear_marker("layer_12/seq_3")
    assert store.arrays() == [(1, 0), (12, 3)] and store.missing([1, 12], 1) == [(12, 0)]
