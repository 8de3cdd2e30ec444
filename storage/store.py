"""The content-addressed store: one directory per (stage, key), complete when `entry.json` exists.

On-disk layout (root = `Store(root)`, default `$DFLASH_STORE`, else `./.dflash-store`)::

    <root>/
      file-digests.json              DigestCache: (abs path, size, mtime_ns) -> sha256
      file-digests.json.lock         flock serializing updates of the digest cache
      <stage>/                       fetch, references, features, drafts, scores, ...
        <key[:2]>/                   two-level fan-out, as git and DVC do (no huge directories)
          <key>.lock                 flock: one process computes an entry, others wait
          <key>/                     the entry: the stage's own files, e.g. features.zarr/,
            ...                      references.json, scores.json
            entry.json               the record, written LAST (atomically): the completion marker

`entry.json` holds `{"format": 1, "stage", "key", "committed_at", "record"}`; only
`record` is the stage's. An entry without `entry.json` is incomplete: its files may
be partial (a killed writer) and are kept only so that a rerun can resume (the
feature store resumes per array). A corrupt `entry.json` is warned about, removed
and treated as a miss.

Keys are sha256 hex digests (see `hashing.key_of`); stage names are lowercase
identifiers. Both are validated, so no argument can escape the root.
"""

import errno
import fcntl
import json
import os
import re
import shutil
import time
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .hashing import DigestCache
from .records import write_json_atomic

STORE_ENV = "DFLASH_STORE"
DEFAULT_ROOT = ".dflash-store"
MARKER_NAME = "entry.json"
MARKER_FORMAT = 1

_STAGE_RE = re.compile(r"[a-z][a-z0-9_-]*")
_KEY_RE = re.compile(r"[0-9a-f]{64}")


class EntryMissing(LookupError):
    """A store entry is absent or incomplete (no valid `entry.json`): the stage must run."""

    def __init__(self, stage: str, key: str, reason: str):
        super().__init__(f"{stage}/{key}: {reason}")
        self.stage = stage
        self.key = key
        self.reason = reason


class CorruptEntryWarning(UserWarning):
    """An `entry.json` could not be read as a record; it was removed and the entry counts as a miss."""


class LockTimeout(TimeoutError):
    """`Store.lock` waited longer than its timeout."""


def default_root() -> Path:
    """The store root: `$DFLASH_STORE` if set, else `./.dflash-store`."""
    return Path(os.environ.get(STORE_ENV) or DEFAULT_ROOT)


def _check_stage(stage: str) -> None:
    if not isinstance(stage, str) or not _STAGE_RE.fullmatch(stage):
        raise ValueError(f"stage must be a lowercase identifier like 'features', got {stage!r}")


def _check_stage_key(stage: str, key: str) -> None:
    _check_stage(stage)
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
        raise ValueError(f"key must be a 64-character lowercase sha256 hex digest (hashing.key_of), got {key!r}")


class Store:
    """A local content-addressed store of stage outputs (layout in the module docstring)."""

    def __init__(self, root: str | os.PathLike | None = None):
        self.root = Path(root) if root is not None else default_root()

    def __repr__(self) -> str:
        return f"Store({str(self.root)!r})"

    # ------------------------------------------------------------ paths

    def entry(self, stage: str, key: str) -> Path:
        """The directory of entry (stage, key); it may not exist."""
        _check_stage_key(stage, key)
        return self.root / stage / key[:2] / key

    def _marker(self, stage: str, key: str) -> Path:
        return self.entry(stage, key) / MARKER_NAME

    def digest_cache(self) -> DigestCache:
        """The store's file-digest cache (`<root>/file-digests.json`)."""
        return DigestCache(self.root / "file-digests.json")

    # ------------------------------------------------------------ reading

    def read_record(self, stage: str, key: str) -> dict[str, Any]:
        """The record committed for (stage, key).

        Raises `EntryMissing` when the entry is absent or incomplete. A corrupt
        `entry.json` (not JSON, wrong shape, another entry's stage/key) is warned about
        (`CorruptEntryWarning`), removed, and also raises `EntryMissing`.
        """
        marker = self._marker(stage, key)
        try:
            with open(marker, "rb") as f:
                identity = os.fstat(f.fileno()).st_ino
                raw = f.read()
        except FileNotFoundError:
            reason = "incomplete (no entry.json)" if marker.parent.is_dir() else "absent"
            raise EntryMissing(stage, key, reason) from None
        problem, record = _parse_marker(raw, stage, key)
        if problem is None:
            return record
        warnings.warn(
            f"removing corrupt {marker}: {problem}; treating the entry as a miss", CorruptEntryWarning, stacklevel=2
        )
        _unlink_if_same_file(marker, identity)
        raise EntryMissing(stage, key, f"corrupt entry.json removed ({problem})")

    def committed_at(self, stage: str, key: str) -> datetime | None:
        """When (stage, key) was committed (entry.json's `committed_at`, UTC), None if the marker holds no
        readable time (written by hand); raises `EntryMissing` as `read_record` does. A recomputed entry
        (refresh) has the time of its last commit."""
        self.read_record(stage, key)  # a missing or corrupt marker is handled there
        try:
            committed = json.loads(self._marker(stage, key).read_bytes()).get("committed_at")
        except FileNotFoundError:  # removed since
            raise EntryMissing(stage, key, "absent") from None
        try:
            when = datetime.fromisoformat(committed)
        except (TypeError, ValueError):
            return None
        return when if when.tzinfo else when.replace(tzinfo=timezone.utc)  # comparable with every other time

    def is_complete(self, stage: str, key: str) -> bool:
        """Whether (stage, key) has a valid `entry.json` (a corrupt one is removed, with a warning)."""
        try:
            self.read_record(stage, key)
        except EntryMissing:
            return False
        return True

    def keys(self, stage: str) -> list[str]:
        """Keys of the complete entries of `stage` (sorted; validity of entry.json not checked)."""
        _check_stage(stage)
        stage_dir = self.root / stage
        if not stage_dir.is_dir():
            return []
        return sorted(
            marker.parent.name
            for marker in stage_dir.glob(f"??/*/{MARKER_NAME}")
            if _KEY_RE.fullmatch(marker.parent.name)
        )

    # ------------------------------------------------------------ writing

    def begin(self, stage: str, key: str) -> Path:
        """Create the entry directory for writing and return it.

        A marker already present is removed first, so the entry reads as incomplete
        until `commit`. Files already in the directory are kept: a rerun after a crash
        resumes (for example the feature store rewrites only arrays without their own
        marker). Call it holding `lock(stage, key)` when other processes may be writing.
        """
        directory = self.entry(stage, key)
        directory.mkdir(parents=True, exist_ok=True)
        try:
            os.unlink(directory / MARKER_NAME)
        except FileNotFoundError:
            pass
        return directory

    def commit(self, stage: str, key: str, record: dict[str, Any]) -> Path:
        """Write `entry.json` holding `record` atomically, marking the entry complete.

        Call it after every other file of the entry is written: a reader treats the
        entry as complete from the moment the rename lands. Returns the entry directory.
        """
        if not isinstance(record, dict):
            raise TypeError(f"record must be a dict (a JSON object), got {type(record).__name__}")
        directory = self.entry(stage, key)
        if not directory.is_dir():
            raise FileNotFoundError(f"entry {stage}/{key} was not begun: {directory} does not exist")
        write_json_atomic(
            directory / MARKER_NAME,
            {
                "format": MARKER_FORMAT,
                "stage": stage,
                "key": key,
                # microseconds: history orders checkpoints without a training step by it
                "committed_at": datetime.now(timezone.utc).isoformat(timespec="microseconds"),
                "record": record,
            },
            indent=1,
        )
        return directory

    def remove(self, stage: str, key: str) -> None:
        """Delete entry (stage, key) if present.

        The marker goes first, so no reader ever sees a half-deleted entry as complete.
        """
        directory = self.entry(stage, key)
        try:
            os.unlink(directory / MARKER_NAME)
        except FileNotFoundError:
            pass
        shutil.rmtree(directory, ignore_errors=True)

    # ------------------------------------------------------------ concurrency

    @contextmanager
    def lock(self, stage: str, key: str, timeout: float | None = None) -> Iterator[None]:
        """Hold an exclusive inter-process lock on (stage, key) for the `with` block.

        `fcntl.flock` on `<key>.lock` beside the entry: the OS releases it when the
        holder exits or is killed, so a crashed run never blocks the next one (a lock
        *file* would). The lock file is never deleted: deleting it while another
        process waits on it would let a third one lock a fresh file at the same time.
        `timeout` None waits forever; otherwise raises `LockTimeout`. Not re-entrant
        within one process (a second `lock` on the same entry waits for the first).
        """
        directory = self.entry(stage, key)
        directory.parent.mkdir(parents=True, exist_ok=True)
        lock_path = directory.parent / f"{key}.lock"
        with open(lock_path, "a") as lock_file:
            _flock_exclusive(lock_file, lock_path, timeout)
            try:
                yield
            finally:
                fcntl.flock(lock_file, fcntl.LOCK_UN)

    def get_or_compute(
        self,
        stage: str,
        key: str,
        compute: Callable[[Path], dict[str, Any]],
        timeout: float | None = None,
    ) -> dict[str, Any]:
        """The record of (stage, key), running `compute(entry_dir) -> record` only on a miss.

        The usual pattern for a stage: try the store first; on a miss take the lock,
        check again (another process may have committed while this one waited), then
        `begin`, `compute` (which writes its files into the directory it is given) and
        `commit`. If `compute` raises, nothing is committed and its partial files stay
        for a resuming rerun. `timeout` bounds the wait for the lock (`LockTimeout`).
        """
        try:
            return self.read_record(stage, key)
        except EntryMissing:
            pass
        with self.lock(stage, key, timeout=timeout):
            try:
                return self.read_record(stage, key)
            except EntryMissing:
                pass
            directory = self.begin(stage, key)
            record = compute(directory)
            self.commit(stage, key, record)
            return record


def _parse_marker(raw: bytes, stage: str, key: str) -> tuple[str | None, dict[str, Any]]:
    # Returns (problem, record): problem is None for a valid marker of this very entry.
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"not JSON ({e})", {}
    if not isinstance(data, dict) or not isinstance(data.get("record"), dict):
        return "no 'record' object", {}
    if data.get("format") != MARKER_FORMAT:
        return f"unknown format {data.get('format')!r}", {}
    if (data.get("stage"), data.get("key")) != (stage, key):
        # A directory copied or renamed by hand: its content belongs to another key.
        return f"belongs to {data.get('stage')}/{data.get('key')}", {}
    return None, data["record"]


def _unlink_if_same_file(path: Path, inode: int) -> None:
    # Between reading a corrupt marker and removing it, a writer may have committed a good one
    # (os.replace gives it a new inode): leave that one alone. The remaining window is tiny and
    # costs at most a recomputation, never a wrong result.
    try:
        if os.stat(path).st_ino == inode:
            os.unlink(path)
    except FileNotFoundError:
        pass


def _flock_exclusive(lock_file, lock_path: Path, timeout: float | None) -> None:
    if timeout is None:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        return
    deadline = time.monotonic() + timeout
    delay = 0.005
    while True:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise
        if time.monotonic() >= deadline:
            raise LockTimeout(f"could not lock {lock_path} within {timeout} s (another process holds it)")
        time.sleep(delay)
        delay = min(delay * 2, 0.1)
