"""A store in a local folder (storage.backend): the folder is the store itself, its markers files, its locks
`fcntl.flock` on a lock file beside each entry."""

import errno
import fcntl
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from .backend import Fetched, Identity, LockTimeout
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

    @contextmanager
    def lock(self, entry: str, timeout: float | None) -> Iterator[None]:
        # `fcntl.flock` on `<key>.lock` beside the entry: the OS releases it when the holder exits or is
        # killed, so a crashed run never blocks the next one (a lock *file* would). The lock file is never
        # deleted: deleting it while another process waits on it would let a third one lock a fresh file
        # at the same time.
        lock_path = self.root / f"{entry}.lock"
        lock_path.parent.mkdir(parents=True, exist_ok=True)
        with open(lock_path, "a") as lock_file:
            _flock_exclusive(lock_file, lock_path, timeout)
            try:
                yield
            finally:
                fcntl.flock(lock_file, fcntl.LOCK_UN)

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


def _flock_exclusive(lock_file: IO[str], lock_path: Path, timeout: float | None) -> None:
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
