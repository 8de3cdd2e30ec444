"""Every check of an evaluation's inputs, made once per evaluation before any stage runs.

An evaluation run by hand (`dflash-eval run`, `stage`, `demo`) is checked by the command line before Prefect
starts, so bad input costs no server start-up, and the flow run it then starts takes that check instead of
making it again (`checked_before_run`). A run nobody checked for (a deployment's, an event's, a test's) is
checked by the flow itself (`inputs_of_run`). Either way the checks run once and raise InputError with one
message naming the file, line or field: the command line prints it as `error: ...` (exit code 2), a flow run
fails with it as its state message.

The checks only read, except the store's write probe, made last, once everything else is known good.
"""

import inspect
import os
import stat
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer

from dflash_core.checkpoint_files import WeightFilesError, has_safetensors, weight_file_problem, weight_files
from dflash_core.drafter import SLIDING_SEMANTICS, DrafterConfig, DrafterError, check_compatible
from dflash_core.prompts import PromptError
from dflash_core.reference.backends import BackendError, open_backend
from dflash_core.target import read_target_config
from dflash_eval.flows.choices import DEVICES, STAGES
from dflash_eval.flows.store_paths import store_root
from dflash_eval.storage import Store
from dflash_eval.storage.object_storage import ObjectStorageError
from dflash_eval.storage.relay.client import RelayError
from dflash_eval.tasks.fetch import CheckpointError, await_checkpoint, read_config
from dflash_eval.tasks.references import load_prompts
from dflash_eval.tasks.target import DTYPE_CHOICES, target_tokenizer


class InputError(ValueError):
    """Bad input to an evaluation: the message says what is wrong and what to do."""


@dataclass(frozen=True)
class CheckedInputs:
    """What the checks read that the flow needs: the drafter's config, how many prompts, the target's depth."""

    drafter: DrafterConfig
    n_prompts: int
    num_target_layers: int


def check_inputs(
    *, target: str, drafter: str, prompts: str, max_new_tokens: int, store: str | None, dtype: str, device: str,
    sliding_semantics: str, thinking: bool, reference: str, relay_token_file: str | None, baseline: str | None,
    reference_api_key_file: str | None, drafter_config: str | None, include: list[str] | None,
    checkpoint_wait: float | None, settle_seconds: float | None, until: str, refresh: list[str] | None,
    temperature: float = 0.0,
) -> CheckedInputs:
    """Read everything an evaluation with these flow parameters needs: raises InputError on bad input.

    A reference server is asked who it is and checked against the target's tokenizer here, so a
    mismatched or dead server, or one that refuses the API key (or its absence), is refused before
    any stage stores anything. `temperature` is the command line's (the flow has none: it is greedy)."""
    if problem := store_problem(store):
        raise InputError(problem)
    if temperature != 0:
        raise InputError(
            f"--temperature {temperature}: only greedy decoding (temperature 0) is evaluated; at any other temperature "
            "the references are samples, and replaying them would not equal speculative decoding"
        )
    if until not in STAGES:
        raise InputError(f"unknown stage {until!r}: one of {', '.join(STAGES)}")
    if unknown := set(refresh or ()) - set(STAGES):
        raise InputError(f"cannot refresh unknown stages {sorted(unknown)}: stages are {', '.join(STAGES)}")
    if dtype not in DTYPE_CHOICES:
        raise InputError(f"--dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")
    if sliding_semantics not in SLIDING_SEMANTICS:
        raise InputError(f"--sliding-semantics must be one of {', '.join(SLIDING_SEMANTICS)}, got {sliding_semantics!r}")
    if max_new_tokens < 1:
        raise InputError(f"--max-new-tokens must be at least 1, got {max_new_tokens}")
    if device not in DEVICES:
        raise InputError(f"--device must be one of {', '.join(DEVICES)}, got {device!r} (choose a GPU with "
                         "CUDA_VISIBLE_DEVICES)")
    if device == "cuda" and not torch.cuda.is_available():
        raise InputError(f"--device {device}: CUDA is not available on this machine; use --device cpu")
    if not Path(target).is_dir():
        raise InputError(f"target {target} is not a directory: pass a Hugging Face model folder")
    # a weight file cut short (an interrupted copy, a full disk) would otherwise fail only once the target loads,
    # after the store was written to; only headers are read (safetensors' own reader raises
    # its own exception type on such a file)
    try:
        weights = weight_files(target) if has_safetensors(target) else []
    except WeightFilesError as e:
        raise InputError(f"target {target}: {e}") from None
    for path in weights:
        if problem := weight_file_problem(path):
            raise InputError(f"target {target}: {problem}; copy the checkpoint again")
    try:
        target_config = read_target_config(target)
    except (ValueError, OSError) as e:
        raise InputError(f"target {target}: {e}") from None
    try:
        fetch_options = {"relay_token_file": relay_token_file, "include": include,
                         "wait_seconds": checkpoint_wait, "settle_seconds": settle_seconds}
        tokenizer = target_tokenizer(target)  # resolves a mask token given as a string
        drafter_checkpoint = _read_drafter_source(drafter, tokenizer, drafter_config=drafter_config,
                                                  **fetch_options)
        check_compatible(drafter_checkpoint, target_config.hidden_size, target_config.vocab_size, target_config.num_layers)
    except DrafterError as e:
        raise InputError(f"drafter {drafter} does not fit target {target}: {e}") from None
    if baseline is not None:
        try:
            baseline_config = _read_drafter_source(baseline, tokenizer, **fetch_options)
            check_compatible(baseline_config, target_config.hidden_size, target_config.vocab_size,
                             target_config.num_layers)
        except DrafterError as e:
            raise InputError(f"baseline drafter {baseline} does not fit target {target}: {e}") from None
    try:
        prompt_set = load_prompts(prompts, target, thinking)
    except PromptError as e:
        raise InputError(str(e)) from None
    longest = max(len(p.input_ids) for p in prompt_set)
    if target_config.max_positions is not None and longest + max_new_tokens > target_config.max_positions:
        raise InputError(
            f"the longest prompt ({longest} tokens) plus --max-new-tokens {max_new_tokens} exceeds the target's "
            f"{target_config.max_positions} positions; lower --max-new-tokens or shorten the prompts"
        )
    if reference != "local":
        try:
            backend = open_backend(reference, AutoTokenizer.from_pretrained(target), api_key_file=reference_api_key_file)
            backend.identity  # noqa: B018 (asks the server which model it serves)
            backend.check_matches(target_config.vocab_size)
        except (ValueError, BackendError) as e:
            raise InputError(f"reference server: {e}") from None
    if problem := store_write_problem(store_root(store)):  # last: it creates the store
        raise InputError(problem)
    return CheckedInputs(drafter=drafter_checkpoint, n_prompts=len(prompt_set), num_target_layers=target_config.num_layers)


def _read_drafter_source(drafter: str, tokenizer, drafter_config: str | None = None, **wait_options) -> DrafterConfig:
    """The drafter's config, once its checkpoint is finished (waited for, bounded): read from a local
    folder or a relay (only config.json and the manifest travel: nothing is downloaded into the
    store before the inputs are known to fit), its run folder, or `drafter_config`."""
    try:
        ready = await_checkpoint(drafter, **wait_options)
        raw, config_source = read_config(ready, drafter_config)
    except (CheckpointError, RelayError, OSError) as e:
        raise InputError(str(e)) from None
    return DrafterConfig.from_dict(raw, source=f"{drafter} config.json ({config_source})", tokenizer=tokenizer)


def check_out(out: Path | None, folder: bool = False) -> None:
    """Refuse an --out that could not be written, before any work (else the results are lost at the end)."""
    if out is not None and (problem := writable_problem(out, folder)):
        raise InputError(f"--out: {problem}")


def writable_problem(path: Path, folder: bool) -> str | None:
    """Why this command could not create and fill `path` (a folder) or write it (a file), or None. Only reads:
    bad input leaves nothing behind. os.access also answers for root on a read-only filesystem (EROFS)."""
    path = Path(path).absolute()
    try:
        for found in (path, *path.parents):  # the nearest part of the path that exists
            try:
                mode = found.stat().st_mode
                break
            except (FileNotFoundError, NotADirectoryError):
                continue
    except OSError as e:  # EACCES: a folder above it cannot be searched
        return f"{path} cannot be reached ({e.strerror})"
    if found != path:
        if not stat.S_ISDIR(mode):
            return f"{path} cannot be created: {found} is a file, not a folder"
        if not os.access(found, os.W_OK | os.X_OK):
            return f"{path} cannot be created: {found} is not writable (permissions, or a read-only filesystem)"
        return None
    if folder and not stat.S_ISDIR(mode):
        return f"{path} is a file, not a folder"
    if not folder and stat.S_ISDIR(mode):
        return f"{path} is a folder; give a file name"
    if not os.access(path, os.R_OK | os.W_OK | os.X_OK if folder else os.W_OK):
        what = "readable and writable" if folder else "writable"
        return f"{path} is not {what} (permissions, or a read-only filesystem)"
    return None


def store_problem(store: str | None) -> str | None:
    """Why the store cannot be used (read, created, written), or None. A store on object storage must answer
    (server up, bucket there, credentials taken), and this machine's copy of it be writable."""
    try:
        opened = Store(store)
    except ValueError as e:  # a URL of another scheme, or without a bucket
        return f"--store: {e}"
    if opened.remote is not None:
        try:
            opened.remote.check_reachable()
        except ObjectStorageError as e:
            return f"--store: {e}"
    problem = writable_problem(opened.root, folder=True)
    return f"--store: {problem}" if problem else None


def store_write_problem(root: Path) -> str | None:
    """Why the store cannot be created or written, found by trying (with the inputs known good, the flow would
    create it next): what os.access cannot tell, e.g. for root, a folder that refuses new entries (/proc)."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=root):  # O_TMPFILE: never has a name in the store
            pass
    except OSError as e:
        return f"--store: {root} cannot be created or written ({e.strerror})"
    return None


# The flow parameters check_inputs reads (all of its own but the command line's temperature).
CHECKED_PARAMETERS = tuple(name for name in inspect.signature(check_inputs).parameters if name != "temperature")
_checked_by_caller = threading.local()


@contextmanager
def checked_before_run(flow, parameters: dict, temperature: float = 0.0) -> Iterator[CheckedInputs]:
    """Check the inputs of a run of `flow` (evaluate-checkpoint) with these parameters (its defaults for those
    not given), then, within the block, hand them to that run when it starts in this thread (`inputs_of_run`),
    so that it does not check them again. Raises InputError before the block on bad input."""
    bound = inspect.signature(flow.fn).bind(**parameters)
    bound.apply_defaults()
    arguments = {name: bound.arguments[name] for name in CHECKED_PARAMETERS}
    inputs = check_inputs(**arguments, temperature=temperature)
    _checked_by_caller.held = (arguments, inputs)
    try:
        yield inputs
    finally:
        _checked_by_caller.held = None


def inputs_of_run(parameters: dict) -> CheckedInputs:
    """The checked inputs of the flow run with these parameters (all of them, as the flow normalised them):
    those its caller checked for exactly these (`checked_before_run`; one run takes them), else checked now."""
    arguments = {name: parameters[name] for name in CHECKED_PARAMETERS}
    held = getattr(_checked_by_caller, "held", None)
    _checked_by_caller.held = None
    if held is not None and held[0] == arguments:
        return held[1]
    return check_inputs(**arguments)
