"""What a drafter checkpoint folder says about itself: its training step.

Trainers record the step in different places; the first one found wins:
  config.json {"step": N} or {"global_step": N}, trainer_state.json {"global_step": N} (HF Trainer),
  then the folder name's trailing number (step_1000, checkpoint-1000, iter1000).
"""

import re
from pathlib import Path

from .records import read_json

_TRAILING_NUMBER = re.compile(r"(\d+)$")


def training_step(directory: str | Path, name: str | None = None) -> int | None:
    """The training step of the checkpoint in `directory` (None when nothing says).

    name: the checkpoint's name when it differs from the folder's (a store copy of a relay path)."""
    directory = Path(directory)
    for file, fields in (("config.json", ("step", "global_step")), ("trainer_state.json", ("global_step",))):
        try:
            record = read_json(directory / file)
        except (OSError, ValueError):
            continue
        for field in fields:
            step = record.get(field) if isinstance(record, dict) else None
            if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
                return step
    return step_from_name(name if name is not None else directory.name)


def step_from_name(name: str) -> int | None:
    """The trailing number of a checkpoint's name, or None."""
    match = _TRAILING_NUMBER.search(name.rstrip("/").rsplit("/", 1)[-1])
    return int(match.group(1)) if match else None
