"""Shards of a stage on a Dask cluster (`--dask ADDRESS`, $DFLASH_DASK_ADDRESS, the flow parameter `dask_address`).

The features and drafts stages stay Prefect tasks of the flow run and still get their entries through the
store's get-or-compute (tasks/stage.py): this process holds the entry's lock and commits it. What they compute
is split into shards, each a Prefect task of the stage's own (tasks/features.py: `features shard`, one per batch
of the single-process batch plan; tasks/drafts.py: `drafts shard`, one per replay group), which `run_shards`
submits through prefect-dask's `DaskTaskRunner` to the scheduler at the address, and so the cluster's workers
run (Dask reschedules the shards of a worker that dies on the others; a shard run again does only what its
first run had not finished). This module knows no stage: each stage passes in its shard task.

What the workers need: this package importable (the same environment), the store (a shard reopens it from its
location and finds the references, the fetched checkpoint and the features through it, never through paths
this process computed), and the target checkpoint at the same path on every worker. Each worker process loads
its models once and reuses them for every shard it runs (`load_once`), and computes on one torch thread per
worker thread (`dask worker --nthreads N`: `use_worker_threads`). The workers are the cluster's to schedule:
this process takes no heavy-stage slot (tasks/heavy.py) for a stage it hands to them. The entries and the
results record which worker computed each shard (`worker_identity`).
"""

import asyncio
import os
import socket
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .progress import StageProgress
from .threads import configure_threads

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

    try:
        threads = distributed.get_worker().state.nthreads
    except ValueError:  # not in a Dask worker: the process's own budget
        threads = None
    return configure_threads(threads, set_default=False)


_loading = threading.Lock()  # a worker with several threads loads each model once
_loaded: OrderedDict[tuple, Any] = OrderedDict()
KEPT_MODELS = 3  # a worker's drafter(s) of the run and the target's token head


def load_once(key: tuple, load: Callable[[], Any]) -> Any:
    """`load()`, made once per `key` for the life of this process (a worker's models, whatever number of shards
    it runs: the KEPT_MODELS used last are kept), by one thread at a time."""
    with _loading:
        if key not in _loaded:
            _loaded[key] = load()
            while len(_loaded) > KEPT_MODELS:
                _loaded.popitem(last=False)
        _loaded.move_to_end(key)
        return _loaded[key]
