"""Every scored checkpoint in a store, by training step: is the newest save better than the best so far?

Rows come from the store alone (scores -> drafts -> fetch, features entries), grouped by what makes
taus comparable: the same target and references (the features entry: greedy, or sampled with one
setting), the same sliding-layer semantics, the same block size chosen with --block-size (without
it, each drafter verifies its own block size, and drafters of different block sizes compare), the same draft
sampling and the same confidence threshold (--confidence-threshold: a DSpark drafter verifying fewer drafts is
served otherwise, so its taus are a series of their own). Order: checkpoints with a training step by step; checkpoints without one (an untrained
drafter, a final export) by when they were first scored (the scores entry's commit time), never by
path. A checkpoint is flagged as a regression when it is worse than the best checkpoint of an earlier
step on the same references: the 95% interval of the per-reference difference (paired bootstrap over
prompts, and samples within a prompt: dflash_core.metrics) lies below 0 (scores written before they kept
per-reference taus: when its whole interval lies below the best earlier step's); a checkpoint
without a step is never flagged, as its place among the steps is unknown.

Baselines: a checkpoint scored with `dflash-eval run --baseline` has a `baselines` entry (its checkpoint key).
It is a row of its own, after the others (never the best, never a regression), unless it is a save of a training
run of the series: it has a training step and sits in the same run folder (training_run_of) as a checkpoint of
the group that was not scored as a baseline. Such a save stays a step of the curve, so comparing two saves of
one run (`--drafter runs/x/step_300 --baseline runs/x/step_200`) changes the history of neither, whichever was
scored first: the rule reads only what the store holds, not the order it was written in. A published drafter
(no step, outside the run) and a save of another run compared against stay baseline rows.

Comparisons (`comparisons`): a row's tau minus that of the previous step, the best other checkpoint and the
baselines, with the 95% interval of the per-reference difference (paired): what the command line, `--out`
results, `history --json`, the Prefect summary and the report show, computed here once.

A damaged scores entry is skipped with a warning naming it (storage.store removes what is damaged; the
next run recomputes it), and so is a stale one (its drafts were recomputed with another content since:
the next run scores them again); one whose drafts or checkpoint entry is gone is skipped silently.
"""

import functools
import json
import re
import warnings
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from urllib.parse import urlsplit

from dflash_core.checkpoint_files import COMMIT_HASH, model_name, step_from_name
from dflash_core.metrics import paired_difference_interval
from dflash_core.sampling import Served
from dflash_core.sections import Column, Section, registered, sections_of
from dflash_eval.storage import CorruptEntryWarning, EntryMissing, Store, canonical_json, key_of, read_json
from dflash_eval.storage.integrity import StaleEntryWarning, stale_upstream
from dflash_eval.storage.schema import (
    SCORES_FILE,
    DraftsRecord,
    FeaturesRecord,
    FetchRecord,
    ReferencesRecord,
    ScoresRecord,
    Stage,
)

from .sections import ComparisonJson

_NEVER = datetime.min.replace(tzinfo=UTC)  # a scores entry without a readable commit time sorts first


@dataclass(frozen=True)
class HistoryRow:
    """One scored checkpoint of a group."""

    step: int | None  # training step; None for an untrained drafter, a final export, ...
    source: str  # where the checkpoint was fetched from
    label: str  # source_name(source): how tables and plots call it
    checkpoint: str  # fetch key
    drafts: str  # drafts key
    scores: str  # scores key
    scores_path: str  # its scores.json
    scored_at: datetime | None  # when the checkpoint was first scored (UTC); None: no readable commit time
    tau_macro: float
    tau_macro_ci95: tuple[float, float] | None  # 95% bootstrap interval over prompts
    tau_pooled: float
    all_positions_tau: float | None  # None unless scored in all-positions mode
    baseline: bool
    # per reference scored: (id, the prompt it samples, tau); empty for scores without per-reference taus
    per_reference: tuple[tuple[str, str, float], ...] = ()
    # all-positions mode: each draft position's accuracy whatever came before it (as training measures it)
    teacher_forced_accuracy: tuple[float | None, ...] | None = None
    # the values its scores.json's sections set beside tau (dflash_core.sections: Section.history, by name; a
    # DFlash2 drafter's: unary_tau_macro, the tau its unary head's argmax alone reaches, and selector_lift)
    values: dict[str, float | None] = field(default_factory=dict)
    merged_scores: tuple[str, ...] = ()  # the other scores entries of the same checkpoint this row stands for
    best: bool = False  # the best candidate of its group
    regression: bool = False  # worse than the best earlier step's (the module docstring)

    @property
    def mark(self) -> str:
        """How tables flag the row: "best", "REGRESSION", "baseline" or ""."""
        if self.best:
            return "best"
        if self.regression:
            return "REGRESSION"
        return "baseline" if self.baseline else ""


@dataclass
class Group:
    """Checkpoints scored against one target, one reference set, one sliding-layer semantics and block size, in
    one store: a series, whose taus compare."""

    features: str  # features key (target + references)
    sliding_semantics: str
    chosen_block_size: int | None  # --block-size; None: each drafter's own
    draft_sampling: str | None  # sampled drafts: the drafts record's draft_sampling as canonical JSON; None: greedy
    title: str  # "<target> on <prompts>, ...", for people
    sweep_title: str  # the title without the block size: the same for every block size of one sweep
    setting: str  # how the target is served: dflash_core.sampling.Served's label ("greedy, blocks of 4", ...)
    series: str  # its key in Prefect (artifact keys, the `series:` tag): series_key
    rows: list[HistoryRow] = field(default_factory=list)  # candidates in history order (module doc), then baselines
    names: tuple[str, str] = ("", "")  # what people call its target and prompt set (readable_name), for series_key
    # --confidence-threshold: the drafts a step verified stopped at the first the drafter was less confident of than
    # this (a DSpark drafter's confidence head); None: every draft verified
    confidence_threshold: float | None = None

    @property
    def candidates(self) -> list[HistoryRow]:
        return [r for r in self.rows if not r.baseline]

    @property
    def baselines(self) -> list[HistoryRow]:
        return [r for r in self.rows if r.baseline]

    @property
    def best(self) -> HistoryRow | None:
        return next((r for r in self.rows if r.best), None)


def history(store: Store, problems: list[str] | None = None) -> list[Group]:
    """Every group of comparable scores, its rows in history order with the best one and regressions marked.

    Reads only: a damaged or stale entry is left as it is and its row left out, with one line saying so and how
    to get the row back, appended to `problems` (None: each one warned about instead)."""

    def left_out(message: str, category: type[Warning]) -> None:
        if problems is None:
            warnings.warn(message, category, stacklevel=3)
        else:
            problems.append(message)

    groups: dict[tuple[str, str, int | None, str | None, float | None], Group] = {}
    for key in store.keys(Stage.SCORES):
        try:
            entry = store.read_entry(Stage.SCORES, key, discard_damaged=False)  # verifies scores.json
            record = ScoresRecord.from_record(entry.record)
            # records only: their files (drafts.json, weights) are not read here, and a run verifies them
            drafts = DraftsRecord.from_record(store.read_record(Stage.DRAFTS, record.drafts, verify=False,
                                                                discard_damaged=False))
            fetch = FetchRecord.from_record(store.read_record(Stage.FETCH, drafts.checkpoint, verify=False,
                                                              discard_damaged=False))
            scored_at = store.committed_at(Stage.SCORES, key)
            scores = read_json(store.entry(Stage.SCORES, key) / SCORES_FILE)
        except EntryMissing as e:  # absent or incomplete (deleted, being written): nothing to show or say
            if e.damaged:
                whose = "" if (e.stage, e.key) == (Stage.SCORES, key) else f" (its {e.stage} entry {e.key})"
                left_out(f"scores/{key} left out{whose}: {e.reason}; `dflash-eval verify --repair` removes the "
                         "damage, then evaluating that checkpoint again restores its row", CorruptEntryWarning)
            continue
        except (OSError, ValueError, KeyError) as e:  # removed meanwhile, or not in this format
            left_out(f"scores/{key} left out: {e!r}", CorruptEntryWarning)
            continue
        changed = stale_upstream(store, entry)
        if changed:
            left_out(f"scores/{key} left out: stale, built on {', '.join(changed)}, whose content has changed "
                     "since; the next evaluation of that checkpoint scores it again", StaleEntryWarning)
            continue
        sampled = None if drafts.draft_sampling is None else canonical_json(drafts.draft_sampling)
        group_key = (drafts.features, drafts.sliding_semantics, drafts.chosen_block_size, sampled,
                     drafts.confidence_threshold or None)
        if group_key not in groups:
            title, sweep_title, setting, names = _describe(store, *group_key)
            groups[group_key] = Group(*group_key[:4], title, sweep_title, setting, "", names=names,
                                      confidence_threshold=group_key[4])
        rows = groups[group_key].rows
        ci = scores.get("tau_macro_ci95")
        row = HistoryRow(
            step=fetch.step, source=fetch.source, label=source_name(fetch.source), checkpoint=drafts.checkpoint,
            drafts=record.drafts, scores=key, scores_path=str(store.entry(Stage.SCORES, key) / SCORES_FILE),
            scored_at=scored_at, tau_macro=scores["tau_macro"], tau_macro_ci95=tuple(ci) if ci else None,
            tau_pooled=scores["tau_pooled"], all_positions_tau=scores.get("all_positions_tau"),
            # scored as a baseline; saves_of_the_series_on_the_curve decides, once the group is known
            baseline=store.is_complete(Stage.BASELINES, drafts.checkpoint, discard_damaged=False),
            per_reference=tuple((p["id"], p.get("prompt") or p["id"], p["tau"]) for p in scores.get("per_prompt", ())
                                if p.get("tau") is not None),
            teacher_forced_accuracy=tuple(scores["teacher_forced_accuracy"]) if "teacher_forced_accuracy" in scores
            else None,
            values={name: value for shown in sections_of(scores) for name, value in shown.history().items()},
        )
        same = next((r for r in rows if r.checkpoint == row.checkpoint), None)
        if same is not None:  # scored in decode and in all-positions mode: the same decode path, keep the richer
            rows.remove(same)
            richer = row if same.all_positions_tau is None and row.all_positions_tau is not None else same
            first = min((t for t in (same.scored_at, row.scored_at) if t is not None), default=None)
            other = row if richer is same else same
            row = replace(richer, scored_at=first, merged_scores=richer.merged_scores + (other.scores,))
        rows.append(row)
    for group_key, group in groups.items():
        group.rows = saves_of_the_series_on_the_curve(group.rows)
        candidates = in_history_order(group.candidates)
        best = max(candidates, key=lambda r: r.tau_macro, default=None)  # the first of equals, in order
        group.rows = [replace(r, best=r is best, regression=_regressed(r, candidates))
                      for r in candidates + sorted(group.baselines, key=_scored)]
        # named by the training run of its first scored checkpoint: a name that stays as the series grows
        earliest = min(candidates, key=_scored, default=None)
        group.series = series_key(store, *group_key[:4], *group.names,
                                  run=drafter_run(earliest.source) if earliest else None,
                                  confidence_threshold=group_key[4])
    return sorted(groups.values(), key=lambda g: g.title)


def shown_beside_tau(rows: list[HistoryRow]) -> list[tuple[type[Section], Column]]:
    """The sections' history values some of `rows` hold, as the tables' columns beside tau, in section order."""
    return [(cls, column) for cls in registered() for column in cls.HISTORY if any(column.name in r.values for r in rows)]


def saves_of_the_series_on_the_curve(rows: list[HistoryRow]) -> list[HistoryRow]:
    """The group's rows with `baseline` decided (the module docstring): a row scored as a baseline stays one
    unless it has a training step and its run folder is that of a row of the group not scored as a baseline."""
    runs = {training_run_of(r.source) for r in rows if not r.baseline}
    return [replace(r, baseline=False) if r.baseline and r.step is not None and training_run_of(r.source) in runs
            else r for r in rows]


def training_run_of(source: str) -> str:
    """The training run a checkpoint source belongs to: the folder or URL its checkpoint folder sits in."""
    return source.rstrip("/").rsplit("/", 1)[0]


def _regressed(row: HistoryRow, candidates: list[HistoryRow]) -> bool:
    """Whether `row` is worse than the best of the `candidates` of an earlier step (paired_interval below 0;
    without per-reference taus, its whole interval below the other's): only against steps known to come
    before it, so a row without a step (or a baseline) never is."""
    if row.baseline or row.step is None:
        return False
    best_earlier = max((r for r in candidates if r.step is not None and r.step < row.step),
                       key=lambda r: r.tau_macro, default=None)
    if best_earlier is None:
        return False
    if (paired := paired_interval(row, best_earlier)) is not None:
        return paired[1] < 0
    return bool(row.tau_macro_ci95 and best_earlier.tau_macro_ci95
                and row.tau_macro_ci95[1] < best_earlier.tau_macro_ci95[0])


def paired_interval(row: HistoryRow, other: HistoryRow) -> tuple[float, float] | None:
    """95% interval of row's tau minus other's, paired on the references both scored (the same in a group);
    None when either lacks per-reference taus or they share no reference."""
    return _paired(row.per_reference, other.per_reference)


@functools.lru_cache(maxsize=4096)  # the regressions, the comparisons and every view ask for the same pairs
def _paired(ours: tuple[tuple[str, str, float], ...],
            other: tuple[tuple[str, str, float], ...]) -> tuple[float, float] | None:
    theirs = {ref: tau for ref, _, tau in other}
    pairs = [(prompt, tau, theirs[ref]) for ref, prompt, tau in ours if ref in theirs]
    return paired_difference_interval(pairs) if pairs else None


PREVIOUS_STEP, BEST, BASELINE = "previous step", "best", "baseline"  # what a Comparison is against


@dataclass(frozen=True)
class Comparison:
    """A row's tau macro minus another checkpoint's of its group, with the 95% interval of the per-reference
    difference (paired: what the references share cancels, so it is much narrower than the two rows' own
    intervals side by side)."""

    against: str  # PREVIOUS_STEP, BEST (the best other checkpoint of the series) or BASELINE
    other: HistoryRow
    difference: float  # the row's tau macro minus other's
    difference_ci95: tuple[float, float] | None  # None: either row lacks per-reference taus

    @property
    def verdict(self) -> str:
        """What the paired interval says: "better" (above 0), "worse" (below 0), "no difference shown" (it
        holds 0), or "" without an interval."""
        if self.difference_ci95 is None:
            return ""
        low, high = self.difference_ci95
        return "better" if low > 0 else "worse" if high < 0 else "no difference shown"

    def as_dict(self) -> ComparisonJson:
        """JSON-able: the results' `comparisons`, `history --json`."""
        ci = self.difference_ci95
        return {"against": self.against, "checkpoint": self.other.label, "source": self.other.source,
                "checkpoint_key": self.other.checkpoint, "step": self.other.step, "tau_macro": self.other.tau_macro,
                "difference": self.difference, "difference_ci95": list(ci) if ci else None}


def comparisons(group: Group, row: HistoryRow, baseline: str | None = None) -> list[Comparison]:
    """`row` (one of group.rows) against, in this order: the previous step (the candidate of the highest step
    below row's; only for a candidate with a step), the best other candidate of the series, and the baselines:
    the checkpoint `baseline` names (a checkpoint key: the run's --baseline, a baseline row or a save on the
    curve), then every other baseline row of the group. One entry per other checkpoint and role: a checkpoint
    both the previous step and the best is in two."""
    others = [r for r in group.candidates if r is not row]
    found: list[tuple[str, HistoryRow]] = []
    if not row.baseline and row.step is not None:
        step = row.step
        earlier = [r for r in others if r.step is not None and r.step < step]
        if earlier:
            found.append((PREVIOUS_STEP, earlier[-1]))  # history order: by step
    if others:
        found.append((BEST, max(others, key=lambda r: r.tau_macro)))  # the first of equals, in order
    given = next((r for r in group.rows if baseline is not None and r.checkpoint == baseline and r is not row), None)
    found += [(BASELINE, r) for r in ([given] if given else [])
              + [b for b in group.baselines if b is not row and b is not given]]
    return [Comparison(against, other, row.tau_macro - other.tau_macro, paired_interval(row, other))
            for against, other in found]


def in_history_order(rows: list[HistoryRow]) -> list[HistoryRow]:
    """Candidates in history order: rows with a training step by step; rows without one by when they were
    first scored, each in the place its scoring time gives it among all rows (an untrained drafter scored
    before the first save comes first, a final export scored after the last save last). Never by path."""
    stepped = iter(sorted((r for r in rows if r.step is not None), key=lambda r: (r.step, _scored(r))))
    # the stepped rows fill, in step order, the places their scoring times take
    return [next(stepped) if row.step is not None else row for row in sorted(rows, key=_scored)]


def _scored(row: HistoryRow) -> tuple:
    return row.scored_at or _NEVER, row.scores  # the content key only breaks ties


def find_group(groups: list[Group], scores_key: str) -> tuple[Group, HistoryRow] | None:
    """The group and row of one scores entry (or of the row standing for it: a checkpoint scored in decode and in
    all-positions mode is one row)."""
    for group in groups:
        for row in group.rows:
            if scores_key == row.scores or scores_key in row.merged_scores:
                return group, row
    return None


# Folder and file names that say what a thing is, not which one: a name is read from the nearest part that does.
GENERIC_NAMES = frozenset({"target", "targets", "model", "models", "drafter", "drafters", "checkpoint", "checkpoints",
                           "run", "runs", "out", "output", "outputs", "prompts", "eval", "evals", "data", "snapshots",
                           "hf", "export", "exports", "final", "latest", "best", "main"})
SERIES_NAME = 48  # characters: `series:<name>-<8 hex>` is a tag, at most 64


def _telling(part: str) -> bool:
    return bool(part) and part.lower() not in GENERIC_NAMES and not COMMIT_HASH.fullmatch(part) and not part.startswith(".")


def readable_name(path: str) -> str:
    """A name a person can read for a folder or file: its own name, or where that says only what it is (`target`,
    `prompts.jsonl`, a commit hash) the nearest telling folder above it before it (`tiny/target`).
    A URL's path is read the same way; a name that is no path (a Hub id, a suite) is returned as it is."""
    path = urlsplit(path).path if "://" in path else path
    parts = [p for p in Path(path.rstrip("/")).parts if p not in ("/", ".")]
    if not parts:
        return path
    leaf = parts[-1]
    if _telling(Path(leaf).stem if Path(leaf).suffix in (".jsonl", ".json") else leaf):
        return leaf
    above = next((p for p in reversed(parts[:-1]) if _telling(p)), None)
    return f"{above}/{leaf}" if above else leaf


def drafter_run(source: str) -> str:
    """The training run a checkpoint belongs to, as people call it: the run folder of a save named by its step
    (training_run_of: `runs/exp7/step_300`, a relay's `run1/step_1000`: `exp7`, `run1`), else the checkpoint's own
    name (a published drafter)."""
    stepped = step_from_name(source.rstrip("/").rsplit("/", 1)[-1]) is not None
    return readable_name(training_run_of(source) if stepped and "/" in source.rstrip("/") else source)


def series_key(store: Store, features_key: str, sliding_semantics: str, chosen_block_size: int | None,
               draft_sampling: dict | str | None, target: str, prompts: str, run: str | None = None,
               confidence_threshold: float | None = None) -> str:
    """A series' key in Prefect: `<target>-<drafter run>-<prompts>-<8 hex>`, lowercase letters, digits and dashes (an
    artifact key's alphabet), a word the parts repeat said once (`tiny-target-drafter-prompts-...`). The hex digits
    are what makes its taus comparable: the store, the features entry (the target's content and the references':
    prompts, max new tokens, thinking, backend, sampling), the sliding-layer semantics, the chosen block size, how
    drafts are sampled (draft_sampling, the drafts record's, or its canonical JSON; None: greedy drafts) and the
    confidence threshold (None or 0: every draft verified); the names (readable_name, drafter_run) only make it
    readable."""
    if isinstance(draft_sampling, str):
        draft_sampling = json.loads(draft_sampling)
    identity = key_of({"store": store.location, "features": features_key, "sliding_semantics": sliding_semantics,
                       "block_size": chosen_block_size,
                       # only when sampled: the keys of greedy drafts' series stay as they were
                       **({"draft_sampling": draft_sampling} if draft_sampling is not None else {}),
                       # only when set: the keys of series verifying every draft stay as they were
                       **({"confidence_threshold": confidence_threshold} if confidence_threshold else {})})[:8]
    prompts = re.sub(r"\.jsonl?$", "", readable_name(prompts))
    words = re.sub(r"[^a-z0-9]+", " ", " ".join((target, run or "", prompts)).lower()).split()
    name = "-".join(dict.fromkeys(words))[:SERIES_NAME].strip("-")
    return f"{name or 'series'}-{identity}"


def references_of(store: Store, features_key: str) -> ReferencesRecord | None:
    """The record of the references a features entry was extracted from (records only, no files read); None when
    either entry is gone."""
    try:
        features = FeaturesRecord.from_record(store.read_record(Stage.FEATURES, features_key, verify=False,
                                                                discard_damaged=False))
        return ReferencesRecord.from_record(store.read_record(Stage.REFERENCES, features.references, verify=False,
                                                              discard_damaged=False))
    except (EntryMissing, KeyError):
        return None


def _describe(store: Store, features_key: str, sliding_semantics: str, chosen_block_size: int | None,
              draft_sampling: str | None, confidence_threshold: float | None = None
              ) -> tuple[str, str, str, tuple[str, str]]:
    """A group's (title, sweep title, setting, names): the title for people, that title without the block size, how
    the target is served (dflash_core.sampling.Served's label, the confidence threshold in it), and what people call
    its target and prompt set."""
    references = references_of(store, features_key)
    if references is None:
        served = Served.from_record(None, block_size=chosen_block_size,
                                    draft_sampling=None if draft_sampling is None else json.loads(draft_sampling),
                                    confidence_threshold=confidence_threshold)
        blocks = "" if served.default else f", {served.label}"
        title = f"features {features_key[:12]} ({sliding_semantics} sliding layers)"
        return title + blocks, title, f"features {features_key[:12]}" + blocks, ("features", features_key[:12])
    # --name, else the Hub id (model_name), else its folder's name (what the entry recorded; older entries: from the
    # path); a folder named only for what it is (`target`) by the telling part of its path
    named = references.target_name or model_name(references.target or "target")
    target = named if "/" in named or _telling(named) else readable_name(references.target or named)
    prompts = readable_name(references.prompts) or "prompts"
    if references.benchmarks:  # published benchmarks: by which protocol (two protocols are two series)
        prompts += f" ({references.benchmarks['protocol']})"
    given = references.backend.get("kind") == "given"
    drafts = None if draft_sampling is None else json.loads(draft_sampling)
    served = Served.from_record(references.sampling, given, chosen_block_size, drafts, confidence_threshold)
    # the same without the block size (a block-size sweep's groups share it)
    swept = Served.from_record(references.sampling, given, draft_sampling=drafts,
                               confidence_threshold=confidence_threshold)
    title = f"{target} on {prompts}, {references.max_new_tokens} new tokens"
    semantics = f" ({sliding_semantics} sliding layers)"
    return (title + ("" if served.default else f", {served.label}") + semantics,
            title + ("" if swept.default else f", {swept.label}") + semantics, served.label, (target, prompts))


def source_name(source: str) -> str:
    """A short name for a checkpoint source: its last two path parts."""
    return "/".join(Path(source.rstrip("/")).parts[-2:])
