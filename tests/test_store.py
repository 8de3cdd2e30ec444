import json
import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest

from dflash_eval.storage import (
    CorruptEntryWarning,
    EntryMissing,
    LockTimeout,
    Store,
    default_root,
    key_of,
    read_json,
    write_json_atomic,
)
from tests import storage_workers

KEY = key_of({"test": "entry"})
OTHER_KEY = key_of({"test": "other"})
SPAWN = multiprocessing.get_context("spawn")


def _wait_for(path: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.01)


# ---------------------------------------------------------------- layout and records


def test_layout(tmp_path):
    store = Store(tmp_path)
    assert store.entry("features", KEY) == tmp_path / "features" / KEY[:2] / KEY
    directory = store.begin("features", KEY)
    (directory / "features.zarr").mkdir()
    store.commit("features", KEY, {"layers": [1, 16]})
    marker = json.loads((directory / "entry.json").read_text())
    assert marker["record"] == {"layers": [1, 16]}
    assert (marker["format"], marker["stage"], marker["key"]) == (1, "features", KEY)
    assert store.keys("features") == [KEY]
    assert store.keys("scores") == []


def test_committed_at_is_when_the_entry_was_committed(tmp_path):
    from datetime import datetime, timezone

    store = Store(tmp_path)
    with pytest.raises(EntryMissing):
        store.committed_at("scores", KEY)
    store.begin("scores", KEY)
    before = datetime.now(timezone.utc)
    store.commit("scores", KEY, {})
    after = datetime.now(timezone.utc)
    assert before <= store.committed_at("scores", KEY) <= after  # microseconds: not truncated to before the commit
    marker = store.entry("scores", KEY) / "entry.json"
    write_json_atomic(marker, {**json.loads(marker.read_text()), "committed_at": "2025-01-01T00:00:00"})
    assert store.committed_at("scores", KEY) == datetime(2025, 1, 1, tzinfo=timezone.utc)  # naive reads as UTC
    write_json_atomic(marker, {**json.loads(marker.read_text()), "committed_at": "yesterday"})
    assert store.committed_at("scores", KEY) is None


def test_default_root(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_STORE", str(tmp_path / "shared"))
    assert Store().root == tmp_path / "shared"
    monkeypatch.delenv("DFLASH_STORE")
    assert default_root() == Path(".dflash-store")


@pytest.mark.parametrize(
    "stage, key", [("../etc", KEY), ("Features", KEY), ("scores", "abc"), ("scores", "../" + KEY[3:])]
)
def test_stage_and_key_are_validated(tmp_path, stage, key):
    with pytest.raises(ValueError):
        Store(tmp_path).entry(stage, key)


def test_miss_is_named(tmp_path):
    store = Store(tmp_path)
    with pytest.raises(EntryMissing, match="absent") as info:
        store.read_record("drafts", KEY)
    assert (info.value.stage, info.value.key) == ("drafts", KEY)
    store.begin("drafts", KEY)
    with pytest.raises(EntryMissing, match="incomplete"):
        store.read_record("drafts", KEY)
    assert not store.is_complete("drafts", KEY)


def test_commit_round_trip_and_begin_clears_marker(tmp_path):
    store = Store(tmp_path)
    directory = store.begin("references", KEY)
    write_json_atomic(directory / "references.json", {"ids": [[1, 2, 3]]})
    store.commit("references", KEY, {"n": 1})
    assert store.is_complete("references", KEY)
    assert store.read_record("references", KEY) == {"n": 1}

    # begin on a complete entry: incomplete again until commit, the files stay for a resume.
    assert store.begin("references", KEY) == directory
    assert not store.is_complete("references", KEY)
    assert read_json(directory / "references.json") == {"ids": [[1, 2, 3]]}


def test_commit_needs_begin_and_a_dict(tmp_path):
    store = Store(tmp_path)
    with pytest.raises(FileNotFoundError, match="not begun"):
        store.commit("scores", KEY, {})
    store.begin("scores", KEY)
    with pytest.raises(TypeError, match="dict"):
        store.commit("scores", KEY, [1, 2])


def test_remove(tmp_path):
    store = Store(tmp_path)
    store.begin("scores", KEY)
    store.commit("scores", KEY, {"tau": 3.5})
    store.remove("scores", KEY)
    assert not store.entry("scores", KEY).exists()
    with pytest.raises(EntryMissing, match="absent"):
        store.read_record("scores", KEY)
    store.remove("scores", KEY)  # removing a missing entry is fine


@pytest.mark.parametrize(
    "content",
    [
        b'{"format": 1, "stage": "scores", "key": "',  # truncated
        b"\xff\xfe not utf-8",
        b"[1, 2]",
        b'{"format": 1, "stage": "scores", "key": "' + OTHER_KEY.encode() + b'", "record": {}}',  # someone else's
        b'{"format": 99, "stage": "scores", "key": "' + KEY.encode() + b'", "record": {}}',
    ],
)
def test_corrupt_marker_is_a_miss_with_warning(tmp_path, content):
    store = Store(tmp_path)
    directory = store.begin("scores", KEY)
    (directory / "scores.json").write_text("{}")
    (directory / "entry.json").write_bytes(content)
    with pytest.warns(CorruptEntryWarning, match="corrupt"):
        assert not store.is_complete("scores", KEY)
    assert not (directory / "entry.json").exists()
    with pytest.raises(EntryMissing, match="incomplete"):
        store.read_record("scores", KEY)
    # The next run recomputes it.
    assert store.get_or_compute("scores", KEY, lambda d: {"tau": 2.0}) == {"tau": 2.0}


def test_records_are_atomic_and_strict(tmp_path):
    path = tmp_path / "deep" / "scores.json"
    write_json_atomic(path, {"tau": 3.25, "hist": [1, 2]})
    assert read_json(path) == {"tau": 3.25, "hist": [1, 2]}
    with pytest.raises(ValueError):
        write_json_atomic(path, {"tau": float("nan")})
    assert read_json(path) == {"tau": 3.25, "hist": [1, 2]}  # old content intact
    assert sorted(p.name for p in path.parent.iterdir()) == ["scores.json"]  # no temp files left


# ---------------------------------------------------------------- get_or_compute


def test_get_or_compute_runs_only_on_a_miss(tmp_path):
    store = Store(tmp_path)
    calls = []

    def compute(directory):
        calls.append(directory)
        write_json_atomic(directory / "drafts.json", {"blocks": 4})
        return {"blocks": 4}

    assert store.get_or_compute("drafts", KEY, compute) == {"blocks": 4}
    assert store.get_or_compute("drafts", KEY, compute) == {"blocks": 4}
    assert calls == [store.entry("drafts", KEY)]


def test_failed_compute_commits_nothing_and_keeps_partial_files(tmp_path):
    store = Store(tmp_path)

    def crash(directory):
        (directory / "partial.bin").write_bytes(b"half")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        store.get_or_compute("features", KEY, crash)
    assert not store.is_complete("features", KEY)
    assert (store.entry("features", KEY) / "partial.bin").exists()
    # The lock was released: a second attempt does not block.
    assert store.get_or_compute("features", KEY, lambda d: {"ok": True}, timeout=5) == {"ok": True}


# ---------------------------------------------------------------- locking across processes


def test_second_process_waits_then_reads_the_committed_entry(tmp_path):
    store = Store(tmp_path)
    started = tmp_path / "started"
    computing = SPAWN.Process(target=storage_workers.compute_slowly, args=(tmp_path, "drafts", KEY, started, 1.5))
    computing.start()
    try:
        _wait_for(started)

        def must_not_run(directory):
            raise AssertionError("the waiting process computed the entry itself")

        t0 = time.monotonic()
        record = store.get_or_compute("drafts", KEY, must_not_run, timeout=60)
        waited = time.monotonic() - t0
    finally:
        computing.join(timeout=60)
    assert computing.exitcode == 0
    assert record["pid"] == computing.pid
    assert waited > 0.5  # it really waited for the other process's commit
    assert json.loads((store.entry("drafts", KEY) / "payload.json").read_text()) == {"pid": computing.pid}


def test_lock_timeout_and_release_when_the_holder_is_killed(tmp_path):
    store = Store(tmp_path)
    ready = tmp_path / "locked"
    holder = SPAWN.Process(target=storage_workers.hold_lock, args=(tmp_path, "features", KEY, ready, 120))
    holder.start()
    try:
        _wait_for(ready)
        with pytest.raises(LockTimeout, match="another process holds it"):
            with store.lock("features", KEY, timeout=0.2):
                pass
        with store.lock("features", OTHER_KEY, timeout=0.2):  # other entries are not blocked
            pass
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.join(timeout=30)
    assert holder.exitcode == -signal.SIGKILL
    t0 = time.monotonic()
    with store.lock("features", KEY, timeout=10):
        pass
    assert time.monotonic() - t0 < 5
