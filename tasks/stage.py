"""What every stage task shares: the store is the cache, and Prefect shows its hits as `Cached`.

Why not Prefect's own result cache (notes/prefect.md): it never checks that what a cached result
points to still exists, so a deleted store entry would come back as a dangling record; its default
policy never reuses results across flow runs; and its lock files outlive a killed run. Here each task
asks the store instead. A complete entry is returned at once as a `Completed` state named `Cached`
(what the Prefect UI shows for a cache hit); a missing or incomplete one is computed under the
store's lock, so two runs that need it at once compute it once and the second one reuses it.
"""

from collections.abc import Callable
from pathlib import Path
from typing import Any

from prefect.states import Completed, State

from storage import EntryMissing, Store


def cached(record: Any) -> State:
    """The final state of a task whose result came from the store."""
    return Completed(data=record, name="Cached", message="complete in the store: not recomputed")


def run_entry(
    store: Store, stage: str, key: str, compute: Callable[[Path], dict], refresh: bool = False
) -> tuple[dict, bool]:
    """(record, computed) of entry (stage, key): read from the store, or computed and committed.

    compute(entry_dir) writes the stage's files into entry_dir and returns the record. It runs under
    the entry's lock; files a killed earlier run left behind stay, so it can resume. refresh=True
    deletes the entry first and recomputes it.
    """
    if not refresh:
        try:
            return store.read_record(stage, key), False
        except EntryMissing:
            pass
    with store.lock(stage, key):
        if refresh:
            store.remove(stage, key)
        else:
            try:  # another run may have committed it while this one waited for the lock
                return store.read_record(stage, key), False
            except EntryMissing:
                pass
        directory = store.begin(stage, key)
        record = compute(directory)
        store.commit(stage, key, record)
        return record, True
