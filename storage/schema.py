"""What the store holds: the names of its stages, and the record each stage commits.

A record is the small JSON object in an entry's `entry.json` (storage.store); the files beside it
(drafts.json, scores.json, features.zarr, ...) are the stage's own. Each record is a frozen dataclass
here, built by the stage that writes it (tasks/) and parsed by every reader (flows/): `to_record()` is
exactly the JSON object the stage commits, `from_record()` reads one back. Fields that older entries
lack have defaults; unknown keys are ignored; a missing required key raises KeyError, as indexing the
dict did, which readers treat as an entry not in this format.
"""

from collections.abc import Mapping
from dataclasses import MISSING, Field, dataclass, field, fields
from enum import StrEnum
from typing import Any, ClassVar, Self


class Stage(StrEnum):
    """The store's stages, one folder each under the store's root (a StrEnum: each is its name)."""

    FETCH = "fetch"
    REFERENCES = "references"
    FEATURES = "features"
    DRAFTS = "drafts"
    SCORES = "scores"
    DIAGNOSTICS = "diagnostics"
    BASELINES = "baselines"  # one entry per checkpoint key scored as a baseline
    DRAFT_SHARDS = "draft-shards"  # one replay group of a drafts entry drafted on a Dask worker (tasks/cluster.py)


# Files of an entry that another stage, or a reader, opens.
DRAFTS_FILE = "drafts.json"  # drafts: per prompt, the decode steps of the replay
SCORES_FILE = "scores.json"  # scores: dflash_core.metrics.summarize and what the stage adds to it
DIAGNOSTICS_FILE = "diagnostics.json"  # diagnostics: ablation, offset probe, sliding switch, divergences
DRAFT_SHARD_FILE = "shard.json"  # draft-shards: drafts.json's per_prompt items of one replay group

_OMITTED_WHEN_NONE = "omitted when None"


def _written_when_set() -> Any:
    """A field whose key the record holds only when it has a value (as the stages have always written it)."""
    return field(default=None, metadata={_OMITTED_WHEN_NONE: True})


class _Record:
    """to_record / from_record for the dataclasses below (JSON arrays are tuples on the Python side)."""

    __dataclass_fields__: ClassVar[dict[str, Field[Any]]]  # what @dataclass gives each record: fields() reads it

    def to_record(self) -> dict[str, Any]:
        """The JSON object committed as the entry's record."""
        record = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None and f.metadata.get(_OMITTED_WHEN_NONE):
                continue
            record[f.name] = list(value) if isinstance(value, tuple) else value
        return record

    @classmethod
    def from_record(cls, record: Mapping[str, Any]) -> Self:
        """Parse a committed record; raises KeyError naming a required key it lacks."""
        values = {}
        for f in fields(cls):
            if f.name in record:
                value = record[f.name]
                values[f.name] = tuple(value) if isinstance(value, list) else value
            elif f.default is MISSING and f.default_factory is MISSING:
                raise KeyError(f.name)
        return cls(**values)


@dataclass(frozen=True)
class FetchRecord(_Record):
    """A drafter checkpoint fetched into the store (tasks/fetch.py); its files are in checkpoint/."""

    files: dict[str, str]  # {file name: sha256}: the checkpoint's content key is key_of({"files": files})
    source: str  # the folder it was copied from, or the relay URL
    step: int | None  # training step (dflash_core.checkpoint_files.training_step)
    layout: str = "hf"  # how the trainer saved it, "hf" or "specforge"; older entries are "hf"
    config_source: str = "checkpoint"  # "checkpoint", "run folder" or "--drafter-config <file>"
    weights_from: str | None = _written_when_set()  # a SpecForge payload: where its drafter weights were read


@dataclass(frozen=True)
class ReferencesRecord(_Record):
    """References of a prompt set (tasks/references.py): seq_<n>.json per prompt (per sample of a prompt when
    sampled: n = prompt * samples + sample)."""

    n_prompts: int
    n: int  # references: a multi-turn prompt has one per turn
    prompts: str  # the prompt suite or file, as given
    backend: dict[str, Any]  # the reference backend's identity
    max_new_tokens: int
    stop_token_ids: tuple[int, ...]
    lookahead: int  # greedy tokens kept past each completion's end
    unverified: int  # references a server gave as text whose re-tokenisation did not round-trip
    target: str | None = None  # the target folder; None in entries from before it was recorded
    backend_fingerprint: str | None = _written_when_set()  # digest of a server's fingerprint (none when local)
    # sampled references: the settings, samples per prompt and seed (dflash_core.sampling); given completions scored
    # with sampled drafts: the settings alone (their p and q); None: greedy
    sampling: dict[str, Any] | None = _written_when_set()
    # how series titles call the target (--name, else tasks.target.model_name); None in older entries
    target_name: str | None = _written_when_set()
    # published benchmarks (dflash_core.published.prompt_set): the protocol and each benchmark's rows; None otherwise
    benchmarks: dict[str, Any] | None = _written_when_set()


@dataclass(frozen=True)
class FeaturesRecord(_Record):
    """Target hidden states of a reference set (tasks/features.py), in features.zarr."""

    # every layer the entry holds, sorted; -1 (feature_store.TARGET_PROBS): the target's probabilities of the tokens
    layer_ids: tuple[int, ...]
    n: int  # sequences (references)
    references: str  # the references key
    dtype: str
    # the target's attention implementation when not SDPA ("eager"); None: SDPA (as every entry before the choice)
    attention: str | None = _written_when_set()
    # computed on a Dask cluster (--dask): per shard, the sequences it extracted and the worker that did
    # (tasks/cluster.py: worker, host, pid, seconds); None when extracted in the flow's own process
    shards: tuple[dict[str, Any], ...] | None = _written_when_set()


@dataclass(frozen=True)
class DraftsRecord(_Record):
    """One drafter's replay over one reference set (tasks/drafts.py), in drafts.json."""

    checkpoint: str  # the fetch key
    features: str  # the features key
    block_size: int  # the block size drafted and verified
    sliding_semantics: str
    layer_ids: tuple[int, ...]  # the target layers the drafter reads
    # --block-size: the tokens verified per step when not the drafter's own block size; None: its own
    chosen_block_size: int | None = _written_when_set()
    # sampled drafts (dflash_core.sampled_drafts): {"q": how the drafter's logits became q (Sampling.identity()),
    # "seed": of the acceptance coins}; None: greedy drafts
    draft_sampling: dict[str, Any] | None = _written_when_set()
    # --confidence-threshold: a drafter with a confidence head (DSpark) verified only the drafts before the first it
    # was less confident of than this; None: every draft verified
    confidence_threshold: float | None = _written_when_set()
    # a save holding its own copies of the target's embedding and head (DeepSpec's) that differ from the target's:
    # {tensor name: what differs} (DFlashDrafter.token_head_differences); None when they equal it, or it holds none
    token_head: dict[str, str] | None = _written_when_set()
    # drafted on a Dask cluster (--dask): per shard (one replay group), its prompts [start, stop) and the
    # worker that drafted it (tasks/cluster.py); None when drafted in the flow's own process
    shards: tuple[dict[str, Any], ...] | None = _written_when_set()


@dataclass(frozen=True)
class DraftShardRecord(_Record):
    """One replay group of a drafts entry, drafted on a Dask worker (tasks/cluster.py), in shard.json; the
    drafts stage merges the shards' per-prompt items in prompt order into drafts.json."""

    drafts: str  # the drafts key
    start: int  # its prompts: start .. stop-1 (reference indices)
    stop: int
    worker: str  # the Dask worker's address
    host: str
    pid: int
    seconds: float  # how long the worker drafted it

    def shard(self) -> dict[str, Any]:
        """What the drafts record and the results say of this shard."""
        return {"prompts": [self.start, self.stop], "worker": self.worker, "host": self.host, "pid": self.pid,
                "seconds": self.seconds}


@dataclass(frozen=True)
class ScoresRecord(_Record):
    """The scores of one drafts entry (tasks/scores.py), in full in scores.json."""

    tau_macro: float
    tau_pooled: float
    drafts: str  # the drafts key


@dataclass(frozen=True)
class DiagnosticsRecord(_Record):
    """The diagnostics of one drafts entry (tasks/diagnostics.py), in diagnostics.json."""

    drafts: str  # the drafts key
    scores: str  # the scores key


@dataclass(frozen=True)
class BaselineRecord(_Record):
    """A checkpoint scored as a baseline (`dflash-eval run --baseline`); the entry's key is its fetch key. It makes
    the checkpoint a baseline row of the history unless it is a save of a training run of the series
    (reporting.history: saves_of_the_series_on_the_curve)."""

    source: str
    step: int | None
