import hashlib
import json
import multiprocessing
import os
import shutil

import pytest

from dflash_eval.storage import CHECKPOINT_PATTERNS, DigestCache, canonical_json, directory_digest, file_sha256, key_of
from tests import storage_workers

# ---------------------------------------------------------------- canonical JSON and keys


def test_key_is_pinned():
    # If this changes, every key in every store changes: only on purpose, with a migration.
    obj = {"b": [1, 2.5, None, True], "a": "é", "c": {"z": 0.1, "y": -0.0}}
    assert canonical_json(obj) == '{"a":"\\u00e9","b":[1,2.5,null,true],"c":{"y":-0.0,"z":0.1}}'
    assert key_of(obj) == "f45c5f2a4b81dc1df0c9d1df32b879b7554b0b7a744aaef3e2e4274ecfbd5496"


def test_key_ignores_dict_order_and_tuple_vs_list():
    assert key_of({"x": 1, "y": (1, 2)}) == key_of({"y": [1, 2], "x": 1})


def test_key_distinguishes_int_and_float():
    # Documented, not normalized: callers normalize values that may arrive as either.
    assert key_of({"t": 0}) != key_of({"t": 0.0})


def test_floats_are_shortest_round_trip():
    assert canonical_json([0.1, 1e-7, 1e22, 3.0]) == "[0.1,1e-07,1e+22,3.0]"


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), {"a": [1, float("-inf")]}])
def test_non_finite_floats_refused(bad):
    with pytest.raises(ValueError, match="finite"):
        key_of(bad)


def test_non_json_values_refused_with_location():
    with pytest.raises(TypeError, match=r"\$\.a\[1\]: PosixPath is not a JSON type"):
        key_of({"a": [1, __import__("pathlib").Path("/x")]})
    with pytest.raises(TypeError, match="dict keys must be str"):
        key_of({1: "a"})


# ---------------------------------------------------------------- file digests


@pytest.mark.parametrize("size", [0, 1, (1 << 20) - 1, 1 << 20, (1 << 20) + 1, 3 * (1 << 20) + 12345])
def test_streaming_digest_equals_whole_file_digest(tmp_path, size):
    path = tmp_path / "blob"
    path.write_bytes(os.urandom(size))
    assert file_sha256(path) == hashlib.sha256(path.read_bytes()).hexdigest()
    # A chunk size that does not divide the file: same digest.
    assert file_sha256(path, chunk_bytes=4097) == file_sha256(path)


def _checkpoint(directory):
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text('{"hidden_size": 8}')
    (directory / "model.safetensors").write_bytes(b"weights")
    (directory / "README.md").write_text("not part of the identity")
    return directory


def test_directory_digest_names_files_and_is_location_independent(tmp_path):
    a = _checkpoint(tmp_path / "a")
    digest = directory_digest(a)
    assert digest.files == {
        "config.json": hashlib.sha256(b'{"hidden_size": 8}').hexdigest(),
        "model.safetensors": hashlib.sha256(b"weights").hexdigest(),
    }
    # Pinned: the combined key of a known directory.
    assert digest.key == key_of({"files": digest.files})
    assert digest.key == "329910d91977434a37303d028a7feabf600d24050e4537b31134a93820c82cda"
    b = tmp_path / "elsewhere" / "b"
    shutil.copytree(a, b)
    assert directory_digest(b) == digest
    (b / "model.safetensors").write_bytes(b"weights, retrained")
    assert directory_digest(b).key != digest.key


def test_directory_digest_patterns_and_empty(tmp_path):
    a = _checkpoint(tmp_path / "a")
    (a / "sub").mkdir()
    (a / "sub" / "extra.json").write_text("{}")
    assert set(directory_digest(a, patterns=["*.md"]).files) == {"README.md"}
    assert "sub/extra.json" in directory_digest(a, patterns=["**/*.json"]).files
    assert "sub/extra.json" not in directory_digest(a).files
    with pytest.raises(FileNotFoundError, match="no files matching"):
        directory_digest(a, patterns=["*.bin"])
    with pytest.raises(FileNotFoundError, match="not a directory"):
        directory_digest(tmp_path / "nope")
    assert "*.safetensors" in CHECKPOINT_PATTERNS


# ---------------------------------------------------------------- digest cache


def test_digest_cache_hit_does_not_reread(tmp_path):
    path = tmp_path / "shard.safetensors"
    path.write_bytes(b"A" * 5000)
    original = hashlib.sha256(b"A" * 5000).hexdigest()
    cache_path = tmp_path / "store" / "file-digests.json"

    cache = DigestCache(cache_path)
    assert cache.sha256(path) == original
    assert cache.sha256(path) == original
    assert (cache.hits, cache.misses) == (1, 1)

    # Another process (a new instance) hits the persisted entry.
    assert DigestCache(cache_path).sha256(path) == original

    # Same size, same mtime, different bytes: a cache that re-read the file would notice.
    stat = os.stat(path)
    path.write_bytes(b"B" * 5000)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    unchanged_looking = DigestCache(cache_path)
    assert unchanged_looking.sha256(path) == original
    assert (unchanged_looking.hits, unchanged_looking.misses) == (1, 0)

    # A changed mtime re-hashes.
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    rehashed = DigestCache(cache_path)
    assert rehashed.sha256(path) == hashlib.sha256(b"B" * 5000).hexdigest()
    assert rehashed.misses == 1

    # A changed size re-hashes, even with the old mtime.
    stat = os.stat(path)
    path.write_bytes(b"C" * 4999)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert DigestCache(cache_path).sha256(path) == hashlib.sha256(b"C" * 4999).hexdigest()


def test_directory_digest_through_cache(tmp_path):
    a = _checkpoint(tmp_path / "a")
    cache_path = tmp_path / "file-digests.json"
    first = DigestCache(cache_path)
    digest = directory_digest(a, cache=first)
    second = DigestCache(cache_path)
    assert directory_digest(a, cache=second) == digest
    assert (first.misses, second.misses, second.hits) == (2, 0, 2)


def test_corrupt_digest_cache_is_ignored_with_warning(tmp_path):
    cache_path = tmp_path / "file-digests.json"
    cache_path.write_text('{"files": {')
    path = tmp_path / "f"
    path.write_bytes(b"x")
    with pytest.warns(UserWarning, match="corrupt digest cache"):
        cache = DigestCache(cache_path)
    assert cache.sha256(path) == hashlib.sha256(b"x").hexdigest()
    assert json.loads(cache_path.read_text())["files"]  # rewritten valid


def test_digest_cache_forgets_deleted_files(tmp_path):
    cache_path = tmp_path / "file-digests.json"
    gone, kept = tmp_path / "gone", tmp_path / "kept"
    gone.write_bytes(b"1")
    kept.write_bytes(b"2")
    DigestCache(cache_path).sha256(gone)
    gone.unlink()
    DigestCache(cache_path).sha256(kept)
    assert list(json.loads(cache_path.read_text())["files"]) == [str(kept.resolve())]


@pytest.mark.slow  # starts processes or waits on purpose
def test_concurrent_cache_writers_lose_nothing(tmp_path):
    cache_path = tmp_path / "file-digests.json"
    groups = []
    for g in range(2):
        files = []
        for i in range(25):
            path = tmp_path / f"g{g}_{i}"
            path.write_bytes(f"{g}-{i}".encode())
            files.append(str(path))
        groups.append(files)
    context = multiprocessing.get_context("spawn")
    workers = [
        context.Process(target=storage_workers.hash_through_cache, args=(cache_path, files, 1)) for files in groups
    ]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=120)
        assert w.exitcode == 0
    entries = json.loads(cache_path.read_text())["files"]
    assert len(entries) == 50
    for files in groups:
        for name in files:
            assert entries[str(os.path.realpath(name))]["sha256"] == hashlib.sha256(open(name, "rb").read()).hexdigest()
    assert not list(tmp_path.glob("*.partial"))
