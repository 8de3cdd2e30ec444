"""The settings of an evaluation, declared once.

Each setting is a field of one group below: its type, default, bounds and help, and, by its group, the panel it
shows in. Everything else is made from this one declaration:

- the command line's options (cli/options.py): `--max-new-tokens` in the "Inputs" panel of `run --help`;
  a field's `Cli` says where the option differs from the field (its flag, an environment variable);
- `--config FILE`'s keys, which are the options' names;
- the evaluate-checkpoint flow's parameters (flows/evaluate.py): `drafter`, then one parameter per group, which
  Prefect's deployment form shows as a section of its own, then `until` and `refresh`;
- the checks of values and of the rules between them: `Settings.checked` validates once, before any work, with
  one message naming each setting as the user gave it (`--top-p` on the command line, `serving.top_p` in a
  deployment's parameters). The checks that read files or ask servers follow in flows/checks.py.

Adding a setting is one field here, plus its use. Imports neither torch nor Prefect: the command line builds its
options from this module before it imports either.
"""

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, Self, get_args

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dflash_core.choices import DEFAULT_REPLAY_GROUP, DraftSampleMethod
from dflash_core.published.benchmarks import BenchmarkError, benchmark_names, read_data_option
from dflash_core.published.protocols import DEFAULT_PROTOCOL, PROTOCOLS, ProtocolName

# The stages of an evaluation, in pipeline order (the store's other stages are bookkeeping: baselines, shards); the
# store's names for them (storage.schema.Stage).
StageName = Literal["fetch", "references", "features", "drafts", "scores", "diagnostics"]
STAGES: tuple[str, ...] = get_args(StageName)
DeviceName = Literal["cpu", "cuda"]
# dflash_core.choices' names, written out for the type checker and the deployment forms (tests/test_cli.py checks
# they are the same): "auto" (the target checkpoint's own dtype) or a dtype the stages compute in; how sliding-window
# drafter layers treat the block.
DtypeName = Literal["auto", "float32", "bfloat16"]
AttentionName = Literal["auto", "sdpa", "eager"]
SlidingSemanticsName = Literal["causal", "non_causal"]
# The temperatures served: 0 (greedy), or one in [MIN_TEMPERATURE, MAX_TEMPERATURE], where vLLM and SGLang both sample
# at the temperature given (why, with the sources: dflash_core.sampling, which states the same bounds for library
# users; it imports torch, so they are written out here, and tests/test_bad_input.py checks they agree).
MIN_TEMPERATURE = 0.01
MAX_TEMPERATURE = 2.0
# A decode step needs two completion tokens: the first, which the target emits after the prompt (the block's anchor),
# and one after it to verify a draft against, whatever the block size (at least 2). One new token leaves no step to
# score, and the run would fail only in the scores stage, after references, features and drafts were stored.
MIN_NEW_TOKENS = 2
# Sampled completions per prompt: a guard against a slip (`--samples 1000000000`), far past any useful count. Each is
# a reference of its own, with its own features stored; past a few dozen, tau's interval hardly narrows (the spread
# between prompts sets it): more prompts help where more samples do not.
MAX_SAMPLES = 1000


class SettingsError(ValueError):
    """Settings that break a bound or a rule: the message names each setting as it was given."""


@dataclass(frozen=True)
class Cli:
    """Where a setting's command-line option differs from what its field gives: `--<field-name>`, a boolean as
    `--<name>/--no-<name>`, on every command that evaluates (run, stage, serve, watch)."""

    flag: str | None = None  # the option's name, when not --<field-name>
    negatable: bool = True  # a boolean: also --no-<name>
    envvar: str | None = None  # read when the option is not given
    metavar: str | None = None
    path: bool = False  # a file or folder: given to flow runs as an absolute path (they may start elsewhere)
    by_hand_only: bool = False  # only where a person runs the evaluation (run, stage), not fixed in deployments


class Group(BaseModel):
    """One group of settings: a help panel on the command line, a section of the deployment form."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    panel: ClassVar[str]  # its panel in `--help`

    @model_validator(mode="before")
    @classmethod
    def _empty_means_default(cls, values: Any) -> Any:
        # a deployment's templated parameter ("{{ $DFLASH_REFERENCE }}") arrives as "" when its variable is unset
        if isinstance(values, Mapping):
            return {name: value for name, value in values.items() if value != ""}
        return values


class Inputs(Group):
    """What a checkpoint is evaluated on."""

    panel = "Inputs"
    target: Annotated[str, Cli(path=True)] = Field(description="Target model folder (Hugging Face format).")
    prompts: Annotated[str | None, Cli(path=True)] = Field(None, description=(
        "A suite (math, code, chat, multiturn), a JSONL file (id + one of text/messages/turns/input_ids, optional "
        "category), or published benchmarks, comma-separated: gsm8k, math500, aime24, aime25, humaneval, mbpp, "
        "livecodebench, swe-bench, lbpp, mt-bench, alpaca, arena-hard-v2, or zlab-paper (the paper's ten), deepspec "
        "(DeepSpec's tasks)."))
    references: Annotated[str | None, Cli(path=True)] = Field(None, description=(
        "Completions you already have (a JSONL file: id, input_ids and completion_ids, or a text/messages prompt and "
        "a completion text), e.g. a server's logged outputs: stored as the references instead of generating them "
        "(no --prompts needed). With --draft-sample-method probabilistic, --temperature and the other sampling "
        "options say at which settings they were sampled."))
    max_new_tokens: int = Field(256, ge=MIN_NEW_TOKENS, description=(
        "Reference length limit per prompt, at least 2: a decode step needs the target's first token and one to "
        "verify a draft against (default 256; published benchmarks: their protocol's 2048)."))
    thinking: bool = Field(False, description="enable_thinking in the chat template (a suite or a prompt file).")
    protocol: ProtocolName | None = Field(None, description=(
        "Published benchmarks: the version of z-lab's protocol that picks, templates, tokenizes and stops them: "
        "zlab-2026-01 (the paper's tables; the default), zlab-2026-04 or dflash-0.1 (PyPI dflash 0.1.0); or "
        "deepspec (DeepSpec's evaluator, the DSpark paper's: its own files, T = 1.0, pooled tau)."))
    data: Annotated[str | None, Cli(metavar="[NAME=]PATH,...")] = Field(None, description=(
        "Published benchmarks: local copies in the dataset's own layout (its downloaded folder, or its parquet/jsonl "
        "files), as NAME=PATH pairs (one PATH for one benchmark); the others come from a package that ships them, "
        "else the hub (or its cache with HF_DATASETS_OFFLINE=1)."))
    max_samples: int | None = Field(None, ge=1, description=(
        "Published benchmarks: rows of each, picked as the protocol picks them (default: zlab-2026-01's run-script "
        "counts, 128 mostly; the others' all)."))
    reasoning: str | None = Field(None, description=(
        "Published benchmarks: the template's reasoning as the protocol sets it: on or off (enable_thinking), or "
        "with dflash-0.1 a level the template reads (reasoning_effort: low, high, xhigh, ...); default: off, and "
        "the template's own default with dflash-0.1."))
    target_name: Annotated[str | None, Cli(flag="--name")] = Field(None, description=(
        "How series titles and tags call the target (default: the Hub id in its config or cache path, else its "
        "folder's name); recorded with its references the first time they are made."))
    baseline: Annotated[str | None, Cli(path=True)] = Field(None, description=(
        "Another drafter (e.g. the published one for this target) scored alongside: its own row in history and the "
        "report."))

    @property
    def benchmarks(self) -> tuple[str, ...] | None:
        """The published benchmarks --prompts names (dflash_core.published), or None."""
        return benchmark_names(self.prompts) if self.prompts else None

    @model_validator(mode="after")
    def _benchmark_options(self) -> Self:
        if self.prompts is not None:
            try:
                named = benchmark_names(self.prompts)
                if named is not None:
                    read_data_option(self.data, named)
            except BenchmarkError as e:
                raise ValueError(str(e).replace("--prompts", "{prompts}").replace("--data", "{data}")) from None
        if self.benchmarks is None:
            given = [name for name in ("protocol", "data", "max_samples", "reasoning") if getattr(self, name)]
            if given:
                raise ValueError(f"{{{given[0]}}} applies to published benchmarks as {{prompts}} (gsm8k, math500, "
                                 "..., zlab-paper), not to a suite or a prompt file")
        elif self.thinking:
            raise ValueError("{thinking}: published benchmarks are templated as their protocol says; set "
                             "{reasoning} on instead")
        return self

    @property
    def prompt_set(self) -> str:
        """What names the prompt set: the prompts, else the completions file that stands for them."""
        return self.prompts or self.references or ""


class Generation(Group):
    """How the references are made."""

    panel = "References"
    reference: str = Field("local", description=(
        "Greedy references from: local (the target here), sglang+http://HOST:PORT or openai+http://HOST:PORT/v1."))
    reference_api_key_file: Annotated[str | None, Cli(path=True)] = Field(None, description=(
        "File holding the reference server's API key (else $DFLASH_REFERENCE_API_KEY), sent as Authorization: "
        "Bearer."))
    concurrency: int = Field(8, ge=1, description="Requests in flight to a reference server.")
    lookahead: bool = Field(False, description=(
        "Keep B-1 greedy tokens past each completion so the last step is scored against a whole block (default: "
        "clipped, as online decoding)."))


class Serving(Group):
    """How the target is served, which is what tau answers for: the sampling of its completions and the tokens it
    verifies per step."""

    panel = "Serving"
    temperature: float = Field(0.0, ge=0, le=MAX_TEMPERATURE, allow_inf_nan=False, description=(
        f"Sampling temperature the target is served at: 0 (greedy), or {MIN_TEMPERATURE:g} to {MAX_TEMPERATURE:g} "
        "(sampled references, --samples per prompt)."))
    top_k: int = Field(0, ge=0, description=(
        "Keep the K most likely tokens (0: off); applied after the temperature, before top-p and min-p, as SGLang "
        "does."))
    top_p: float = Field(1.0, gt=0, le=1, description="Keep the most likely tokens holding this much mass (1: off).")
    min_p: float = Field(0.0, ge=0, lt=1, description=(
        "Drop tokens below this fraction of the most likely one's probability (0: off)."))
    samples: int = Field(1, ge=1, le=MAX_SAMPLES, description=(
        f"Sampled completions per prompt at a temperature above 0 (each a reference of its own; tau is their mean), "
        f"at most {MAX_SAMPLES}."))
    seed: int = Field(0, ge=0, description=(
        "Seed of the sampled completions (each request's seed follows from it, the prompt and the sample)."))
    block_size: int | None = Field(None, ge=2, description=(
        "Verify blocks of this many tokens (2 .. the drafter's block size), as SGLang's "
        "--speculative-num-draft-tokens and vLLM's num_speculative_tokens + 1 serve it (default: the drafter's)."))
    draft_sample_method: DraftSampleMethod = Field("greedy", description=(
        "How drafts are drawn, as vLLM names it: greedy (the drafter's argmax, accepted where the target emits it: "
        "SGLang, vLLM's default, z-lab's paper-era benchmark) or probabilistic (sampled from the drafter's "
        "distribution q and accepted by rejection sampling: z-lab's dflash 0.1.0 benchmark, vLLM's "
        "draft_sample_method=probabilistic); probabilistic needs a temperature above 0."))
    draft_truncation: bool = Field(True, description=(
        "Probabilistic drafts: q gets the served top-k, top-p and min-p after the temperature, as the target's p "
        "does (dflash 0.1.0); off, the temperature only (vLLM's probabilistic drafts)."))
    confidence_threshold: float = Field(0.0, ge=0, le=1, allow_inf_nan=False, description=(
        "A drafter with a confidence head (DSpark) verifies only the drafts before the first it is less confident "
        "of than this, as DeepSpec's evaluator and the serving stacks' DSpark threshold do "
        "(0: every draft)."))

    @field_validator("temperature")
    @classmethod
    def _greedy_or_sampled(cls, value: float) -> float:
        if 0 < value < MIN_TEMPERATURE:
            raise ValueError(f"give 0 for greedy, or at least {MIN_TEMPERATURE:g} to sample (below it vLLM samples at "
                             f"{MIN_TEMPERATURE:g} or is greedy, SGLang samples at the temperature given)")
        return value

    @model_validator(mode="after")
    def _greedy_is_greedy(self) -> Self:
        if self.temperature == 0 and (self.top_k, self.top_p, self.min_p) != (0, 1.0, 0.0):
            raise ValueError("{top_k}, {top_p} and {min_p} apply at a temperature above 0: at temperature 0 "
                             "decoding is greedy (set {temperature}, or leave them off)")
        if self.temperature == 0 and self.samples != 1:
            raise ValueError("{samples} " f"{self.samples}: greedy completions (temperature 0) are all the same; set "
                             "{temperature} above 0 to sample several per prompt")
        if self.temperature == 0 and self.draft_sample_method == "probabilistic":
            raise ValueError("{draft_sample_method} probabilistic samples drafts at the served temperature: at "
                             "temperature 0 a draft is the drafter's argmax (greedy); set {temperature} above 0")
        if not self.draft_truncation and self.draft_sample_method == "greedy":
            raise ValueError("{draft_truncation} applies to probabilistic drafts: a greedy draft is the argmax")
        return self


class Scoring(Group):
    """What is scored besides tau, and how the drafter's sliding layers attend."""

    panel = "Scoring"
    block_sizes: Annotated[list[int] | None, Cli(metavar="B1,B2,...")] = Field(None, description=(
        "Also draft and score at each of these block sizes (e.g. 2,4,8,16): tau(b), tau(b)/b and, with --step-cost, "
        "the projected speedup per b."))
    step_cost: Annotated[str | None, Cli(path=True)] = Field(None, description=(
        'A JSON file {"<b>": cost of one speculative step verifying b tokens relative to one plain decode step}, '
        "measured on the serving box: the projected speedup per block size (labelled as projected)."))
    sliding_semantics: SlidingSemanticsName = Field("causal", description=(
        "Sliding drafter layers: causal (training, serving, current z-lab reference) or non_causal (earlier z-lab "
        "reference); a config's is_causal overrides it."))
    all_positions: Annotated[bool, Cli(negatable=False)] = Field(False, description=(
        "Also score a block drafted at every position (all_positions_tau: every position weighed once, as training "
        "losses do)."))
    confidence_thresholds: Annotated[list[float] | None, Cli(metavar="T1,T2,...")] = Field(None, description=(
        "A drafter with a confidence head (DSpark): also draft and score at each of these confidence thresholds "
        "(e.g. 0,0.3,0.5,0.7): tau and the tokens emitted per token verified (DeepSpec's verify_rate) per "
        "threshold."))

    @field_validator("block_sizes", mode="before")
    @classmethod
    def _from_text(cls, value: Any) -> Any:
        """The command line's and a TOML file's "2,4,8"."""
        if isinstance(value, str):
            try:
                return [int(part) for part in value.split(",") if part.strip()]
            except ValueError:
                raise ValueError("give whole numbers separated by commas, e.g. 2,4,8,16") from None
        return value

    @field_validator("block_sizes")
    @classmethod
    def _at_least_two(cls, value: list[int] | None) -> list[int] | None:
        if value is not None and any(b < 2 for b in value):
            raise ValueError(f"block sizes verify at least 2 tokens, got {','.join(map(str, value))}")
        return value

    @field_validator("confidence_thresholds", mode="before")
    @classmethod
    def _thresholds_from_text(cls, value: Any) -> Any:
        """The command line's and a TOML file's "0,0.3,0.5"."""
        if isinstance(value, str):
            try:
                return [float(part) for part in value.split(",") if part.strip()]
            except ValueError:
                raise ValueError("give numbers from 0 to 1 separated by commas, e.g. 0,0.3,0.5,0.7") from None
        return value

    @field_validator("confidence_thresholds")
    @classmethod
    def _thresholds_in_range(cls, value: list[float] | None) -> list[float] | None:
        if value is not None and not all(0 <= t <= 1 for t in value):  # (NaN fails too)
            raise ValueError(f"confidence thresholds lie in [0, 1], got {','.join(f'{t:g}' for t in value)}")
        return value


class Checkpoints(Group):
    """How a checkpoint is found, waited for and fetched."""

    panel = "Checkpoints"
    drafter_config: Annotated[str | None, Cli(path=True)] = Field(None, description=(
        "The drafter's config.json, for checkpoints saved without one (SpecForge's run-stepN folders) whose run "
        "folder holds none either."))
    include: list[str] | None = Field(None, description=(
        "Also fetch checkpoint files matching this pattern (repeatable); config, weights and trainer_state.json "
        "always travel, optimizer state never unless named."))
    checkpoint_wait: float = Field(300.0, ge=0, allow_inf_nan=False, description=(
        "Seconds to wait for a checkpoint that is not there yet or still being written, before failing."))
    settle_seconds: Annotated[float | None, Cli(envvar="DFLASH_SETTLE_SECONDS")] = Field(
        None, ge=0, allow_inf_nan=False, description=(
            "A checkpoint folder counts as finished once none of its files changed for this long (default "
            "$DFLASH_SETTLE_SECONDS, else 30)."))
    relay_token_file: Annotated[str | None, Cli(path=True)] = Field(None, description=(
        "File holding a relay's bearer token (else $DFLASH_RELAY_TOKEN), for --drafter http://RELAY/<path>."))


class Compute(Group):
    """What the stages compute in and where."""

    panel = "Compute"
    dtype: DtypeName = Field("auto", description=(
        "auto (the target checkpoint's own dtype; a float16 one computes in float32), float32 or bfloat16: target "
        "and drafter compute dtype."))
    attn_implementation: AttentionName = Field("auto", description=(
        "The target's attention implementation: auto (SDPA where its text model takes it, else eager: gpt-oss), "
        "sdpa or eager. Not SDPA, it is part of the references' and features' keys (the two round differently)."))
    device: DeviceName = Field("cpu", description="cpu or cuda (choose a GPU with CUDA_VISIBLE_DEVICES).")
    threads: int | None = Field(None, ge=1, description=(
        "CPU threads torch computes with (default: $OMP_NUM_THREADS, else this machine's cores shared by the "
        "evaluations computing on it at the time; ops of small models take fewer, where that is faster)."))
    replay_group: int = Field(DEFAULT_REPLAY_GROUP, ge=1, description=(
        "Prompts the drafts stage replays together (their blocks share replay's batches, so it is part of the "
        f"drafts key unless {DEFAULT_REPLAY_GROUP}); on a Dask cluster, one shard each."))
    dask_address: Annotated[str | None, Cli(flag="--dask", envvar="DFLASH_DASK_ADDRESS", metavar="ADDRESS")] = Field(
        None, description=(
            "Compute the features and drafts stages on the workers of the Dask scheduler at ADDRESS "
            "(tcp://HOST:PORT), shard by shard; the workers need this package, the store and the target at the same "
            "path. Default: this process."))


class Output(Group):
    """Where the results go."""

    panel = "Store and output"
    store: str | None = Field(None, description=(
        "The store: a folder or s3://BUCKET/PREFIX (default $DFLASH_STORE, else ./.dflash-store)."))
    report_dir: Annotated[str | None, Cli(path=True, by_hand_only=True)] = Field(None, description=(
        "Where the report is rewritten after scoring (default <store>/report)."))


class Training(Group):
    """The training run beside the evaluation."""

    panel = "Training run"
    training_log: Annotated[str | None, Cli(path=True, metavar="DIR")] = Field(None, description=(
        "The training run's folder (or its runs/ folder), for a checkpoint whose run folder is not on this machine "
        "(a relay): what the trainer logged (TensorBoard, SpecForge's best_meta.json, transformers' "
        "trainer_state.json) beside tau, and the train/eval gap alarm. A local checkpoint's run folder is found by "
        "itself."))
    tensorboard: Annotated[str | None, Cli(path=True, metavar="DIR")] = Field(None, description=(
        "Write tau by training step into this TensorBoard run (default <training run>/runs/dflash-eval when the run "
        "folder is on this machine and writable)."))
    mlflow: Annotated[str | None, Cli(metavar="URI")] = Field(None, description=(
        "Also write tau by training step into an MLflow run of ours at this tracking URI (http://HOST:PORT of "
        "`mlflow server`, or file:DIR), experiment dflash-eval, one run per training run."))
    divergence_window: int = Field(4, ge=3, description=(
        "Saves the diverging alarm fits its slopes over (training accuracy rising while tau does not)."))


class Settings(BaseModel):
    """Every setting of an evaluation but the checkpoint, by group: what `serve` fixes in its deployments."""

    model_config = ConfigDict(frozen=True, extra="forbid")
    inputs: Inputs
    generation: Generation = Generation()
    serving: Serving = Serving()
    scoring: Scoring = Scoring()
    checkpoints: Checkpoints = Checkpoints()
    compute: Compute = Compute()
    output: Output = Output()
    training: Training = Training()

    @model_validator(mode="after")
    def _protocol_defaults(self) -> Self:
        """Published benchmarks: the protocol named (default zlab-2026-01), its max new tokens, its temperature
        (DeepSpec's 1.0) and, at a temperature, its way of drawing drafts, unless given."""
        inputs, serving = self.inputs, self.serving
        if inputs.benchmarks is None:
            return self
        protocol = PROTOCOLS[inputs.protocol or DEFAULT_PROTOCOL]
        updates: dict[str, Any] = {"protocol": protocol.name}
        if "max_new_tokens" not in inputs.model_fields_set:
            updates["max_new_tokens"] = protocol.max_new_tokens
        object.__setattr__(self, "inputs", inputs.model_copy(update=updates))
        if protocol.temperature is not None and "temperature" not in serving.model_fields_set:
            serving = serving.model_copy(update={"temperature": protocol.temperature})
            object.__setattr__(self, "serving", serving)
        if (protocol.sampled_drafts and serving.temperature > 0
                and "draft_sample_method" not in serving.model_fields_set):
            object.__setattr__(self, "serving", serving.model_copy(update={"draft_sample_method": "probabilistic"}))
        return self

    @model_validator(mode="after")
    def _rules_between_groups(self) -> Self:
        sampled = self.serving.temperature > 0
        given = self.inputs.references is not None
        if given and (self.generation.reference != "local" or self.generation.lookahead or self.serving.samples != 1):
            raise ValueError("{references} FILE gives the completions: leave out {reference}, {samples} and "
                             "{lookahead}, which say how to generate them")
        # over given completions the sampling settings say only what sampled drafts need: the target's p and the
        # drafter's q at each token (greedy drafts are accepted iff they equal the token, whatever the settings)
        if given and sampled and self.serving.draft_sample_method == "greedy":
            raise ValueError("{references} FILE gives the completions: {temperature} (and the other sampling "
                             "options) apply to them only with {draft_sample_method} probabilistic, where they set "
                             "the target's p and the drafter's q each draft is accepted by; greedy drafts are "
                             "accepted where they equal the token given, at any settings: leave them out")
        if self.inputs.prompts is None and self.inputs.references is None:
            raise ValueError("give {prompts} (a suite or a prompt file), or {references} FILE (completions you "
                             "already have)")
        if self.generation.lookahead and sampled:
            raise ValueError("{lookahead} applies to greedy references: tokens sampled past a stop are not the ones a "
                             "served run draws; leave it off with {temperature} above 0")
        return self

    @model_validator(mode="after")
    def _completions_stand_alone(self) -> Self:
        # (after the rules above, whose messages say more when they apply) a completions file holds its prompts: a
        # prompt set beside it would be recorded as what was evaluated, and never read
        if self.inputs.references is not None and self.inputs.prompts is not None:
            raise ValueError("{references} FILE holds the prompts with their completions: leave out {prompts}, which "
                             "would never be read")
        return self

    def evaluation(self, drafter: str, until: str = "scores", refresh: list[str] | None = None) -> "Evaluation":
        """An evaluation of `drafter` with these settings."""
        return Evaluation.model_validate({**{group: getattr(self, group) for group in GROUPS}, "drafter": drafter,
                                          "until": until, "refresh": refresh})

    @classmethod
    def checked(cls, values: Mapping[str, Any], name: Callable[[str], str] | None = None) -> Self:
        """These settings validated (groups as dicts or as Group objects), or SettingsError: one line naming each
        setting that breaks a bound or a rule with `name` (default: as a deployment's parameter, `serving.top_p`)."""
        try:
            return cls.model_validate(values)
        except ValidationError as e:
            raise SettingsError(settings_error(e, name or parameter_name)) from None


class Evaluation(Settings):
    """One evaluation: the checkpoint, its settings, and which stages run: evaluate-checkpoint's parameters."""

    drafter: str = Field(description=(
        "The checkpoint to score: a folder (a Hugging Face export, or a SpecForge save) or a relay URL "
        "(http://relay:8700/run1/step_1000)."))
    until: StageName = Field("scores", description=(
        "Run only this stage and what it depends on (diagnostics adds them to a full evaluation)."))
    refresh: list[StageName] | None = Field(None, description="Stages to recompute even if the store has them.")

    def parameters(self) -> dict[str, Any]:
        """As evaluate-checkpoint's parameters (the groups as Group objects)."""
        return {name: getattr(self, name) for name in Evaluation.model_fields}


GROUPS: dict[str, type[Group]] = {name: field.annotation for name, field in Settings.model_fields.items()}  # type: ignore[misc]


@dataclass(frozen=True)
class Setting:
    """One declared setting: its group and field, as the command line and the messages read them."""

    group: str  # the group's name in Settings (the flow parameter holding it)
    name: str  # the field's name
    field: Any  # pydantic's FieldInfo
    cli: Cli

    @property
    def flag(self) -> str:
        return self.cli.flag or "--" + self.name.replace("_", "-")

    @property
    def parameter(self) -> str:
        return f"{self.group}.{self.name}"


def _declared() -> dict[str, Setting]:
    found = {}
    for group, cls in GROUPS.items():
        for name, field in cls.model_fields.items():
            cli = next((m for m in field.metadata if isinstance(m, Cli)), Cli())
            assert name not in found, f"{name}: every setting's name is an option of its own, so unique"
            found[name] = Setting(group, name, field, cli)
    return found


SETTINGS: dict[str, Setting] = _declared()  # by field name, in declaration order


def by_group(values: Mapping[str, Any]) -> dict[str, Any]:
    """Settings given by name, as a command line or a script holds them ({"max_new_tokens": 8, "drafter": ...}), as
    evaluate-checkpoint's parameters: by group ({"inputs": {"max_new_tokens": 8}, "drafter": ...}). A name that is
    no setting is SettingsError."""
    grouped: dict[str, Any] = {}
    for name, value in values.items():
        if name in SETTINGS:
            grouped.setdefault(SETTINGS[name].group, {})[name] = value
        elif name in Evaluation.model_fields and name not in GROUPS:
            grouped[name] = value
        else:
            raise SettingsError(f"{name} is no setting (the settings: {', '.join(SETTINGS)})")
    return grouped


def flag_name(field: str) -> str:
    """How the command line names a setting: `--top-p`."""
    return SETTINGS[field].flag if field in SETTINGS else "--" + field.replace("_", "-")


def parameter_name(field: str) -> str:
    """How a deployment's parameters name a setting: `serving.top_p`."""
    return SETTINGS[field].parameter if field in SETTINGS else field


# pydantic's error types, as one line says them
_BOUNDS = ("greater_than_equal", "greater_than", "less_than_equal", "less_than")
_PHRASES = {
    "int_parsing": "must be a whole number", "int_type": "must be a whole number",
    "int_from_float": "must be a whole number", "float_parsing": "must be a number", "float_type": "must be a number",
    "finite_number": "must be a finite number", "bool_parsing": "must be true or false", "bool_type": "must be true or false",
    "string_type": "must be text", "list_type": "must be a list", "model_type": "must be an object of settings",
}


def settings_error(error: ValidationError, name: Callable[[str], str]) -> str:
    """One line for every setting a validation refused, each named with `name` (a field's name -> how the user
    gave it): `--top-p must be at most 1, got 1.5`."""
    names = {field: name(field) for field in SETTINGS} | {"drafter": name("drafter"), "until": name("until"),
                                                          "refresh": name("refresh")}
    lines = []
    for e in error.errors(include_url=False):
        loc = [part for part in e["loc"] if isinstance(part, str)]
        field = loc[-1] if loc else "settings"
        who = names.get(field, ".".join(loc) or "settings")
        if e["type"] == "value_error":  # a rule of ours: a group's or the settings' names them as {field}
            message = _named(str(e["ctx"]["error"]), names)
            lines.append(f"{who} {e['input']!r}: {message}" if field in SETTINGS else message)
        elif e["type"] in _BOUNDS and field in SETTINGS:
            lines.append(f"{who} must {_interval(SETTINGS[field].field)}, got {e['input']!r}")
        elif e["type"] == "literal_error":
            choices = re.findall(r"'([^']*)'", e["ctx"]["expected"])
            lines.append(f"{who} must be one of {', '.join(choices)}, got {e['input']!r}")
        elif e["type"] == "extra_forbidden":
            group = GROUPS.get(loc[0]) if len(loc) == 2 else None
            holds = list(group.model_fields) if group else [*Evaluation.model_fields]
            lines.append(f"{'.'.join(loc)} is no setting (the {loc[0] + ' group' if group else 'settings'} hold: "
                         f"{', '.join(holds)})")
        elif e["type"] == "missing":
            lines.append(f"{who} is required")
        elif e["type"] in _PHRASES:
            lines.append(f"{who} {_PHRASES[e['type']].format(**e.get('ctx', {}))}, got {e['input']!r}")
        else:
            lines.append(f"{who}: {e['msg']}, got {e['input']!r}")
    return "; ".join(dict.fromkeys(lines))


def _interval(field) -> str:
    """What a field's bounds allow, for a message: "be at least 1", "lie in (0, 1]"."""
    bounds = {kind: getattr(m, kind) for m in field.metadata for kind in ("ge", "gt", "le", "lt") if hasattr(m, kind)}
    low = ("[", bounds["ge"]) if "ge" in bounds else ("(", bounds["gt"]) if "gt" in bounds else None
    high = (bounds["le"], "]") if "le" in bounds else (bounds["lt"], ")") if "lt" in bounds else None
    if low and high:
        return f"lie in {low[0]}{low[1]:g}, {high[0]:g}{high[1]}"
    if low:
        return f"be {'at least' if low[0] == '[' else 'above'} {low[1]:g}"
    assert high is not None
    return f"be {'at most' if high[1] == ']' else 'below'} {high[0]:g}"


def _named(message: str, names: dict[str, str]) -> str:
    return re.sub(r"\{(\w+)\}", lambda m: names.get(m.group(1), m.group(0)), message)
