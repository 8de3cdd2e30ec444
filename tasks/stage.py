"""What every stage task shares: the store is the cache, and Prefect shows its hits as `Cached`.

Why not Prefect's own result cache (notes/prefect.md): it never checks that what a cached result
points to still exists, so a deleted store entry would come back as a dangling record; its default
policy never reuses results across flow runs; and its lock files outlive a killed run. Here each task
asks the store instead. A complete entry is returned at once as a `Completed` state named `Cached`
(what the Prefect UI shows for a cache hit); a missing or incomplete one is computed under the
store's lock, so two runs that need it at once compute it once and the second one reuses it.

A hit is verified (storage.store: its records' digests) and must be fresh: each entry records the
content digests of the entries it was built from (`upstream`, storage.integrity), and one built on
content that has changed since (a refresh that did not reproduce its output) is recomputed, with a
warning naming what changed. A refresh says whether it reproduced the content it replaced.
"""

import functools
from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect.states import Completed, Failed, State

from dflash_eval.storage import EntryMissing, Store
from dflash_eval.storage.integrity import changed_upstream

from .progress import stage_logger


def cached(record: Any) -> State:
    """The final state of a task whose result came from the store."""
    return Completed(data=record, name="Cached", message="complete in the store: not recomputed")


def stale_labels(entry, upstream: dict | None) -> list[str]:
    """What `entry` was built from that has another content now (`upstream`: the current digests)."""
    return [] if upstream is None else changed_upstream(entry.upstream, upstream)


def warn_stale(stage: str, key: str, changed: list[str]) -> None:
    stage_logger().warning(f"{stage}/{key} is stale: built on {', '.join(changed)}, whose content has changed "
                           "since; recomputing it")


def report_refresh(stage: str, key: str, old_content: str | None, new_content: str | None) -> None:
    """Log whether a recomputed entry reproduced the content it replaced (entries built on it stay valid)
    or not (each of them is recomputed when next used, as its recorded upstream digest no longer matches)."""
    if old_content is None:
        return
    logger = stage_logger()
    if old_content == new_content:
        logger.info(f"refresh of {stage}/{key} reproduced its content digest {new_content}: entries built on it "
                    "stay valid")
    else:
        logger.warning(f"refresh of {stage}/{key} changed its content ({old_content} -> {new_content}): entries "
                       "built on it are stale and will be recomputed when next used")


def run_entry(
    store: Store, stage: str, key: str, compute: Callable[[Path], dict], refresh: bool = False,
    upstream: Callable[[], dict[str, str | None]] | None = None,
) -> tuple[dict, bool]:
    """(record, computed) of entry (stage, key): read from the store, or computed and committed.

    compute(entry_dir) writes the stage's files into entry_dir and returns the record. It runs under
    the entry's lock; files a killed earlier run left behind stay, so it can resume. refresh=True
    deletes the entry first and recomputes it. upstream() gives the current content digests of what
    the entry is built from ({label: digest}, storage.integrity): recorded at commit, and an entry
    whose recorded ones differ is stale and recomputed.
    """
    if not refresh:
        try:
            entry = store.read_entry(stage, key)
            if not stale_labels(entry, upstream() if upstream else None):
                return entry.record, False
        except EntryMissing:
            pass
    with store.lock(stage, key):
        try:
            old = store.read_entry(stage, key)
        except EntryMissing:
            old = None
        if old is not None and not refresh:
            changed = stale_labels(old, upstream() if upstream else None)
            if not changed:  # another run committed it while this one waited for the lock
                return old.record, False
            warn_stale(stage, key, changed)
        if refresh or old is not None:  # a stale entry goes whole: nothing of it may be resumed
            store.remove(stage, key)
        directory = store.begin(stage, key)
        record = compute(directory)
        store.commit(stage, key, record, upstream=upstream() if upstream else None)
        if refresh and old is not None:
            report_refresh(stage, key, old.content, store.content(stage, key))
        return record, True


def refusals_fail_cleanly(*refusals: type[Exception]):
    """Decorate a flow or task so that the `refusals` it raises (bad input, a checkpoint refused) end it
    in a Failed state carrying the error: Prefect logs one line instead of a traceback, and callers of
    the flow still get the exception raised (from the state)."""

    def decorate(fn):
        @functools.wraps(fn)  # keeps the signature: Prefect reads the parameters through it
        def run(*args, **kwargs):
            try:
                return fn(*args, **kwargs)
            except refusals as e:
                return Failed(message=str(e), data=e)

        return run

    return decorate
