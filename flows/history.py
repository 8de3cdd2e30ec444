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
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from dflash_eval.storage import CorruptEntryWarning, EntryMissing, Store, read_json
from dflash_eval.storage.integrity import StaleEntryWarning, stale_upstream

BASELINES = "baselines"  # store stage: one entry per checkpoint key scored as a baseline
_NEVER = datetime.min.replace(tzinfo=timezone.utc)  # a scores entry without a readable commit time sorts first


@dataclass
class Group:
    """Checkpoints scored against one target, one reference set and one sliding-layer semantics."""

    features: str  # features key (target + references)
    sliding_semantics: str
    title: str  # "<target> on <prompts>", for people
    rows: list[dict] = field(default_factory=list)  # candidates in history order (module docstring), then baselines

    @property
    def candidates(self) -> list[dict]:
        return [r for r in self.rows if not r["baseline"]]

    @property
    def baselines(self) -> list[dict]:
        return [r for r in self.rows if r["baseline"]]

    @property
    def best(self) -> dict | None:
        return next((r for r in self.rows if r["best"]), None)


def history(store: Store) -> list[Group]:
    """Every group of comparable scores. Each row: step, source, label, checkpoint / drafts / scores
    keys, scores_path, scored_at (when the checkpoint was first scored, UTC), tau macro with its interval,
    tau pooled, all_positions_tau (None unless computed), baseline, best (so far), regression."""
    groups: dict[tuple[str, str], Group] = {}
    for key in store.keys("scores"):
        try:
            entry = store.read_entry("scores", key)  # verifies scores.json (a damaged one is warned about)
            drafts_key = entry.record["drafts"]
            # records only: their files (drafts.json, weights) are not read here, and a run verifies them
            drafts = store.read_record("drafts", drafts_key, verify=False)
            fetch = store.read_record("fetch", drafts["checkpoint"], verify=False)
            scored_at = store.committed_at("scores", key)
            scores = read_json(store.entry("scores", key) / "scores.json")
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
        group_key = (drafts["features"], drafts["sliding_semantics"])
        if group_key not in groups:
            groups[group_key] = Group(drafts["features"], drafts["sliding_semantics"],
                                      _title(store, drafts["features"], drafts["sliding_semantics"]))
        rows = groups[group_key].rows
        same = next((r for r in rows if r["checkpoint"] == drafts["checkpoint"]), None)
        if same is not None:  # scored in decode and in all-positions mode: the same decode path, keep the richer
            scored_at = min((t for t in (same["scored_at"], scored_at) if t is not None), default=None)  # first scored
            if same["all_positions_tau"] is not None or "all_positions_tau" not in scores:
                same["scored_at"] = scored_at
                continue
            rows.remove(same)
        rows.append({
            "step": fetch["step"], "source": fetch["source"], "label": source_name(fetch["source"]),
            "checkpoint": drafts["checkpoint"], "drafts": drafts_key, "scores": key,
            "scores_path": str(store.entry("scores", key) / "scores.json"), "scored_at": scored_at,
            "tau_macro": scores["tau_macro"], "tau_macro_ci95": scores.get("tau_macro_ci95"),
            "tau_pooled": scores["tau_pooled"], "all_positions_tau": scores.get("all_positions_tau"),
            "baseline": store.is_complete(BASELINES, drafts["checkpoint"]),
        })
    for group in groups.values():
        candidates = in_history_order([r for r in group.rows if not r["baseline"]])
        group.rows = candidates + sorted((r for r in group.rows if r["baseline"]), key=_scored)
        stepped = [r for r in candidates if r["step"] is not None]
        for row in group.rows:
            # only against steps known to come before it: a row without a step has no known place among them
            earlier = [r for r in stepped if row["step"] is not None and r["step"] < row["step"]]
            best_earlier = max(earlier, key=lambda r: r["tau_macro"], default=None)
            row["regression"] = bool(not row["baseline"] and best_earlier and row["tau_macro_ci95"]
                                     and best_earlier["tau_macro_ci95"]
                                     and row["tau_macro_ci95"][1] < best_earlier["tau_macro_ci95"][0])
        best = max(candidates, key=lambda r: r["tau_macro"], default=None)  # the first of equals, in order
        for row in group.rows:
            row["best"] = row is best
    return sorted(groups.values(), key=lambda g: g.title)


def in_history_order(rows: list[dict]) -> list[dict]:
    """Candidates in history order: rows with a training step by step; rows without one by when they were
    first scored, each in the place its scoring time gives it among all rows (an untrained drafter scored
    before the first save comes first, a final export scored after the last save last). Never by path."""
    stepped = iter(sorted((r for r in rows if r["step"] is not None), key=lambda r: (r["step"], _scored(r))))
    # the stepped rows fill, in step order, the places their scoring times take
    return [next(stepped) if row["step"] is not None else row for row in sorted(rows, key=_scored)]


def _scored(row: dict) -> tuple:
    return row["scored_at"] or _NEVER, row["scores"]  # the content key only breaks ties


def find_group(groups: list[Group], scores_key: str) -> tuple[Group, dict] | None:
    """The group and row of one scores entry."""
    for group in groups:
        for row in group.rows:
            if row["scores"] == scores_key:
                return group, row
    return None


def _title(store: Store, features_key: str, sliding_semantics: str) -> str:
    try:
        # a title only: records, no files read
        references_key = store.read_record("features", features_key, verify=False)["references"]
        references = store.read_record("references", references_key, verify=False)
    except (EntryMissing, KeyError):
        return f"features {features_key[:12]} ({sliding_semantics} sliding layers)"
    target = Path(references.get("target", "")).name or "target"  # entries from before it was recorded
    prompts = Path(references.get("prompts", "")).name or "prompts"
    return f"{target} on {prompts}, {references.get('max_new_tokens')} new tokens ({sliding_semantics} sliding layers)"


def source_name(source: str) -> str:
    """A short name for a checkpoint source: its last two path parts."""
    return "/".join(Path(source.rstrip("/")).parts[-2:])
