"""The heavy stages on a Dask cluster (`--dask ADDRESS`, $DFLASH_DASK_ADDRESS, the flow parameter `dask_address`).

The features and drafts stages stay Prefect tasks of the flow run, and still get their entries through the
store's get-or-compute (tasks/stage.py): this process holds the entry's lock and commits it. What they compute
is split into shards, each a Prefect task (`features shard`, `drafts shard`) submitted through prefect-dask's
`DaskTaskRunner` to the scheduler at the address, and so run by its workers (Dask reschedules the shards of a
worker that dies on the others; a shard run again does only what its first run had not finished):

- features: one shard per batch of the batch plan a single process follows (tasks/features.py:
  `extraction_batches`), so every array comes out bit for bit as a single process extracts it. Shards write
  their arrays straight into the (uncommitted) features entry, each array with its own marker, so the
  arrays of each shard are disjoint and a rerun of a shard extracts only those still missing.
- drafts: one shard per replay group (tasks/drafts.py), committed as its own small store entry
  (draft-shards: the group's per-prompt items and the worker that drafted it), so a shard finished before its
  worker died is kept, by this run and by the next one. The drafts stage merges the shards in prompt order
  into drafts.json (byte for byte the single-process file) and then removes them.

The entries record which worker computed each shard (FeaturesRecord.shards, DraftsRecord.shards: the Dask
worker's address, host, pid, seconds, and the shard's sequences or prompts), and so do the results.

What the workers need: this package importable (the same environment), the store (a shard reopens it from its
`location` and finds the references, the fetched checkpoint and the features through it, never through paths
this process computed), and the target checkpoint at the same path on every worker (`target_dir`). Each worker
process loads the target, and the drafter and token head, once and reuses them for every shard it runs
(`loaded_target`, `loaded_drafter`, `loaded_token_head`). It computes on one torch thread per worker thread
(`dask worker --nthreads N`: `use_worker_threads`). The workers are the cluster's to schedule: this process
takes no heavy-stage slot (tasks/heavy.py) for a stage it hands to them.
"""

import asyncio
import os
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import lru_cache
from typing import Any

from prefect import task
from prefect.cache_policies import NONE

from dflash_eval.storage import Store, key_of, read_json, write_json_atomic
from dflash_eval.storage.integrity import upstream_digests
from dflash_eval.storage.schema import DRAFT_SHARD_FILE, DraftShardRecord, Stage

DASK_ADDRESS_ENV = "DFLASH_DASK_ADDRESS"
CONNECT_TIMEOUT_SECONDS = 5.0  # how long the check before any work waits for the scheduler to answer


class ClusterUnreachable(ValueError):
    """No Dask scheduler answers at the address given; the message names it and says what to do."""


# ---------------------------------------------------------------- the scheduler

def check_cluster(address: str, timeout: float | None = None) -> int:
    """Ask the Dask scheduler at `address` (tcp://HOST:PORT, or HOST:PORT) who it is, waiting at most
    `timeout` seconds (default CONNECT_TIMEOUT_SECONDS); returns the workers connected to it now. Raises
    ClusterUnreachable when none answers (nothing listening, something else listening, a malformed address)."""
    timeout = CONNECT_TIMEOUT_SECONDS if timeout is None else timeout
    with ThreadPoolExecutor(1) as pool:  # a loop of its own: the caller may run in one (Prefect)
        try:
            identity = pool.submit(asyncio.run, _identity(address, timeout)).result()
        except Exception as e:  # noqa: BLE001 (a refused, timed-out or garbled connection: all say the same)
            problem = str(e) or type(e).__name__
        else:
            if isinstance(identity, dict) and identity.get("type") == "Scheduler":
                return len(identity.get("workers") or {})
            problem = f"what answered there is not a Dask scheduler ({str(identity)[:80]})"
    raise ClusterUnreachable(
        f"--dask {address}: no Dask scheduler answered there within {timeout:g} s ({problem}). Start one "
        f"(`dask scheduler`, then `dask worker {address} --nthreads 1` on each machine that computes, in this "
        "package's environment), give the address it listens on, or run without --dask (unset "
        f"${DASK_ADDRESS_ENV}) to compute in this process")


async def _identity(address: str, timeout: float) -> Any:
    from distributed.comm import connect

    comm = await connect(address, timeout=timeout)
    try:
        await comm.write({"op": "identity", "reply": True})
        return await asyncio.wait_for(comm.read(), timeout)
    finally:
        comm.abort()


def run_shards(address: str, shard_task, parameters: list[dict[str, Any]], stage: str, description: str) -> list:
    """Run `shard_task` once per item of `parameters` on the Dask cluster at `address` (prefect-dask's
    DaskTaskRunner: each is a Prefect task run of this flow run, computed by a worker); returns their results
    in the order of `parameters`. Progress counts the shards done. A shard that fails fails this call (the
    others are released); one whose worker dies is run again on another by Dask."""
    import distributed
    from prefect_dask import DaskTaskRunner

    from .progress import StageProgress

    results: list = [None] * len(parameters)
    with DaskTaskRunner(address=address, client_kwargs={"timeout": CONNECT_TIMEOUT_SECONDS}) as runner, \
            StageProgress(stage, description, len(parameters)) as progress:
        futures = [runner.submit(shard_task, parameters=p) for p in parameters]
        index = {f.wrapped_future.key: i for i, f in enumerate(futures)}
        # as they finish: a result fetched here is not lost with its worker
        pending = distributed.as_completed([f.wrapped_future for f in futures], loop=runner.client.loop)
        for done, finished in enumerate(pending, 1):
            i = index[finished.key]
            results[i] = futures[i].result()
            progress.update(done)
    return results


# ---------------------------------------------------------------- on a worker

def worker_identity() -> dict[str, Any]:
    """Who computes here: the Dask worker's address (None outside a worker), the host and the process id."""
    import distributed

    try:
        address = distributed.get_worker().address
    except ValueError:  # not in a Dask worker
        address = None
    return {"worker": address, "host": socket.gethostname(), "pid": os.getpid()}


def use_worker_threads() -> int:
    """Make this process's thread budget (tasks/threads.py) one torch thread per thread of its Dask worker
    (`dask worker --nthreads N`): each shard it runs at once leases its thread from it. Returns the budget."""
    import distributed

    from .threads import configure_threads

    try:
        threads = distributed.get_worker().state.nthreads
    except ValueError:  # not in a Dask worker: the process's own budget
        threads = None
    return configure_threads(threads, set_default=False)


_loading = threading.Lock()  # a worker with several threads loads each model once


@lru_cache(maxsize=2)
def _drafter(checkpoint_dir: str, dtype: str, device: str, sliding_semantics: str, target_dir: str):
    from dflash_core.drafter import load_drafter

    from .target import DTYPES, target_tokenizer

    return load_drafter(checkpoint_dir, dtype=DTYPES[dtype], device=device, sliding_semantics=sliding_semantics,
                        tokenizer=target_tokenizer(target_dir))


def loaded_drafter(checkpoint_dir: str, dtype: str, device: str, sliding_semantics: str, target_dir: str):
    """The drafter checkpoint in `checkpoint_dir` (a fetch entry's folder: its path names its content), loaded
    once per worker process (the target's tokenizer resolves a mask token given as a string)."""
    with _loading:
        return _drafter(checkpoint_dir, dtype, device, sliding_semantics, target_dir)


@lru_cache(maxsize=1)
def _token_head(target_dir: str, dtype: str, device: str):
    from dflash_core.token_head import load_token_head

    from .target import DTYPES

    head = load_token_head(target_dir, dtype=DTYPES[dtype])
    return head.embed_weight.to(device), head.head_weight.to(device)


def loaded_token_head(target_dir: str, dtype: str, device: str):
    """(embedding, lm_head) weights of the target, on `device`, loaded once per worker process."""
    with _loading:
        return _token_head(target_dir, dtype, device)


def _local_references(store: Store, refs):
    """`refs` as this machine holds them: its entry folder found through the store."""
    return replace(refs, path=str(store.local_entry(Stage.REFERENCES, refs.key)))


# ---------------------------------------------------------------- features

@task(name="features shard", task_run_name="features shard {label}", cache_policy=NONE, persist_result=False)
def extract_features_shard(store_location: str, features_key: str, refs, target_dir: str,
                           arrays: list[tuple[int, int]], dtype: str, device: str, label: str = "") -> dict:
    """On a worker: extract the (layer, sequence) `arrays` of one batch into features entry `features_key`,
    those the entry does not hold yet (a shard run again after its worker died does only the rest); returns
    the shard's record: its sequences, the arrays it extracted, who extracted them and how long it took."""
    from .features import _extract

    started = time.monotonic()
    use_worker_threads()
    store = Store(store_location)
    feature_store = store.feature_store(features_key)
    todo = [(layer, n) for layer, n in arrays if not feature_store.has(layer, n)]
    if todo:
        _extract(target_dir, _local_references(store, refs), todo, feature_store, dtype, device, progress=False)
    return {"sequences": sorted({n for _, n in arrays}), "arrays": len(todo), **worker_identity(),
            "seconds": round(time.monotonic() - started, 3)}


def extract_on_cluster(address: str, store: Store, features_key: str, refs, target_dir: str, missing,
                       dtype: str, device: str) -> tuple[dict, ...]:
    """Extract the `missing` (layer, sequence) arrays of features entry `features_key` on the cluster at
    `address`, one shard per batch of the single-process plan; returns the shards' records."""
    from .features import STAGE, extraction_batches
    from .references import load_references

    sequences = [item.reference.token_ids for item in load_references(refs)]
    batches = extraction_batches(sequences, missing)
    parameters = []
    for i, batch in enumerate(batches, 1):
        members = set(batch)
        parameters.append(dict(store_location=store.location, features_key=features_key, refs=refs,
                               target_dir=target_dir, arrays=[(layer, n) for layer, n in missing if n in members],
                               dtype=dtype, device=device, label=f"{i}/{len(batches)}"))
    return tuple(run_shards(address, extract_features_shard, parameters, STAGE, "feature batches extracted"))


# ---------------------------------------------------------------- drafts

def draft_shard_key(drafts_key: str, start: int, stop: int) -> str:
    """The store key of the shard of drafts entry `drafts_key` that drafts prompts start .. stop-1."""
    return key_of({"drafts": drafts_key, "prompts": [start, stop]})


@task(name="drafts shard", task_run_name="drafts shard {label}", cache_policy=NONE, persist_result=False)
def draft_shard(store_location: str, drafts_key: str, checkpoint, features, refs, target_dir: str, start: int,
                stop: int, upstream: list[str], sliding_semantics: str, dtype: str, device: str,
                all_positions: bool, label: str = "") -> dict:
    """On a worker: replay prompts start .. stop-1 (one replay group of drafts entry `drafts_key`) and commit
    their per-prompt items as a draft-shards entry, unless one is committed and fresh (its `upstream` labels:
    the drafts entry's); returns what the drafts record says of the shard (DraftShardRecord.shard)."""
    from dflash_core.drafter import check_compatible
    from dflash_core.replay import replay

    from .drafts import per_prompt_items
    from .features import FeatureReader
    from .fetch import CHECKPOINT_DIRNAME
    from .references import load_references
    from .stage import get_or_compute
    from .threads import replay_threads

    store = Store(store_location)

    def compute(entry) -> dict:
        started = time.monotonic()
        use_worker_threads()
        local_refs = _local_references(store, refs)
        checkpoint_dir = store.local_entry(Stage.FETCH, checkpoint.key) / CHECKPOINT_DIRNAME
        drafter = loaded_drafter(str(checkpoint_dir), dtype, device, sliding_semantics, target_dir)
        embed, lm_head = loaded_token_head(target_dir, dtype, device)
        check_compatible(drafter, embed.shape[1], embed.shape[0])
        items = load_references(local_refs)[start:stop]
        reader = FeatureReader(features, local_refs, target_dir, store.location, dtype, device)
        feats = (f.to(device) for f in reader.read_each(drafter.target_layer_ids, range(start, stop)))
        with replay_threads(drafter, stop - start):
            results = replay(drafter, embed, lm_head, [item.reference for item in items], feats,
                             all_positions=all_positions)
        write_json_atomic(entry / DRAFT_SHARD_FILE, {"per_prompt": per_prompt_items(items, results)})
        return DraftShardRecord(drafts=drafts_key, start=start, stop=stop, **worker_identity(),
                                seconds=round(time.monotonic() - started, 3)).to_record()

    outcome = get_or_compute(store, Stage.DRAFT_SHARDS, draft_shard_key(drafts_key, start, stop), compute,
                             upstream=lambda: upstream_digests(store, upstream))
    return DraftShardRecord.from_record(outcome.record).shard()


def draft_on_cluster(address: str, store: Store, drafts_key: str, checkpoint, features, refs, target_dir: str,
                     groups: list[tuple[int, int]], upstream: list[str], *, sliding_semantics: str, dtype: str,
                     device: str, all_positions: bool, refresh: bool = False) -> tuple[list[dict], tuple[dict, ...]]:
    """Draft each replay group of drafts entry `drafts_key` as a shard on the cluster at `address` (shards an
    interrupted run committed are kept, unless `refresh`); returns (drafts.json's per_prompt items, merged in
    prompt order; the shards' records)."""
    from .drafts import STAGE

    if refresh:  # recomputed whole, as the entry itself
        remove_draft_shards(store, drafts_key, groups)
    parameters = [dict(store_location=store.location, drafts_key=drafts_key, checkpoint=checkpoint, features=features,
                       refs=refs, target_dir=target_dir, start=start, stop=stop, upstream=list(upstream),
                       sliding_semantics=sliding_semantics, dtype=dtype, device=device, all_positions=all_positions,
                       label=f"prompts {start}-{stop - 1}")
                  for start, stop in groups]
    shards = run_shards(address, draft_shard, parameters, STAGE, "replay groups drafted")
    per_prompt = []
    for start, stop in groups:
        directory = store.local_entry(Stage.DRAFT_SHARDS, draft_shard_key(drafts_key, start, stop))
        per_prompt += read_json(directory / DRAFT_SHARD_FILE)["per_prompt"]
    return per_prompt, tuple(shards)


def remove_draft_shards(store: Store, drafts_key: str, groups: list[tuple[int, int]]) -> None:
    """Remove the draft-shards entries of drafts entry `drafts_key` (once drafts.json holds them, or before
    a refresh drafts every group again)."""
    for start, stop in groups:
        key = draft_shard_key(drafts_key, start, stop)
        with store.lock(Stage.DRAFT_SHARDS, key):
            store.remove(Stage.DRAFT_SHARDS, key)
