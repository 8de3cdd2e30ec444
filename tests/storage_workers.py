"""Functions run in spawned child processes by the storage tests (importable, so 'spawn' can find them).

Kept apart from the test modules so a child imports only what it needs.
"""

import json
import os
import time
from pathlib import Path


def hidden_for(layer_id: int, seq_index: int, n_rows: int, width: int):
    """Deterministic bf16 [n_rows, width] hidden states for (layer, sequence): parent and children agree."""
    import torch

    generator = torch.Generator().manual_seed(1000 * layer_id + seq_index)
    return (torch.randn(n_rows, width, generator=generator) * 50).to(torch.bfloat16)


def rows_for(seq_index: int) -> int:
    """Ragged lengths, as real references are."""
    return 17 + (seq_index * 37) % 91


def write_sequences(path, layer_ids, seq_indices, width, max_chunk_bytes, barrier=None, rows=None):
    """Write the given sequences (all `layer_ids`) into a FeatureStore, optionally starting at a barrier."""
    from dflash_eval.storage.feature_store import FeatureStore

    store = FeatureStore(path, max_chunk_bytes=max_chunk_bytes)
    if barrier is not None:
        barrier.wait(timeout=60)
    for seq in seq_indices:
        n_rows = rows if rows is not None else rows_for(seq)
        for layer in layer_ids:
            store.write(layer, seq, hidden_for(layer, seq, n_rows, width))


def compute_slowly(root, stage, key, started_path, seconds):
    """get_or_compute whose computation announces itself, then takes `seconds`."""
    from dflash_eval.storage import Store

    def compute(entry_dir: Path) -> dict:
        Path(started_path).write_text("started")
        time.sleep(seconds)
        (entry_dir / "payload.json").write_text(json.dumps({"pid": os.getpid()}))
        return {"pid": os.getpid(), "committed_after": time.time()}

    Store(root).get_or_compute(stage, key, compute)


def compute_at_once(root, stage, key, barrier, log_path, result_path):
    """get_or_compute started with others at a barrier: a computation appends its pid to `log_path`; the
    outcome (record, computed) goes to `result_path`."""
    from dflash_eval.storage import Store

    def compute(entry_dir: Path) -> dict:
        with open(log_path, "a") as log:
            log.write(f"{os.getpid()}\n")
        time.sleep(0.5)  # the others reach the lock meanwhile
        return {"pid": os.getpid()}

    barrier.wait(timeout=60)
    outcome = Store(root).get_or_compute(stage, key, compute, timeout=60)
    Path(result_path).write_text(json.dumps({"record": outcome.record, "computed": outcome.computed}))


def hold_lock(root, stage, key, ready_path, seconds):
    """Take the entry lock, announce it, and hold it for `seconds` (the test kills us first)."""
    from dflash_eval.storage import Store

    with Store(root).lock(stage, key):
        Path(ready_path).write_text("locked")
        time.sleep(seconds)


def hash_through_cache(cache_path, file_paths, rounds):
    """Hash files through one shared DigestCache, `rounds` times each."""
    from dflash_eval.storage import DigestCache

    for _ in range(rounds):
        cache = DigestCache(cache_path)
        for file_path in file_paths:
            cache.sha256(file_path)
