"""Every check of an evaluation's inputs, made once per evaluation before any stage runs.

`check_evaluation` takes evaluate-checkpoint's parameters (flows/settings.py: `Evaluation`), checks the values
and the rules between them (the settings' declaration), then what only reading files or asking servers can tell
(the target, the drafter's config and its fit to the target, the prompts, a reference server, the store), and
returns one typed record, `CheckedEvaluation`: the settings with what the checks read and resolved (the dtype, the
served setting with its block size chosen, the drafter's validated config). An evaluation run by hand (`dflash-eval
run`, `stage`, `demo`) is checked by the command line before Prefect starts, so bad input costs no server start-up,
and the flow run it then starts is given that record (flows/evaluate.py: `evaluation_flow`). A run nobody checked
for (a deployment's, an event's, a test's) is checked by the flow itself. Either way the checks run once and raise
InputError with one message naming the file, line or setting (as the user gave it: `--top-p` on the command line,
`serving.top_p` in a deployment's parameters): the command line prints it as `error: ...` (exit code 2), a flow run
fails with it as its state message.

The checks only read, except the store's write probe, made last, once everything else is known good.
"""

import difflib
import importlib.util
import json
import os
import stat
import tempfile
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from dflash_core.blocks import Block, resolve_block
from dflash_core.checkpoint_files import (
    WeightFilesError,
    has_safetensors,
    model_name,
    weight_file_problem,
    weight_files,
)
from dflash_core.drafter_config import (
    DrafterConfig,
    DrafterConfigWarning,
    DrafterError,
    check_compatible,
)
from dflash_core.prompts import PromptError, read_completions
from dflash_core.published.benchmarks import BenchmarkError
from dflash_core.sampling import Sampling, Served
from dflash_core.target import choose_attention, read_target_config
from dflash_eval.services.reference.backends import BackendError, open_backend
from dflash_eval.services.relay.client import RelayError
from dflash_eval.storage import Store
from dflash_eval.storage.object_storage import ObjectStorageError
from dflash_eval.tasks.cluster import ClusterUnreachable, check_cluster
from dflash_eval.tasks.fetch import CheckpointError, await_checkpoint, is_relay_url, local_path, read_config
from dflash_eval.tasks.progress import stage_logger
from dflash_eval.tasks.references import PromptChoice, load_prompts
from dflash_eval.tasks.target import DtypeChoice, resolve_dtype, target_tokenizer

from .settings import STAGES, Evaluation, Inputs, SettingsError, parameter_name


class InputError(ValueError):
    """Bad input to an evaluation: the message says what is wrong and what to do."""


@dataclass(frozen=True)
class CheckedEvaluation:
    """An evaluation's settings, checked, with what the checks read and resolved: what the flow wires its tasks
    with."""

    evaluation: Evaluation  # the checkpoint, its settings by group, and which stages run
    store_location: str  # the store: an absolute folder or s3://BUCKET/PREFIX, as every task reopens it
    dtype: DtypeChoice  # resolved once: `auto` and the name it resolves to share the store's entries
    attention: str  # the target text model's attention implementation ("sdpa", "eager"), resolved once
    target_name: str  # how series titles and tags call the target: --name, else checkpoint_files.model_name
    # how the target is served: the sampling, the block size chosen only when it is not the drafter's own, and how
    # drafts are drawn (Served.draft_sampling: what the drafts stage takes, as it is)
    served: Served
    # the blocks resolved once, which the drafts stage takes as they are: the drafter's at the block size served,
    # the baseline drafter's at the same request (against its own), and the drafter's at each --block-sizes b
    block: Block
    baseline_block: Block | None
    block_sweep: tuple[tuple[int, Block], ...]
    threshold_sweep: tuple[float, ...]  # --confidence-thresholds, each drafted and scored beside the run's own
    stages: tuple[str, ...]  # `until` and the stages it depends on, in pipeline order
    drafter: DrafterConfig  # the drafter source's config, validated against the target
    baseline: DrafterConfig | None
    n_prompts: int
    num_target_layers: int
    step_costs: dict[int, float] | None  # --step-cost: a speculative step's cost per block size (plain step = 1)

    def runs(self, stage: str) -> bool:
        """Whether this evaluation runs `stage`."""
        return stage in self.stages

    @property
    def refresh(self) -> frozenset[str]:
        """The stages recomputed even if the store has them."""
        return frozenset(self.evaluation.refresh or ())


def check_evaluation(parameters: Evaluation | Mapping[str, Any],
                     name: Callable[[str], str] = parameter_name) -> CheckedEvaluation:
    """Check the parameters of an evaluate-checkpoint run (an Evaluation, or its parameters by group, as Prefect
    gives them): the record the flow wires its tasks with, or InputError naming what is wrong, each setting as
    `name` names it (default: as a deployment's parameter; the command line names its flags).

    A Dask scheduler is asked first (a dead one gets one message, nothing computed); a reference server is asked
    who it is and checked against the target's tokenizer, so a mismatched or dead server, or one that refuses the
    API key (or its absence), is refused before any stage stores anything."""
    try:  # an Evaluation was checked when it was made (by the command line)
        evaluation = parameters if isinstance(parameters, Evaluation) else Evaluation.checked(parameters, name)
    except SettingsError as e:
        raise InputError(str(e)) from None
    inputs, generation, serving = evaluation.inputs, evaluation.generation, evaluation.serving
    scoring, checkpoints, training = evaluation.scoring, evaluation.checkpoints, evaluation.training
    for field, folder in (("tensorboard", training.tensorboard), ("report_dir", evaluation.output.report_dir)):
        if folder and (problem := writable_problem(Path(folder), folder=True)):
            raise InputError(f"{name(field)}: {problem}")
    if checkpoints.drafter_config and not Path(checkpoints.drafter_config).is_file():
        raise InputError(f"{name('drafter_config')} {checkpoints.drafter_config}: no such file (the drafter's "
                         "config.json, for checkpoints saved without one)")
    if training.mlflow and (problem := mlflow_uri_problem(training.mlflow)):
        raise InputError(f"{name('mlflow')} {problem}")
    check_dask_address(evaluation.compute.dask_address)
    if problem := store_problem(evaluation.output.store, name("store")):
        raise InputError(problem)
    device = evaluation.compute.device
    if device == "cuda" and not torch.cuda.is_available():
        raise InputError(f"{name('device')} {device}: CUDA is not available on this machine; use cpu")
    target = inputs.target
    target_config = check_target(target)
    try:
        attention = choose_attention(target, evaluation.compute.attn_implementation)
    except ValueError as e:  # (names the config file)
        raise InputError(f"target: {e}".replace("--attn-implementation", name("attn_implementation"))) from None
    fetch_options = {"relay_token_file": checkpoints.relay_token_file, "include": checkpoints.include,
                     "wait_seconds": checkpoints.checkpoint_wait, "settle_seconds": checkpoints.settle_seconds}
    tokenizer = target_tokenizer(target)  # resolves a mask token given as a string
    requested = [("block_size", serving.block_size), *(("block_sizes", b) for b in scoring.block_sizes or ())]
    configs: dict[str, DrafterConfig] = {}
    for which, source, config_file in (("drafter", evaluation.drafter, checkpoints.drafter_config),
                                       ("baseline drafter", inputs.baseline, None)):
        if source is None:
            continue
        try:
            if which == "drafter":
                configs[which] = config = _read_drafter_source(source, tokenizer, drafter_config=config_file,
                                                               **fetch_options)
            else:
                configs[which] = config = _read_baseline(source, tokenizer, name("baseline"), **fetch_options)
        except DrafterError as e:  # (the message names the file)
            raise InputError(f"{which}: {e}") from None
        try:
            check_compatible(config, target_config.hidden_size, target_config.vocab_size, target_config.num_layers)
        except DrafterError as e:
            raise InputError(f"{which} {source} does not fit target {target}: {e}") from None
        verifier = config.verifier_architectures  # a speculators save names the target it was trained against
        if verifier and target_config.architectures and not set(verifier) & set(target_config.architectures):
            warnings.warn(f"{which} {source} was trained against a {', '.join(verifier)} (speculators_config."
                          f"verifier); the target {target} is a {', '.join(target_config.architectures)}: its "
                          "features may not be the ones the drafter reads", DrafterConfigWarning, stacklevel=2)
        for field, size in requested:
            try:
                resolve_block(size, config)
            except ValueError as e:  # a block size it cannot draft
                raise InputError(f"{name(field)} for {which} {source}: {e}") from None
    drafter, baseline = configs["drafter"], configs.get("baseline drafter")
    # a step cost alone projects the speedup at the one block size evaluated
    sweep = sorted(set(scoring.block_sizes or ())) or ([serving.block_size or drafter.block_size]
                                                       if scoring.step_cost else [])
    step_costs = read_step_costs(scoring.step_cost, sweep or [serving.block_size or drafter.block_size],
                                 name("step_cost"))
    if inputs.references is not None:
        n_prompts = check_given_references(inputs.references, target, inputs.thinking, target_config,
                                           name("references"))
    else:
        n_prompts = check_prompts(prompt_choice(inputs), target, inputs.max_new_tokens, target_config,
                                  name("max_new_tokens"))
    if generation.reference != "local":
        try:
            backend = open_backend(generation.reference, AutoTokenizer.from_pretrained(target),
                                   api_key_file=generation.reference_api_key_file)
            backend.identity  # noqa: B018 (asks the server which model it serves)
            backend.check_matches(target_config.vocab_size)
        except (ValueError, BackendError) as e:
            raise InputError(f"reference server: {e}") from None
    if problem := store_write_problem(Store(evaluation.output.store).root.absolute(), name("store")):
        raise InputError(problem)  # last: it creates the store
    try:
        dtype = resolve_dtype(evaluation.compute.dtype, target)
    except ValueError as e:
        raise InputError(str(e)) from None
    block = resolve_block(serving.block_size, drafter)
    for field, set_to in (("confidence_threshold", serving.confidence_threshold),
                          ("confidence_thresholds", scoring.confidence_thresholds)):
        if set_to and not drafter.generation.schedules_verification(drafter):
            raise InputError(f"{name(field)}: drafter {evaluation.drafter} ({drafter.architecture}) has no confidence "
                             "head to schedule its verification; a confidence threshold applies to DSpark drafters "
                             "saved with one (enable_confidence_head)")
    served = Served(Sampling(serving.temperature, serving.top_k, serving.top_p, serving.min_p), serving.samples,
                    serving.seed, block.chosen, given=inputs.references is not None,
                    draft_sample_method=serving.draft_sample_method, draft_truncation=serving.draft_truncation,
                    confidence_threshold=serving.confidence_threshold)
    return CheckedEvaluation(
        evaluation=evaluation, store_location=Store(evaluation.output.store).location, dtype=dtype, attention=attention,
        target_name=inputs.target_name or model_name(target), served=served, block=block,
        baseline_block=resolve_block(serving.block_size, baseline) if baseline else None,
        block_sweep=tuple((b, resolve_block(b, drafter)) for b in sweep),
        threshold_sweep=tuple(sorted(set(scoring.confidence_thresholds or ()))),
        stages=stages_to_run(evaluation.until), drafter=drafter, baseline=baseline, n_prompts=n_prompts,
        num_target_layers=target_config.num_layers, step_costs=step_costs)


def check_target(target: str):
    """The target folder's config (dflash_core.target.read_target_config), or InputError: not a folder, a weight
    file cut short (an interrupted copy, a full disk: only headers are read, which would otherwise fail only once the
    target loads, after the store was written to), a config value of the wrong type."""
    if not Path(target).is_dir():
        raise InputError(f"target {target} is not a directory: pass a Hugging Face model folder")
    try:
        weights = weight_files(target) if has_safetensors(target) else []
    except WeightFilesError as e:
        raise InputError(f"target {target}: {e}") from None
    for path in weights:
        if problem := weight_file_problem(path):
            raise InputError(f"target {target}: {problem}; copy the checkpoint again")
    try:
        return read_target_config(target)
    except (ValueError, OSError) as e:
        raise InputError(f"target {target}: {e}") from None


def prompt_choice(inputs: Inputs) -> PromptChoice:
    """What the references stage reads the prompts from (the inputs' prompts, else their references file)."""
    return PromptChoice(inputs.prompt_set, inputs.thinking, inputs.protocol, inputs.data, inputs.max_samples,
                        inputs.reasoning)


def check_prompts(choice: PromptChoice, target: str, max_new_tokens: int, target_config,
                  max_new_tokens_name: str = "--max-new-tokens") -> int:
    """Read a prompt set as the references stage will (InputError naming the file and line, or the published
    benchmark); each prompt plus the completion must fit the target's context. Returns its number of prompts."""
    try:
        prompt_set = load_prompts(choice, target).prompts
    except (PromptError, BenchmarkError) as e:
        raise InputError(str(e)) from None
    longest = max(len(p.input_ids) for p in prompt_set)
    if target_config.max_positions is not None and longest + max_new_tokens > target_config.max_positions:
        raise InputError(
            f"the longest prompt ({longest} tokens) plus {max_new_tokens_name} {max_new_tokens} exceeds the target's "
            f"{target_config.max_positions} positions; lower {max_new_tokens_name} or shorten the prompts")
    return len(prompt_set)


def read_step_costs(path: str | None, block_sizes: list[int], option: str = "--step-cost") -> dict[int, float] | None:
    """A --step-cost file: {"<b>": cost of one speculative step verifying b tokens, relative to one plain decode
    step, measured on the serving box}, one for each block size evaluated; None without a file. `option`: how
    messages name the setting."""
    if path is None:
        return None
    try:
        raw = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise InputError(f"{option} {path}: cannot read it as JSON ({e})") from None
    if not isinstance(raw, dict):
        raise InputError(f'{option} {path}: must be a JSON object {{"<block size>": <relative step cost>}}')
    costs = {}
    for key, value in raw.items():
        if not key.isdigit() or isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
            raise InputError(f"{option} {path}: {key!r}: {value!r}: keys are block sizes, values positive costs "
                             "relative to one plain decode step")
        costs[int(key)] = float(value)
    if missing := sorted(set(block_sizes) - set(costs)):
        raise InputError(f"{option} {path}: no cost for block size {', '.join(map(str, missing))}")
    return costs


def check_given_references(path: str, target: str, thinking: bool, target_config,
                           option: str = "--references") -> int:
    """Read a --references file as the references stage will (InputError naming the file, line and field);
    each prompt + completion must fit the target's context. Returns its number of completions."""
    try:
        completions = read_completions(path, target_tokenizer(target), thinking=thinking,
                                       vocab_size=target_config.vocab_size)
    except PromptError as e:
        raise InputError(f"{option} {e}") from None
    if all(len(c.completion_ids) < 2 for c in completions):  # else the scores stage fails, after the work
        raise InputError(f"{option} {path}: no completion holds two tokens, so none has a decode step to score (the "
                         "target's first token, then one to verify a draft against); give longer completions")
    longest = max(completions, key=lambda c: len(c.input_ids) + len(c.completion_ids))
    if target_config.max_positions is not None and \
            len(longest.input_ids) + len(longest.completion_ids) > target_config.max_positions:
        raise InputError(f"{option} {path}: {longest.id} holds {len(longest.input_ids)} prompt and "
                         f"{len(longest.completion_ids)} completion tokens, more than the target's "
                         f"{target_config.max_positions} positions; leave it out or shorten it")
    return len(completions)


def _read_baseline(source: str, tokenizer, option: str, **fetch_options) -> DrafterConfig:
    """The baseline's config: a baseline is a finished checkpoint (the published drafter, another run's save), so it
    is taken as it is, never waited for, and a mistyped one is refused at once, named as the baseline."""
    if not is_relay_url(source) and not local_path(source).exists():
        folder = local_path(source).absolute()
        try:
            siblings = [p.name for p in folder.parent.iterdir() if p.is_dir()]
        except OSError:  # no such folder either, or one this user cannot list
            siblings = []
        near = difflib.get_close_matches(folder.name, siblings, n=1, cutoff=0.75)
        raise InputError(f"{option} {source}: no such folder" + (f" (did you mean {near[0]}?)" if near else "")
                         + "; give a finished drafter checkpoint's folder or its relay URL")
    options = {**fetch_options, "wait_seconds": 0, "settle_seconds": 0}
    return _read_drafter_source(source, tokenizer, role="baseline", **options)


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


def mlflow_uri_problem(uri: str) -> str | None:
    """Why MLflow would not write to tracking URI `uri` (the package missing, a scheme no tracking store of MLflow's
    or of a plugin's serves), or None. Found up front: MLflow itself would fail only after the scores were stored,
    and then as a warning."""
    if importlib.util.find_spec("mlflow") is None:
        return "needs the mlflow package: pip install 'dflash-eval[mlflow]'"
    try:  # MLflow's registry of tracking stores by URI scheme (plugins' included): what MlflowClient(uri) looks up
        from mlflow.tracking._tracking_service.utils import _tracking_store_registry
    except ImportError:  # (a private name: an MLflow that moved it is not asked)
        return None
    try:
        _tracking_store_registry.get_store_builder(uri)
    except Exception:  # noqa: BLE001 - MLflow raises its own kinds for an unknown scheme
        return (f"{uri}: MLflow has no tracking store for this URI; give http://HOST:PORT of `mlflow server`, file:DIR, "
                "a database URI (sqlite:///FILE, postgresql://...) or databricks")
    return None


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


def store_problem(store: str | None, option: str = "--store") -> str | None:
    """Why the store cannot be used (read, created, written), or None. A store on object storage must answer
    (server up, bucket there, credentials taken), and this machine's copy of it be writable."""
    try:
        opened = Store(store)
    except ValueError as e:  # a URL of another scheme, or without a bucket
        return f"{option}: {e}"
    if opened.remote is not None:
        try:
            opened.remote.check_reachable()
        except ObjectStorageError as e:
            return f"{option}: {e}"
    problem = writable_problem(opened.root, folder=True)
    return f"{option}: {problem}" if problem else None


def store_write_problem(root: Path, option: str = "--store") -> str | None:
    """Why the store cannot be created or written, found by trying (with the inputs known good, the flow would
    create it next): what os.access cannot tell, e.g. for root, a folder that refuses new entries (/proc)."""
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=root):  # O_TMPFILE: never has a name in the store
            pass
    except OSError as e:
        return f"{option}: {root} cannot be created or written ({e.strerror})"
    return None


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
        stage_logger().warning(f"the Dask scheduler at {address} has no workers yet; the features and drafts "
                               "stages wait for one to join")
    return workers


# What each stage needs done first (a stage run by hand runs these too; they are usually cached).
DEPENDS_ON: dict[str, tuple[str, ...]] = {
    "fetch": (), "references": (), "features": ("references",), "drafts": ("fetch", "features"),
    "scores": ("drafts", "references"), "diagnostics": ("scores",),
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
