"""An exclusive lock between processes on this machine: `fcntl.flock` on a lock file that its holder
deletes before it lets go, so a folder keeps no lock files once nothing runs.

The OS releases a flock when its holder exits or is killed, so a crashed holder never blocks the next
one (a lock file's mere existence would). Deleting the file is safe because whoever gets the lock next
checks that the file it locked is still the one at the path, and opens the path again when it is not
(the last holder deleted it, and someone may hold a newer one). A killed holder leaves its file; the next
holder deletes it.
"""

import errno
import fcntl
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from .backend import LockTimeout


@contextmanager
def file_lock(path: Path, timeout: float | None = None) -> Iterator[None]:
    """Hold the lock at `path` for the `with` block; `LockTimeout` after `timeout` seconds of waiting
    (None: wait as long as it takes). The folder is created if missing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        lock_file = open(path, "a")
        try:
            _flock_exclusive(lock_file, path, deadline)
            if _same_file(lock_file, path):
                break
        except BaseException:
            lock_file.close()
            raise
        lock_file.close()  # we locked a file its last holder deleted: lock the one at the path now
    try:
        yield
    finally:
        try:
            os.unlink(path)  # before unlocking: no one can hold the file we delete
        finally:
            lock_file.close()  # closing releases the flock


def _same_file(opened: IO[str], path: Path) -> bool:
    try:
        return os.fstat(opened.fileno()).st_ino == os.stat(path).st_ino
    except FileNotFoundError:
        return False


def _flock_exclusive(lock_file: IO[str], path: Path, deadline: float | None) -> None:
    if deadline is None:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        return
    delay = 0.005
    while True:
        try:
            fcntl.flock(lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except OSError as e:
            if e.errno not in (errno.EAGAIN, errno.EACCES):
                raise
        if time.monotonic() >= deadline:
            raise LockTimeout(f"could not lock {path} in the time allowed (another process holds it)")
        time.sleep(delay)
        delay = min(delay * 2, 0.1)
