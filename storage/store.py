"""The content-addressed store: one directory per (stage, key), complete when `entry.json` exists.

On-disk layout (root = `Store(root)`, default `$DFLASH_STORE`, else `./.dflash-store`)::

    <root>/
      file-digests.json              DigestCache: (abs path, size, mtime_ns) -> sha256
      file-digests.json.lock         flock serializing updates of the digest cache (deleted on release)
      <stage>/                       fetch, references, features, drafts, scores, ...
        <key[:2]>/                   two-level fan-out, as git and DVC do (no huge directories)
          <key>.lock                 flock: one process computes an entry, others wait (deleted on release)
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

On object storage (`Store("s3://bucket/prefix")`) the same layout lives under the prefix, and the bucket
is the truth: `entry.json` is one PUT, written last, after every file of the entry is uploaded, and locks
are lease objects that expire when their holder stops renewing them. Each machine keeps its own copy of the
entries it reads and writes (and its digest cache) in a local folder, `Store.root`: stages write an entry's
files there, `commit` uploads them, and a read downloads what this machine lacks, hashing it as it streams;
a file in it that no longer matches the entry's digests is downloaded again. Feature arrays are not copied:
they are read and written in the bucket directly (`Store.feature_store`), so the shards of a stage on
several machines write their arrays straight into one entry (storage.object_storage_backend).

The Store is written once for both kinds of store: what differs between them (markers, listing, locks,
moving files) is its backend's (storage.backend). What `entry.json` holds is storage.marker's.
"""

import json
import os
import re
import shutil
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from .backend import Backend, Identity, LockTimeout
from .hashing import DigestCache, file_sha256
from .local_backend import LocalBackend, entry_folders
from .marker import MARKER_NAME, Entry, FileDigests, MarkerDamaged, parse, seal
from .object_storage import LEASE_SECONDS, Lease, ObjectStorage, local_path, store_url
from .object_storage_backend import ObjectStorageBackend
from .outcomes import (
    ABSENT,
    DAMAGED,
    LACKING,
    REFRESH,
    STALE,
    CorruptEntryWarning,
    Damage,
    EntryMissing,
    Miss,
    Outcome,
)
from .records import PARTIAL_SUFFIX

if TYPE_CHECKING:
    from .feature_store import FeatureStore

__all__ = ["ABSENT", "DAMAGED", "LACKING", "REFRESH", "STALE", "CorruptEntryWarning", "Damage", "Entry",
           "EntryMissing", "LockTimeout", "Miss", "Outcome", "Store", "changed_upstream", "default_root"]

STORE_ENV = "DFLASH_STORE"
LEASE_ENV = "DFLASH_LOCK_LEASE_SECONDS"  # object-storage locks: how long one outlives a holder that stopped
DEFAULT_ROOT = ".dflash-store"
# Files up to this size are hashed on every read (all records: scores.json, drafts.json, seq_*.json are
# KBs to MBs, hashed at ~1 GB/s); larger ones (checkpoint weights) are checked by size, and hashed in
# full by read_entry(full=True) (the drafts stage, before it loads the weights) and `dflash-eval verify`.
VERIFY_ON_READ_BYTES = 16 << 20

_STAGE_RE = re.compile(r"[a-z][a-z0-9_-]*")
_KEY_RE = re.compile(r"[0-9a-f]{64}")
_T = TypeVar("_T")
_R = TypeVar("_R")


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
    """A content-addressed store of stage outputs, in a local folder or on object storage (layout and
    both kinds in the module docstring).

    root: a folder, `s3://bucket/prefix`, or None for `$DFLASH_STORE` (else `./.dflash-store`). cache:
    this machine's folder for an object store's entries (default `object_storage_backend.store_cache`);
    lease_seconds: how long an object-storage lock outlives a holder that stopped renewing it (default
    `$DFLASH_LOCK_LEASE_SECONDS`, else 60)."""

    def __init__(self, root: str | os.PathLike[str] | None = None, *, cache: str | os.PathLike[str] | None = None,
                 lease_seconds: float | None = None):
        location = str(root) if root is not None else os.environ.get(STORE_ENV) or DEFAULT_ROOT
        if lease_seconds is None:
            lease_seconds = float(os.environ.get(LEASE_ENV) or LEASE_SECONDS)
        # remote: the truth when the store is on object storage (None for a local folder)
        self.remote: ObjectStorage | None
        self._backend: Backend
        if store_url(location):
            self.remote = ObjectStorage(location, lease_seconds=lease_seconds)
            self._backend = ObjectStorageBackend(self.remote, Path(cache) if cache is not None else None)
        else:
            self.remote = None
            self._backend = LocalBackend(local_path(location))
        self.root = self._backend.root  # the entries' files on this machine: the store, or this machine's copy

    def __repr__(self) -> str:
        return f"Store({self.location!r})"

    # ------------------------------------------------------------ paths

    def entry(self, stage: str, key: str) -> Path:
        """The directory of entry (stage, key) on this machine; it may not exist."""
        return self.root / _entry_name(stage, key)

    @property
    def location(self) -> str:
        """What `Store(location)` opens again on any machine (a task's `store_location`): the object store's URL,
        or the absolute folder."""
        return self._backend.location

    def feature_store(self, key: str) -> "FeatureStore":
        """The feature arrays of features entry `key` (storage.feature_store): in the entry's folder, or
        on object storage itself (never copied to this machine)."""
        from .feature_store import FEATURES_DIRNAME, FeatureStore

        return FeatureStore(self._backend.in_place(_entry_name("features", key), FEATURES_DIRNAME))

    def local_entry(self, stage: str, key: str, *, full: bool = False) -> Path:
        """The folder on this machine holding every file of committed entry (stage, key) (from object
        storage: what this machine lacks is downloaded), checked as `read_entry(full=full)` checks them.
        Raises `EntryMissing` as `read_entry` does."""
        self._read_entry(stage, key, verify=True, full=full, every_file=True)
        return self.entry(stage, key)

    def digest_cache(self) -> DigestCache:
        """The store's file-digest cache (`<root>/file-digests.json`)."""
        return DigestCache(self.root / "file-digests.json")

    def newest_incomplete_entry(self) -> tuple[str, str, Path] | None:
        """(stage, key, this machine's folder) of the most recently created entry without its marker (what a run
        that stopped, say on a full disk, was writing); None when there is none or the store cannot be read."""
        try:
            complete = {(stage, key) for stage, key, done in self._folders() if done}
            here = [(stage, key, self.entry(stage, key)) for stage, fan_out, key, _ in entry_folders(self.root)
                    if _is_entry(stage, fan_out, key) and (stage, key) not in complete]
            return max(here, key=lambda entry: entry[2].stat().st_mtime, default=None)
        except OSError:
            return None

    # ------------------------------------------------------------ reading

    def read_entry(self, stage: str, key: str, *, verify: bool = True, full: bool = False,
                   discard_damaged: bool = True) -> Entry:
        """The committed entry (stage, key), its files checked against their digests.

        verify: files up to VERIFY_ON_READ_BYTES are hashed, larger ones checked by size; full: every
        file is hashed. Raises `EntryMissing` when the entry is absent or incomplete. A damaged entry
        (corrupt `entry.json`; a file missing, resized or changed) also raises `EntryMissing` (`damaged`,
        its reason naming what is wrong). A stage about to recompute it (discard_damaged) also has it
        warned about (`CorruptEntryWarning`) and its marker and damaged files removed, so that it recomputes
        exactly those; a reader (history, report, verify) passes False and changes nothing.
        """
        return self._read_entry(stage, key, verify=verify, full=full, discard_damaged=discard_damaged)

    def _read_entry(self, stage: str, key: str, *, verify: bool, full: bool, every_file: bool = False,
                    discard_damaged: bool = True) -> Entry:
        entry, damage, identity = self._inspect(stage, key, verify=verify or full, full=full, every_file=every_file)
        if entry is not None and not damage:
            return entry
        reasons = "; ".join(str(d) for d in damage)
        if not discard_damaged:
            raise EntryMissing(stage, key, f"damaged ({reasons})", damaged=True)
        warnings.warn(f"{stage}/{key} is corrupt ({reasons}): removed, it counts as a miss and will be recomputed",
                      CorruptEntryWarning, stacklevel=3)
        self._discard(stage, key, damage, identity)
        raise EntryMissing(stage, key, f"damaged, removed ({reasons})", damaged=True)

    def read_record(self, stage: str, key: str, *, verify: bool = True, discard_damaged: bool = True) -> dict[str, Any]:
        """The record committed for (stage, key): `read_entry(stage, key, ...).record`.

        Raises `EntryMissing` when the entry is absent, incomplete or damaged (see `read_entry`).
        """
        return self.read_entry(stage, key, verify=verify, discard_damaged=discard_damaged).record

    def check(self, stage: str, key: str, *, full: bool = True) -> tuple[Entry | None, list[Damage]]:
        """(entry, what is damaged) without changing anything; entry is None when `entry.json` itself
        is damaged. Raises `EntryMissing` when the entry is absent or incomplete."""
        entry, damage, _ = self._inspect(stage, key, verify=True, full=full)
        return entry, damage

    def discard(self, stage: str, key: str, damage: Sequence[Damage]) -> None:
        """Remove the marker of (stage, key) and the damaged files `check` found, so the next run
        recomputes them (a stage that resumes, as references do per prompt, recomputes only those)."""
        identity = self._backend.marker_identity(_entry_name(stage, key))
        if identity is not None:
            self._discard(stage, key, damage, identity)

    def content(self, stage: str, key: str) -> str | None:
        """The content digest recorded for (stage, key) (None for an entry committed before digests were
        recorded). Reads the marker only and changes nothing; raises `EntryMissing` as `read_entry` does."""
        return self.read_entry(stage, key, verify=False, discard_damaged=False).content

    def committed_at(self, stage: str, key: str) -> datetime | None:
        """When (stage, key) was committed (entry.json's `committed_at`, UTC), None if the marker holds no
        readable time (written by hand); raises `EntryMissing` as `read_record` does. A recomputed entry
        (refresh) has the time of its last commit. Changes nothing."""
        committed = self.read_entry(stage, key, verify=False, discard_damaged=False).committed_at
        if not isinstance(committed, str):
            return None
        try:
            when = datetime.fromisoformat(committed)
        except ValueError:
            return None
        return when if when.tzinfo else when.replace(tzinfo=UTC)  # comparable with every other time

    def is_complete(self, stage: str, key: str, *, discard_damaged: bool = True) -> bool:
        """Whether (stage, key) is committed and undamaged (see `read_entry` for a damaged one)."""
        try:
            self.read_entry(stage, key, discard_damaged=discard_damaged)
        except EntryMissing:
            return False
        return True

    def _inspect(self, stage: str, key: str, verify: bool, full: bool,
                 every_file: bool = False) -> tuple[Entry | None, list[Damage], Identity]:
        # (entry, damage, identity of the marker read): the identity lets a remover leave a newer marker
        # alone. every_file: an object store's files all copied here.
        name = _entry_name(stage, key)
        try:
            raw, identity = self._backend.read_marker(name)
        except FileNotFoundError:
            reason = "incomplete (no entry.json)" if self._backend.has_files(name) else "absent"
            raise EntryMissing(stage, key, reason) from None
        try:
            entry = parse(raw, stage, key)
        except MarkerDamaged as e:
            return None, [Damage(MARKER_NAME, str(e))], identity
        damage = self._file_damage(stage, key, entry.files, full, every_file) if verify else []
        return entry, damage, identity

    def _file_damage(self, stage: str, key: str, files: FileDigests | None, full: bool,
                     every_file: bool) -> list[Damage]:
        """What no longer matches the digests recorded at commit. Each file is checked in this machine's
        folder (`_local_damage`); one that is not right there is fetched from where the store keeps it, if
        elsewhere (object storage: downloaded here and hashed while it streams; a large file is only sized on
        the server, unless `full` or `every_file`: the caller opens the files). For an entry committed
        before digests were recorded: its top-level JSON files that do not parse."""
        directory, name = self.entry(stage, key), _entry_name(stage, key)
        if files is None:
            return _unparsable_json(directory)

        def check(item: tuple[str, dict[str, Any]]) -> Damage | None:
            path, recorded = item
            damage = _local_damage(directory, path, recorded, full)
            if damage is None:
                return None
            hashed = full or every_file or recorded["size"] <= VERIFY_ON_READ_BYTES
            fetched = self._backend.fetch(name, path, download=hashed)
            return damage if fetched is None else _mismatch(path, recorded, *fetched)

        found = _map(check, sorted(files.items()), self._backend.concurrent_files)
        return [d for d in found if d is not None]

    def _discard(self, stage: str, key: str, damage: Sequence[Damage], identity: Identity) -> None:
        # Marker first (nothing reads as complete), then the damaged files. Only if the marker is still
        # the one that was checked: a writer that began since removed it (begin) and its new files are
        # not damaged. The remaining window is tiny and costs at most a recomputation.
        paths = [d.path for d in damage if d.path != MARKER_NAME]
        if not self._backend.discard(_entry_name(stage, key), identity, paths):
            return
        directory = self.entry(stage, key)
        for path in paths:
            try:
                os.unlink(directory / path)
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
        # (stage, key, has entry.json) of every entry where the store keeps them
        for found, fan_out, key, complete in self._backend.folders(stage):
            if _is_entry(found, fan_out, key):
                yield found, key, complete

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
        self._backend.unmark(_entry_name(stage, key))
        return directory

    def commit(
        self, stage: str, key: str, record: dict[str, Any], *, upstream: Mapping[str, str | None] | None = None,
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
        marker = seal(stage, key, record, files, upstream)
        self._backend.publish(_entry_name(stage, key), list(files), marker)
        return directory

    def remove(self, stage: str, key: str) -> None:
        """Delete entry (stage, key) if present.

        The marker goes first, so no reader ever sees a half-deleted entry as complete.
        """
        self._backend.delete(_entry_name(stage, key))
        shutil.rmtree(self.entry(stage, key), ignore_errors=True)

    # ------------------------------------------------------------ concurrency

    def lock(self, stage: str, key: str, timeout: float | None = None) -> AbstractContextManager[Lease | None]:
        """Hold an exclusive lock on (stage, key), across processes and machines, for the `with` block.

        Local: `fcntl.flock` on `<key>.lock` beside the entry, which the OS releases when the holder
        exits or is killed (storage.local_backend). Object storage: the lease object `<key>.lock`
        beside the entry (storage.object_storage), which expires when its holder stops renewing it; it
        yields the `Lease` (its `check()` raises if it was lost), locally None.
        `timeout` None waits forever; otherwise raises `LockTimeout`. Not re-entrant
        within one process (a second `lock` on the same entry waits for the first).
        """
        return self._backend.lock(_entry_name(stage, key), timeout)

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
            old: Entry | None = None
            try:
                old = self.read_entry(stage, key)
            except EntryMissing as e:
                found = found or e
            if refresh:
                miss = Miss(REFRESH, "refresh asked", old)
            elif old is not None:
                unfit = _unfit(old, upstream, holds)
                if unfit is None:  # committed by another process while this one waited for the lock
                    return Outcome(old.record, old.content)
                miss = unfit
            else:
                assert found is not None  # the second look missed too
                miss = Miss(DAMAGED if found.damaged else ABSENT, found.reason)
            if on_miss is not None:
                on_miss(miss)
            if miss.kind in (REFRESH, STALE):
                self.remove(stage, key)
            directory = self.begin(stage, key)
            if miss.kind == LACKING:
                assert extend is not None and old is not None  # `holds` (given with extend) found `old` lacking
                record = extend(directory, old)
            else:
                record = compute(directory)
            if lease is not None:
                lease.check()  # never commit what another process may be computing since our lease lapsed
            self.commit(stage, key, record, upstream=upstream() if upstream else None, skip=skip)
            return Outcome(record, self.content(stage, key), miss)


def changed_upstream(recorded: Mapping[str, str | None] | None, current: Mapping[str, str | None]) -> list[str]:
    """The labels whose content differs between what an entry recorded and `current` (every label of
    either). Nothing when the entry recorded no upstream (committed before digests were recorded)."""
    if recorded is None:
        return []
    return sorted(label for label in set(recorded) | set(current) if recorded.get(label) != current.get(label))


def _unfit(entry: Entry, upstream: Callable[[], dict[str, str | None]] | None,
           holds: Callable[[Entry], bool] | None) -> Miss | None:
    # Why a committed, undamaged entry cannot be used as it is (None: it can).
    changed = changed_upstream(entry.upstream, upstream()) if upstream else []
    if changed:
        return Miss(STALE, f"built on {', '.join(changed)}, whose content has changed since", entry, tuple(changed))
    if holds is not None and not holds(entry):
        return Miss(LACKING, "does not hold everything asked", entry)
    return None


def _entry_name(stage: str, key: str) -> str:
    # the entry's path relative to the root (and its prefix on object storage), the one place that knows it
    _check_stage_key(stage, key)
    return f"{stage}/{key[:2]}/{key}"


def _is_entry(stage: str, fan_out: str, key: str) -> bool:
    return bool(_STAGE_RE.fullmatch(stage) and _KEY_RE.fullmatch(key)) and fan_out == key[:2]


def _map(function: Callable[[_T], _R], items: Iterable[_T], workers: int) -> list[_R]:
    # function over items, `workers` at a time (one: in this thread)
    if workers == 1:
        return [function(item) for item in items]
    with ThreadPoolExecutor(workers) as pool:
        return list(pool.map(function, items))


def _digest_files(directory: Path, skip: Sequence[str]) -> FileDigests:
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


def _unparsable_json(directory: Path) -> list[Damage]:
    """The top-level JSON files of an entry committed before digests were recorded that do not parse."""
    damage = []
    for path in sorted(directory.glob("*.json")):
        if path.name != MARKER_NAME:
            try:
                json.loads(path.read_bytes().decode("utf-8"))
            except (UnicodeDecodeError, ValueError) as e:
                damage.append(Damage(path.name, f"not JSON ({e})"))
    return damage


def _local_damage(directory: Path, name: str, recorded: dict[str, Any], full: bool) -> Damage | None:
    """What is wrong with file `name` of an entry's folder: missing, resized, or (hashed when small or `full`)
    changed."""
    path = directory / name
    size: int | None
    try:
        size = path.stat().st_size
    except (FileNotFoundError, NotADirectoryError):
        size = None
    hashed = size == recorded["size"] and (full or recorded["size"] <= VERIFY_ON_READ_BYTES)
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
