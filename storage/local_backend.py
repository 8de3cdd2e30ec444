"""A store in a local folder (storage.backend): the folder is the store itself, its markers files, its locks
lock files beside each entry (storage.file_lock)."""

import os
from collections.abc import Iterator, Sequence
from contextlib import AbstractContextManager
from pathlib import Path

from .backend import Fetched, Identity
from .file_lock import file_lock
from .marker import MARKER_NAME
from .records import write_bytes_atomic


class LocalBackend:
    """The entries of a store in the folder `root` (a `storage.backend.Backend`)."""

    concurrent_files = 1  # files are checked one after another: hashing them is disk-bound

    def __init__(self, root: Path):
        self.root = root

    @property
    def location(self) -> str:
        return str(self.root.resolve())

    def read_marker(self, entry: str) -> tuple[bytes, Identity]:
        with open(self.root / entry / MARKER_NAME, "rb") as f:
            return f.read(), os.fstat(f.fileno()).st_ino

    def marker_identity(self, entry: str) -> Identity | None:
        try:
            return os.stat(self.root / entry / MARKER_NAME).st_ino
        except FileNotFoundError:
            return None

    def has_files(self, entry: str) -> bool:
        return (self.root / entry).is_dir()

    def folders(self, stage: str | None) -> Iterator[tuple[str, str, str, bool]]:
        return entry_folders(self.root, stage)

    def fetch(self, entry: str, name: str, *, download: bool) -> Fetched | None:
        return None  # this folder is the store: there is no other copy

    def unmark(self, entry: str) -> None:
        try:
            os.unlink(self.root / entry / MARKER_NAME)
        except FileNotFoundError:
            pass

    def publish(self, entry: str, names: Sequence[str], marker: bytes) -> None:
        write_bytes_atomic(self.root / entry / MARKER_NAME, marker)  # the files are in place already

    def discard(self, entry: str, identity: Identity, names: Sequence[str]) -> bool:
        # Between reading a damaged marker and removing it, a writer may have committed a good one
        # (os.replace gives it a new inode): leave that one alone. The remaining window is tiny and
        # costs at most a recomputation, never a wrong result. The files are this folder's: the Store's.
        marker = self.root / entry / MARKER_NAME
        try:
            if os.stat(marker).st_ino == identity:
                os.unlink(marker)
                return True
        except FileNotFoundError:
            pass
        return False

    def delete(self, entry: str) -> None:
        self.unmark(entry)  # the folder itself is this machine's, which the Store removes

    def lock(self, entry: str, timeout: float | None) -> AbstractContextManager[None]:
        # storage.file_lock: `<key>.lock` beside the entry, released by the OS if its holder is killed,
        # deleted by the holder at the end
        return file_lock(self.root / f"{entry}.lock", timeout)

    def in_place(self, entry: str, folder: str) -> Path:
        return self.root / entry / folder


def entry_folders(root: Path, stage: str | None = None) -> Iterator[tuple[str, str, str, bool]]:
    """(stage, fan-out, name, holds the marker) of every folder at the depth of entries under `root` (in the
    folder of `stage` only, if given)."""
    stage_dirs = [root / stage] if stage else (root.iterdir() if root.is_dir() else [])
    for stage_dir in stage_dirs:
        if stage_dir.is_dir():
            for directory in stage_dir.glob("??/*"):
                if directory.is_dir():
                    yield stage_dir.name, directory.parent.name, directory.name, (directory / MARKER_NAME).is_file()
