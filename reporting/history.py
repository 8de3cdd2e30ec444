"""Every scored checkpoint in a store, by training step: is the newest save better than the best so far?

Rows come from the store alone (scores -> drafts -> fetch, features entries), grouped by what makes
taus comparable: the same target and references (the features entry: greedy, or sampled with one
setting), the same sliding-layer semantics, and the same block size chosen with --block-size (without
it, each drafter verifies its own block size, and drafters of different block sizes compare). Order: checkpoints with a training step by step; checkpoints without one (an untrained
drafter, a final export) by when they were first scored (the scores entry's commit time), never by
path. A checkpoint is flagged as a regression when it is worse than the best checkpoint of an earlier
step on the same references: the 95% interval of the per-reference difference (paired bootstrap over
prompts, and samples within a prompt: dflash_core.metrics) lies below 0 (scores written before they kept
per-reference taus: when its whole interval lies below the best earlier step's); a checkpoint
without a step is never flagged, as its place among the steps is unknown. Baseline drafters (a
`baselines` entry holds their checkpoint key, written by `dflash-eval run --baseline`) are rows of
their own, after the others: never the best, never a regression.

A damaged scores entry is skipped with a warning naming it (storage.store removes what is damaged; the
next run recomputes it), and so is a stale one (its drafts were recomputed with another content since:
the next run scores them again); one whose drafts or checkpoint entry is gone is skipped silently.
"""

import json
import re
import warnings
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

from dflash_core.checkpoint_files import model_name
from dflash_core.metrics import paired_difference_interval
from dflash_core.sampling import Served
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
    # DFlash2: the tau its unary head's argmax alone reaches, and tau_macro minus it (what its candidate selector
    # adds: scores.json's `selector`); None for other drafters
    unary_tau_macro: float | None = None
    selector_lift: float | None = None
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

    groups: dict[tuple[str, str, int | None, str | None], Group] = {}
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
        group_key = (drafts.features, drafts.sliding_semantics, drafts.chosen_block_size, sampled)
        if group_key not in groups:
            groups[group_key] = Group(*group_key, *_describe(store, *group_key))
        rows = groups[group_key].rows
        ci = scores.get("tau_macro_ci95")
        row = HistoryRow(
            step=fetch.step, source=fetch.source, label=source_name(fetch.source), checkpoint=drafts.checkpoint,
            drafts=record.drafts, scores=key, scores_path=str(store.entry(Stage.SCORES, key) / SCORES_FILE),
            scored_at=scored_at, tau_macro=scores["tau_macro"], tau_macro_ci95=tuple(ci) if ci else None,
            tau_pooled=scores["tau_pooled"], all_positions_tau=scores.get("all_positions_tau"),
            baseline=store.is_complete(Stage.BASELINES, drafts.checkpoint, discard_damaged=False),
            per_reference=tuple((p["id"], p.get("prompt") or p["id"], p["tau"]) for p in scores.get("per_prompt", ())
                                if p.get("tau") is not None),
            teacher_forced_accuracy=tuple(scores["teacher_forced_accuracy"]) if "teacher_forced_accuracy" in scores
            else None,
            unary_tau_macro=scores["selector"]["unary_tau_macro"] if "selector" in scores else None,
            selector_lift=scores["selector"]["lift"] if "selector" in scores else None,
        )
        same = next((r for r in rows if r.checkpoint == row.checkpoint), None)
        if same is not None:  # scored in decode and in all-positions mode: the same decode path, keep the richer
            rows.remove(same)
            richer = row if same.all_positions_tau is None and row.all_positions_tau is not None else same
            first = min((t for t in (same.scored_at, row.scored_at) if t is not None), default=None)
            other = row if richer is same else same
            row = replace(richer, scored_at=first, merged_scores=richer.merged_scores + (other.scores,))
        rows.append(row)
    for group in groups.values():
        candidates = in_history_order(group.candidates)
        best = max(candidates, key=lambda r: r.tau_macro, default=None)  # the first of equals, in order
        group.rows = [replace(r, best=r is best, regression=_regressed(r, candidates))
                      for r in candidates + sorted(group.baselines, key=_scored)]
    return sorted(groups.values(), key=lambda g: g.title)


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
    theirs = {ref: tau for ref, _, tau in other.per_reference}
    pairs = [(prompt, tau, theirs[ref]) for ref, prompt, tau in row.per_reference if ref in theirs]
    return paired_difference_interval(pairs) if pairs else None


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


def series_key(store: Store, features_key: str, sliding_semantics: str, chosen_block_size: int | None,
               draft_sampling: dict | str | None, target: str, prompts: str) -> str:
    """A series' key in Prefect: `<target>-<prompts>-<8 hex>`, lowercase letters, digits and dashes (an artifact
    key's alphabet). The hex digits are what makes its taus comparable: the store, the features entry (the
    target's content and the references': prompts, max new tokens, thinking, backend, sampling), the
    sliding-layer semantics, the chosen block size and how drafts are sampled (draft_sampling, the drafts
    record's, or its canonical JSON; None: greedy drafts); the names only make it readable."""
    if isinstance(draft_sampling, str):
        draft_sampling = json.loads(draft_sampling)
    identity = key_of({"store": store.location, "features": features_key, "sliding_semantics": sliding_semantics,
                       "block_size": chosen_block_size,
                       # only when sampled: the keys of greedy drafts' series stay as they were
                       **({"draft_sampling": draft_sampling} if draft_sampling is not None else {})})[:8]
    name = re.sub(r"[^a-z0-9]+", "-", f"{target}-{Path(prompts).stem}".lower()).strip("-")[:40].strip("-")
    return f"{name or 'series'}-{identity}"


def _describe(store: Store, features_key: str, sliding_semantics: str,
              chosen_block_size: int | None, draft_sampling: str | None) -> tuple[str, str, str, str]:
    """A group's (title, sweep title, setting, series key): the title for people, that title without the block
    size, how the target is served (dflash_core.sampling.Served's label), its key in Prefect."""
    try:
        # a title only: records, no files read
        features = FeaturesRecord.from_record(store.read_record(Stage.FEATURES, features_key, verify=False,
                                                                discard_damaged=False))
        references = ReferencesRecord.from_record(store.read_record(Stage.REFERENCES, features.references,
                                                                    verify=False, discard_damaged=False))
    except (EntryMissing, KeyError):
        served = Served.from_record(None, block_size=chosen_block_size,
                                    draft_sampling=None if draft_sampling is None else json.loads(draft_sampling))
        blocks = "" if served.default else f", {served.label}"
        title = f"features {features_key[:12]} ({sliding_semantics} sliding layers)"
        return (title + blocks, title, f"features {features_key[:12]}" + blocks,
                series_key(store, features_key, sliding_semantics, chosen_block_size, draft_sampling, "features",
                           features_key[:12]))
    target = references.target_name or model_name(references.target or "target")  # older entries: from the path
    prompts = Path(references.prompts).name or "prompts"
    if references.benchmarks:  # published benchmarks: by which protocol (two protocols are two series)
        prompts += f" ({references.benchmarks['protocol']})"
    given = references.backend.get("kind") == "given"
    drafts = None if draft_sampling is None else json.loads(draft_sampling)
    served = Served.from_record(references.sampling, given, chosen_block_size, drafts)
    swept = Served.from_record(references.sampling, given, draft_sampling=drafts)  # the same without the block size
    title = f"{target} on {prompts}, {references.max_new_tokens} new tokens"
    semantics = f" ({sliding_semantics} sliding layers)"
    return (title + ("" if served.default else f", {served.label}") + semantics,
            title + ("" if swept.default else f", {swept.label}") + semantics, served.label,
            series_key(store, features_key, sliding_semantics, chosen_block_size, draft_sampling, target, prompts))


def source_name(source: str) -> str:
    """A short name for a checkpoint source: its last two path parts."""
    return "/".join(Path(source.rstrip("/")).parts[-2:])
