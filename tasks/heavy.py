"""One heavy stage at a time per machine: features, drafts and diagnostics hold the CPU/GPU and the
memory of a whole model, so flow runs started by deployments on one machine (a watcher starting
several evaluations, events arriving together) take turns through a Prefect global concurrency limit
named after the machine. It is created with 1 slot on first use; raise it on the server to allow more
(`prefect gcl update dflash-heavy-stages-<host> --limit 2`). Cached stages never take a slot.

Only deployment runs take slots. They need a real `prefect server start`, whose repossessor frees
the slot of a run that died holding it once its 60 s lease lapses. The temporary server of a run by
hand has no repossessor, so a killed `dflash-eval run` would hold its slot for good; runs by hand
rely on the store's entry locks alone (two of them never compute the same entry twice).

A deployment run's default thread budget is the machine's cores divided by the slots (tasks/threads.py).
"""

import re
import socket
from contextlib import contextmanager
from functools import cache

from prefect import get_client, get_run_logger
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.concurrency.sync import concurrency
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound
from prefect.runtime import deployment

DEFAULT_SLOTS = 1
LEASE_SECONDS = 60  # the server's minimum: how long a dead holder keeps its slot
SLOT_TAKEN, SLOT_RELEASED = "took a heavy-stage slot of", "released a heavy-stage slot of"  # log lines


def heavy_limit_name() -> str:
    """The concurrency limit of this machine's heavy stages."""
    host = re.sub(r"[^a-z0-9-]+", "-", socket.gethostname().lower()).strip("-") or "host"
    return f"dflash-heavy-stages-{host}"


@cache
def _ensure_limit(name: str, api_url: str) -> int:
    """Creates the limit `name` on the server at `api_url` if it is not there; returns its slots."""
    with get_client(sync_client=True) as client:
        try:
            return client.read_global_concurrency_limit_by_name(name).limit
        except ObjectNotFound:
            try:
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=DEFAULT_SLOTS))
            except ObjectAlreadyExists:  # another run created it first
                return client.read_global_concurrency_limit_by_name(name).limit
            return DEFAULT_SLOTS


def heavy_stages_at_once() -> int | None:
    """How many heavy stages may compute at once on this machine, as this run sees it: the machine's
    heavy-stage limit in a deployment run (read from the server; created with DEFAULT_SLOTS); None in a run
    by hand, which takes no slot (tasks/threads.py then counts the runs by hand computing at once). The
    default thread budget divides the cores by it."""
    from prefect.settings import PREFECT_API_URL

    if deployment.id is None:
        return None
    return max(1, _ensure_limit(heavy_limit_name(), str(PREFECT_API_URL.value())))


@contextmanager
def heavy_stage():
    """Hold one of this machine's heavy-stage slots (waits for a free one) in a deployment run."""
    from prefect.settings import PREFECT_API_URL

    if deployment.id is None:  # a run by hand: see the module docstring
        yield
        return
    name = heavy_limit_name()
    _ensure_limit(name, str(PREFECT_API_URL.value()))  # per server: a test session may talk to several
    logger = get_run_logger()
    with concurrency(name, occupy=1, strict=True, lease_duration=LEASE_SECONDS):
        logger.info(f"{SLOT_TAKEN} {name}")
        try:
            yield
        finally:
            logger.info(f"{SLOT_RELEASED} {name}")


def heavy(compute):
    """`compute` (a stage's get_or_compute function), run while holding a heavy-stage slot."""
    def run(entry):
        with heavy_stage():
            return compute(entry)
    return run
