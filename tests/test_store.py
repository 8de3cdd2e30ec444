import json
import multiprocessing
import os
import signal
import threading
import time
from contextlib import contextmanager
from datetime import UTC
from pathlib import Path

import pytest

from dflash_eval.storage import (
    CorruptEntryWarning,
    EntryMissing,
    LockTimeout,
    Outcome,
    Store,
    default_root,
    key_of,
    read_json,
    write_json_atomic,
)
from dflash_eval.storage.integrity import entry_label, upstream_digests
from dflash_eval.storage.store import ABSENT, DAMAGED, LACKING, REFRESH, STALE
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


@contextmanager
def worker_started(worker, store: Store, folder: Path, stage: str, key: str, seconds: float, kill: bool = False):
    """A spawned process running `worker(store location, stage, key, marker, seconds)`, yielded once it has
    written its marker file in `folder` (it computes or holds the lock from then on); joined on exit, after a
    SIGKILL if `kill`."""
    marker = folder / "marker"
    process = SPAWN.Process(target=worker, args=(store.location, stage, key, marker, seconds))
    process.start()
    try:
        _wait_for(marker)
        yield process
    finally:
        if kill:
            os.kill(process.pid, signal.SIGKILL)
        process.join(timeout=60)


def elsewhere(store: Store, tmp_path: Path) -> Store:
    """The same store as another machine sees it: on object storage, with a copy of its own."""
    return Store(store.location, cache=tmp_path / "elsewhere") if store.remote else store


def overwrite(store: Store, stage: str, key: str, name: str, data: bytes) -> None:
    """Change a file of the entry where the store keeps its truth (the bucket, or the folder)."""
    if store.remote:
        store.remote.put(f"{stage}/{key[:2]}/{key}/{name}", data)
    else:
        (store.entry(stage, key) / name).write_bytes(data)


def stored_files(store: Store, stage: str, key: str) -> list[str]:
    """The names of the entry's files where the store keeps its truth."""
    if store.remote:
        prefix = f"{stage}/{key[:2]}/{key}/"
        return sorted(m["path"].removeprefix(prefix) for m in store.remote.objects(prefix))
    return sorted(p.name for p in store.entry(stage, key).iterdir())


def committed(store: Store, stage: str, key: str) -> bool:
    """Whether the entry's marker is there (unchecked)."""
    return (stage, key, True) in store.entries()


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
    from datetime import datetime

    store = Store(tmp_path)
    with pytest.raises(EntryMissing):
        store.committed_at("scores", KEY)
    store.begin("scores", KEY)
    before = datetime.now(UTC)
    store.commit("scores", KEY, {})
    after = datetime.now(UTC)
    assert before <= store.committed_at("scores", KEY) <= after  # microseconds: not truncated to before the commit
    marker = store.entry("scores", KEY) / "entry.json"
    write_json_atomic(marker, {**json.loads(marker.read_text()), "committed_at": "2025-01-01T00:00:00"})
    assert store.committed_at("scores", KEY) == datetime(2025, 1, 1, tzinfo=UTC)  # naive reads as UTC
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


def test_miss_is_named(any_store):
    store = any_store
    with pytest.raises(EntryMissing, match="absent") as info:
        store.read_record("drafts", KEY)
    assert (info.value.stage, info.value.key) == ("drafts", KEY)
    store.begin("drafts", KEY)
    with pytest.raises(EntryMissing, match="incomplete"):
        store.read_record("drafts", KEY)
    assert not store.is_complete("drafts", KEY)


def test_commit_round_trip_and_begin_clears_marker(any_store):
    store = any_store
    directory = store.begin("references", KEY)
    write_json_atomic(directory / "references.json", {"ids": [[1, 2, 3]]})
    store.commit("references", KEY, {"n": 1})
    assert store.is_complete("references", KEY)
    assert store.read_record("references", KEY) == {"n": 1}

    # begin on a complete entry: incomplete again until commit, the files stay for a resume.
    assert store.begin("references", KEY) == directory
    assert not store.is_complete("references", KEY)
    assert read_json(directory / "references.json") == {"ids": [[1, 2, 3]]}


def test_commit_needs_begin_and_a_dict(any_store):
    store = any_store
    with pytest.raises(FileNotFoundError, match="not begun"):
        store.commit("scores", KEY, {})
    store.begin("scores", KEY)
    with pytest.raises(TypeError, match="dict"):
        store.commit("scores", KEY, [1, 2])


def test_remove(any_store):
    store = any_store
    store.begin("scores", KEY)
    store.commit("scores", KEY, {"tau": 3.5})
    store.remove("scores", KEY)
    assert not store.entry("scores", KEY).exists() and not store.entries()
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
def test_corrupt_marker_is_a_miss_with_warning(any_store, content):
    store = any_store
    store.begin("scores", KEY)
    overwrite(store, "scores", KEY, "scores.json", b"{}")
    overwrite(store, "scores", KEY, "entry.json", content)
    with pytest.warns(CorruptEntryWarning, match="corrupt"):
        assert not store.is_complete("scores", KEY)
    assert not committed(store, "scores", KEY)
    with pytest.raises(EntryMissing, match="incomplete"):
        store.read_record("scores", KEY)
    # The next run recomputes it.
    assert store.get_or_compute("scores", KEY, lambda d: {"tau": 2.0}).record == {"tau": 2.0}


def test_records_are_atomic_and_strict(tmp_path):
    path = tmp_path / "deep" / "scores.json"
    write_json_atomic(path, {"tau": 3.25, "hist": [1, 2]})
    assert read_json(path) == {"tau": 3.25, "hist": [1, 2]}
    with pytest.raises(ValueError):
        write_json_atomic(path, {"tau": float("nan")})
    assert read_json(path) == {"tau": 3.25, "hist": [1, 2]}  # old content intact
    assert sorted(p.name for p in path.parent.iterdir()) == ["scores.json"]  # no temp files left


# ---------------------------------------------------------------- get_or_compute: the one path every stage takes


def _write(value):
    """A compute that writes out.json holding `value` and returns it as the record."""
    def compute(directory):
        write_json_atomic(directory / "out.json", {"value": value})
        return {"value": value}
    return compute


def test_get_or_compute_runs_only_on_a_miss_and_names_it(any_store):
    store = any_store
    calls = []

    def compute(directory):
        calls.append(directory)
        write_json_atomic(directory / "drafts.json", {"blocks": 4})
        return {"blocks": 4}

    first = store.get_or_compute("drafts", KEY, compute)
    assert first.record == {"blocks": 4} and first.computed
    assert (first.miss.kind, first.miss.reason, first.miss.entry) == (ABSENT, "absent", None)
    assert first.content == store.content("drafts", KEY) is not None
    again = store.get_or_compute("drafts", KEY, compute)
    assert again == Outcome({"blocks": 4}, first.content) and not again.computed
    assert calls == [store.entry("drafts", KEY)]


def test_on_miss_is_told_why_before_anything_is_removed_or_computed(any_store):
    store = any_store
    store.get_or_compute("scores", KEY, _write(1))
    seen = []

    def on_miss(miss):
        seen.append((miss.kind, (store.entry("scores", KEY) / "out.json").exists()))  # the old file still there

    def compute(directory):
        seen.append("computed")
        return _write(2)(directory)

    store.get_or_compute("scores", KEY, compute, refresh=True, on_miss=on_miss)
    assert seen == [(REFRESH, True), "computed"]
    store.get_or_compute("scores", KEY, compute, on_miss=on_miss)  # a hit: not called
    assert len(seen) == 2


def test_refresh_removes_the_entry_whole_and_recomputes_it(any_store):
    store = any_store
    old = store.get_or_compute("scores", KEY, _write(1))
    (store.entry("scores", KEY) / "extra.bin").write_bytes(b"of the old entry")
    store.commit("scores", KEY, {"value": 1})  # extra.bin is part of the committed entry now
    committed = store.read_entry("scores", KEY)
    refreshed = store.get_or_compute("scores", KEY, _write(1), refresh=True)
    assert refreshed.computed and refreshed.miss.kind == REFRESH and refreshed.miss.entry == committed
    assert not (store.entry("scores", KEY) / "extra.bin").exists()  # nothing of the old entry kept
    assert refreshed.content == old.content != committed.content  # reproduced out.json, without extra.bin
    # a refresh of an entry never committed removes what an interrupted run left
    (store.begin("drafts", KEY) / "partial.bin").write_bytes(b"half")
    fresh = store.get_or_compute("drafts", KEY, _write(3), refresh=True)
    assert fresh.miss.kind == REFRESH and fresh.miss.entry is None
    assert stored_files(store, "drafts", KEY) == ["entry.json", "out.json"]


def test_an_entry_built_on_changed_content_is_removed_whole_and_recomputed_with_the_miss_named(any_store):
    store = any_store
    label = entry_label("drafts", KEY)
    upstream = lambda: upstream_digests(store, [label])  # noqa: E731
    store.get_or_compute("drafts", KEY, _write(1))
    built = store.get_or_compute("scores", OTHER_KEY, _write("a"), upstream=upstream)
    assert built.computed and store.read_entry("scores", OTHER_KEY).upstream == {label: store.content("drafts", KEY)}
    assert not store.get_or_compute("scores", OTHER_KEY, _write("b"), upstream=upstream).computed

    store.get_or_compute("drafts", KEY, _write(1), refresh=True)  # the same content: still fresh
    assert store.get_or_compute("scores", OTHER_KEY, _write("b"), upstream=upstream).record == {"value": "a"}

    store.get_or_compute("drafts", KEY, _write(2), refresh=True)  # another content: stale
    (store.entry("scores", OTHER_KEY) / "old.bin").write_bytes(b"of the stale entry")
    extended = []
    stale = store.get_or_compute("scores", OTHER_KEY, _write("c"), upstream=upstream,
                                 holds=lambda entry: False, extend=lambda d, kept: extended.append(kept))
    assert stale.record == {"value": "c"} and not extended  # recomputed, never extended
    assert (stale.miss.kind, stale.miss.stale) == (STALE, (label,))
    assert stale.miss.reason == f"built on {label}, whose content has changed since"
    assert stale.miss.entry.record == {"value": "a"}
    assert not (store.entry("scores", OTHER_KEY) / "old.bin").exists()
    assert store.read_entry("scores", OTHER_KEY).upstream == {label: store.content("drafts", KEY)}
    assert not store.get_or_compute("scores", OTHER_KEY, _write("d"), upstream=upstream).computed


def test_a_damaged_entry_is_recomputed_with_what_was_damaged_named(any_store, tmp_path):
    store = any_store
    store.get_or_compute("scores", KEY, _write(1))
    overwrite(store, "scores", KEY, "out.json", b'{"value": 9}')  # same size, another content
    overwrite(store, "scores", KEY, "kept.bin", b"resumable")
    reader = elsewhere(store, tmp_path)  # on object storage: a machine without its own good copy
    with pytest.warns(CorruptEntryWarning, match="out.json"):
        outcome = reader.get_or_compute("scores", KEY, _write(1))
    assert outcome.miss.kind == DAMAGED and outcome.record == {"value": 1}
    assert outcome.miss.reason.startswith("damaged, removed (out.json: sha256 differs")
    assert "kept.bin" in stored_files(store, "scores", KEY)  # undamaged files stay: a stage may resume
    assert store.read_record("scores", KEY) == {"value": 1}


def test_a_fresh_entry_that_lacks_what_is_asked_is_extended_in_place(any_store):
    store = any_store
    entry = store.entry("features", KEY)

    def layers(*ids):
        def compute(directory, kept=None):
            held = kept.record["layers"] if kept is not None else []
            for i in ids:
                if not (directory / f"layer_{i}").exists():
                    (directory / f"layer_{i}").write_text(str(i))
            return {"layers": sorted(set(held) | set(ids))}
        return compute

    def holds(*ids):
        return lambda entry_found: all((entry / f"layer_{i}").exists() for i in ids)

    first = store.get_or_compute("features", KEY, layers(1), holds=holds(1), extend=layers(1))
    assert first.miss.kind == ABSENT
    one = (entry / "layer_1").stat().st_mtime_ns
    more = store.get_or_compute("features", KEY, layers(2), holds=holds(2), extend=layers(2))
    assert more.record == {"layers": [1, 2]}  # the kept entry's layers and the new ones
    assert (more.miss.kind, more.miss.entry.record) == (LACKING, {"layers": [1]})
    assert (entry / "layer_1").stat().st_mtime_ns == one  # extended, not removed
    assert not store.get_or_compute("features", KEY, layers(1, 2), holds=holds(1, 2), extend=layers(1, 2)).computed
    with pytest.raises(TypeError, match="together"):
        store.get_or_compute("features", KEY, layers(3), holds=holds(3))


def test_failed_compute_commits_nothing_and_keeps_partial_files_for_the_resume(any_store):
    store = any_store

    def crash(directory):
        (directory / "partial.bin").write_bytes(b"half")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError, match="killed"):
        store.get_or_compute("features", KEY, crash)
    assert not store.is_complete("features", KEY)
    assert (store.entry("features", KEY) / "partial.bin").exists()

    def resume(directory):
        assert (directory / "partial.bin").read_bytes() == b"half"  # what the killed run left
        return {"ok": True}

    # The lock was released: a second attempt does not block.
    resumed = store.get_or_compute("features", KEY, resume, timeout=5)
    assert resumed.record == {"ok": True}
    assert (resumed.miss.kind, resumed.miss.reason) == (ABSENT, "incomplete (no entry.json)")


def test_the_stage_tasks_log_each_miss_and_whether_a_refresh_reproduced_the_content(any_store, capsys):
    from dflash_eval.tasks.stage import get_or_compute

    store = any_store
    upstream = lambda: upstream_digests(store, [entry_label("drafts", KEY)])  # noqa: E731
    assert get_or_compute(store, "drafts", KEY, _write(1)).computed
    assert f"drafts/{KEY} is absent: computing it" in capsys.readouterr().err
    get_or_compute(store, "scores", OTHER_KEY, _write("a"), upstream=upstream)

    # a refresh that reproduces the content: what was built on it stays
    capsys.readouterr()
    assert get_or_compute(store, "drafts", KEY, _write(1), refresh=True).computed
    assert "reproduced its content digest" in capsys.readouterr().err
    assert not get_or_compute(store, "scores", OTHER_KEY, _write("b"), upstream=upstream).computed

    # one that changes it: what was built on it is recomputed, and both say so
    get_or_compute(store, "drafts", KEY, _write(2), refresh=True)
    assert f"refresh of drafts/{KEY} changed its content" in capsys.readouterr().err
    assert get_or_compute(store, "scores", OTHER_KEY, _write("c"), upstream=upstream).record == {"value": "c"}
    assert f"scores/{OTHER_KEY} is stale: built on drafts/{KEY}, whose content has changed since; recomputing it" \
        in capsys.readouterr().err

    # `compared`: what a refresh compares, read from the replaced entry before it is removed
    compared = []
    get_or_compute(store, "drafts", KEY, _write(2), refresh=True,
                   compared=lambda entry: compared.append(entry.record) or "same digest")
    assert compared == [{"value": 2}, {"value": 2}]
    assert f"refresh of drafts/{KEY} reproduced its content digest same digest" in capsys.readouterr().err


# ---------------------------------------------------------------- locking across processes


@pytest.mark.slow  # starts processes or waits on purpose
def test_second_process_waits_then_reads_the_committed_entry(any_store, tmp_path):
    store = any_store

    def must_not_run(directory):
        raise AssertionError("the waiting process computed the entry itself")

    with worker_started(storage_workers.compute_slowly, store, tmp_path, "drafts", KEY, 1.5) as computing:
        t0 = time.monotonic()
        outcome = store.get_or_compute("drafts", KEY, must_not_run, timeout=60)
        waited = time.monotonic() - t0
    assert computing.exitcode == 0
    assert outcome.record["pid"] == computing.pid and not outcome.computed
    assert waited > 0.5  # it really waited for the other process's commit
    assert json.loads((store.entry("drafts", KEY) / "payload.json").read_text()) == {"pid": computing.pid}


@pytest.mark.slow  # starts processes or waits on purpose
def test_processes_that_need_an_entry_at_once_compute_it_once(any_store, tmp_path):
    n = 4
    barrier, log = SPAWN.Barrier(n), tmp_path / "computed.log"
    results = [tmp_path / f"outcome_{i}.json" for i in range(n)]
    workers = [SPAWN.Process(target=storage_workers.compute_at_once,
                             args=(any_store.location, "drafts", KEY, barrier, log, results[i])) for i in range(n)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join(timeout=120)
    assert [w.exitcode for w in workers] == [0] * n
    (pid,) = log.read_text().split()  # one computation
    outcomes = [json.loads(r.read_text()) for r in results]
    assert all(o["record"] == {"pid": int(pid)} for o in outcomes)
    assert sorted(o["computed"] for o in outcomes) == [False] * (n - 1) + [True]


def test_the_lock_excludes_while_its_file_is_deleted_at_each_release(tmp_path):
    # Every release deletes `<key>.lock`, so waiters keep finding a file that is gone or replaced: a lost
    # update here means two holders at once. flock excludes between threads too (one open file each).
    store, counter = Store(tmp_path / "store"), tmp_path / "counter"
    counter.write_text("0")

    def add_ones():
        for _ in range(150):
            with store.lock("fetch", KEY):
                value = int(counter.read_text())
                counter.write_text(str(value + 1))

    threads = [threading.Thread(target=add_ones) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert int(counter.read_text()) == 6 * 150
    assert list((tmp_path / "store").rglob("*.lock")) == []  # nothing is left once no one holds it


@pytest.mark.slow  # starts processes or waits on purpose
def test_lock_timeout_and_release_when_the_holder_is_killed(any_store, tmp_path, monkeypatch):
    # on object storage a killed holder's lease expires: a short one here (the holder's is what counts)
    monkeypatch.setenv("DFLASH_LOCK_LEASE_SECONDS", "2")
    store = any_store
    with worker_started(storage_workers.hold_lock, store, tmp_path, "features", KEY, 120, kill=True) as holder:
        with pytest.raises(LockTimeout, match=f"another process holds it|is held by .*:{holder.pid}:"):
            with store.lock("features", KEY, timeout=0.2):
                pass
        with store.lock("features", OTHER_KEY, timeout=0.2):  # other entries are not blocked
            pass
        with pytest.raises(LockTimeout):
            store.get_or_compute("features", KEY, lambda d: {"computed": "without the lock"}, timeout=0.2)
        assert not committed(store, "features", KEY)
    assert holder.exitcode == -signal.SIGKILL
    t0 = time.monotonic()
    with store.lock("features", KEY, timeout=10):
        pass
    assert time.monotonic() - t0 < 5
