"""Every scored checkpoint in a store, by training step: is the newest save better than the best so far?

Rows come from the store alone (scores -> drafts -> fetch, features entries), grouped by what makes
taus comparable: the same target and references (the features entry) and the same sliding-layer
semantics. Order: checkpoints with a training step by step; checkpoints without one (an untrained
drafter, a final export) by when they were first scored (the scores entry's commit time), never by
path. A checkpoint is flagged as a regression when its whole 95% interval lies below the interval of
the best checkpoint of an earlier step (bootstrap over prompts, dflash_core.metrics); a checkpoint
without a step is never flagged, as its place among the steps is unknown. Baseline drafters (a
`baselines` entry holds their checkpoint key, written by `dflash-eval run --baseline`) are rows of
their own, after the others: never the best, never a regression.

A damaged scores entry is skipped with a warning naming it (storage.store removes what is damaged; the
next run recomputes it), and so is a stale one (its drafts were recomputed with another content since:
the next run scores them again); one whose drafts or checkpoint entry is gone is skipped silently.
"""

import warnings
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path

from dflash_eval.storage import CorruptEntryWarning, EntryMissing, Store, read_json
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
    best: bool = False  # the best candidate of its group
    regression: bool = False  # its whole interval lies below the best earlier step's

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
    """Checkpoints scored against one target, one reference set and one sliding-layer semantics."""

    features: str  # features key (target + references)
    sliding_semantics: str
    title: str  # "<target> on <prompts>", for people
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


def history(store: Store) -> list[Group]:
    """Every group of comparable scores, its rows in history order with the best one and regressions marked."""
    groups: dict[tuple[str, str], Group] = {}
    for key in store.keys(Stage.SCORES):
        try:
            entry = store.read_entry(Stage.SCORES, key)  # verifies scores.json (a damaged one is warned about)
            record = ScoresRecord.from_record(entry.record)
            # records only: their files (drafts.json, weights) are not read here, and a run verifies them
            drafts = DraftsRecord.from_record(store.read_record(Stage.DRAFTS, record.drafts, verify=False))
            fetch = FetchRecord.from_record(store.read_record(Stage.FETCH, drafts.checkpoint, verify=False))
            scored_at = store.committed_at(Stage.SCORES, key)
            scores = read_json(store.entry(Stage.SCORES, key) / SCORES_FILE)
        except EntryMissing:  # it, its drafts or its checkpoint entry was deleted or damaged: nothing to show
            continue
        except (OSError, ValueError, KeyError) as e:  # removed meanwhile, or not in this format
            warnings.warn(f"history: skipping scores/{key}: {e!r}", CorruptEntryWarning, stacklevel=2)
            continue
        changed = stale_upstream(store, entry)
        if changed:
            warnings.warn(f"history: skipping scores/{key}: stale, built on {', '.join(changed)}, whose content "
                          "has changed since; the next run scores it again", StaleEntryWarning, stacklevel=2)
            continue
        group_key = (drafts.features, drafts.sliding_semantics)
        if group_key not in groups:
            groups[group_key] = Group(drafts.features, drafts.sliding_semantics,
                                      _title(store, drafts.features, drafts.sliding_semantics))
        rows = groups[group_key].rows
        ci = scores.get("tau_macro_ci95")
        row = HistoryRow(
            step=fetch.step, source=fetch.source, label=source_name(fetch.source), checkpoint=drafts.checkpoint,
            drafts=record.drafts, scores=key, scores_path=str(store.entry(Stage.SCORES, key) / SCORES_FILE),
            scored_at=scored_at, tau_macro=scores["tau_macro"], tau_macro_ci95=tuple(ci) if ci else None,
            tau_pooled=scores["tau_pooled"], all_positions_tau=scores.get("all_positions_tau"),
            baseline=store.is_complete(Stage.BASELINES, drafts.checkpoint),
        )
        same = next((r for r in rows if r.checkpoint == row.checkpoint), None)
        if same is not None:  # scored in decode and in all-positions mode: the same decode path, keep the richer
            rows.remove(same)
            richer = row if same.all_positions_tau is None and row.all_positions_tau is not None else same
            first = min((t for t in (same.scored_at, row.scored_at) if t is not None), default=None)
            row = replace(richer, scored_at=first)
        rows.append(row)
    for group in groups.values():
        candidates = in_history_order(group.candidates)
        stepped = [r for r in candidates if r.step is not None]
        best = max(candidates, key=lambda r: r.tau_macro, default=None)  # the first of equals, in order
        group.rows = [replace(r, best=r is best, regression=_regressed(r, stepped))
                      for r in candidates + sorted(group.baselines, key=_scored)]
    return sorted(groups.values(), key=lambda g: g.title)


def _regressed(row: HistoryRow, stepped: list[HistoryRow]) -> bool:
    """Whether the whole interval of `row` lies below that of the best of the `stepped` candidates of an earlier
    step: only against steps known to come before it, so a row without a step (or a baseline) never is."""
    if row.baseline or row.step is None or not row.tau_macro_ci95:
        return False
    best_earlier = max((r for r in stepped if r.step < row.step), key=lambda r: r.tau_macro, default=None)
    return bool(best_earlier and best_earlier.tau_macro_ci95
                and row.tau_macro_ci95[1] < best_earlier.tau_macro_ci95[0])


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
    """The group and row of one scores entry."""
    for group in groups:
        for row in group.rows:
            if row.scores == scores_key:
                return group, row
    return None


def _title(store: Store, features_key: str, sliding_semantics: str) -> str:
    try:
        # a title only: records, no files read
        features = FeaturesRecord.from_record(store.read_record(Stage.FEATURES, features_key, verify=False))
        references = ReferencesRecord.from_record(store.read_record(Stage.REFERENCES, features.references,
                                                                    verify=False))
    except (EntryMissing, KeyError):
        return f"features {features_key[:12]} ({sliding_semantics} sliding layers)"
    target = Path(references.target or "").name or "target"  # entries from before it was recorded
    prompts = Path(references.prompts).name or "prompts"
    return f"{target} on {prompts}, {references.max_new_tokens} new tokens ({sliding_semantics} sliding layers)"


def source_name(source: str) -> str:
    """A short name for a checkpoint source: its last two path parts."""
    return "/".join(Path(source.rstrip("/")).parts[-2:])
