"""Preloaded by the Dask workers tests/test_cluster.py starts (`dask worker --preload <this file>`).

It imports the stages once at the worker's start, so that the first shard a worker runs does not pay for it,
and, with $DFLASH_TEST_SHARD_SECONDS, makes every shard's compute (a feature batch, a replay group) take that
much longer: the tiny models compute a shard in a fraction of a second, too fast to kill a worker while a
stage is midway, or to see both workers take shards.
"""

import os
import time

from dflash_eval.tasks import cluster, drafts, features  # noqa: F401 (imported once, here)

SHARD_SECONDS = float(os.environ.get("DFLASH_TEST_SHARD_SECONDS", "0"))


def _slowed(compute):
    def run(*args, **kwargs):
        time.sleep(SHARD_SECONDS)
        return compute(*args, **kwargs)

    return run


if SHARD_SECONDS > 0:
    # the shard tasks look these up in their modules when they run, so they find the slowed ones
    features.extract_arrays = _slowed(features.extract_arrays)
    drafts.replay = _slowed(drafts.replay)
