"""The store on object storage, beyond what the conformance tests (test_store.py, test_feature_store.py: every
test there runs on a local folder and on moto's S3 server) cover: store URLs, an unreachable server, lease
locks that expire and are taken over, and a second machine with its own copy."""

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from dflash_eval.flows.checks import store_problem
from dflash_eval.storage import CorruptEntryWarning, EntryMissing, Store, key_of, write_json_atomic
from dflash_eval.storage import store as store_module
from dflash_eval.storage.integrity import verify_store
from dflash_eval.storage.object_storage import LockLost, ObjectStorage, ObjectStorageError
from tests.ports import free_port

KEY = key_of({"test": "object storage"})


def _commit(store: Store, stage: str, files: dict[str, bytes], record: dict) -> Path:
    directory = store.begin(stage, KEY)
    for name, data in files.items():
        (directory / name).write_bytes(data)
    return store.commit(stage, KEY, record)


# ---------------------------------------------------------------- URLs


@pytest.mark.parametrize("location, message", [
    ("gs://evals/dflash", "gs:// is not supported; give a local folder or s3://BUCKET/PREFIX"),
    ("s3://", "names no bucket"),
    ("s3:///prefix", "names no bucket"),
])
def test_a_store_url_of_another_scheme_or_without_a_bucket_is_refused_never_made_a_folder(
        location, message, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=message):
        Store(location)
    assert message in store_problem(location)
    assert list(tmp_path.iterdir()) == []  # no folder named "gs:" or "s3:" (what a path would have made)


def test_store_locations(tmp_path, monkeypatch):
    assert Store(f"file://{tmp_path}/store").root == tmp_path / "store"
    monkeypatch.setenv("DFLASH_STORE", "s3://evals/from-the-environment")
    assert Store().location == "s3://evals/from-the-environment"
    assert Store(tmp_path).location == str(tmp_path)
    monkeypatch.setenv("DFLASH_STORE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:1")
    store = Store("s3://evals/dflash/")
    assert store.location == "s3://evals/dflash" and repr(store) == "Store('s3://evals/dflash')"
    assert store.root.parent.parent == tmp_path / "cache" and store.root.name == "dflash"
    # another server with a bucket of the same name gets another copy
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:2")
    assert Store("s3://evals/dflash").root != store.root


def test_an_unreachable_server_is_one_clear_message(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nothing listens there
    monkeypatch.setenv("AWS_ALLOW_HTTP", "true")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    store = Store("s3://evals/dflash", cache=tmp_path / "cache")
    with pytest.raises(ObjectStorageError) as info:
        store.read_record("scores", KEY)
    message = str(info.value)
    assert "\n" not in message and "s3://evals/dflash at http://127.0.0.1:" in message
    assert "Check that the server is up (AWS_ENDPOINT_URL)" in message
    assert store_problem("s3://evals/dflash").startswith("--store: object storage s3://evals/dflash at ")


def test_a_missing_bucket_is_named(s3_server, tmp_path):
    assert "s3://no-such-bucket" in store_problem("s3://no-such-bucket/dflash")


# ---------------------------------------------------------------- locks


def test_a_lease_is_renewed_while_held_and_an_expired_one_is_taken_over(s3_url):
    holder, other = ObjectStorage(s3_url, lease_seconds=0.6), ObjectStorage(s3_url, lease_seconds=0.6)
    with holder.lease("entry.lock") as lease:
        time.sleep(1.5)  # past the lease: renewals keep it
        with pytest.raises(TimeoutError, match=r"entry.lock is held by .*:\d+:"):
            with other.lease("entry.lock", timeout=0.3):
                pass
        lease.check()
    with other.lease("entry.lock", timeout=0.3):  # released at the end of the block
        pass
    # a holder that stopped renewing (crashed, or cut off): its lease expires and is taken over
    holder.put("entry.lock", b'{"owner": "crashed:1:x", "expires": %f}' % (time.time() + 0.5))
    t0 = time.monotonic()
    with other.lease("entry.lock", timeout=10):
        assert 0.3 < time.monotonic() - t0 < 5
    assert holder.head("entry.lock") is None


def test_a_holder_whose_lease_was_taken_over_commits_nothing(s3_url, tmp_path, monkeypatch):
    slow = Store(s3_url, cache=tmp_path / "slow", lease_seconds=0.5)
    fast = Store(s3_url, cache=tmp_path / "fast", lease_seconds=0.5)
    monkeypatch.setattr(ObjectStorage, "_renew", lambda self, *args: None)  # the slow one stalls: no renewals
    started, taken_over, errors = threading.Event(), threading.Event(), []

    def stalled(directory):
        started.set()
        taken_over.wait(30)
        return {"by": "the stalled holder"}

    def run():
        try:
            slow.get_or_compute("drafts", KEY, stalled)
        except LockLost as e:
            errors.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    started.wait(30)
    assert fast.get_or_compute("drafts", KEY, lambda d: {"by": "the one that took over"}, timeout=10).computed
    taken_over.set()
    thread.join(30)
    assert len(errors) == 1 and "another process took it over: nothing was committed" in str(errors[0])
    assert fast.read_record("drafts", KEY) == {"by": "the one that took over"}


# ---------------------------------------------------------------- a second machine


def test_a_second_machine_copies_what_it_reads_checks_it_and_fetches_large_files_only_when_opened(
        s3_url, tmp_path, monkeypatch):
    monkeypatch.setattr(store_module, "VERIFY_ON_READ_BYTES", 100)
    first = Store(s3_url, cache=tmp_path / "first")
    weights, record = bytes(range(256)) * 4, b'{"n": 3}'
    _commit(first, "fetch", {"weights.bin": weights, "record.json": record}, {"n": 3})
    second = Store(s3_url, cache=tmp_path / "second")
    assert second.read_record("fetch", KEY) == {"n": 3}
    here = second.entry("fetch", KEY)
    assert (here / "record.json").read_bytes() == record  # small files are copied (and hashed) on every read
    assert not (here / "weights.bin").exists()  # a large one only sized on the server until it is opened
    assert (second.local_entry("fetch", KEY) / "weights.bin").read_bytes() == weights

    # its copy is a cache: a changed file in it is fetched again, never taken, never called damage
    (here / "record.json").write_bytes(b'{"n": 4}')
    (here / "weights.bin").write_bytes(b"\0" * len(weights))
    assert second.read_entry("fetch", KEY, full=True).record == {"n": 3}
    assert (here / "weights.bin").read_bytes() == weights and (here / "record.json").read_bytes() == record

    # damage in the bucket itself is found by a machine that copies the file, and removed
    first.remote.put(f"fetch/{KEY[:2]}/{KEY}/weights.bin", b"\1" * len(weights))
    third = Store(s3_url, cache=tmp_path / "third")
    assert third.is_complete("fetch", KEY)  # the large file is only sized here: the same size
    with pytest.warns(CorruptEntryWarning, match="weights.bin: sha256 differs"), \
            pytest.raises(EntryMissing, match="damaged, removed"):
        third.local_entry("fetch", KEY)  # opening it copies it, and the copy is hashed as it streams
    assert not first.is_complete("fetch", KEY)


def test_verify_finds_and_repairs_a_damaged_feature_array_in_the_bucket(s3_url, tmp_path):
    store = Store(s3_url, cache=tmp_path / "cache")
    features = store.feature_store(KEY)
    hidden = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    store.begin("features", KEY)
    for seq in range(2):
        features.write(3, seq, hidden + seq)
    store.commit("features", KEY, {"layer_ids": [3], "n": 2}, skip=("features.zarr",))
    assert verify_store(store).problems == []
    chunk = f"features/{KEY[:2]}/{KEY}/features.zarr/layer_3/seq_1/c/0/0"
    store.remote.put(chunk, b"\0" * 96)
    report = verify_store(store, repair=True)
    assert [(p.kind, p.what) for p in report.problems] == [("damaged array", "layer_3/seq_1")]
    assert features.missing([3], 2) == [(3, 1)] and not store.is_complete("features", KEY)
    assert store.entries() == [("features", KEY, False)]  # incomplete: the next run extracts that one array


def test_a_store_entry_written_by_one_machine_is_listed_and_removed_everywhere(s3_url, tmp_path):
    first, second = Store(s3_url, cache=tmp_path / "a"), Store(s3_url, cache=tmp_path / "b")
    directory = first.begin("scores", KEY)
    write_json_atomic(directory / "scores.json", {"tau": 3.0})
    first.commit("scores", KEY, {"tau": 3.0})
    assert second.keys("scores") == [KEY] and second.is_complete("scores", KEY)
    second.remove("scores", KEY)
    assert first.keys("scores") == [] and first.entries() == []


@pytest.mark.slow  # starts processes
def test_the_store_commands_say_in_one_line_when_the_store_cannot_be_used(tmp_path):
    dead = {**os.environ, "AWS_ENDPOINT_URL": f"http://127.0.0.1:{free_port()}", "AWS_ALLOW_HTTP": "true",
            "AWS_ACCESS_KEY_ID": "x", "AWS_SECRET_ACCESS_KEY": "y", "DFLASH_STORE_CACHE": str(tmp_path / "cache")}
    for command, store, expected in (
        (["verify"], "gs://evals/dflash", "error: --store: store 'gs://evals/dflash': gs:// is not supported"),
        (["report", "--out", "out"], "gs://evals/dflash", "error: --store: store 'gs://evals/dflash': gs:// is not supported"),
        (["history"], "s3://evals/dflash", "error: object storage s3://evals/dflash at http://127.0.0.1:"),
    ):
        done = subprocess.run([sys.executable, "-m", "dflash_eval.cli", *command, "--store", store], env=dead,
                              capture_output=True, text=True, timeout=120, cwd=tmp_path)
        assert done.returncode == 2 and done.stderr.startswith(expected), done.stderr
        assert len(done.stderr.strip().splitlines()) == 1, done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # nothing created (no "gs:" folder, no copy)
