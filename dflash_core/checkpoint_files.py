"""What a checkpoint folder holds, read from its files alone: its safetensors (one file or an index
and the shards it names), and, for a drafter checkpoint, which files evaluation needs, whether it is
finished, and its training step.

A pure-file module: the standard library only (safetensors headers are read as the bytes they are),
so it imports no torch. That is why it is the one module of dflash_core that `dflash_eval.storage`
may import (the relay and the fetch stage tell checkpoints apart with it, on training boxes too);
nothing else in storage depends on dflash_core.

Safetensors weights (targets and drafters alike)
    `model.safetensors`, or `model.safetensors.index.json` whose `weight_map` names, per tensor, the
    shard file beside it that holds it. `has_safetensors`, `weight_map`, `weight_files` and
    `tensor_files` read them; a malformed index, shards it names that are not there, or a folder
    with neither file raise WeightFilesError, whose message names the file and what is wrong.

Drafter checkpoint layouts
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
    layout "speculators" vLLM's speculators trainer: a numbered folder per save (`0/`, `1/`, ...) holding
                        config.json (its own format: dflash_core.speculators_format) + model.safetensors
                        beside optimizer_state_dict.pt, scheduler_state_dict.pt and training_state.json,
                        with `epoch{E}_step{S}`, `epoch{E}_end` and `checkpoint_best` links to them in
                        the save root. Only config.json, the weights and training_state.json are taken.

    Besides those, small files that name the step (trainer_state.json, training_state.json) travel, and `include` patterns
    (fnmatch, on file names) widen the set when a user needs more. Only regular files directly in the
    folder count, never hidden ones (names starting with '.').

Readiness
    A checkpoint is *ready* when none of its files (all of them, optimizer and temporary files
    included: a trainer writes those too) changed for `settle_seconds`, no temporary file of a weight
    file is there (`*.tmp`, `*.partial`, hidden files), every shard its index names exists, and every
    weight file is whole (a safetensors file is as long as its header says; training_state.pt is a
    zip whose central directory, written last, is there). Trainers write no "done" marker, so this is
    how a checkpoint still being written is told from a finished one.

Training step
    config.json {"step": N} or {"global_step": N}, trainer_state.json {"global_step": N} (HF Trainer),
    training_state.json {"global_step": N} (speculators), then the folder name's trailing number (step_1000, checkpoint-1000, run1-step1000,
    epoch_2_step_1000).
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
from typing import Any

CONFIG = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
TRAINING_STATE = "training_state.pt"  # SpecForge's shared payload (its CheckpointManager.STATE_FILE)
WEIGHT_FILE_NAMES = f"{SINGLE_FILE}, {INDEX_FILE} or SpecForge's {TRAINING_STATE}"  # for messages
# where a save's training step is written: Hugging Face's Trainer, and speculators' trainer (its global_step)
STEP_FILES = ("trainer_state.json", "training_state.json")
TEMPORARY_SUFFIXES = (".tmp", ".partial", ".incomplete", ".lock")
MAX_HEADER_BYTES = 100 << 20  # safetensors' own limit on a header's length

# a save's step ends its name, alone or after a separator or a step word (step_400, checkpoint-1000, iter42, run-step1500,
# speculators' 3); a number glued to another letter is part of a model's name (Qwen3-8B-DFlash-b16), not a step
_TRAILING_NUMBER = re.compile(r"(?:^|[-_.]|step|iter|ckpt|checkpoint)(\d+)$", re.IGNORECASE)
_SHARD = re.compile(r"^model-(\d+)-of-(\d+)\.safetensors$")


class WeightFilesError(ValueError):
    """A folder whose safetensors weights cannot be listed: neither file, a malformed index, or shards
    its index names that are not there."""


class CheckpointBroken(ValueError):
    """A settled checkpoint whose weight files are not whole (truncated, not safetensors, ...)."""


class NotACheckpoint(FileNotFoundError):
    """A settled folder that holds no drafter weights (a run folder, a typo, a folder of other files)."""


# ---------------------------------------------------------------- safetensors files and indexes


def _read_json(path: Path) -> Any:
    return json.loads(path.read_bytes().decode("utf-8"))


def read_index(index_file: str | os.PathLike) -> dict[str, str]:
    """The `weight_map` of a safetensors index file: tensor name -> shard file name (beside the index).

    Raises WeightFilesError when it is not an index (not JSON, no weight_map object, a shard name that
    is not a plain file name), OSError when it cannot be read."""
    index_file = Path(index_file)
    try:
        weight_map = _read_json(index_file)["weight_map"]
    except (ValueError, KeyError, TypeError) as e:  # not JSON (or UTF-8), no weight_map, not an object
        raise WeightFilesError(f"{index_file}: not a safetensors index ({type(e).__name__}: {e})") from None
    if not isinstance(weight_map, dict):
        raise WeightFilesError(f"{index_file}: not a safetensors index (weight_map is not an object)")
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or shard in ("", ".", "..") or "/" in shard or "\\" in shard:
            raise WeightFilesError(f"{index_file}: not a safetensors index (tensor {name!r} is mapped to "
                                   f"{shard!r}, not a file name beside the index)")
    return weight_map


def has_safetensors(folder: str | os.PathLike) -> bool:
    """Whether the folder keeps its weights as safetensors: a model.safetensors or an index."""
    folder = Path(folder)
    return (folder / SINGLE_FILE).is_file() or (folder / INDEX_FILE).is_file()


def weight_map(folder: str | os.PathLike) -> dict[str, str] | None:
    """The folder's index as tensor name -> shard file name, or None when it has no INDEX_FILE.

    Raises WeightFilesError for a malformed index (`read_index`)."""
    index_file = Path(folder) / INDEX_FILE
    return read_index(index_file) if index_file.is_file() else None


def weight_files(folder: str | os.PathLike) -> list[Path]:
    """The safetensors files that hold the folder's weights: the shards its index names (sorted), else
    its model.safetensors.

    Raises WeightFilesError, naming what is wrong, for a folder that is not there or holds neither
    file, a malformed index, or an index that names shards that are not there."""
    folder = Path(folder)
    if not folder.is_dir():
        raise WeightFilesError(f"{folder} does not exist or is not a folder")
    shards = weight_map(folder)
    if shards is None:
        if (folder / SINGLE_FILE).is_file():
            return [folder / SINGLE_FILE]
        raise WeightFilesError(f"{folder}: no {SINGLE_FILE} or {INDEX_FILE}")
    files = sorted({folder / name for name in shards.values()})
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise WeightFilesError(f"{folder / INDEX_FILE} names shard files that are not there: {missing}")
    return files


def safetensors_header(path: str | os.PathLike) -> tuple[dict, int]:
    """(the JSON header of a safetensors file, the offset where its tensor data begins).

    The header maps tensor names to dtype, shape and data_offsets (relative to that offset), beside
    `__metadata__`. Raises ValueError, its message starting with the file's name, for a file too
    short or whose header is not one; OSError when it cannot be read."""
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(8)
        size = os.fstat(f.fileno()).st_size
        if len(head) < 8:
            raise ValueError(f"{path.name} is {size} bytes: too short for a safetensors file")
        (header_len,) = struct.unpack("<Q", head)
        if header_len > min(size - 8, MAX_HEADER_BYTES):
            raise ValueError(f"{path.name} is not a safetensors file (header length {header_len}, file {size} bytes)")
        try:
            header = json.loads(f.read(header_len))
        except ValueError as e:  # not JSON, or not UTF-8
            raise ValueError(f"{path.name} is not a safetensors file (header: {type(e).__name__}: {e})") from None
    if not isinstance(header, dict):
        # a file's content, not an argument's type: the callers' ValueError
        raise ValueError(f"{path.name} is not a safetensors file (its header is not a JSON object)")  # noqa: TRY004
    return header, 8 + header_len


def tensor_files(folder: str | os.PathLike) -> dict[str, Path]:
    """Tensor name -> the safetensors file of `folder` that holds it: from its index, else from its
    model.safetensors' header. Raises WeightFilesError as `weight_files` does."""
    folder = Path(folder)
    files = weight_files(folder)
    shards = weight_map(folder)
    if shards is not None:
        return {name: folder / shard for name, shard in shards.items()}
    try:
        header, _ = safetensors_header(files[0])
    except (OSError, ValueError) as e:
        raise WeightFilesError(f"{files[0]}: cannot read its safetensors header ({e})") from None
    return {name: files[0] for name in header if name != "__metadata__"}


def weight_file_problem(path: str | os.PathLike) -> str | None:
    """Why a weight file is not whole, or None. Reads only its header (safetensors) or its end (zip)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        if path.name.endswith(".safetensors"):
            header, data_start = safetensors_header(path)
            ends = [t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"]
            expected = data_start + max(ends, default=0)
            if size != expected:
                return f"{path.name} has {size} bytes where its header describes {expected}"
        elif path.suffix == ".pt" and size and not zipfile.is_zipfile(path):
            with open(path, "rb") as f:
                legacy = f.read(2) == b"\x80\x02"  # torch.save before 1.6: a bare pickle, no end marker to check
            if not legacy:
                return f"{path.name} is not a complete torch.save file (no zip end record)"
    except ValueError as e:  # safetensors_header names the file
        return str(e)
    except (OSError, KeyError, TypeError, IndexError) as e:
        return f"{path.name} cannot be read as a weight file ({type(e).__name__}: {e})"
    return None


# ---------------------------------------------------------------- drafter checkpoints


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
    def weight_names(self) -> list[str]:
        """The names among `files` that hold weights (safetensors files, SpecForge's payload)."""
        return [n for n in self.files if n.endswith(".safetensors") or n == TRAINING_STATE]


def _regular_files(directory: Path) -> dict[str, float]:
    """{name: mtime} of the regular files directly in `directory` (symlinked files too), hidden ones
    included. A symlink's mtime is its own: when it was made, not when its target last changed."""
    found: dict[str, float] = {}
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
    """The shard names an index names; None while it is not (yet) one: still being written, or gone."""
    try:
        return set(read_index(index_file).values())
    except (OSError, WeightFilesError):
        return None


def checkpoint_files(directory: str | os.PathLike, include: Iterable[str] = ()) -> CheckpointFiles | None:
    """The files evaluation takes from the checkpoint in `directory`, or None when it holds no
    drafter weights in a known layout (module docstring). Shards an index names but that are
    missing are left to `not_ready` to report."""
    directory = Path(directory)
    present = {n for n in _regular_files(directory) if not n.startswith(".")}
    if INDEX_FILE in present:
        shards = _index_shards(directory / INDEX_FILE) or set()
        layout, weights = "hf", {INDEX_FILE} | (shards & present)
    elif SINGLE_FILE in present:
        layout, weights = "hf", {SINGLE_FILE}
        if CONFIG in present and _written_by_speculators(directory / CONFIG):
            layout = "speculators"
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


def _written_by_speculators(config_file: Path) -> bool:
    """Whether a config.json is a speculators save's (vLLM's trainer; dflash_core.speculators_format)."""
    try:
        config = _read_json(config_file)
    except (OSError, ValueError):
        return False  # (the config's own check says what is wrong with it)
    return isinstance(config, dict) and "speculators_model_type" in config


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
    if shards and (found is None or INDEX_FILE not in found.files):  # save_pretrained writes the index after the shards
        return f"shards {shards[:4]} without {INDEX_FILE} yet"
    if found is None:
        if temporary:
            return f"no drafter weights yet, temporary files {temporary[:4]}"
        raise NotACheckpoint(f"{directory} holds no drafter weights ({WEIGHT_FILE_NAMES})")
    weight_temporaries = [n for n in temporary if ".safetensors" in n or TRAINING_STATE in n]
    if weight_temporaries:
        return f"temporary files {weight_temporaries} are still there"
    if INDEX_FILE in found.files:
        # The file found (the relay's resolved path inside its folder), not the folder's name for it.
        try:
            indexed = set(read_index(found.files[INDEX_FILE]).values())
        except (OSError, WeightFilesError) as e:
            raise CheckpointBroken(str(e)) from None
        missing = sorted(indexed - set(found.files))
        if missing:
            return f"{INDEX_FILE} names shards that are not there yet: {missing[:4]}"
    for name in found.weight_names:
        problem = weight_file_problem(found.files[name])
        if problem:
            raise CheckpointBroken(f"{directory}: {problem}")
    return None


def saves_beneath(directory: str | os.PathLike, settle_seconds: float, settle_option: str = "--settle-seconds") -> str | None:
    """For a settled folder without drafter weights of its own (not_ready raised NotACheckpoint), what its
    sub-folders hold, said as the end of the refusal ("...holds no drafter weights; <this>"); None when none of
    them is a checkpoint either. A training run's folder whose saves are younger than `settle_seconds` is told
    apart from one whose saves are finished: its saves are named, with when they count (settled), not sent to
    be passed one by one."""
    directory = Path(directory)
    try:
        folders = [p for p in directory.iterdir() if p.is_dir() and not p.name.startswith(".")]
    except OSError:
        return None
    finished, settling, newest = [], [], 0.0
    for folder in sorted(folders, key=lambda p: (step_from_name(p.name) is None, step_from_name(p.name) or 0, p.name)):
        found = checkpoint_files(folder)
        if found is None:
            continue
        try:
            pending = not_ready(folder, settle_seconds, found)
        except (CheckpointBroken, FileNotFoundError):  # broken (fetching it says why), or gone meanwhile
            pending = None
        if pending is None:
            finished.append(folder.name)
        else:
            settling.append(folder.name)
            newest = max(newest, max(_regular_files(folder).values(), default=0.0))
    if not settling:
        return f"its sub-folders {finished[:4]} do: pass one of them" if finished else None
    age = max(0.0, time.time() - newest)
    saves = (f"its saves {', '.join(settling[:4])}{' ...' if len(settling) > 4 else ''} are" if len(settling) > 1
             else f"its save {settling[0]} is")
    said = (f"it is a training run's folder: {saves} still being written (last change {age:.0f} s ago; "
            f"{'they count' if len(settling) > 1 else 'it counts'} once unchanged for {settle_seconds:g} s: wait and "
            f"run again, or lower {settle_option})")
    if finished:
        said += f"; {', '.join(finished[:4])} {'are' if len(finished) > 1 else 'is'} finished and can be passed now"
    return said


def training_step(directory: str | Path, name: str | None = None) -> int | None:
    """The training step of the checkpoint in `directory` (None when nothing says).

    name: the checkpoint's name when it differs from the folder's (a store copy of a relay path)."""
    directory = Path(directory)
    for file, fields in ((CONFIG, ("step", "global_step")), *((name, ("global_step",)) for name in STEP_FILES)):
        try:
            record = _read_json(directory / file)
        except (OSError, ValueError):
            continue
        for field in fields:
            step = record.get(field) if isinstance(record, dict) else None
            if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
                return step
    return step_from_name(name if name is not None else directory.name)


def step_from_name(name: str) -> int | None:
    """The training step a checkpoint's name ends with (see _TRAILING_NUMBER), or None."""
    match = _TRAILING_NUMBER.search(name.rstrip("/").rsplit("/", 1)[-1])
    return int(match.group(1)) if match else None


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")  # Org/Name, never a path like ./x/y
COMMIT_HASH = re.compile(r"[0-9a-f]{10,64}")  # a folder named by a commit (a hub cache snapshot)


def model_name(target_dir: str) -> str:
    """How people call a target, for series titles and tags: the Hub id its config was saved under
    (`_name_or_path`, e.g. Qwen/Qwen3-8B), else the one in a Hugging Face cache path
    (.../models--Qwen--Qwen3-8B/snapshots/<commit>), else its folder's name (its parent's when the folder is
    named by a commit hash). Reads nothing but config.json, and only when it is on this machine."""
    path = Path(str(target_dir).rstrip("/"))
    try:
        saved_as = json.loads((path / "config.json").read_text()).get("_name_or_path")
    except (OSError, ValueError, AttributeError):
        saved_as = None
    if isinstance(saved_as, str) and _HUB_ID.fullmatch(saved_as):
        return saved_as
    for part in reversed(path.parts):
        if part.startswith("models--"):
            return part.removeprefix("models--").replace("--", "/", 1)
    if COMMIT_HASH.fullmatch(path.name) and path.parent.name:
        return path.parent.name
    return path.name or str(target_dir)
