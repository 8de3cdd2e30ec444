"""Whether the store and output paths can be written, and what to say when a disk fills up.

Checked before any work, so that bad paths cost nothing and results are never computed only to be
lost at the end; a disk that fills mid-run gets one message naming what filled and saying that the
store is consistent (entries are committed atomically: storage/store.py).
"""

import errno
import os
import shutil
import stat
import tempfile
from pathlib import Path

from dflash_eval.storage import Store

# errno -> what happened, for a write that failed for want of room
STORAGE_FULL = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
                errno.EFBIG: "file size limit (ulimit -f) reached"}


def is_storage_full(error: BaseException) -> bool:
    """Whether `error` is a write that failed for want of room (STORAGE_FULL)."""
    return isinstance(error, OSError) and error.errno in STORAGE_FULL


def store_root(store: str | None) -> Path:
    """The absolute root of the store `--store` names (None: the default, storage.store)."""
    return Store(store).root.absolute()


def writable_problem(path: Path, folder: bool) -> str | None:
    """Why this command could not create and fill `path` (a folder) or write it (a file), or None. Only reads:
    bad input leaves nothing behind. os.access also answers for root on a read-only filesystem (EROFS)."""
    path = Path(path).absolute()
    try:
        for found in (path, *path.parents):  # the nearest part of the path that exists
            try:
                mode = found.stat().st_mode
                break
            except (FileNotFoundError, NotADirectoryError):
                continue
    except OSError as e:  # EACCES: a folder above it cannot be searched
        return f"{path} cannot be reached ({e.strerror})"
    if found != path:
        if not stat.S_ISDIR(mode):
            return f"{path} cannot be created: {found} is a file, not a folder"
        if not os.access(found, os.W_OK | os.X_OK):
            return f"{path} cannot be created: {found} is not writable (permissions, or a read-only filesystem)"
        return None
    if folder and not stat.S_ISDIR(mode):
        return f"{path} is a file, not a folder"
    if not folder and stat.S_ISDIR(mode):
        return f"{path} is a folder; give a file name"
    if not os.access(path, os.R_OK | os.W_OK | os.X_OK if folder else os.W_OK):
        what = "readable and writable" if folder else "writable"
        return f"{path} is not {what} (permissions, or a read-only filesystem)"
    return None


def store_problem(store: str | None) -> str | None:
    """Why the store cannot be used (read, created, written), or None."""
    problem = writable_problem(store_root(store), folder=True)
    return f"--store: {problem}" if problem else None


def store_write_problem(root: Path) -> str | None:
    """Why the store cannot be created or written, found by trying (with the inputs known good, the flow would
    create it next): what os.access cannot tell, e.g. for root, a folder that refuses new entries (/proc)."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=root):  # O_TMPFILE: never has a name in the store
            pass
    except OSError as e:
        return f"--store: {root} cannot be created or written ({e.strerror})"
    return None


def storage_full_message(e: OSError, store_root: Path) -> str:
    """What filled up, and what the store holds now (entries are committed atomically, so it is consistent)."""
    written = e.filename2 or e.filename  # shutil's copies name the destination second
    entry = newest_incomplete_entry(store_root)
    place = Path(written) if written else entry or store_root
    message = f"{STORAGE_FULL[e.errno]} while writing {place}"
    if e.errno != errno.EFBIG:
        try:
            free = shutil.disk_usage(next(p for p in (place, *place.parents) if p.exists())).free
            message += f" ({free / 1e6:.1f} MB free on its filesystem)"
        except (OSError, StopIteration):
            pass
    resumed = (f"the {entry.parent.parent.name} entry being written ({entry.name[:12]}) is incomplete and the next run "
               "resumes it" if entry else "the next run resumes where this one stopped")
    return (f"{message}. The store {store_root} is consistent: every entry completed so far is kept and nothing "
            f"incomplete reads as complete; {resumed}. Free some space (or use another --store) and run the same "
            "command again")


def newest_incomplete_entry(store_root: Path) -> Path | None:
    """The most recently created store entry without its completion marker (layout: storage/store.py)."""
    try:
        entries = [p for p in store_root.glob("*/*/*") if len(p.name) == 64 and p.is_dir()
                   and not (p / "entry.json").exists()]
        return max(entries, key=lambda p: p.stat().st_mtime, default=None)
    except OSError:
        return None
