"""The options several commands take, each defined once: their choices as Enums, their Annotated types, and
the dataclasses that group them (`option_groups`). Imports neither torch nor Prefect: every command, `--help`
and `notify` included, builds these before it runs.

A value outside an option's choices gets the one line every refused input gets (`OneLineChoiceErrors`).
"""

import copy
import functools
import inspect
import tomllib
from dataclasses import MISSING, dataclass, fields
from enum import StrEnum
from pathlib import Path
from typing import Annotated, get_type_hints

import typer
from typer._click.exceptions import BadParameter, UsageError  # typer's own click
from typer.core import TyperGroup, TyperOption
from typer.models import OptionInfo

from dflash_core.choices import AUTO_DTYPE, DEFAULT_REPLAY_GROUP, DTYPE_NAMES, SLIDING_SEMANTICS, STAGE_DTYPE_NAMES
from dflash_eval.flows.choices import DEVICES, STAGES

from .common import fail

Stage = StrEnum("Stage", [(stage, stage) for stage in STAGES])  # what `stage NAME` runs
Device = StrEnum("Device", [(device, device) for device in DEVICES])


# From dflash_core.choices, which imports nothing: building the command line imports no torch (seconds, for every
# command and every --help).
Dtype = StrEnum("Dtype", [(name, name) for name in (AUTO_DTYPE, *STAGE_DTYPE_NAMES)])  # an evaluation's --dtype
ServedDtype = StrEnum("ServedDtype", [(name, name) for name in (AUTO_DTYPE, *DTYPE_NAMES)])  # serve-reference's
SlidingSemantics = StrEnum("SlidingSemantics", [(name, name) for name in SLIDING_SEMANTICS])


# tests/test_cli.py checks these against DEFAULT_STEPS (dflash_eval.tiny.target imports torch).
class Arch(StrEnum):
    """--arch of tiny build: the keys of dflash_eval.tiny.target.DEFAULT_STEPS."""

    qwen3 = "qwen3"
    qwen3_5 = "qwen3_5"


class OneLineChoiceErrors(TyperGroup):
    """The root command group: a mistake on the command line (a value outside an option's choices or range, an
    unknown or missing option) is refused with one line and exit code 2, as the input checks refuse everything
    else (flows/checks.py), instead of typer's usage box: `error: --dtype must be one of auto, float32, bfloat16`,
    `error: Invalid value for '--concurrency': Input should be greater than or equal to 1`."""

    def invoke(self, ctx: typer.Context):
        try:
            return super().invoke(ctx)
        except UsageError as e:
            param = getattr(e, "param", None)
            choices = getattr(getattr(param, "type_descriptor", None), "choices", None)
            if choices:
                name = param.opts[0] if param.param_type_name == "option" else param.metavar or param.name
                line = f"{name} must be one of {', '.join(c.value for c in choices)}"
            else:
                line = " ".join(e.format_message().split())
                if e.ctx is not None and not isinstance(e, BadParameter):
                    line += f" (see {e.ctx.command_path} --help)"
            typer.secho(f"error: {line}", err=True, fg="red")
            raise typer.Exit(2) from None


def _no_type_for_flags(display_type_rich):
    """typer shows `<bool>` beside every flag (`--diagnostics  <bool>`), as if it took a value: show nothing."""

    @functools.wraps(display_type_rich)
    def display(self, ctx):
        return None if self.is_flag else display_type_rich(self, ctx)

    return display


TyperOption.display_type_rich = _no_type_for_flags(TyperOption.display_type_rich)  # type: ignore[method-assign]


def example(*lines: str) -> str:
    """A command's epilog: an example to copy and paste (lines after the first are continuations)."""
    return "Example:\n\n" + " \\\n    ".join(lines)


Target = Annotated[str, typer.Option("--target", help="Target model folder (Hugging Face format).")]
CHECKPOINT_FORMS = ("a folder (a Hugging Face export: config.json + model.safetensors; a SpecForge save: "
                    "epoch_E_step_N or run-stepN, with --drafter-config when it has no config), or a relay URL "
                    "(http://RELAY:8700/RUN/step_N)")
Drafter = Annotated[str, typer.Option("--drafter", help=f"The drafter checkpoint: {CHECKPOINT_FORMS}.")]
Drafters = Annotated[list[str], typer.Option(
    "--drafter", help=f"The drafter checkpoint: {CHECKPOINT_FORMS}; or a training run's folder: each of its finished "
    "checkpoints, in step order. Repeat it to evaluate several in this one process (--out is then a folder: a "
    "results file per checkpoint).")]
Prompts = Annotated[str | None, typer.Option("--prompts", help="A suite (math, code, chat, multiturn) or a JSONL file: "
                                             "id + one of text/messages/turns/input_ids, optional category.")]
BlockSizes = Annotated[str | None, typer.Option(
    "--block-sizes", metavar="B1,B2,...", help="Also draft and score at each of these block sizes (e.g. 2,4,8,16): "
    "tau(b), tau(b)/b and, with --step-cost, the projected speedup per b.")]
StepCost = Annotated[str | None, typer.Option(
    "--step-cost", help='A JSON file {"<b>": cost of one speculative step verifying b tokens relative to one plain '
    'decode step}, measured on the serving box: the projected speedup per block size (labelled as projected).')]
TrainingLogOption = Annotated[str | None, typer.Option(
    "--training-log", metavar="DIR", help="The training run's folder (or its runs/ folder), for a checkpoint whose "
    "run folder is not on this machine (a relay): what the trainer logged (TensorBoard, SpecForge's "
    "best_meta.json, transformers' trainer_state.json) beside tau, and the train/eval gap alarm. A local "
    "checkpoint's run folder is found by itself.")]
TensorboardOption = Annotated[str | None, typer.Option(
    "--tensorboard", metavar="DIR", help="Write tau by training step into this TensorBoard run (default "
    "<training run>/runs/dflash-eval when the run folder is on this machine and writable).")]
MlflowOption = Annotated[str | None, typer.Option(
    "--mlflow", metavar="URI", help="Also write tau by training step into an MLflow run of ours at this tracking "
    "URI (http://HOST:PORT of `mlflow server`, or file:DIR), experiment dflash-eval, one run per training run.")]
DivergenceWindow = Annotated[int, typer.Option(
    "--divergence-window", min=3, help="Saves the diverging alarm fits its slopes over (training accuracy rising "
    "while tau does not).")]
TargetName = Annotated[str | None, typer.Option(
    "--name", help="How series titles and tags call the target (default: the Hub id in its config or cache path, "
    "else its folder's name); recorded with its references the first time they are made.")]
ReferencesFile = Annotated[str | None, typer.Option(
    "--references", help="Completions you already have (a JSONL file: id, input_ids and completion_ids, or a "
    "text/messages prompt and a completion text), e.g. a server's logged outputs: stored as the references instead "
    "of generating them (no --prompts needed).")]
MaxNewTokens = Annotated[int, typer.Option("--max-new-tokens", help="Greedy reference length limit per prompt.")]
StoreRoot = Annotated[str | None, typer.Option("--store", help="The store: a folder or s3://BUCKET/PREFIX (default "
                                               "$DFLASH_STORE, else ./.dflash-store).")]
DtypeOption = Annotated[Dtype, typer.Option("--dtype", help="auto (the target checkpoint's own dtype; a float16 one "
                                            "computes in float32), float32 or bfloat16: target and drafter compute "
                                            "dtype.")]
DeviceOption = Annotated[Device, typer.Option("--device", help="cpu or cuda.")]
SlidingOption = Annotated[SlidingSemantics, typer.Option(
    "--sliding-semantics", help="Sliding drafter layers: causal (training, serving, current z-lab reference) or "
    "non_causal (earlier z-lab reference); a config's is_causal overrides it.")]
Thinking = Annotated[bool, typer.Option("--thinking/--no-thinking", help="enable_thinking in the chat template.")]
Reference = Annotated[str, typer.Option("--reference", help="Greedy references from: local (the target here), "
                                        "sglang+http://HOST:PORT or openai+http://HOST:PORT/v1.")]
Lookahead = Annotated[bool, typer.Option("--lookahead/--no-lookahead", help="Keep B-1 greedy tokens past each "
                                         "completion so the last step is scored against a whole block (default: "
                                         "clipped, as online decoding).")]
Concurrency = Annotated[int, typer.Option("--concurrency", min=1, help="Requests in flight to a reference server.")]
Temperature = Annotated[float, typer.Option("--temperature", help="Sampling temperature the target is served at: 0 "
                                            "(greedy), or above 0 (sampled references, --samples per prompt).")]
TopK = Annotated[int, typer.Option("--top-k", help="Keep the K most likely tokens (0: off); applied after the "
                                   "temperature, before top-p and min-p, as SGLang does.")]
TopP = Annotated[float, typer.Option("--top-p", help="Keep the most likely tokens holding this much mass, in (0, 1] "
                                     "(1: off).")]
MinP = Annotated[float, typer.Option("--min-p", help="Drop tokens below this fraction of the most likely one's "
                                     "probability, in [0, 1) (0: off).")]
Samples = Annotated[int, typer.Option("--samples", help="Sampled completions per prompt at a temperature above 0 "
                                      "(each a reference of its own; tau is their mean).")]
Seed = Annotated[int, typer.Option("--seed", help="Seed of the sampled completions (each request's seed follows from "
                                   "it, the prompt and the sample).")]
BlockSize = Annotated[int | None, typer.Option(
    "--block-size", help="Verify blocks of this many tokens (2 .. the drafter's block size), as SGLang's "
    "--speculative-num-draft-tokens and vLLM's num_speculative_tokens + 1 serve it (default: the drafter's).")]
Baseline = Annotated[str | None, typer.Option("--baseline", help="Another drafter (e.g. the published one for this "
                                              "target) scored alongside: its own row in history and the report.")]
RelayTokenFile = Annotated[str | None, typer.Option("--relay-token-file", help="File holding a relay's bearer token "
                                                    "(else $DFLASH_RELAY_TOKEN), for --drafter http://RELAY/<path>.")]
ReferenceApiKeyFile = Annotated[str | None, typer.Option(
    "--reference-api-key-file", help="File holding the reference server's API key (else $DFLASH_REFERENCE_API_KEY), "
    "sent as Authorization: Bearer.")]
DrafterConfig = Annotated[str | None, typer.Option(
    "--drafter-config", help="The drafter's config.json, for checkpoints saved without one (SpecForge's run-stepN "
    "folders) whose run folder holds none either.")]
Include = Annotated[list[str] | None, typer.Option(
    "--include", help="Also fetch checkpoint files matching this pattern (repeatable); config, weights and "
    "trainer_state.json always travel, optimizer state never unless named.")]
CheckpointWait = Annotated[float, typer.Option(
    "--checkpoint-wait", min=0, help="Seconds to wait for a checkpoint that is not "
    "there yet or still being written, before failing.")]
SettleSeconds = Annotated[float, typer.Option(
    "--settle-seconds", min=0, envvar="DFLASH_SETTLE_SECONDS", help="A checkpoint "
    "folder counts as finished once none of its files changed for this "
    "long.")]
Threads = Annotated[int | None, typer.Option(
    "--threads", min=1, help="CPU threads torch computes with in this process (default: $OMP_NUM_THREADS, else this "
    "machine's cores shared by the runs by hand computing on it at the time; ops of small models take fewer, where "
    "that is faster).")]
ReplayGroup = Annotated[int, typer.Option(
    "--replay-group", min=1, help=f"Prompts the drafts stage replays together (their blocks share replay's batches, "
    f"so it is part of the drafts key unless {DEFAULT_REPLAY_GROUP}); on a Dask cluster, one shard each.")]
DaskAddress = Annotated[str | None, typer.Option(
    "--dask", envvar="DFLASH_DASK_ADDRESS", metavar="ADDRESS", help="Compute the features and drafts stages on the "
    "workers of the Dask scheduler at ADDRESS (tcp://HOST:PORT), shard by shard; the workers need this package, "
    "the store and the target at the same path. Default: this process.")]
ResultsOut = Annotated[Path | None, typer.Option("--out", help="Write the results JSON here (its folder is created if need be; checked "
                                                 "before any work).")]


class OptionGroup:
    """A dataclass of options several commands take as one parameter (`option_groups`)."""


@dataclass(frozen=True)
class Inputs(OptionGroup):
    """What checkpoints are evaluated on (run, stage, serve, watch)."""

    target: Target
    prompts: Prompts = None  # run and stage also take --references FILE instead
    store: StoreRoot = None
    max_new_tokens: MaxNewTokens = 256


@dataclass(frozen=True)
class Settings(OptionGroup):
    """How checkpoints are evaluated (run, stage, and serve, which fixes them in its deployments)."""

    dtype: DtypeOption = Dtype.auto
    device: DeviceOption = Device.cpu
    sliding_semantics: SlidingOption = SlidingSemantics.causal
    reference: Reference = "local"
    reference_api_key_file: ReferenceApiKeyFile = None
    concurrency: Concurrency = 8
    drafter_config: DrafterConfig = None
    include: Include = None
    checkpoint_wait: CheckpointWait = 300.0
    settle_seconds: SettleSeconds = 30.0
    replay_group: ReplayGroup = DEFAULT_REPLAY_GROUP
    dask_address: DaskAddress = None
    temperature: Temperature = 0.0
    top_k: TopK = 0
    top_p: TopP = 1.0
    min_p: MinP = 0.0
    samples: Samples = 1
    seed: Seed = 0
    block_size: BlockSize = None
    block_sizes: BlockSizes = None
    step_cost: StepCost = None
    training_log: TrainingLogOption = None
    tensorboard: TensorboardOption = None
    mlflow: MlflowOption = None
    divergence_window: DivergenceWindow = 4
    target_name: TargetName = None

    def parameters(self) -> dict:
        """These as flow parameters: choices by name, files as absolute paths (flow runs may start elsewhere)."""
        return {"dtype": self.dtype.value, "device": self.device.value, "sliding_semantics": self.sliding_semantics.value,
                "reference": self.reference, "concurrency": self.concurrency,
                "reference_api_key_file": absolute(self.reference_api_key_file) if self.reference_api_key_file else None,
                "drafter_config": absolute(self.drafter_config) if self.drafter_config else None,
                "include": self.include or None, "checkpoint_wait": self.checkpoint_wait,
                "settle_seconds": self.settle_seconds, "replay_group": self.replay_group,
                "dask_address": self.dask_address or None, "temperature": self.temperature, "top_k": self.top_k,
                "top_p": self.top_p, "min_p": self.min_p, "samples": self.samples, "seed": self.seed,
                "block_size": self.block_size, "block_sizes": block_size_list(self.block_sizes),
                "step_cost": absolute(self.step_cost) if self.step_cost else None,
                "training_log": absolute(self.training_log) if self.training_log else None,
                "tensorboard": absolute(self.tensorboard) if self.tensorboard else None, "mlflow": self.mlflow or None,
                "divergence_window": self.divergence_window, "target_name": self.target_name}


@dataclass(frozen=True)
class ByHand(OptionGroup):
    """What only an evaluation run by hand takes (run, stage)."""

    thinking: Thinking = False
    lookahead: Lookahead = False
    references: ReferencesFile = None
    relay_token_file: RelayTokenFile = None
    threads: Threads = None
    out: ResultsOut = None

    def parameters(self) -> dict:
        """The flow parameters among these (out is only written)."""
        return {"thinking": self.thinking, "lookahead": self.lookahead, "relay_token_file": self.relay_token_file,
                "threads": self.threads, "references": absolute(self.references) if self.references else None}


# The panels the help of an evaluating command (run, stage, serve, watch) shows its options in, by parameter name;
# an option not named here shows under typer's "Options".
PANELS = {
    "Inputs": ("target", "drafter", "prompts", "references", "max_new_tokens", "thinking", "target_name", "baseline",
               "config"),
    "References": ("reference", "reference_api_key_file", "concurrency", "temperature", "top_k", "top_p", "min_p",
                   "samples", "seed", "lookahead"),
    "Scoring": ("block_size", "block_sizes", "step_cost", "sliding_semantics", "all_positions", "diagnostics"),
    "Checkpoints": ("drafter_config", "include", "checkpoint_wait", "settle_seconds", "relay_token_file"),
    "Compute": ("dtype", "device", "threads", "replay_group", "dask_address"),
    "Store and output": ("store", "out", "report_dir"),
    "Training run": ("training_log", "tensorboard", "mlflow", "divergence_window"),
}
PANEL_OF = {name: panel for panel, names in PANELS.items() for name in names}


def option_info(annotation) -> OptionInfo | None:
    """The typer.Option(...) of an Annotated[..., typer.Option(...)], else None (an argument, a plain type)."""
    return next((m for m in getattr(annotation, "__metadata__", ()) if isinstance(m, OptionInfo)), None)


def in_panel(name: str, annotation):
    """`annotation` (an Annotated[..., typer.Option(...)]) with its option shown in PANEL_OF[name]'s panel."""
    info = option_info(annotation)
    if info is None or name not in PANEL_OF or info.rich_help_panel is not None:
        return annotation
    placed = copy.copy(info)
    placed.rich_help_panel = PANEL_OF[name]
    return Annotated[(annotation.__origin__, placed, *(m for m in annotation.__metadata__ if m is not info))]


def read_config(ctx: typer.Context, value: Path | None) -> Path | None:
    """--config FILE: a TOML file whose keys are this command's options (`max-new-tokens` or `max_new_tokens`) and
    whose values become their defaults, so the command line overrides them, as lm-eval-harness's and Prefect's
    own settings files do. Relative paths in it are taken from where the command runs, as on the command line."""
    if value is None:
        return None
    try:
        found = tomllib.loads(value.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise BadParameter(f"{value}: {getattr(e, 'strerror', None) or e}", param_hint="--config") from None
    # by the option's own name (--max-new-tokens: max-new-tokens or max_new_tokens), to the parameter it sets
    options = {opt.lstrip("-").replace("-", "_"): p.name for p in ctx.command.params
               if isinstance(p, TyperOption) and p.name != "config" for opt in p.opts}
    defaults = {}
    for key, setting in found.items():
        if (name := options.get(key.replace("-", "_"))) is None:
            raise BadParameter(f"{value}: {key!r} is no option of `{ctx.command_path}` (its options: "
                               f"{', '.join(sorted(o.replace('_', '-') for o in options))})", param_hint="--config")
        defaults[name] = setting
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return value


ConfigFile = Annotated[Path | None, typer.Option(
    "--config", is_eager=True, callback=read_config, metavar="FILE", help="A TOML file of this command's options "
    "(e.g. target, prompts, store, reference, thinking, temperature): what a team fixes once. The command line "
    "overrides it.")]


def option_groups(command):
    """Let `command` take OptionGroup dataclasses as parameters: its command line shows each of their fields as
    an option of its own (the field's Annotated type and default, in its PANELS panel), and the command is called
    with the dataclass. Options that several commands share are so declared once, with their defaults."""
    hints = get_type_hints(command, include_extras=True)
    groups, parameters = {}, []
    for name, parameter in inspect.signature(command).parameters.items():
        annotation = hints.get(name, parameter.annotation)
        if isinstance(annotation, type) and issubclass(annotation, OptionGroup):
            groups[name] = annotation
            field_types = get_type_hints(annotation, include_extras=True)
            parameters += [inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY,
                                             annotation=in_panel(f.name, field_types[f.name]),
                                             default=inspect.Parameter.empty if f.default is MISSING else f.default)
                           for f in fields(annotation)]
        else:
            parameters.append(parameter.replace(kind=inspect.Parameter.KEYWORD_ONLY,
                                                annotation=in_panel(name, annotation)))
    parameters.append(inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, default=None,
                                        annotation=in_panel("config", ConfigFile)))

    @functools.wraps(command)
    def run(**values):
        values.pop("config")  # read by its callback into the other options' defaults
        for name, group in groups.items():
            values[name] = group(**{f.name: values.pop(f.name) for f in fields(group)})
        return command(**values)

    panels = list(PANELS)

    def panel_order(parameter: inspect.Parameter) -> int:  # arguments first, then the panels in PANELS order
        info = option_info(parameter.annotation)
        if info is None:
            return -1
        return panels.index(info.rich_help_panel) if info.rich_help_panel in panels else len(panels)

    parameters.sort(key=panel_order)
    run.__signature__ = inspect.Signature(parameters)  # what typer reads the options from
    run.__annotations__ = {p.name: p.annotation for p in parameters}
    return run


def block_size_list(text: str | None) -> list[int] | None:
    """--block-sizes 2,4,8 as [2, 4, 8]; a value that is not a list of whole numbers exits with one line."""
    if text is None:
        return None
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        fail(f"--block-sizes {text!r}: give whole numbers separated by commas, e.g. 2,4,8,16")


def absolute(path: str) -> str:
    """An existing file or folder as an absolute path (flow runs start in other processes); else as given
    (a suite name, a URL)."""
    return str(Path(path).resolve()) if Path(path).exists() else path
