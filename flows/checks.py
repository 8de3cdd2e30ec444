"""Every check of an evaluation's inputs, made once per evaluation before any stage runs.

`check_evaluation` normalises the flow's parameters, checks them and returns one typed record,
`EvaluationInputs`: the parameters as the flow wires its tasks with them, the resolved dtype and the drafter's
validated config. An evaluation run by hand (`dflash-eval run`, `stage`, `demo`) is checked by the command line
before Prefect starts, so bad input costs no server start-up, and the flow run it then starts is given that
record (flows/evaluate.py: `evaluation_flow`). A run nobody checked for (a deployment's, an event's, a test's) is
checked by the flow itself. Either way the checks run once and raise InputError with one message naming the
file, line or field: the command line prints it as `error: ...` (exit code 2), a flow run fails with it as its
state message.

The checks only read, except the store's write probe, made last, once everything else is known good.
"""

import importlib.util
import inspect
import json
import os
import stat
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoTokenizer

from dflash_core.checkpoint_files import (
    WeightFilesError,
    has_safetensors,
    model_name,
    weight_file_problem,
    weight_files,
)
from dflash_core.choices import SLIDING_SEMANTICS
from dflash_core.drafter_config import DrafterConfig, DrafterError, check_block_size, check_compatible
from dflash_core.prompts import PromptError, read_completions
from dflash_core.sampling import Sampling
from dflash_core.target import read_target_config
from dflash_eval.flows.choices import DEVICES, STAGES
from dflash_eval.services.reference.backends import BackendError, open_backend
from dflash_eval.services.relay.client import RelayError
from dflash_eval.storage import Store
from dflash_eval.storage.object_storage import ObjectStorageError
from dflash_eval.storage.schema import Stage
from dflash_eval.tasks.cluster import ClusterUnreachable, check_cluster
from dflash_eval.tasks.fetch import CheckpointError, await_checkpoint, read_config
from dflash_eval.tasks.progress import stage_logger
from dflash_eval.tasks.references import load_prompts
from dflash_eval.tasks.target import DTYPE_CHOICES, DtypeChoice, resolve_dtype, target_tokenizer


class InputError(ValueError):
    """Bad input to an evaluation: the message says what is wrong and what to do."""


@dataclass(frozen=True)
class CheckedInputs:
    """What `check_inputs` read that the flow needs."""

    drafter: DrafterConfig  # the drafter source's config, validated against the target
    baseline: DrafterConfig | None
    n_prompts: int
    num_target_layers: int
    sampling: Sampling  # the references' sampling (greedy at temperature 0)
    step_costs: dict[int, float] | None  # --step-cost: a speculative step's cost per block size (plain step = 1)


@dataclass(frozen=True)
class EvaluationInputs:
    """An evaluation's parameters, normalised and checked, with what the checks read: what the flow wires its
    tasks with (flows/evaluate.py documents each parameter)."""

    target: str
    drafter: str
    prompts: str
    max_new_tokens: int
    store_location: str  # the store: an absolute folder or s3://BUCKET/PREFIX, as every task reopens it
    dtype: DtypeChoice  # resolved once: `auto` and the name it resolves to share the store's entries
    device: str
    sliding_semantics: str
    thinking: bool
    reference: str
    lookahead: bool
    concurrency: int
    relay_token_file: str | None
    stages: tuple[str, ...]  # `until` and the stages it depends on, in pipeline order
    refresh: frozenset[str]
    baseline: str | None
    report_dir: str | None
    all_positions: bool
    reference_api_key_file: str | None
    drafter_config: str | None
    include: tuple[str, ...] | None
    checkpoint_wait: float
    settle_seconds: float | None
    replay_group: int
    dask_address: str | None
    samples: int  # sampled completions per prompt (1 when greedy)
    seed: int
    references: str | None  # a completions file stored as the references instead of generating them
    block_size: int | None  # verified tokens per step; None: the drafter's block size
    block_sizes: tuple[int, ...]  # --block-sizes: also drafted and scored at each of these (a sweep)
    training_log: str | None  # the training run's log folder (reporting.training_side); None: found from the source
    tensorboard: str | None  # the TensorBoard run to write (reporting.tracker); None: the training run's default
    mlflow: str | None  # an MLflow tracking URI to write the same into; None: none
    divergence_window: int  # saves the diverging alarm fits over
    target_name: str  # how series titles and tags call the target: --name, else checkpoint_files.model_name
    checked: CheckedInputs

    def runs(self, stage: str) -> bool:
        """Whether this evaluation runs `stage`."""
        return stage in self.stages


def check_inputs(
    *, target: str, drafter: str, prompts: str, max_new_tokens: int, store: str | None, dtype: str, device: str,
    sliding_semantics: str, thinking: bool, reference: str, relay_token_file: str | None, baseline: str | None,
    reference_api_key_file: str | None, drafter_config: str | None, include: list[str] | None,
    checkpoint_wait: float | None, settle_seconds: float | None, until: str, refresh: list[str] | None,
    temperature: float, top_k: int, top_p: float, min_p: float, samples: int, seed: int, lookahead: bool,
    block_size: int | None, references: str | None, block_sizes: list[int] | None, step_cost: str | None,
) -> CheckedInputs:
    """Read everything an evaluation with these flow parameters needs: raises InputError on bad input.

    A reference server is asked who it is and checked against the target's tokenizer here, so a
    mismatched or dead server, or one that refuses the API key (or its absence), is refused before
    any stage stores anything."""
    if problem := store_problem(store):
        raise InputError(problem)
    sampling = check_sampling(temperature, top_k, top_p, min_p, samples, seed, lookahead)
    if references is not None and (reference != "local" or not sampling.greedy or lookahead):
        raise InputError("--references FILE gives the completions: leave out --reference, --temperature (and the "
                         "other sampling options) and --lookahead, which say how to generate them")
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
    for size in (block_size, *(block_sizes or ())):
        check_block_size_fits(size, drafter_checkpoint, f"drafter {drafter}")
    step_costs = read_step_costs(step_cost, block_sizes or [block_size or drafter_checkpoint.block_size])
    baseline_config = None
    if baseline is not None:
        try:
            baseline_config = _read_drafter_source(baseline, tokenizer, **fetch_options)
            check_compatible(baseline_config, target_config.hidden_size, target_config.vocab_size,
                             target_config.num_layers)
        except DrafterError as e:
            raise InputError(f"baseline drafter {baseline} does not fit target {target}: {e}") from None
        for size in (block_size, *(block_sizes or ())):
            check_block_size_fits(size, baseline_config, f"baseline drafter {baseline}")
    if references is not None:
        n_prompts = check_given_references(references, target, thinking, target_config)
    else:
        try:
            prompt_set = load_prompts(prompts, target, thinking)
        except PromptError as e:
            raise InputError(str(e)) from None
        n_prompts = len(prompt_set)
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
    if problem := store_write_problem(Store(store).root.absolute()):  # last: it creates the store
        raise InputError(problem)
    return CheckedInputs(drafter=drafter_checkpoint, baseline=baseline_config, n_prompts=n_prompts,
                         num_target_layers=target_config.num_layers, sampling=sampling, step_costs=step_costs)


def read_step_costs(path: str | None, block_sizes: list[int]) -> dict[int, float] | None:
    """A --step-cost file: {"<b>": cost of one speculative step verifying b tokens, relative to one plain decode
    step, measured on the serving box}, one for each block size evaluated; None without a file."""
    if path is None:
        return None
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"--step-cost {path}: cannot read it as JSON ({e})") from None
    if not isinstance(raw, dict):
        raise InputError(f'--step-cost {path}: must be a JSON object {{"<block size>": <relative step cost>}}')
    costs = {}
    for key, value in raw.items():
        if not key.isdigit() or isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise InputError(f"--step-cost {path}: {key!r}: {value!r}: keys are block sizes, values positive costs "
                             "relative to one plain decode step")
        costs[int(key)] = float(value)
    if missing := sorted(set(block_sizes) - set(costs)):
        raise InputError(f"--step-cost {path}: no cost for block size {', '.join(map(str, missing))}")
    return costs


def check_given_references(path: str, target: str, thinking: bool, target_config) -> int:
    """Read a --references file as the references stage will (InputError naming the file, line and field);
    each prompt + completion must fit the target's context. Returns its number of completions."""
    try:
        completions = read_completions(path, target_tokenizer(target), thinking=thinking,
                                       vocab_size=target_config.vocab_size)
    except PromptError as e:
        raise InputError(f"--references {e}") from None
    longest = max(completions, key=lambda c: len(c.input_ids) + len(c.completion_ids))
    if target_config.max_positions is not None and \
            len(longest.input_ids) + len(longest.completion_ids) > target_config.max_positions:
        raise InputError(f"--references {path}: {longest.id} holds {len(longest.input_ids)} prompt and "
                         f"{len(longest.completion_ids)} completion tokens, more than the target's "
                         f"{target_config.max_positions} positions; leave it out or shorten it")
    return len(completions)


def check_sampling(temperature: float, top_k: int, top_p: float, min_p: float, samples: int, seed: int,
                   lookahead: bool) -> Sampling:
    """The references' sampling settings, or InputError saying which one is out of range."""
    try:
        sampling = Sampling(temperature, top_k, top_p, min_p)
    except ValueError as e:
        raise InputError(str(e)) from None
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise InputError(f"--samples must be a whole number of at least 1, got {samples!r}")
    if sampling.greedy and samples != 1:
        raise InputError(f"--samples {samples}: greedy completions (temperature 0) are all the same; set "
                         "--temperature above 0 to sample several per prompt")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise InputError(f"--seed must be a whole number of 0 or more, got {seed!r}")
    if lookahead and not sampling.greedy:
        raise InputError("--lookahead applies to greedy references: tokens sampled past a stop are not the ones a "
                         "served run draws; leave it off with --temperature above 0")
    return sampling


def check_block_size_fits(block_size: int | None, config: DrafterConfig, which: str) -> None:
    """Refuse a --block-size the drafter cannot draft (it drafts at most its own block size)."""
    if block_size is None:
        return
    try:
        check_block_size(block_size, config.block_size)
    except ValueError as e:
        raise InputError(f"--block-size for {which}: {e}") from None


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
    """Why this command could not create and fill `path` (a folder) or write it (a file), or None. Bad input
    leaves nothing behind. os.access also answers for root on a read-only filesystem (EROFS); a file created and
    removed at once in the nearest folder answers where even root cannot write (/proc, /sys)."""
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
        if not os.access(found, os.W_OK | os.X_OK) or not _can_create_in(found):
            return f"{path} cannot be created: {found} is not writable (permissions, or a read-only filesystem)"
        return None
    if folder and not stat.S_ISDIR(mode):
        return f"{path} is a file, not a folder"
    if not folder and stat.S_ISDIR(mode):
        return f"{path} is a folder; give a file name"
    if not os.access(path, os.R_OK | os.W_OK | os.X_OK if folder else os.W_OK) or not _can_create_in(
            path if folder else path.parent):
        what = "readable and writable" if folder else "writable"
        return f"{path} is not {what} (permissions, or a read-only filesystem)"
    return None


def _can_create_in(folder: Path) -> bool:
    try:
        with tempfile.TemporaryFile(dir=folder):
            return True
    except OSError:
        return False


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


# The flow parameters check_inputs reads.
CHECKED_PARAMETERS = tuple(inspect.signature(check_inputs).parameters)


def check_evaluation(parameters: dict) -> EvaluationInputs:
    """Normalise and check the parameters of an evaluate-checkpoint run (all of them, its defaults filled in):
    the record the flow wires its tasks with, or InputError naming what is wrong. A Dask scheduler is asked
    first (a dead one gets one message, nothing computed)."""
    p = dict(parameters)
    # a deployment's templated parameters arrive as "" when their variable is unset
    p["reference"] = p["reference"] or "local"
    for name in ("drafter_config", "reference_api_key_file", "dask_address", "references", "step_cost",
                 "training_log", "tensorboard", "mlflow", "target_name"):
        p[name] = p[name] or None
    replay_group = p["replay_group"]
    if isinstance(replay_group, bool) or not isinstance(replay_group, int) or replay_group < 1:
        raise InputError(f"replay_group must be a whole number of at least 1, got {replay_group!r}")
    window = p["divergence_window"]
    if isinstance(window, bool) or not isinstance(window, int) or window < 3:
        raise InputError(f"--divergence-window must be a whole number of at least 3 saves, got {window!r}")
    if p["tensorboard"] and (problem := writable_problem(Path(p["tensorboard"]), folder=True)):
        raise InputError(f"--tensorboard: {problem}")
    if p["report_dir"] and (problem := writable_problem(Path(p["report_dir"]), folder=True)):
        raise InputError(f"--report-dir: {problem}")
    for name, option, least in (("concurrency", "--concurrency", 1), ("checkpoint_wait", "--checkpoint-wait", 0),
                                ("settle_seconds", "--settle-seconds", 0)):
        value = p[name]
        if value is not None and (isinstance(value, bool) or not isinstance(value, int | float) or value < least):
            raise InputError(f"{option} must be a number of at least {least}, got {value!r}")
    if p["drafter_config"] and not Path(p["drafter_config"]).is_file():
        raise InputError(f"--drafter-config {p['drafter_config']}: no such file (the drafter's config.json, for "
                         "checkpoints saved without one)")
    if p["mlflow"] and importlib.util.find_spec("mlflow") is None:
        raise InputError("--mlflow needs the mlflow package: pip install 'dflash-eval[mlflow]'")
    check_dask_address(p["dask_address"])
    checked = check_inputs(**{name: p[name] for name in CHECKED_PARAMETERS})
    try:
        dtype = resolve_dtype(p["dtype"], p["target"])
    except ValueError as e:
        raise InputError(str(e)) from None
    return EvaluationInputs(
        target=p["target"], drafter=p["drafter"], prompts=p["prompts"], max_new_tokens=p["max_new_tokens"],
        store_location=Store(p["store"]).location, dtype=dtype, device=p["device"],
        sliding_semantics=p["sliding_semantics"], thinking=p["thinking"], reference=p["reference"],
        lookahead=p["lookahead"], concurrency=p["concurrency"], relay_token_file=p["relay_token_file"],
        stages=stages_to_run(p["until"]), refresh=frozenset(p["refresh"] or ()), baseline=p["baseline"],
        report_dir=p["report_dir"], all_positions=p["all_positions"],
        reference_api_key_file=p["reference_api_key_file"], drafter_config=p["drafter_config"],
        include=tuple(p["include"]) if p["include"] else None, checkpoint_wait=p["checkpoint_wait"],
        settle_seconds=p["settle_seconds"], replay_group=replay_group, dask_address=p["dask_address"],
        samples=p["samples"], seed=p["seed"], block_size=p["block_size"], references=p["references"],
        # a step cost alone projects the speedup at the one block size evaluated
        block_sizes=tuple(sorted(set(p["block_sizes"] or ())))
        or ((p["block_size"] or checked.drafter.block_size,) if p["step_cost"] else ()),
        training_log=p["training_log"], tensorboard=p["tensorboard"], mlflow=p["mlflow"], divergence_window=window,
        target_name=p["target_name"] or model_name(p["target"]), checked=checked)


def check_dask_address(address: str | None) -> int | None:
    """Ask the Dask scheduler at `address` (None: no cluster) who it is, before any work: its workers now,
    or InputError naming the address and what to do when none answers (tasks/cluster.py: check_cluster)."""
    if not address:
        return None
    try:
        workers = check_cluster(address)
    except ClusterUnreachable as e:
        raise InputError(str(e)) from None
    if workers == 0:  # not an error: workers may join later, and the shards wait for them
        stage_logger().warning(f"--dask {address}: the scheduler has no workers yet; the features and drafts "
                               "stages wait for one to join")
    return workers


# What each stage needs done first (a stage run by hand runs these too; they are usually cached).
DEPENDS_ON = {
    Stage.FETCH: (), Stage.REFERENCES: (), Stage.FEATURES: (Stage.REFERENCES,),
    Stage.DRAFTS: (Stage.FETCH, Stage.FEATURES), Stage.SCORES: (Stage.DRAFTS, Stage.REFERENCES),
    Stage.DIAGNOSTICS: (Stage.SCORES,),
}


def stages_to_run(until: str) -> tuple[str, ...]:
    """`until` and every stage it depends on, in pipeline order."""
    needed, todo = set(), [until]
    while todo:
        stage = todo.pop()
        if stage not in needed:
            needed.add(stage)
            todo.extend(DEPENDS_ON[stage])
    return tuple(s for s in STAGES if s in needed)
