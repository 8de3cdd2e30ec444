"""What every stage task shares: the store is the cache, and Prefect shows its hits as `Cached`.

Why not Prefect's own result cache (docs/design.md): it never checks that what a cached result
points to still exists, so a deleted store entry would come back as a dangling record; its default
policy never reuses results across flow runs; and its lock files outlive a killed run. Here each task
asks the store instead, through its one get-or-compute (`Store.get_or_compute`, logged here by
`get_or_compute`). A complete entry is returned at once as a `Completed` state named `Cached`
(what the Prefect UI shows for a cache hit); a missing or incomplete one is computed under the
store's lock, so two runs that need it at once compute it once and the second one reuses it.

A hit is verified (storage.store: its records' digests) and must be fresh: each entry records the
content digests of the entries it was built from (`upstream`, storage.integrity), and one built on
content that has changed since (a refresh that did not reproduce its output) is recomputed, with a
warning naming what changed. Every miss is logged with its reason before the computation starts, and
a refresh says whether it reproduced the content it replaced.
"""

import functools
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from prefect.states import Completed, Failed, State

from dflash_eval.storage import Miss, Outcome, Store
from dflash_eval.storage.store import ABSENT, DAMAGED, LACKING, REFRESH, STALE, Entry

from .progress import stage_logger


def cached(record: Any) -> State:
    """The final state of a task whose result came from the store."""
    return Completed(data=record, name="Cached", message="complete in the store: not recomputed")


def log_miss(stage: str, key: str, miss: Miss) -> None:
    """Log why (stage, key) is computed, before the computation starts (a refresh is reported after it,
    `report_refresh`)."""
    logger = stage_logger()
    if miss.kind == STALE:
        logger.warning(f"{stage}/{key} is stale: built on {', '.join(miss.stale)}, whose content has changed "
                       "since; recomputing it")
    elif miss.kind == DAMAGED:
        logger.warning(f"{stage}/{key} is {miss.reason}: computing it again")
    elif miss.kind == ABSENT:
        logger.info(f"{stage}/{key} is {miss.reason}: computing it")
    elif miss.kind == LACKING:
        logger.info(f"{stage}/{key} {miss.reason}: extending it")


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


def get_or_compute(
    store: Store, stage: str, key: str, compute: Callable[[Path], dict], *, refresh: bool = False,
    upstream: Callable[[], dict[str, str | None]] | None = None,
    holds: Callable[[Entry], bool] | None = None, extend: Callable[[Path, Entry], dict] | None = None,
    skip: Sequence[str] = (), compared: Callable[[Entry], str | None] | None = None,
) -> Outcome:
    """`Store.get_or_compute` (its arguments but `on_miss` and `timeout`: a task waits for the lock as long
    as another run computes), with every miss logged (`log_miss`) and a refresh reported (`report_refresh`).

    compared(entry): the digest a refresh compares, of the entry it replaces: read before that entry is
    removed and again once it is recomputed (default: the entry's content digest; the features stage
    compares the digest of the layers the replaced entry held).
    """
    replaced: list[tuple[Entry, str | None]] = []  # the entry a refresh replaces, its digest taken before removal

    def on_miss(miss: Miss) -> None:
        log_miss(stage, key, miss)
        if miss.kind == REFRESH and miss.entry is not None:
            replaced.append((miss.entry, compared(miss.entry) if compared else miss.entry.content))

    outcome = store.get_or_compute(stage, key, compute, refresh=refresh, upstream=upstream, holds=holds,
                                   extend=extend, on_miss=on_miss, skip=skip)
    if replaced:
        entry, before = replaced[0]
        report_refresh(stage, key, before, compared(entry) if compared else outcome.content)
    return outcome


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
