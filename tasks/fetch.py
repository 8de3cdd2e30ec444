"""Fetch stage: bring a drafter checkpoint into the store, verified, keyed by its files' digests."""

import re
import shutil
from dataclasses import dataclass
from pathlib import Path

from prefect import task
from prefect.cache_policies import NONE

from storage import Store, directory_digest, file_sha256

from .stage import cached, run_entry

STAGE = "fetch"
CHECKPOINT_DIRNAME = "checkpoint"
_STEP_RE = re.compile(r"(?:step|checkpoint|ckpt|iter)[_-]?(\d+)$", re.IGNORECASE)


@dataclass(frozen=True)
class Checkpoint:
    """A drafter checkpoint held in the store."""

    key: str  # content key: digest of its files
    path: str  # the checkpoint folder inside the store entry
    source: str  # where it was fetched from
    step: int | None  # training step, from the folder name (step_1000, checkpoint-1000, ...)


def training_step(source: str) -> int | None:
    """The training step a checkpoint's folder name states, if any."""
    match = _STEP_RE.search(Path(source.rstrip("/")).name)
    return int(match.group(1)) if match else None


@task(name="fetch", cache_policy=NONE, persist_result=False)
def fetch_checkpoint(source: str, store_root: str, refresh: bool = False):
    """Copy a local checkpoint folder into the store (verified by sha256) unless it is already there."""
    store = Store(store_root)
    src = Path(source)
    digest = directory_digest(src, cache=store.digest_cache())

    def compute(entry: Path) -> dict:
        # A copy, not a link: trainers overwrite files in place, which would change a hard link's content.
        destination = entry / CHECKPOINT_DIRNAME
        destination.mkdir(exist_ok=True)
        for name, sha in digest.files.items():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src / name, destination / name)
            if file_sha256(destination / name) != sha:
                raise OSError(f"{src / name} changed while it was copied into the store; run again once it is stable")
        return {"files": digest.files, "source": str(src.resolve()), "step": training_step(source)}

    record, computed = run_entry(store, STAGE, digest.key, compute, refresh)
    checkpoint = Checkpoint(
        key=digest.key,
        path=str(store.entry(STAGE, digest.key) / CHECKPOINT_DIRNAME),
        source=source,
        step=record["step"],
    )
    return checkpoint if computed else cached(checkpoint)
