"""Fetch stage: bring a drafter checkpoint into the store, verified, keyed by its files' digests.

Sources: a local folder (or `file://` URL), or a relay URL `http(s)://relay:port/<path>` (see
services/relay/server.py). Only the files the drafter needs travel (`dflash_core.checkpoint_files`: config,
weights, trainer_state.json, plus `include` patterns): optimizer, scheduler, RNG and per-rank state
are never read, hashed, sent or stored. Both sources give the same key for the same files, so a
checkpoint fetched once is never downloaded or copied again, whichever way it is named (a SpecForge
`run-latest` link included).

A checkpoint the trainer is still writing is waited for, bounded by `wait_seconds`: a folder is
ready once none of its files changed for `settle_seconds` and its weights are whole, a relay says
409 until then. Where the checkpoint has no config.json, the drafter config comes from the run
folder (the relay and `dflash_core.checkpoint_files` find it) or from `drafter_config`; the record says which.

The store holds every checkpoint in the published format (config.json + model.safetensors or
shards): a SpecForge `training_state.pt` is read without executing it, its drafter weights are
written as model.safetensors, and the payload itself is not kept.
"""

import difflib
import json
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlsplit

from prefect import task
from prefect.cache_policies import NONE

from dflash_core.checkpoint_files import (
    CONFIG,
    SINGLE_FILE,
    TRAINING_STATE,
    WEIGHT_FILE_NAMES,
    CheckpointBroken,
    CheckpointFiles,
    NotACheckpoint,
    checkpoint_files,
    not_ready,
    saves_beneath,
    step_from_name,
    training_step,
)
from dflash_core.drafter_config import DrafterConfig, DrafterError, read_drafter_config
from dflash_core.drafter_weights import check_drafter_weights, export_drafter_weights
from dflash_eval.services.relay.client import RelayClient, RelayError, parse_checkpoint_url
from dflash_eval.services.tokens import TokenFileError, read_token_file
from dflash_eval.storage import Store, file_sha256, key_of
from dflash_eval.storage.schema import FetchRecord, Stage

from .progress import StageProgress, stage_logger
from .stage import cached, get_or_compute, refusals_fail_cleanly
from .target import target_tokenizer

STAGE = Stage.FETCH
CHECKPOINT_DIRNAME = "checkpoint"
RELAY_TOKEN_ENV = "DFLASH_RELAY_TOKEN"
SETTLE_ENV = "DFLASH_SETTLE_SECONDS"
DEFAULT_SETTLE_SECONDS = 30.0  # as the relay: a folder untouched this long is taken as finished
DEFAULT_WAIT_SECONDS = 300.0  # a save of a 17 GB checkpoint to a shared disk takes a few minutes
LOG_EVERY_SECONDS = 30.0


class CheckpointError(ValueError):
    """A checkpoint that cannot be fetched: absent or unfinished past the wait, broken, not a
    drafter checkpoint; the message names it and says what to do."""


@dataclass(frozen=True)
class Checkpoint:
    """A drafter checkpoint held in the store (config.json + safetensors, whatever layout it came in)."""

    key: str  # content key: digest of the files fetched
    path: str  # the checkpoint folder inside the store entry
    source: str  # where it was fetched from
    step: int | None  # training step (checkpoint_files.training_step, as the relay reads it)
    config: DrafterConfig  # its config.json as validated once, at the fetch: what every later stage reads
    layout: str = "hf"  # how the trainer saved it: "hf" or "specforge" (checkpoint_files)
    config_source: str = "checkpoint"  # "checkpoint", "run folder" or "--drafter-config <file>"
    fetched_by_this_run: bool = False  # its files were hashed at commit, moments ago (not a cache hit)


@dataclass(frozen=True)
class ReadyCheckpoint:
    """A source whose checkpoint is finished: what fetching it takes, before anything is read."""

    source: str
    step: int | None
    layout: str
    config_source: str | None  # None: it has no config.json; --drafter-config must give one
    local: CheckpointFiles | None = None  # a folder on this machine ...
    client: RelayClient | None = None  # ... or a relay, with the manifest of the files to fetch
    manifest: dict | None = None

    def relay(self) -> tuple[RelayClient, dict]:
        """(client, manifest) of a checkpoint that is not local."""
        assert self.client is not None and self.manifest is not None, "a checkpoint is local or on a relay"
        return self.client, self.manifest


def is_relay_url(source: str) -> bool:
    return urlsplit(source).scheme in ("http", "https")


def local_path(source: str) -> Path:
    """The folder a local source names (a path or a file:// URL)."""
    parts = urlsplit(source)
    return Path(unquote(parts.path)) if parts.scheme == "file" else Path(source)


def source_step(source: str) -> int | None:
    """The training step of a checkpoint source, before it is fetched (checkpoint_files.training_step)."""
    if is_relay_url(source):
        return step_from_name(urlsplit(source).path)
    return training_step(local_path(source).resolve())


def relay_token(token_file: str | None) -> str | None:
    """The relay's bearer token: from token_file, else $DFLASH_RELAY_TOKEN (never a flow parameter,
    which the Prefect UI would show). A token file that cannot be read or is empty raises CheckpointError."""
    if token_file:
        try:
            return read_token_file(token_file, "--relay-token-file")
        except TokenFileError as e:
            raise CheckpointError(str(e)) from None
    return os.environ.get(RELAY_TOKEN_ENV) or None


def settle_seconds_default() -> float:
    """`$DFLASH_SETTLE_SECONDS`, else 30 s."""
    return float(os.environ.get(SETTLE_ENV) or DEFAULT_SETTLE_SECONDS)


class _NotYet(Exception):
    """The checkpoint is not there (`absent`) or not finished yet."""

    def __init__(self, reason: str, retry_after: float | None = None, absent: bool = False):
        super().__init__(reason)
        self.reason, self.retry_after, self.absent = reason, retry_after, absent


def _ready_now(source: str, client: RelayClient | None, include: tuple[str, ...], settle_seconds: float,
               role: str = "drafter") -> ReadyCheckpoint:
    """The source's checkpoint (on `client`'s relay, else local) if it is finished; raises _NotYet while
    it is absent or being written. `role`: how messages name it ("drafter", "baseline")."""
    if client is not None:
        path = parse_checkpoint_url(source)[1]
        try:
            manifest = client.manifest(path, include)
        except RelayError as e:
            if e.status == 409:
                raise _NotYet(e.detail or str(e), float(e.headers.get("Retry-After") or 0) or None) from None
            if e.status == 404:
                raise _NotYet(f"not on the relay (yet): {e.detail}", absent=True) from None
            raise CheckpointError(f"{role} {source}: {e}") from None
        return ReadyCheckpoint(source, manifest.get("step", step_from_name(manifest["path"])),
                               manifest.get("layout", "hf"), manifest.get("config_source", "checkpoint"),
                               client=client, manifest=manifest)
    directory = local_path(source).resolve()  # a run-latest link names the folder it points to
    if not directory.exists():
        if not directory.parent.is_dir():  # a run folder exists before its first save: a wrong path
            raise CheckpointError(f"{role} checkpoint {source} is not a folder, and neither is {directory.parent}"
                                  f"{_nearest(directory.parent)}: pass a checkpoint folder or a relay URL "
                                  "http://HOST:PORT/<path>")
        near = _similar_folders(directory)
        if near and _steps_blanked(near[0]) != _steps_blanked(directory.name):  # not a later save: a typo
            raise CheckpointError(f"{role} checkpoint {source}: no folder {directory.name} in {directory.parent}; "
                                  f"did you mean {near[0]}?")
        raise _NotYet(f"no folder {directory} (yet){_nearest(directory)}", absent=True)
    if not directory.is_dir():
        raise CheckpointError(f"{role} checkpoint {source} is not a folder: pass a checkpoint folder or a relay URL "
                              "http://HOST:PORT/<path>")
    found = checkpoint_files(directory, include)
    try:
        pending = not_ready(directory, settle_seconds, found)
    except CheckpointBroken as e:
        raise CheckpointError(f"{role} checkpoint {source} is broken: {e}; the save did not complete") from None
    except NotACheckpoint:  # settled, and still no weights: a run folder (its saves finished or still settling), a typo
        inner = saves_beneath(directory, settle_seconds)
        raise CheckpointError(f"{role} checkpoint {source} holds no drafter weights ({WEIGHT_FILE_NAMES})"
                              + (f"; {inner}" if inner else "")) from None
    if pending is not None:
        raise _NotYet(pending)
    if found is None:  # weights written between checkpoint_files' look and not_ready's: the next look judges them
        raise _NotYet("drafter weights appeared just now")
    return ReadyCheckpoint(source, training_step(directory), found.layout, found.config_source, local=found)


def _similar_folders(path: Path) -> list[str]:
    """The folders beside `path` whose names are most like its name, most alike first."""
    try:
        siblings = [p.name for p in path.parent.iterdir() if p.is_dir()]
    except OSError:
        return []
    return difflib.get_close_matches(path.name, siblings, n=3, cutoff=0.75)


def _nearest(path: Path) -> str:
    near = _similar_folders(path)
    return f" (nearest there: {', '.join(near)})" if near else ""


def _steps_blanked(name: str) -> str:
    # step_1000 and step_1100 are one run's saves; stpe_1000 and step_1000 are not
    return re.sub(r"\d+", "#", name)


def await_checkpoint(source: str, relay_token_file: str | None = None, include=(), wait_seconds: float | None = None,
                     settle_seconds: float | None = None, role: str = "drafter") -> ReadyCheckpoint:
    """Wait until the checkpoint `source` names is finished (at most `wait_seconds`; 0: not at all), saying so in
    the run's logs and a progress artifact; raises CheckpointError when it never appears or never settles. `role`:
    how messages name the checkpoint ("drafter", "baseline")."""
    wait_seconds = DEFAULT_WAIT_SECONDS if wait_seconds is None else wait_seconds
    settle_seconds = settle_seconds_default() if settle_seconds is None else settle_seconds
    include = tuple(include or ())
    client = RelayClient(parse_checkpoint_url(source)[0], token=relay_token(relay_token_file)) if is_relay_url(source) else None
    started = time.monotonic()
    progress, last_log, was_absent = None, 0.0, None
    try:
        while True:
            try:
                ready = _ready_now(source, client, include, settle_seconds, role)
            except _NotYet as e:
                waited = time.monotonic() - started
                if not wait_seconds:
                    raise CheckpointError(f"{role} {source}: {e.reason}; it is taken only once finished, without "
                                          "waiting for it: is the path right?") from None
                if waited >= wait_seconds:
                    raise CheckpointError(
                        f"{role} {source}: {e.reason}; gave up after waiting {waited:.0f} s "
                        f"(--checkpoint-wait {wait_seconds:g}). Is the trainer still saving it, and is the path right?"
                    ) from None
                if progress is None:
                    progress = StageProgress(STAGE, f"waiting for {source} to be finished", max(1, int(wait_seconds)),
                                             log_quarters=False)
                    progress.__enter__()
                if e.absent != was_absent or waited - last_log >= LOG_EVERY_SECONDS:  # news, or a sign of life
                    was_absent = e.absent
                    progress.logger.info(f"waiting for {source}: {e.reason} (waited {waited:.0f} s of at most "
                                         f"{wait_seconds:g} s)")
                    last_log = waited
                progress.update(int(waited))
                time.sleep(min(e.retry_after or 2.0, max(0.1, wait_seconds - waited)))
                continue
            if progress is not None:
                progress.logger.info(f"{source} is finished after a wait of {time.monotonic() - started:.0f} s")
            return ready
    finally:
        if progress is not None:
            progress.__exit__(None, None, None)


def read_config(ready: ReadyCheckpoint, drafter_config: str | None = None) -> tuple[dict, str]:
    """(config.json as a dict, where it came from) for a finished checkpoint: its own (or its run
    folder's), else the `drafter_config` file. Nothing but the config is read."""
    if ready.config_source is None:
        if not drafter_config:
            raise CheckpointError(
                f"drafter checkpoint {ready.source} has no config.json (layout {ready.layout}), and neither has its "
                "run folder: pass the drafter config the run trained with, --drafter-config FILE")
        return _json_file(Path(drafter_config), "--drafter-config"), f"--drafter-config {Path(drafter_config).resolve()}"
    if ready.local is not None:
        return _json_file(ready.local.files[CONFIG], ready.source), ready.config_source
    client, manifest = ready.relay()
    try:
        raw = client.read_small_file(manifest["path"], CONFIG, manifest=manifest)
    except RelayError as e:
        raise CheckpointError(f"drafter {ready.source}: {e}") from None
    try:
        return json.loads(raw), ready.config_source
    except ValueError as e:
        raise CheckpointError(f"drafter {ready.source}: config.json is not JSON ({e})") from None


def _json_file(path: Path, what: str) -> dict:
    try:
        raw = json.loads(path.read_text())
    except OSError as e:
        raise CheckpointError(f"{what}: cannot read {path} ({e.strerror or e})") from None
    except ValueError as e:
        raise CheckpointError(f"{what}: {path} is not JSON ({e})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{what}: {path} is not a JSON object")
    return raw


def fetched_files(ready: ReadyCheckpoint, drafter_config: str | None, store: Store) -> tuple[dict, str]:
    """({name: sha256} of the files a fetch of `ready` brings, config included, and where the config
    comes from). The checkpoint's content key is key_of({"files": ...}) of them. Local files are
    hashed once (the store's digest cache); a relay's digests come with its manifest."""
    if ready.local is not None:
        cache = store.digest_cache()
        files = {name: cache.sha256(path) for name, path in ready.local.files.items()}
    else:
        files = {f["name"]: f["sha256"] for f in ready.relay()[1]["files"]}
    if ready.config_source is not None:
        return files, ready.config_source
    read_config(ready, drafter_config)  # the clear error when there is none
    assert drafter_config is not None  # read_config raised without one
    return {**files, CONFIG: file_sha256(drafter_config)}, f"--drafter-config {Path(drafter_config).resolve()}"


@task(name="fetch", cache_policy=NONE, persist_result=False)
@refusals_fail_cleanly(CheckpointError)
def fetch_checkpoint(
    source: str,
    store_location: str,
    target_dir: str,
    relay_token_file: str | None = None,
    drafter_config: str | None = None,
    include: list[str] | None = None,
    wait_seconds: float | None = None,
    settle_seconds: float | None = None,
    refresh: bool = False,
):
    """The checkpoint in the store: the files evaluation needs, copied (local) or downloaded (relay) and
    verified, unless already there; a SpecForge payload becomes model.safetensors. Its config is read once,
    here, with the target's tokenizer (which resolves a mask token given as a string), into the record."""
    store = Store(store_location)
    logger = stage_logger()
    ready = await_checkpoint(source, relay_token_file, include, wait_seconds, settle_seconds)
    files, config_source = fetched_files(ready, drafter_config, store)
    if ready.config_source is not None and drafter_config and file_sha256(drafter_config) != files.get(CONFIG):
        logger.warning(f"--drafter-config {drafter_config} is not used: {source} has its own config.json "
                       f"({config_source}), which differs from it")
    logger.info(f"drafter {source}: {ready.layout} layout, config from {config_source}")
    key = key_of({"files": files})
    # the drafter_config file, copied in rather than fetched (fetched_files refused a checkpoint without a config
    # and no drafter_config); None: the checkpoint's own config is fetched
    external_config = drafter_config if ready.config_source is None else None
    parsed: list[DrafterConfig] = []  # the fetched copy's config, read once (by `compute` when it fetches)

    def compute(entry: Path) -> dict:
        destination = entry / CHECKPOINT_DIRNAME
        destination.mkdir(exist_ok=True)
        fetched = {n: s for n, s in files.items() if not (external_config is not None and n == CONFIG)}
        if ready.local is None:
            client, manifest = ready.relay()
            # partial files stay in the entry if this is interrupted: the next run resumes them
            manifest = dict(manifest, files=[f for f in manifest["files"] if f["name"] in fetched])
            with StageProgress(STAGE, f"downloading {manifest['path']}", manifest["total_bytes"]) as progress:
                try:
                    client.download(manifest["path"], destination, manifest=manifest,
                                    progress=lambda done, total: progress.update(done))
                except RelayError as e:
                    raise CheckpointError(f"drafter {source}: the download stopped: {e}. What arrived is kept: "
                                          "run again to resume it") from None
        else:
            # A copy, not a link: trainers overwrite files in place, which would change a hard link's content.
            for name, sha in fetched.items():
                shutil.copyfile(ready.local.files[name], destination / name)
                if file_sha256(destination / name) != sha:
                    raise CheckpointError(f"{ready.local.files[name]} changed while it was copied into the store; "
                                          "run again once the trainer has finished writing it")
        if external_config is not None:
            shutil.copyfile(external_config, destination / CONFIG)
            if file_sha256(destination / CONFIG) != files[CONFIG]:
                raise CheckpointError(f"--drafter-config {external_config} changed while this run used it; run again")
        try:
            parsed.append(read_drafter_config(destination, tokenizer=target_tokenizer(target_dir)))
            weights_from = _export_payload(destination, parsed[0]) if ready.layout == "specforge" else None
            check_drafter_weights(destination, parsed[0])
        except (CheckpointError, DrafterError) as e:
            shutil.rmtree(entry)  # verified bytes of a bad checkpoint: nothing of it stays in the store
            where = str(e).replace(f"{destination}/", "").replace(f"{destination}: ", "")  # not the store's path
            raise CheckpointError(f"drafter {source}: {where}") from None
        except Exception:  # a check that broke rather than refused: still, nothing unverified stays in the store
            shutil.rmtree(entry, ignore_errors=True)
            raise
        return FetchRecord(files=files, source=source if ready.local is None else str(ready.local.directory),
                           step=ready.step, layout=ready.layout, config_source=config_source,
                           weights_from=weights_from).to_record()

    outcome = get_or_compute(store, STAGE, key, compute, refresh=refresh)
    record = FetchRecord.from_record(outcome.record)
    path = store.entry(STAGE, key) / CHECKPOINT_DIRNAME
    try:
        config = parsed[0] if parsed else read_drafter_config(path, tokenizer=target_tokenizer(target_dir))
    except DrafterError as e:
        raise CheckpointError(f"drafter {source}: {e}") from None
    checkpoint = Checkpoint(key=key, path=str(path), source=source, step=record.step, config=config,
                            layout=record.layout, config_source=record.config_source,
                            fetched_by_this_run=outcome.computed)
    return checkpoint if outcome.computed else cached(checkpoint)


def _export_payload(destination: Path, config: DrafterConfig) -> str:
    """Write the drafter weights of destination/training_state.pt as model.safetensors and drop the
    payload (its optimizer state has no place in the store); returns where the weights were."""
    try:
        where = export_drafter_weights(destination / TRAINING_STATE, config, destination / SINGLE_FILE)
    except DrafterError as e:
        raise CheckpointError(f"{TRAINING_STATE}: {e}") from None
    os.unlink(destination / TRAINING_STATE)
    return f"{TRAINING_STATE}: {where}"
