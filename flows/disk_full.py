"""What to say when a disk fills up during a run.

Whether the store and output paths can be written is checked before any work (flows/checks.py); a disk
that fills mid-run gets one message naming what filled and saying that the store is consistent (entries
are committed atomically: storage/store.py).
"""

import errno
import shutil
from pathlib import Path

from dflash_eval.storage import Store

# errno -> what happened, for a write that failed for want of room
STORAGE_FULL = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
                errno.EFBIG: "file size limit (ulimit -f) reached"}


def is_storage_full(error: BaseException) -> bool:
    """Whether `error` is a write that failed for want of room (STORAGE_FULL)."""
    return isinstance(error, OSError) and error.errno in STORAGE_FULL


def storage_full_message(e: OSError, store: Store) -> str:
    """What filled up, and what the store holds now (entries are committed atomically, so it is consistent)."""
    written = e.filename2 or e.filename  # shutil's copies name the destination second
    entry = store.newest_incomplete_entry()
    place = Path(written) if written else entry[2] if entry else store.root
    assert e.errno is not None, "a full disk's error (is_storage_full)"
    message = f"{STORAGE_FULL[e.errno]} while writing {place}"
    if e.errno != errno.EFBIG:
        try:
            free = shutil.disk_usage(next(p for p in (place, *place.parents) if p.exists())).free
            message += f" ({free / 1e6:.1f} MB free on its filesystem)"
        except (OSError, StopIteration):
            pass
    resumed = (f"the {entry[0]} entry being written ({entry[1][:12]}) is incomplete and the next run resumes it"
               if entry else "the next run resumes where this one stopped")
    return (f"{message}. The store {store.location} is consistent: every entry completed so far is kept and nothing "
            f"incomplete reads as complete; {resumed}. Free some space (or use another --store) and run the same "
            "command again")
