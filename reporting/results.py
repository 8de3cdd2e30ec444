"""What an evaluation found, as one typed record: `Results` (flows/results.py assembles it from the checked
evaluation and what its stages returned; the flow returns it, `dflash-eval run --out` writes its JSON).

It is three parts: the checkpoint's scores (`Scores`: scores.json's numbers, and the sections scores.json holds: a
drafter generation's own, one draw of sampled drafts' coins, the all-positions numbers), what was evaluated and how
(the drafter, target, prompts, served setting, dtype, each stage's status and key, ...), and the sections the
evaluation added around the scores (a block-size sweep, the baseline, diagnostics, published benchmarks, the
training run, the comparisons with the series' other checkpoints). Each section says how every renderer shows it
(dflash_core.sections); the renderers iterate over `Results.sections()`.

`to_json` gives the results JSON: scores.json's keys first (sorted, as scores.json has them, its sections among
them), then what was evaluated, then the evaluation's sections and the series in JSON_ORDER. The record reads as that
JSON too (a read-only Mapping), so code that reads results files reads the record alike. `json_schema` is the JSON
schema of that JSON (docs/results.schema.json).
"""

from collections.abc import Iterator, Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, NotRequired, Self

from typing_extensions import TypedDict  # (pydantic reads it for the schema on Python 3.11)

from dflash_core.sections import Context, Section, in_order, registered

from . import benchmarks as _benchmarks  # noqa: F401 - registers its section
from . import sections as _sections  # noqa: F401 - registers the evaluation's sections


class PromptRow(TypedDict):
    """One reference scored (scores.json's `per_prompt`)."""

    id: str
    prompt: str | None  # the prompt a sampled reference samples (None: greedy)
    category: str | None
    tau: float | None  # None: the target stopped right after the prompt (no decode step)
    acceptance_lengths: list[float]
    last_step_clipped: bool | float


class PositionCounts(TypedDict):
    """Per draft position k: the decode steps that compared it and those that accepted it."""

    reached: list[float]
    accepted: list[float]


@dataclass
class Scores:
    """scores.json as the results carry it (dflash_core.metrics.summarize, tasks/scores.py): tau, its intervals and
    distribution, per draft position and per reference; the sections it holds; keys this version does not know, as
    they are. Counts are expectations (floats) with sampled drafts."""

    block_size: int
    clipped_last_steps: float
    clipping_note: str
    histogram: dict[str, float]  # acceptance length -> decode steps
    lookahead: bool  # the references hold lookahead tokens (the results' `lookahead` says the setting, in its place)
    n_prompts: int
    n_scored_prompts: int
    n_steps: float
    n_tokens: float
    per_prompt: list[PromptRow]
    position_acceptance: list[float | None]  # P(position k accepted | earlier ones accepted)
    position_acceptance_ci95: list[list[float] | None]
    position_counts: PositionCounts
    projected_speedup: dict[str, float]  # drafter cost c -> the speedup upper bound tau / (1 + c)
    sliding_semantics: str
    speedup_note: str
    tau_by_category: dict[str, float]
    tau_macro: float
    tau_macro_ci95: list[float]
    tau_pooled: float
    tau_pooled_ci95: list[float]
    unverified_references: list[str]  # references given as text whose re-tokenisation did not round-trip
    draft_sampling: dict[str, Any] | None = None  # sampled drafts: their q and the coins' seed (None: greedy)
    by_benchmark: dict[str, Any] | None = None  # tau per published benchmark, until set beside the published taus
    sections: list[Section] = field(default_factory=list)
    unknown: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Self:
        """scores.json's record (samples_per_prompt and sampling_label left out: the results' `served` says them)."""
        data = {k: v for k, v in data.items() if k not in ("samples_per_prompt", "sampling_label")}
        named = {f.name for f in fields(cls)} - {"sections", "unknown"}
        sections = [cls_.from_json(data[cls_.KEY]) for cls_ in registered() if data.get(cls_.KEY) is not None]
        held = {s.KEY for s in sections}
        return cls(**{k: v for k, v in data.items() if k in named},
                   sections=sections, unknown={k: v for k, v in data.items() if k not in named | held})

    def to_json(self) -> dict[str, Any]:
        """The keys in scores.json's order (sorted)."""
        values = {f.name: getattr(self, f.name) for f in fields(self) if f.name not in ("sections", "unknown")}
        values = {k: v for k, v in values.items() if v is not None or k not in ("draft_sampling", "by_benchmark")}
        values.update({s.KEY: s.to_json() for s in self.sections}, **self.unknown)
        return dict(sorted(values.items()))


class DrafterJson(TypedDict):
    """The checkpoint evaluated: where from, its fetch key and training step; once fetched, its layout and where its
    config came from."""

    source: str
    key: str | None
    step: int | None
    layout: NotRequired[str]
    config_source: NotRequired[str]
    # a save's own copies of the target's embedding and head (DeepSpec's) that differ from the target's: name -> how
    token_head: NotRequired[dict[str, str]]


class ServedJson(TypedDict):
    """How the target is served (dflash_core.sampling.Served.to_json): one label, then every value."""

    label: str
    references: str  # "greedy", "sampled" or "given"
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    samples: int
    seed: int
    block_size: int | None
    draft_sample_method: str
    draft_truncation: bool
    confidence_threshold: NotRequired[float]  # set, a drafter with a confidence head (DSpark) verified fewer drafts


class ClusterJson(TypedDict):
    """--dask: the scheduler, and per sharded stage the workers that computed its shards (None: not on a cluster)."""

    dask_address: str
    shards: dict[str, list[Any] | None]


class SeriesJson(TypedDict):
    """The series the checkpoint's tau belongs to (reporting.history.series_key), and its title once in the history."""

    key: str
    title: str | None


@dataclass(frozen=True)
class Published:
    """Published benchmarks' protocol and the template's reasoning (the results say them only on benchmarks)."""

    protocol: str | None
    reasoning: str | None


# the keys of the evaluation's sections and of the values only some results hold, in their JSON order after `keys`
# (a section the evaluation adds names its key here)
JSON_ORDER = ("references_file", "block_sweep", "threshold_sweep", "replay_group", "cluster", "baseline", "diagnostics", "benchmarks",
              "series", "training", "comparisons")


@dataclass(eq=False)
class Results(Mapping[str, Any]):
    """What an evaluation found (the module docstring). Reads as its JSON (`results["tau_macro"]`); the typed fields
    and `sections()` are what the renderers use."""

    drafter: DrafterJson
    target: str
    prompts: str
    reference: str  # "local", or the reference server's backend and address
    lookahead: bool
    thinking: bool
    max_new_tokens: int
    served: ServedJson
    layer_ids: list[int]
    dtype: str
    dtype_requested: str
    dtype_note: str | None
    attn_implementation: str
    device: str
    store: str
    stages: dict[str, str]  # each stage task run: "ran" or "cached"
    stage_keys: dict[str, str]  # each stage's content key (the JSON's `keys`)
    scores: Scores | None = None  # None: the evaluation stopped before the scores stage
    published: Published | None = None  # published benchmarks
    references_file: str | None = None  # --references: the completions given
    replay_group: int | None = None  # a replay group other than the default
    cluster: ClusterJson | None = None
    series: SeriesJson | None = None  # once scored
    around: list[Section] = field(default_factory=list)  # the evaluation's sections

    def sections(self) -> list[Section]:
        """Every section the results hold (the scores' and the evaluation's), in the order the renderers show them."""
        return in_order([*(self.scores.sections if self.scores else []), *self.around])

    def section(self, cls: type[Section]) -> Section | None:
        """The section of class `cls` the results hold, None when they hold none."""
        return next((s for s in self.sections() if type(s) is cls), None)

    def add(self, section: Section) -> None:
        """Hold `section` among the evaluation's sections (in place of one of its key)."""
        self.around = [s for s in self.around if s.KEY != section.KEY] + [section]

    @property
    def sampled(self) -> bool:
        """The drafts were sampled (and accepted by rejection sampling): counts are expectations."""
        return self.served["draft_sample_method"] != "greedy"

    def context(self) -> Context:
        """What the sections' views need of the rest of the results."""
        return Context(sampled=self.sampled, tau_macro=self.scores.tau_macro if self.scores else None)

    def to_json(self) -> dict[str, Any]:
        """The results JSON (the module docstring)."""
        out = self.scores.to_json() if self.scores else {}
        out.update({"drafter": self.drafter, "target": self.target, "prompts": self.prompts,
                    "reference": self.reference, "lookahead": self.lookahead, "thinking": self.thinking})
        if self.published is not None:
            out.update({"protocol": self.published.protocol, "reasoning": self.published.reasoning})
        out.update({"max_new_tokens": self.max_new_tokens, "served": self.served, "layer_ids": self.layer_ids,
                    "dtype": self.dtype, "dtype_requested": self.dtype_requested, "dtype_note": self.dtype_note,
                    "attn_implementation": self.attn_implementation, "device": self.device, "store": self.store,
                    "stages": self.stages, "keys": self.stage_keys})
        later: dict[str, Any] = {s.KEY: s.to_json() for s in self.around}
        later.update({name: value for name, value in (
            ("references_file", self.references_file), ("replay_group", self.replay_group),
            ("cluster", self.cluster), ("series", self.series)) if value is not None})
        place = {name: index for index, name in enumerate(JSON_ORDER)}
        out.update(sorted(later.items(), key=lambda item: place.get(item[0], len(place))))
        return out

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Self:
        """The record a results JSON holds (one `to_json` wrote)."""
        evaluated = [f.name for f in fields(cls) if f.name not in ("scores", "published", "around", "stage_keys")]
        told = {*evaluated, "keys", "protocol", "reasoning"}
        # what is neither what was evaluated nor the evaluation's is scores.json's (its `lookahead` is the setting's)
        scored = {k: v for k, v in data.items() if k not in told | set(JSON_ORDER) or k == "lookahead"}
        around = [section.from_json(data[section.KEY]) for section in registered()
                  if section.KEY in JSON_ORDER and data.get(section.KEY) is not None]
        return cls(**{name: data[name] for name in evaluated if name in data}, stage_keys=data["keys"],
                   scores=Scores.from_json(scored) if "tau_macro" in scored else None,
                   published=Published(data["protocol"], data.get("reasoning")) if "protocol" in data else None,
                   around=around)

    # the JSON, read-only, as a Mapping
    def __getitem__(self, key: str) -> Any:
        return self.to_json()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_json())

    def __len__(self) -> int:
        return len(self.to_json())


def json_schema() -> dict[str, Any]:
    """The JSON schema of the results JSON (docs/results.schema.json; `python -m dflash_eval.reporting.results`
    prints it): every key `to_json` writes, each section's as its JSON type says, with its docstring (the sections
    this package registers; a generation registered elsewhere adds a key of its own). scores.json's keys come
    together: once scored (`tau_macro`), all of them."""
    from pydantic import TypeAdapter

    definitions: dict[str, Any] = {}
    properties: dict[str, Any] = {}

    def add(name: str, annotation: Any, described: str | None = None) -> None:
        found = TypeAdapter(annotation).json_schema(ref_template="#/$defs/{model}")
        definitions.update(found.pop("$defs", {}))
        properties[name] = {**found, **({"description": " ".join(described.split())} if described else {})}

    shipped = [cls for cls in registered() if cls.__module__.startswith(("dflash_core.", "dflash_eval."))]
    scored = [f for f in fields(Scores) if f.name not in ("sections", "unknown")]
    for f in scored:
        add(f.name, f.type)
    for cls in shipped:
        if cls.KEY not in JSON_ORDER:
            add(cls.KEY, cls.JSON, cls.__doc__)
    evaluated = [f for f in fields(Results) if f.name not in ("scores", "published", "around", *JSON_ORDER)]
    for f in evaluated:
        add("keys" if f.name == "stage_keys" else f.name, f.type)
    add("protocol", str | None, "Published benchmarks: the protocol that picked, templated and stopped them.")
    add("reasoning", str | None, "Published benchmarks: the template's reasoning, as the protocol sets it.")
    around = {cls.KEY: cls for cls in shipped if cls.KEY in JSON_ORDER}
    for name in JSON_ORDER:
        if name in around:
            add(name, around[name].JSON, around[name].__doc__)
        else:
            add(name, next(f.type for f in fields(Results) if f.name == name))
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "dflash-eval results",
            "description": "What `dflash-eval run --out` writes: what an evaluation found (reporting/results.py).",
            "type": "object", "properties": properties,
            "required": list(dict.fromkeys("keys" if f.name == "stage_keys" else f.name for f in evaluated)),
            "dependentRequired": {"tau_macro": [f.name for f in scored if f.default is MISSING and f.name != "tau_macro"]},
            "additionalProperties": True, "$defs": definitions}


if __name__ == "__main__":
    import json

    print(json.dumps(json_schema(), indent=1))
