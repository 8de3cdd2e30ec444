"""`dflash-eval` that SIGKILLs itself at its K-th write (fault injection for tests/test_faults.py).

Usage: python -m tests.fault_run WHEN:K EVENTS_FILE <dflash-eval arguments...>

Writes are the store's record writes (`dflash_eval.storage.records.write_bytes_atomic`: references, drafts,
scores, entry.json, ...), feature array writes (`FeatureStore.write`) and file copies (the fetch
stage's `shutil.copyfile`). Each write is appended to EVENTS_FILE (index, kind, path) before it
happens. WHEN is `before` or `after` (the K-th write): no cleanup, no flushing, like the OOM killer.
`count` (or K = 0) never dies: it only counts.
"""

import os
import shutil
import signal
import sys

from dflash_eval import storage
from dflash_eval.storage.feature_store import FeatureStore

when, _, limit = sys.argv[1].partition(":")
limit, events_file = int(limit or 0), sys.argv[2]
count = 0


def counted(kind, write, where):
    def run(*args, **kwargs):
        global count
        count += 1
        with open(events_file, "a") as f:
            f.write(f"{count}\t{kind}\t{where(*args)}\n")
        if count == limit and when == "before":
            os.kill(os.getpid(), signal.SIGKILL)
        result = write(*args, **kwargs)
        if count == limit and when == "after":
            os.kill(os.getpid(), signal.SIGKILL)
        return result

    return run


storage.records.write_bytes_atomic = counted("record", storage.records.write_bytes_atomic, lambda path, *_: path)
FeatureStore.write = counted("array", FeatureStore.write, lambda store, layer, seq, *_: f"{store.path}/layer_{layer}/seq_{seq}")
shutil.copyfile = counted("copy", shutil.copyfile, lambda source, destination, *_: destination)

if __name__ == "__main__":
    from dflash_eval.cli import main

    sys.argv = ["dflash-eval", *sys.argv[3:]]
    main()
