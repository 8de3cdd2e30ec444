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

`entry.json` holds `{"format": 1, "stage", "key", "committed_at", "record", "files", "content",
"upstream", "checksum"}`; only `record` is the stage's. The rest is written by `commit`:

- `files`: {path relative to the entry: {"size", "sha256"}} of every file the stage wrote, except
  subtrees that carry their own digests (`skip`, e.g. features.zarr: one sha256 per array marker);
- `content`: the digest of `files`, what entries built on this one record as its content;
- `upstream`: {label: content digest} of what the entry was built from (given by the stage); `get_or_compute`
  treats an entry whose upstream has another content now as stale;
- `checksum`: sha256 of record, files, content and upstream, so a flipped digit in a record is caught.

An entry without `entry.json` is incomplete: its files may be partial (a killed writer) and are
kept only so that a rerun can resume (the feature store resumes per array). A damaged entry (a
corrupt `entry.json`, or a file that no longer matches its digest) is warned about, its marker and
its damaged files are removed, and it is treated as a miss: the next run recomputes exactly what
was removed. Reads check the files of up to `VERIFY_ON_READ_BYTES` by sha256 and larger ones by
size (`read_entry(full=True)` and `dflash-eval verify` hash every file). Entries committed before
digests were recorded (no `files`) are read as before, their top-level JSON files parse-checked.

Keys are sha256 hex digests (see `hashing.key_of`); stage names are lowercase
identifiers. Both are validated, so no argument can escape the root.

On object storage (`Store("s3://bucket/prefix")`, storage.object_storage) the same layout lives under the
prefix, and the bucket is the truth: `entry.json` is one PUT, written last, after every file of the entry
is uploaded; locks are lease objects created with `If-None-Match: *` (never flock on a network path), and
a crashed holder's lease expires. Each machine keeps its own copy of the entries it reads and writes (and
its digest cache) in a local folder, `Store.root` (`$DFLASH_STORE_CACHE/<bucket>-<id>/<prefix>`, default
`~/.cache/dflash-eval/stores/...`): stages write an entry's files there, `commit` uploads them, and a read
downloads what this machine lacks, hashing it as it streams. That copy is only a cache: a file in it that
no longer matches the entry's digests is downloaded again. Feature arrays are not copied: they are read
and written in the bucket directly (`Store.feature_store`), so the shards of a stage on several machines
write their arrays straight into one entry.
"""

import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from .hashing import DigestCache, file_sha256, key_of
from .object_storage import LEASE_SECONDS, LockBusy, ObjectStorage, local_path, store_url
from .records import PARTIAL_SUFFIX, write_json_atomic

STORE_ENV = "DFLASH_STORE"
CACHE_ENV = "DFLASH_STORE_CACHE"
LEASE_ENV = "DFLASH_LOCK_LEASE_SECONDS"  # object-storage locks: how long one outlives a holder that stopped  # where this machine keeps its copy of an object store's entries
DEFAULT_CACHE = Path("~/.cache/dflash-eval/stores")
TRANSFERS = 16  # uploads and downloads of one entry's files in flight at once (object storage)
DEFAULT_ROOT = ".dflash-store"
MARKER_NAME = "entry.json"
MARKER_FORMAT = 1
# Files up to this size are hashed on every read (all records: scores.json, drafts.json, seq_*.json are
# KBs to MBs, hashed at ~1 GB/s); larger ones (checkpoint weights) are checked by size, and hashed in
# full by read_entry(full=True) (the drafts stage, before it loads the weights) and `dflash-eval verify`.
VERIFY_ON_READ_BYTES = 16 << 20

_STAGE_RE = re.compile(r"[a-z][a-z0-9_-]*")
_KEY_RE = re.compile(r"[0-9a-f]{64}")


class EntryMissing(LookupError):
    """A store entry is absent or incomplete (no valid `entry.json`): the stage must run. `damaged`: it
    was committed, but found damaged and removed (`reason` names what was wrong)."""

    def __init__(self, stage: str, key: str, reason: str, *, damaged: bool = False):
        super().__init__(f"{stage}/{key}: {reason}")
        self.stage = stage
        self.key = key
        self.reason = reason
        self.damaged = damaged


class CorruptEntryWarning(UserWarning):
    """A damaged entry (an unreadable `entry.json`, or files that no longer match their digests): its
    marker and damaged files were removed and the entry counts as a miss."""


@dataclass(frozen=True)
class Damage:
    """One thing wrong with an entry: `path` relative to the entry (`entry.json` for the marker)."""

    path: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


@dataclass(frozen=True)
class Entry:
    """A committed entry, as its `entry.json` describes it."""

    stage: str
    key: str
    record: dict[str, Any]
    files: dict[str, dict[str, Any]] | None  # None: committed before digests were recorded
    content: str | None  # digest of `files`; None as for files
    upstream: dict[str, str] | None  # content digests of what it was built from; None: not recorded
    committed_at: str | None


class LockTimeout(TimeoutError):
    """`Store.lock` waited longer than its timeout."""


# Why `Store.get_or_compute` computed an entry (`Miss.kind`).
ABSENT = "absent"  # no entry, or an incomplete one (a killed writer's files: resumed)
DAMAGED = "damaged"  # committed, but damaged: its marker and damaged files were removed (resumed)
STALE = "stale"  # built on upstream content that has changed since: removed whole, recomputed
REFRESH = "refresh"  # the caller asked for it: removed whole, recomputed
LACKING = "lacking"  # fresh, but without everything asked (`holds`): extended in place


@dataclass(frozen=True)
class Miss:
    """Why `Store.get_or_compute` computed an entry, named for people in `reason`."""

    kind: str  # ABSENT, DAMAGED, STALE, REFRESH or LACKING
    reason: str
    entry: Entry | None = None  # the committed entry found: replaced (STALE, REFRESH) or extended (LACKING)
    stale: tuple[str, ...] = ()  # STALE: the upstream labels whose content has changed

    def __str__(self) -> str:
        return self.reason


@dataclass(frozen=True)
class Outcome:
    """What `Store.get_or_compute` gives: the entry's record and content digest, and why it was computed
    (`miss`; None when it was read from the store)."""

    record: dict[str, Any]
    content: str | None
    miss: Miss | None = None

    @property
    def computed(self) -> bool:
        """Whether this call computed the entry (rather than reading it)."""
        return self.miss is not None


def default_root() -> Path:
    """The store root: `$DFLASH_STORE` if set, else `./.dflash-store`."""
    return Path(os.environ.get(STORE_ENV) or DEFAULT_ROOT)


def store_cache(remote: ObjectStorage) -> Path:
    """This machine's folder for its copy of object store `remote` (module docstring). The folder name
    includes a digest of the endpoint and URL: two servers with a bucket of the same name never share it."""
    base = Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser()
    identity = hashlib.sha256(f"{remote.endpoint or 'aws'}|{remote.url}".encode()).hexdigest()[:10]
    return base / f"{remote.bucket}-{identity}" / remote.prefix


def _check_stage(stage: str) -> None:
    if not isinstance(stage, str) or not _STAGE_RE.fullmatch(stage):
        raise ValueError(f"stage must be a lowercase identifier like 'features', got {stage!r}")


def _check_stage_key(stage: str, key: str) -> None:
    _check_stage(stage)
    if not isinstance(key, str) or not _KEY_RE.fullmatch(key):
        raise ValueError(f"key must be a 64-character lowercase sha256 hex digest (hashing.key_of), got {key!r}")


class Store:
    """A content-addressed store of stage outputs, in a local folder or on object storage (layout and
    both kinds in the module docstring).

    root: a folder, `s3://bucket/prefix`, or None for `$DFLASH_STORE` (else `./.dflash-store`). cache:
    this machine's folder for an object store's entries (default `store_cache`); lease_seconds: how long an
    object-storage lock outlives a holder that stopped renewing it (default `$DFLASH_LOCK_LEASE_SECONDS`,
    else 60)."""

    def __init__(self, root: str | os.PathLike | None = None, *, cache: str | os.PathLike | None = None,
                 lease_seconds: float | None = None):
        location = str(root) if root is not None else os.environ.get(STORE_ENV) or DEFAULT_ROOT
        if lease_seconds is None:
            lease_seconds = float(os.environ.get(LEASE_ENV) or LEASE_SECONDS)
        # remote: the truth when the store is on object storage; root is then this machine's copy
        self.remote = ObjectStorage(location, lease_seconds=lease_seconds) if store_url(location) else None
        if self.remote is None:
            self.root = local_path(location)
        else:
            self.root = Path(cache) if cache is not None else store_cache(self.remote)

    def __repr__(self) -> str:
        return f"Store({self.location!r})"

    # ------------------------------------------------------------ paths

    def entry(self, stage: str, key: str) -> Path:
        """The directory of entry (stage, key); it may not exist."""
        _check_stage_key(stage, key)
        return self.root / stage / key[:2] / key

    @property
    def location(self) -> str:
        """What `Store(location)` opens again on any machine (a task's `store_root`): the object store's URL,
        or the absolute folder."""
        return self.remote.url if self.remote is not None else str(self.root.resolve())

    def feature_store(self, key: str):
        """The feature arrays of features entry `key` (storage.feature_store): in the entry's folder, or
        on object storage itself (never copied to this machine)."""
        from .feature_store import FEATURES_DIRNAME, FeatureStore

        if self.remote is not None:
            return FeatureStore(self.remote.child(f"{self._entry_key('features', key)}/{FEATURES_DIRNAME}"))
        return FeatureStore.in_entry(self.entry("features", key))

    def _entry_key(self, stage: str, key: str) -> str:
        # the entry's prefix on object storage
        _check_stage_key(stage, key)
        return f"{stage}/{key[:2]}/{key}"

    def local_entry(self, stage: str, key: str, *, full: bool = False) -> Path:
        """The folder on this machine holding every file of committed entry (stage, key) (from object
        storage: what this machine lacks is downloaded), checked as `read_entry(full=full)` checks them.
        Raises `EntryMissing` as `read_entry` does."""
        self._read_entry(stage, key, verify=True, full=full, every_file=True)
        return self.entry(stage, key)

    def _marker(self, stage: str, key: str) -> Path:
        return self.entry(stage, key) / MARKER_NAME

    def digest_cache(self) -> DigestCache:
        """The store's file-digest cache (`<root>/file-digests.json`)."""
        return DigestCache(self.root / "file-digests.json")

    # ------------------------------------------------------------ reading

    def read_entry(self, stage: str, key: str, *, verify: bool = True, full: bool = False) -> Entry:
        """The committed entry (stage, key), its files checked against their digests.

        verify: files up to VERIFY_ON_READ_BYTES are hashed, larger ones checked by size; full: every
        file is hashed. Raises `EntryMissing` when the entry is absent or incomplete. A damaged entry
        (corrupt `entry.json`; a file missing, resized or changed) is warned about
        (`CorruptEntryWarning`, naming the entry and what is wrong), its marker and damaged files are
        removed (so a resuming stage recomputes exactly those), and it also raises `EntryMissing`.
        """
        return self._read_entry(stage, key, verify=verify, full=full)

    def _read_entry(self, stage: str, key: str, *, verify: bool, full: bool, every_file: bool = False) -> Entry:
        entry, damage, identity = self._inspect(stage, key, verify=verify or full, full=full, every_file=every_file)
        if not damage:
            return entry
        reasons = "; ".join(str(d) for d in damage)
        warnings.warn(f"{stage}/{key} is corrupt ({reasons}): removed, it counts as a miss and will be recomputed",
                      CorruptEntryWarning, stacklevel=3)
        self._discard(stage, key, damage, identity)
        raise EntryMissing(stage, key, f"damaged, removed ({reasons})", damaged=True)

    def read_record(self, stage: str, key: str, *, verify: bool = True) -> dict[str, Any]:
        """The record committed for (stage, key): `read_entry(stage, key, verify=verify).record`.

        Raises `EntryMissing` when the entry is absent, incomplete or damaged (a damaged one is
        warned about and removed, see `read_entry`).
        """
        return self.read_entry(stage, key, verify=verify).record

    def check(self, stage: str, key: str, *, full: bool = True) -> tuple[Entry | None, list[Damage]]:
        """(entry, what is damaged) without changing anything; entry is None when `entry.json` itself
        is damaged. Raises `EntryMissing` when the entry is absent or incomplete."""
        entry, damage, _ = self._inspect(stage, key, verify=True, full=full)
        return entry, damage

    def discard(self, stage: str, key: str, damage: Sequence[Damage]) -> None:
        """Remove the marker of (stage, key) and the damaged files `check` found, so the next run
        recomputes them (a stage that resumes, as references do per prompt, recomputes only those)."""
        if self.remote is not None:
            meta = self.remote.head(f"{self._entry_key(stage, key)}/{MARKER_NAME}")
            identity = meta and meta["e_tag"]
        else:
            try:
                identity = os.stat(self._marker(stage, key)).st_ino
            except FileNotFoundError:
                identity = None
        if identity is not None:
            self._discard(stage, key, damage, identity)

    def content(self, stage: str, key: str) -> str | None:
        """The content digest recorded for (stage, key) (None for an entry committed before digests were
        recorded). Reads the marker only; raises `EntryMissing` as `read_entry` does."""
        return self.read_entry(stage, key, verify=False).content

    def committed_at(self, stage: str, key: str) -> datetime | None:
        """When (stage, key) was committed (entry.json's `committed_at`, UTC), None if the marker holds no
        readable time (written by hand); raises `EntryMissing` as `read_record` does. A recomputed entry
        (refresh) has the time of its last commit."""
        committed = self.read_entry(stage, key, verify=False).committed_at
        try:
            when = datetime.fromisoformat(committed)
        except (TypeError, ValueError):
            return None
        return when if when.tzinfo else when.replace(tzinfo=timezone.utc)  # comparable with every other time

    def is_complete(self, stage: str, key: str) -> bool:
        """Whether (stage, key) is committed and undamaged (a damaged one is removed, with a warning)."""
        try:
            self.read_entry(stage, key)
        except EntryMissing:
            return False
        return True

    def _inspect(self, stage: str, key: str, verify: bool, full: bool,
                 every_file: bool = False) -> tuple[Entry | None, list[Damage], int | str]:
        # (entry, damage, identity of the marker read: inode, or e_tag on object storage): the identity lets
        # a remover leave a newer marker alone. every_file: an object store's files all copied here.
        marker = self._marker(stage, key)
        try:
            if self.remote is not None:
                raw, identity = self.remote.get(f"{self._entry_key(stage, key)}/{MARKER_NAME}")
            else:
                with open(marker, "rb") as f:
                    identity = os.fstat(f.fileno()).st_ino
                    raw = f.read()
        except FileNotFoundError:
            reason = "incomplete (no entry.json)" if self._has_files(stage, key) else "absent"
            raise EntryMissing(stage, key, reason) from None
        problem, entry = _parse_marker(raw, stage, key)
        if problem is not None:
            return None, [Damage(MARKER_NAME, problem)], identity
        if not verify:
            damage = []
        elif self.remote is not None:
            damage = self._copy_here(stage, key, entry.files, full, every_file)
        else:
            damage = _file_damage(marker.parent, entry.files, full)
        return entry, damage, identity

    def _has_files(self, stage: str, key: str) -> bool:
        # whether an entry without a marker has files (incomplete: a killed writer's, here or, on object
        # storage, anywhere) or is absent
        if self.entry(stage, key).is_dir():
            return True
        return self.remote is not None and bool(self.remote.objects(self._entry_key(stage, key) + "/"))

    def _copy_here(self, stage: str, key: str, files: dict[str, dict[str, Any]] | None, full: bool,
                   every_file: bool) -> list[Damage]:
        """Damage of an object-store entry's files, each checked as `_file_damage` checks a local one: the
        copy on this machine if it holds the file (hashed when small or `full`), else the object, downloaded
        here and hashed while it streams. A large file this machine lacks is only sized on the server,
        unless every_file (the caller opens the files)."""
        if files is None:
            files = {}  # committed before digests were recorded: never written to object storage
        directory, prefix = self.entry(stage, key), self._entry_key(stage, key)

        def check(item) -> Damage | None:
            name, recorded = item
            if _local_damage(directory, name, recorded, full) is None:  # this machine's copy is good
                return None
            if not (recorded["size"] <= VERIFY_ON_READ_BYTES or full or every_file):
                meta = self.remote.head(f"{prefix}/{name}")
                return _mismatch(name, recorded, meta and meta["size"])
            try:
                size, sha256 = self.remote.download(f"{prefix}/{name}", directory / name)
            except FileNotFoundError:
                size = sha256 = None
            return _mismatch(name, recorded, size, sha256)

        with ThreadPoolExecutor(TRANSFERS) as pool:
            return [d for d in pool.map(check, sorted(files.items())) if d is not None]

    def _discard(self, stage: str, key: str, damage: Sequence[Damage], identity: int) -> None:
        # Marker first (nothing reads as complete), then the damaged files. Only if the marker is still
        # the one that was checked: a writer that began since removed it (begin) and its new files are
        # not damaged. The remaining window is tiny and costs at most a recomputation.
        directory = self.entry(stage, key)
        if self.remote is not None:
            prefix = self._entry_key(stage, key)
            meta = self.remote.head(f"{prefix}/{MARKER_NAME}")
            if meta is None or meta["e_tag"] != identity:
                return
            self.remote.delete([f"{prefix}/{MARKER_NAME}"])
            self.remote.delete([f"{prefix}/{d.path}" for d in damage if d.path != MARKER_NAME])
        elif not _unlink_if_same_file(directory / MARKER_NAME, identity):
            return
        for d in damage:
            if d.path != MARKER_NAME:
                try:
                    os.unlink(directory / d.path)
                except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
                    pass

    def keys(self, stage: str) -> list[str]:
        """Keys of the complete entries of `stage` (sorted; validity of entry.json not checked)."""
        _check_stage(stage)
        return sorted(key for found, key, complete in self._folders(stage) if complete)

    def entries(self) -> list[tuple[str, str, bool]]:
        """(stage, key, complete) of every entry in the store, complete or not, sorted."""
        return sorted(self._folders())

    def _folders(self, stage: str | None = None) -> Iterator[tuple[str, str, bool]]:
        # (stage, key, has entry.json) of every entry folder (object storage: every entry prefix)
        if self.remote is not None:
            found: dict[tuple[str, str], bool] = {}
            for meta in self.remote.objects(f"{stage}/" if stage else ""):
                parts = meta["path"].split("/")
                if len(parts) >= 4 and _is_entry(*parts[:3]):
                    found[parts[0], parts[2]] = found.get((parts[0], parts[2]), False) or (
                        len(parts) == 4 and parts[3] == MARKER_NAME)
            yield from ((s, k, complete) for (s, k), complete in found.items())
            return
        stage_dirs = [self.root / stage] if stage else (self.root.iterdir() if self.root.is_dir() else [])
        for stage_dir in stage_dirs:
            if stage_dir.is_dir():
                for directory in stage_dir.glob("??/*"):
                    if directory.is_dir() and _is_entry(stage_dir.name, directory.parent.name, directory.name):
                        yield stage_dir.name, directory.name, (directory / MARKER_NAME).is_file()

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
        if self.remote is not None:
            self.remote.delete([f"{self._entry_key(stage, key)}/{MARKER_NAME}"])
        try:
            os.unlink(directory / MARKER_NAME)
        except FileNotFoundError:
            pass
        return directory

    def commit(
        self, stage: str, key: str, record: dict[str, Any], *, upstream: dict[str, str] | None = None,
        skip: Sequence[str] = (),
    ) -> Path:
        """Write `entry.json` holding `record` atomically, marking the entry complete.

        Call it after every other file of the entry is written: a reader treats the entry as complete
        from the moment the rename lands (on object storage: the files are uploaded first, then
        `entry.json` in one PUT). The entry's files are hashed here (`files`, `content`),
        except the top-level folders named in `skip` (which carry digests of their own) and partial
        files; `upstream` ({label: content digest} of what the entry was built from) is recorded
        as given. Returns the entry directory (on this machine).
        """
        if not isinstance(record, dict):
            raise TypeError(f"record must be a dict (a JSON object), got {type(record).__name__}")
        directory = self.entry(stage, key)
        if not directory.is_dir():
            raise FileNotFoundError(f"entry {stage}/{key} was not begun: {directory} does not exist")
        files = _digest_files(directory, skip)
        sealed = {"record": record, "files": files, "content": _content_digest(files)}
        if upstream is not None:
            sealed["upstream"] = dict(upstream)
        # normalized through JSON, so the checksum is computed on exactly what a reader parses back
        sealed = json.loads(json.dumps(sealed, allow_nan=False))
        marker = {
            "format": MARKER_FORMAT,
            "stage": stage,
            "key": key,
            # microseconds: history orders checkpoints without a training step by it
            "committed_at": datetime.now(timezone.utc).isoformat(timespec="microseconds"),
            **sealed,
            "checksum": key_of(sealed),
        }
        if self.remote is None:
            write_json_atomic(directory / MARKER_NAME, marker, indent=1)
            return directory
        prefix = self._entry_key(stage, key)
        with ThreadPoolExecutor(TRANSFERS) as pool:
            list(pool.map(lambda name: self.remote.upload(f"{prefix}/{name}", directory / name), files))
        self.remote.put(f"{prefix}/{MARKER_NAME}",
                        json.dumps(marker, sort_keys=True, indent=1, ensure_ascii=False).encode("utf-8"))
        return directory

    def remove(self, stage: str, key: str) -> None:
        """Delete entry (stage, key) if present.

        The marker goes first, so no reader ever sees a half-deleted entry as complete.
        """
        directory = self.entry(stage, key)
        if self.remote is not None:
            prefix = self._entry_key(stage, key)
            self.remote.delete([f"{prefix}/{MARKER_NAME}"])
            self.remote.delete_prefix(prefix)
        try:
            os.unlink(directory / MARKER_NAME)
        except FileNotFoundError:
            pass
        shutil.rmtree(directory, ignore_errors=True)

    # ------------------------------------------------------------ concurrency

    @contextmanager
    def lock(self, stage: str, key: str, timeout: float | None = None) -> Iterator[Any]:
        """Hold an exclusive lock on (stage, key), across processes and machines, for the `with` block.

        Local: `fcntl.flock` on `<key>.lock` beside the entry: the OS releases it when the
        holder exits or is killed, so a crashed run never blocks the next one (a lock
        *file* would). The lock file is never deleted: deleting it while another
        process waits on it would let a third one lock a fresh file at the same time.
        Object storage: the lease object `<key>.lock` beside the entry (storage.object_storage), which
        expires when its holder stops renewing it; it yields the `Lease` (its `check()` raises if it
        was lost), locally None.
        `timeout` None waits forever; otherwise raises `LockTimeout`. Not re-entrant
        within one process (a second `lock` on the same entry waits for the first).
        """
        if self.remote is not None:
            try:
                with self.remote.lease(f"{self._entry_key(stage, key)}.lock", timeout=timeout) as lease:
                    yield lease
            except LockBusy as e:
                raise LockTimeout(str(e)) from None
            return
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
        *,
        refresh: bool = False,
        upstream: Callable[[], dict[str, str | None]] | None = None,
        holds: Callable[[Entry], bool] | None = None,
        extend: Callable[[Path, Entry], dict[str, Any]] | None = None,
        on_miss: Callable[[Miss], None] | None = None,
        skip: Sequence[str] = (),
        timeout: float | None = None,
    ) -> Outcome:
        """The entry (stage, key): read from the store when it is committed, undamaged and fresh, else
        computed and committed; every stage gets its entries through this.

        `compute(entry_dir) -> record` writes the stage's files into the entry directory. It runs under
        the entry's lock, after a second look (another process may have committed while this one
        waited): two processes that need an entry at once compute it once. Files an interrupted run
        left in an uncommitted entry stay, so it can resume; if `compute` raises, nothing is committed.

        - refresh: remove the entry whole and compute it again;
        - upstream() gives the current content digests of what the entry is built from ({label:
          digest}, storage.integrity): recorded at commit; an entry whose recorded ones differ is stale,
          removed whole (nothing of it may be resumed) and computed again;
        - holds(entry): whether a fresh entry holds everything asked; one that does not is extended in
          place by `extend(entry_dir, entry) -> record` (its files kept). Given together;
        - on_miss(miss) is called under the lock before anything is removed or computed (a caller logs
          why, or reads the entry a refresh replaces);
        - skip: top-level folders that carry their own digests (`commit`);
        - timeout bounds the wait for the lock (`LockTimeout`).
        """
        if (holds is None) != (extend is None):
            raise TypeError("holds and extend go together: an entry that lacks something asked is extended")
        found = None  # why the first look missed: a damaged entry reads as incomplete once it is removed
        if not refresh:
            try:
                entry = self.read_entry(stage, key)
            except EntryMissing as e:
                found = e
            else:
                if _unfit(entry, upstream, holds) is None:
                    return Outcome(entry.record, entry.content)
        with self.lock(stage, key, timeout=timeout) as lease:
            try:
                old = self.read_entry(stage, key)
            except EntryMissing as e:
                old, found = None, found or e
            if refresh:
                miss = Miss(REFRESH, "refresh asked", old)
            elif old is None:
                miss = Miss(DAMAGED if found.damaged else ABSENT, found.reason)
            else:
                miss = _unfit(old, upstream, holds)
                if miss is None:  # committed by another process while this one waited for the lock
                    return Outcome(old.record, old.content)
            if on_miss is not None:
                on_miss(miss)
            if miss.kind in (REFRESH, STALE):
                self.remove(stage, key)
            directory = self.begin(stage, key)
            record = extend(directory, old) if miss.kind == LACKING else compute(directory)
            if lease is not None:
                lease.check()  # never commit what another process may be computing since our lease lapsed
            self.commit(stage, key, record, upstream=upstream() if upstream else None, skip=skip)
            return Outcome(record, self.content(stage, key), miss)

def changed_upstream(recorded: dict[str, str | None] | None, current: dict[str, str | None]) -> list[str]:
    """The labels whose content differs between what an entry recorded and `current` (every label of
    either). Nothing when the entry recorded no upstream (committed before digests were recorded)."""
    if recorded is None:
        return []
    return sorted(label for label in set(recorded) | set(current) if recorded.get(label) != current.get(label))


def _unfit(entry: Entry, upstream, holds) -> Miss | None:
    # Why a committed, undamaged entry cannot be used as it is (None: it can).
    changed = changed_upstream(entry.upstream, upstream()) if upstream else []
    if changed:
        return Miss(STALE, f"built on {', '.join(changed)}, whose content has changed since", entry, tuple(changed))
    if holds is not None and not holds(entry):
        return Miss(LACKING, "does not hold everything asked", entry)
    return None


def _is_entry(stage: str, fan_out: str, key: str) -> bool:
    return bool(_STAGE_RE.fullmatch(stage) and _KEY_RE.fullmatch(key)) and fan_out == key[:2]


def _parse_marker(raw: bytes, stage: str, key: str) -> tuple[str | None, Entry | None]:
    # Returns (problem, entry): problem is None for a valid marker of this very entry.
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        return f"not JSON ({e})", None
    if not isinstance(data, dict) or not isinstance(data.get("record"), dict):
        return "no 'record' object", None
    if data.get("format") != MARKER_FORMAT:
        return f"unknown format {data.get('format')!r}", None
    if (data.get("stage"), data.get("key")) != (stage, key):
        # A directory copied or renamed by hand: its content belongs to another key.
        return f"belongs to {data.get('stage')}/{data.get('key')}", None
    files, upstream = data.get("files"), data.get("upstream")
    if "checksum" in data:
        sealed = {name: data[name] for name in ("record", "files", "content", "upstream") if name in data}
        try:
            intact = key_of(sealed) == data["checksum"]
        except (TypeError, ValueError):
            intact = False
        if not intact:
            return "checksum mismatch (the record or its digests changed since commit)", None
        if not isinstance(files, dict) or not all(
            isinstance(f, dict) and isinstance(f.get("size"), int) and isinstance(f.get("sha256"), str)
            and not Path(name).is_absolute() and ".." not in Path(name).parts  # damaged files are deleted
            for name, f in files.items()
        ):
            return "malformed 'files'", None
    elif files is not None:
        return "digests without a checksum", None
    return None, Entry(stage, key, data["record"], files, data.get("content"),
                       upstream if isinstance(upstream, dict) else None, data.get("committed_at"))


def _digest_files(directory: Path, skip: Sequence[str]) -> dict[str, dict[str, Any]]:
    """{relative path: {"size", "sha256"}} of the files under directory, but the marker, partial files
    (temporary files, the relay's .partial/ folder) and the top-level folders in `skip`."""
    files = {}
    for folder, subdirs, names in os.walk(directory):
        relative = Path(folder).relative_to(directory)
        subdirs[:] = sorted(d for d in subdirs if not d.endswith(PARTIAL_SUFFIX)
                            and not (relative == Path(".") and d in skip))
        for name in sorted(names):
            if name.endswith(PARTIAL_SUFFIX) or (relative == Path(".") and name == MARKER_NAME):
                continue
            path = Path(folder) / name
            files[(relative / name).as_posix()] = {"size": path.stat().st_size, "sha256": file_sha256(path)}
    return files


def _content_digest(files: dict[str, dict[str, Any]]) -> str:
    return key_of({path: f["sha256"] for path, f in files.items()})


def _file_damage(directory: Path, files: dict[str, dict[str, Any]] | None, full: bool) -> list[Damage]:
    """What no longer matches the digests recorded at commit; for an entry committed before digests
    were recorded, its top-level JSON files that do not parse."""
    if files is None:
        damage = []
        for path in sorted(directory.glob("*.json")):
            if path.name != MARKER_NAME:
                try:
                    json.loads(path.read_bytes().decode("utf-8"))
                except (UnicodeDecodeError, ValueError) as e:
                    damage.append(Damage(path.name, f"not JSON ({e})"))
        return damage
    return [d for name, recorded in files.items() if (d := _local_damage(directory, name, recorded, full))]


def _local_damage(directory: Path, name: str, recorded: dict[str, Any], full: bool) -> Damage | None:
    """What is wrong with file `name` of an entry's folder: missing, resized, or (hashed when small or `full`)
    changed."""
    path = directory / name
    try:
        size = path.stat().st_size
    except (FileNotFoundError, NotADirectoryError):
        size = None
    hashed = size == recorded["size"] and (full or size <= VERIFY_ON_READ_BYTES)
    return _mismatch(name, recorded, size, file_sha256(path) if hashed else None)


def _mismatch(name: str, recorded: dict[str, Any], size: int | None, sha256: str | None = None) -> Damage | None:
    """Damage when a file's size (None: missing) or sha256 (None: not hashed) differs from those recorded."""
    if size is None:
        return Damage(name, "missing")
    if size != recorded["size"]:
        return Damage(name, f"{size} bytes, {recorded['size']} at commit")
    if sha256 is not None and sha256 != recorded["sha256"]:
        return Damage(name, "sha256 differs from the one recorded at commit")
    return None


def _unlink_if_same_file(path: Path, inode: int) -> bool:
    # Between reading a damaged marker and removing it, a writer may have committed a good one
    # (os.replace gives it a new inode): leave that one alone. The remaining window is tiny and
    # costs at most a recomputation, never a wrong result. True if it was removed.
    try:
        if os.stat(path).st_ino == inode:
            os.unlink(path)
            return True
    except FileNotFoundError:
        pass
    return False


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
