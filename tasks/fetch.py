"""Fetch stage: bring a drafter checkpoint into the store, verified, keyed by its files' digests.

Sources: a local folder (or `file://` URL), or a relay URL `http(s)://relay:port/<path>` (see
storage/relay_server.py). Both give the same key for the same files, so a checkpoint fetched once is
never downloaded or copied again, whichever way it is named.
"""

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from prefect import task
from prefect.cache_policies import NONE

from storage import Store, directory_digest, file_sha256
from storage.checkpoint import step_from_name, training_step
from storage.relay_client import RelayClient, parse_checkpoint_url

from .progress import StageProgress
from .stage import cached, run_entry

STAGE = "fetch"
CHECKPOINT_DIRNAME = "checkpoint"
# The files of a checkpoint: every regular file directly in its folder but hidden ones (as the relay serves them).
CHECKPOINT_FILES = ("[!.]*",)
RELAY_TOKEN_ENV = "DFLASH_RELAY_TOKEN"


@dataclass(frozen=True)
class Checkpoint:
    """A drafter checkpoint held in the store."""

    key: str  # content key: digest of its files
    path: str  # the checkpoint folder inside the store entry
    source: str  # where it was fetched from
    step: int | None  # training step (storage.checkpoint.training_step, as the relay reads it)


def is_relay_url(source: str) -> bool:
    return urlsplit(source).scheme in ("http", "https")


def local_path(source: str) -> Path:
    """The folder a local source names (a path or a file:// URL)."""
    parts = urlsplit(source)
    return Path(unquote(parts.path)) if parts.scheme == "file" else Path(source)


def source_step(source: str) -> int | None:
    """The training step of a checkpoint source, before it is fetched (storage.checkpoint)."""
    if is_relay_url(source):
        return step_from_name(urlsplit(source).path)
    return training_step(local_path(source))


def relay_token(token_file: str | None) -> str | None:
    """The relay's bearer token: from token_file, else $DFLASH_RELAY_TOKEN (never a flow parameter,
    which the Prefect UI would show)."""
    if token_file:
        return Path(token_file).read_text().strip() or None
    return os.environ.get(RELAY_TOKEN_ENV) or None


@task(name="fetch", cache_policy=NONE, persist_result=False)
def fetch_checkpoint(source: str, store_root: str, relay_token_file: str | None = None, refresh: bool = False):
    """The checkpoint in the store: copied (local) or downloaded (relay), verified, unless already there."""
    store = Store(store_root)
    if is_relay_url(source):
        base_url, relay_path = parse_checkpoint_url(source)
        client = RelayClient(base_url, token=relay_token(relay_token_file))
        manifest = client.manifest(relay_path)
        key, step = manifest["key"], manifest["step"]

        def compute(entry: Path) -> dict:
            # partial files stay in the entry if this is interrupted: the next run resumes them
            with StageProgress(STAGE, f"downloading {relay_path}", manifest["total_bytes"]) as progress:
                client.download(relay_path, entry / CHECKPOINT_DIRNAME, progress=lambda done, total: progress.update(done))
            return {"files": {f["name"]: f["sha256"] for f in manifest["files"]}, "source": source, "step": step}
    else:
        src = local_path(source)
        digest = directory_digest(src, patterns=CHECKPOINT_FILES, cache=store.digest_cache())
        key, step = digest.key, training_step(src)

        def compute(entry: Path) -> dict:
            # A copy, not a link: trainers overwrite files in place, which would change a hard link's content.
            destination = entry / CHECKPOINT_DIRNAME
            destination.mkdir(exist_ok=True)
            for name, sha in digest.files.items():
                shutil.copyfile(src / name, destination / name)
                if file_sha256(destination / name) != sha:
                    raise OSError(f"{src / name} changed while it was copied into the store; run again once it is stable")
            return {"files": digest.files, "source": str(src.resolve()), "step": step}

    record, computed = run_entry(store, STAGE, key, compute, refresh)
    checkpoint = Checkpoint(key=key, path=str(store.entry(STAGE, key) / CHECKPOINT_DIRNAME), source=source,
                            step=record["step"])
    return checkpoint if computed else cached(checkpoint)
