"""Baselines stage: marks a checkpoint as scored as a baseline (`dflash-eval run --baseline`).

One entry per checkpoint key, holding its source and step. reporting/history.py lists such checkpoints as rows of
their own, never the best and never a regression, except a save of a training run of the series (a step, in the
run folder of a checkpoint of the series not scored as a baseline), which stays a step of the curve: comparing two
saves of one run changes the history of neither, whichever was scored first (the entry says only that it was
compared against; the history decides from what the store holds).
"""

from prefect import task
from prefect.cache_policies import NONE
from prefect.states import State

from dflash_eval.storage import Store
from dflash_eval.storage.schema import BaselineRecord, Stage

from .fetch import Checkpoint
from .stage import cached, get_or_compute

STAGE = Stage.BASELINES


@task(name="baselines", cache_policy=NONE, persist_result=False)
def mark_baseline(checkpoint: Checkpoint, store_location: str) -> str | State:
    """Record in the store that `checkpoint` is scored as a baseline: its key (a Cached state when recorded
    already)."""
    outcome = get_or_compute(Store(store_location), STAGE, checkpoint.key,
                             lambda entry: BaselineRecord(source=checkpoint.source, step=checkpoint.step).to_record())
    return checkpoint.key if outcome.computed else cached(checkpoint.key)
