"""A store on object storage (storage.backend), through storage.object_storage: the bucket is the truth, and this
machine keeps a copy of the entries it reads and writes in a local folder.

`entry.json` is one PUT, written last, after every file of the entry is uploaded; locks are lease objects
(`ObjectStorage.lease`: never flock on a network path), which expire when their holder stops renewing them.
Feature arrays are not copied here: they are read and written in the bucket directly (`in_place`).
"""

import hashlib
import os
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

from .backend import Fetched, Identity, LockTimeout
from .marker import MARKER_NAME
from .object_storage import Lease, LockBusy, ObjectStorage

CACHE_ENV = "DFLASH_STORE_CACHE"  # where this machine keeps its copy of an object store's entries
DEFAULT_CACHE = Path("~/.cache/dflash-eval/stores")
TRANSFERS = 16  # uploads and downloads of one entry's files in flight at once


def store_cache(storage: ObjectStorage) -> Path:
    """This machine's folder for its copy of object store `storage`: `$DFLASH_STORE_CACHE/<bucket>-<id>/<prefix>`
    (default `~/.cache/dflash-eval/stores/...`). The folder name includes a digest of the endpoint and URL: two
    servers with a bucket of the same name never share it."""
    base = Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE).expanduser()
    identity = hashlib.sha256(f"{storage.endpoint or 'aws'}|{storage.url}".encode()).hexdigest()[:10]
    return base / f"{storage.bucket}-{identity}" / storage.prefix


class ObjectStorageBackend:
    """The entries of a store on object storage `storage`, with this machine's copy in `root` (a
    `storage.backend.Backend`)."""

    concurrent_files = TRANSFERS  # each file checked may be a round trip to the server: overlap them

    def __init__(self, storage: ObjectStorage, root: Path | None = None):
        self.storage = storage
        self.root = root if root is not None else store_cache(storage)

    @property
    def location(self) -> str:
        return self.storage.url

    def read_marker(self, entry: str) -> tuple[bytes, Identity]:
        return self.storage.get(f"{entry}/{MARKER_NAME}")

    def marker_identity(self, entry: str) -> Identity | None:
        meta = self.storage.head(f"{entry}/{MARKER_NAME}")
        return None if meta is None else meta["e_tag"]

    def has_files(self, entry: str) -> bool:
        # a killed writer's files, here or on any machine that uploaded some
        return (self.root / entry).is_dir() or bool(self.storage.objects(f"{entry}/"))

    def folders(self, stage: str | None) -> Iterator[tuple[str, str, str, bool]]:
        found: dict[tuple[str, str, str], bool] = {}
        for meta in self.storage.objects(f"{stage}/" if stage else ""):
            parts = meta["path"].split("/")
            if len(parts) >= 4:
                folder = (parts[0], parts[1], parts[2])
                found[folder] = found.get(folder, False) or (len(parts) == 4 and parts[3] == MARKER_NAME)
        return ((*folder, complete) for folder, complete in found.items())

    def fetch(self, entry: str, name: str, *, download: bool) -> Fetched:
        if not download:
            meta = self.storage.head(f"{entry}/{name}")
            return (None if meta is None else meta["size"]), None
        try:
            return self.storage.download(f"{entry}/{name}", self.root / entry / name)
        except FileNotFoundError:
            return None, None

    def unmark(self, entry: str) -> None:
        self.storage.delete([f"{entry}/{MARKER_NAME}"])

    def publish(self, entry: str, names: Sequence[str], marker: bytes) -> None:
        with ThreadPoolExecutor(TRANSFERS) as pool:
            list(pool.map(lambda name: self.storage.upload(f"{entry}/{name}", self.root / entry / name), names))
        self.storage.put(f"{entry}/{MARKER_NAME}", marker)

    def discard(self, entry: str, identity: Identity, names: Sequence[str]) -> bool:
        if self.marker_identity(entry) != identity:
            return False
        self.storage.delete([f"{entry}/{MARKER_NAME}"])
        self.storage.delete([f"{entry}/{name}" for name in names])
        return True

    def delete(self, entry: str) -> None:
        self.unmark(entry)
        self.storage.delete_prefix(entry)

    @contextmanager
    def lock(self, entry: str, timeout: float | None) -> Iterator[Lease]:
        # the lease object `<key>.lock` beside the entry; its `check()` raises if it was lost
        try:
            with self.storage.lease(f"{entry}.lock", timeout=timeout) as lease:
                yield lease
        except LockBusy as e:
            raise LockTimeout(str(e)) from None

    def in_place(self, entry: str, folder: str) -> ObjectStorage:
        return self.storage.child(f"{entry}/{folder}")
