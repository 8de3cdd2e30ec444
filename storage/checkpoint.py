"""What a drafter checkpoint folder holds: which of its files evaluation needs, whether it is
finished, and its training step.

Training saves are mostly optimizer state (a 17 GB save of a Qwen3.6-27B drafter holds ~3.5 GB
of weights), so only the files the drafter needs are ever hashed, sent or stored:

  layout "hf"         a `save_pretrained` folder: config.json + model.safetensors, or
                      model.safetensors.index.json + the shards it names. SpecForge's older
                      `epoch_{E}_step_{S}/` saves are such folders plus a training_state.pt
                      (optimizer, args), which is left out.
  layout "specforge"  SpecForge's CheckpointManager (`specforge/training/checkpoint.py`):
                      `{run_id}-step{N}/training_state.pt`, the rank-0 payload that holds the
                      drafter's weights (`draft_state_dict`), beside `training_state_rank{r}.pt`
                      per rank (FSDP optimizer shards, RNG), which are left out. It has no
                      config.json: the drafter config comes from the run folder (its parent)
                      when one is there, else from the user (`--drafter-config`).

Besides those, small files that name the step (trainer_state.json) travel, and `include` patterns
(fnmatch, on file names) widen the set when a user needs more. Only regular files directly in the
folder count, never hidden ones (names starting with '.').

A checkpoint is *ready* when none of its files (all of them, optimizer and temporary files
included: a trainer writes those too) changed for `settle_seconds`, no temporary file of a weight
file is there (`*.tmp`, `*.partial`, hidden files), every shard its index names exists, and every
weight file is whole (a safetensors file is as long as its header says; training_state.pt is a zip
whose central directory, written last, is there). Trainers write no "done" marker, so this is how a
checkpoint still being written is told from a finished one.

The training step: config.json {"step": N} or {"global_step": N}, trainer_state.json
{"global_step": N} (HF Trainer), then the folder name's trailing number (step_1000,
checkpoint-1000, run1-step1000, epoch_2_step_1000).
"""

import fnmatch
import json
import os
import re
import struct
import time
import zipfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from .records import read_json

CONFIG = "config.json"
WEIGHTS = "model.safetensors"
INDEX = "model.safetensors.index.json"
TRAINING_STATE = "training_state.pt"  # SpecForge's shared payload (its CheckpointManager.STATE_FILE)
STEP_FILES = ("trainer_state.json",)
LAYOUTS = ("hf", "specforge")
TEMPORARY_SUFFIXES = (".tmp", ".partial", ".incomplete", ".lock")

_TRAILING_NUMBER = re.compile(r"(\d+)$")
_SHARD = re.compile(r"^model-(\d+)-of-(\d+)\.safetensors$")


class CheckpointBroken(ValueError):
    """A settled checkpoint whose weight files are not whole (truncated, not safetensors, ...)."""


class NotACheckpoint(FileNotFoundError):
    """A settled folder that holds no drafter weights (a run folder, a typo, a folder of other files)."""


@dataclass(frozen=True)
class CheckpointFiles:
    """The files of one checkpoint folder that evaluation takes.

    layout: "hf" or "specforge" (module docstring).
    files: name in the checkpoint -> the file to read. config.json may be the run folder's.
    config_source: "checkpoint", "run folder", or None (no config: the user must give one).
    """

    directory: Path
    layout: str
    files: dict[str, Path]
    config_source: str | None

    @property
    def weight_files(self) -> list[str]:
        return [n for n in self.files if n.endswith(".safetensors") or n == TRAINING_STATE]


def _regular_files(directory: Path) -> dict[str, float]:
    """{name: mtime} of the regular files directly in `directory` (symlinked files too), hidden ones
    included. A symlink's mtime is its own: when it was made, not when its target last changed."""
    found = {}
    try:
        entries = list(os.scandir(directory))
    except OSError:
        return found
    for entry in entries:
        try:
            if entry.is_file():
                found[entry.name] = entry.stat(follow_symlinks=False).st_mtime
        except OSError:  # vanished while we looked
            continue
    return found


def _index_shards(index_file: Path) -> set[str] | None:
    try:
        weight_map = read_json(index_file)["weight_map"]
        return {name for name in weight_map.values() if isinstance(name, str)}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None  # an index still being written, or not an index


def checkpoint_files(directory: str | os.PathLike, include: Iterable[str] = ()) -> CheckpointFiles | None:
    """The files evaluation takes from the checkpoint in `directory`, or None when it holds no
    drafter weights in a known layout (module docstring). Shards an index names but that are
    missing are left to `not_ready` to report."""
    directory = Path(directory)
    present = {n for n in _regular_files(directory) if not n.startswith(".")}
    if INDEX in present:
        shards = _index_shards(directory / INDEX) or set()
        layout, weights = "hf", {INDEX} | (shards & present)
    elif WEIGHTS in present:
        layout, weights = "hf", {WEIGHTS}
    elif TRAINING_STATE in present:
        layout, weights = "specforge", {TRAINING_STATE}
    else:
        return None
    names = weights | (present & {CONFIG, *STEP_FILES})
    names |= {n for n in present for pattern in include if fnmatch.fnmatchcase(n, pattern)}
    files = {name: directory / name for name in sorted(names)}
    config_source = "checkpoint" if CONFIG in names else None
    if config_source is None and (directory.parent / CONFIG).is_file():
        # A run folder that holds the drafter config beside its step folders.
        files[CONFIG] = directory.parent / CONFIG
        config_source = "run folder"
    return CheckpointFiles(directory, layout, dict(sorted(files.items())), config_source)


def weight_file_problem(path: str | os.PathLike) -> str | None:
    """Why a weight file is not whole, or None. Reads only its header (safetensors) or its end (zip)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if path.name.endswith(".safetensors"):
            with open(path, "rb") as f:
                head = f.read(8)
                if len(head) < 8:
                    return f"{path.name} is {size} bytes: too short for a safetensors file"
                (header_len,) = struct.unpack("<Q", head)
                if header_len > min(size - 8, 100 << 20):
                    return f"{path.name} is not a safetensors file (header length {header_len}, file {size} bytes)"
                header = json.loads(f.read(header_len))
            ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"]
            expected = 8 + header_len + max(ends, default=0)
            if size != expected:
                return f"{path.name} has {size} bytes where its header describes {expected}"
        elif path.suffix == ".pt" and size and not zipfile.is_zipfile(path):
            with open(path, "rb") as f:
                legacy = f.read(2) == b"\x80\x02"  # torch.save before 1.6: a bare pickle, no end marker to check
            if not legacy:
                return f"{path.name} is not a complete torch.save file (no zip end record)"
    except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error, UnicodeDecodeError) as e:
        return f"{path.name} cannot be read as a weight file ({type(e).__name__}: {e})"
    return None


def not_ready(directory: str | os.PathLike, settle_seconds: float, found: CheckpointFiles | None = None) -> str | None:
    """Why the checkpoint in `directory` is still being written (None: it is ready to fetch).

    Raises CheckpointBroken for a settled checkpoint whose weight files are not whole,
    NotACheckpoint for a settled folder without drafter weights, and FileNotFoundError when
    `directory` does not exist."""
    directory = Path(directory)
    if not directory.is_dir():
        raise FileNotFoundError(f"no folder {directory}")
    stats = _regular_files(directory)
    newest = max(stats.values(), default=directory.stat().st_mtime)
    age = time.time() - newest
    if age < settle_seconds:
        return f"a file changed {age:.0f} s ago; ready once none changed for {settle_seconds:g} s"
    found = found or checkpoint_files(directory)
    temporary = sorted(n for n in stats if n.startswith(".") or n.endswith(TEMPORARY_SUFFIXES))
    shards = sorted(n for n in stats if _SHARD.match(n))
    if shards and (found is None or INDEX not in found.files):  # save_pretrained writes the index after the shards
        return f"shards {shards[:4]} without {INDEX} yet"
    if found is None:
        if temporary:
            return f"no drafter weights yet, temporary files {temporary[:4]}"
        raise NotACheckpoint(f"{directory} holds no drafter weights ({WEIGHTS}, {INDEX} or SpecForge's {TRAINING_STATE})")
    weight_temporaries = [n for n in temporary if ".safetensors" in n or TRAINING_STATE in n]
    if weight_temporaries:
        return f"temporary files {weight_temporaries} are still there"
    if INDEX in found.files:
        shards = _index_shards(found.files[INDEX])
        if shards is None:
            raise CheckpointBroken(f"{directory / INDEX} is not a safetensors index (no weight_map)")
        missing = sorted(shards - set(found.files))
        if missing:
            return f"{INDEX} names shards that are not there yet: {missing[:4]}"
    for name in found.weight_files:
        problem = weight_file_problem(found.files[name])
        if problem:
            raise CheckpointBroken(f"{directory}: {problem}")
    return None


def training_step(directory: str | Path, name: str | None = None) -> int | None:
    """The training step of the checkpoint in `directory` (None when nothing says).

    name: the checkpoint's name when it differs from the folder's (a store copy of a relay path)."""
    directory = Path(directory)
    for file, fields in ((CONFIG, ("step", "global_step")), ("trainer_state.json", ("global_step",))):
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
