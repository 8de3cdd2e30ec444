"""`dflash-eval` that SIGKILLs itself right after writing N feature arrays (fault injection).

Usage: python -m tests.killed_run N <dflash-eval arguments...>
"""

import os
import signal
import sys

from dflash_eval.storage.feature_store import FeatureStore

limit = int(sys.argv[1])
written = 0
write = FeatureStore.write


def write_then_maybe_die(self, *args, **kwargs):
    global written
    write(self, *args, **kwargs)
    written += 1
    if written >= limit:
        os.kill(os.getpid(), signal.SIGKILL)  # no cleanup, no flushing: like the OOM killer


FeatureStore.write = write_then_maybe_die

if __name__ == "__main__":
    from dflash_eval.cli import main

    sys.argv = ["dflash-eval", *sys.argv[2:]]
    main()
