"""The stages and devices an evaluation may name: Literal types for the flow's parameters (Prefect shows them as
dropdowns in the deployment forms) and their values. Imports neither torch nor Prefect, so that the command
line builds its choices from them before it imports either. The stage names are the store's (storage.schema)."""

from typing import Literal, get_args

from dflash_eval.storage.schema import Stage

# the stages of an evaluation, in pipeline order (the store's other stages are bookkeeping: baselines, shards)
STAGES = tuple(stage.value for stage in (Stage.FETCH, Stage.REFERENCES, Stage.FEATURES, Stage.DRAFTS, Stage.SCORES,
                                         Stage.DIAGNOSTICS))
StageName = Literal[STAGES]  # type: ignore[valid-type]
DeviceName = Literal["cpu", "cuda"]
DEVICES = get_args(DeviceName)
