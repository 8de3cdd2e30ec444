"""The stages and devices an evaluation may name: Literal types for the flow's parameters (Prefect shows them as
dropdowns in the deployment forms) and their values. Imports neither torch nor Prefect, so that the command
line builds its choices from them before it imports either."""

from typing import Literal, get_args

StageName = Literal["fetch", "references", "features", "drafts", "scores", "diagnostics"]
STAGES = get_args(StageName)  # in pipeline order
DeviceName = Literal["cpu", "cuda"]
DEVICES = get_args(DeviceName)
