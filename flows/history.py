"""Every scored checkpoint in a store, by training step: is the newest save better than the best so far?

Rows come from the store alone (scores -> drafts -> fetch, features entries), grouped by what makes
taus comparable: the same target and references (the features entry) and the same sliding-layer
semantics. A checkpoint is flagged as a regression when its whole 95% interval lies below the best
earlier step's interval (bootstrap over prompts, dflash_core.metrics).
"""

from pathlib import Path

from storage import EntryMissing, Store, read_json


def history(store: Store) -> dict[tuple[str, str], list[dict]]:
    """(features key, sliding semantics) -> rows sorted by step: step, source, checkpoint key, tau
    macro with its interval, tau pooled, best (so far), regression."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for key in store.keys("scores"):
        try:
            scores = read_json(store.entry("scores", key) / "scores.json")
            drafts = store.read_record("drafts", store.read_record("scores", key)["drafts"])
            fetch = store.read_record("fetch", drafts["checkpoint"])
        except EntryMissing:  # its drafts or checkpoint entry was deleted: nothing to say which step it was
            continue
        groups.setdefault((drafts["features"], drafts["sliding_semantics"]), []).append({
            "step": fetch["step"], "source": fetch["source"], "checkpoint": drafts["checkpoint"],
            "tau_macro": scores["tau_macro"], "tau_macro_ci95": scores.get("tau_macro_ci95"),
            "tau_pooled": scores["tau_pooled"],
        })
    for rows in groups.values():
        rows.sort(key=lambda r: (r["step"] is None, r["step"] or 0, r["source"]))
        best = None
        for row in rows:
            row["regression"] = bool(best and row["tau_macro_ci95"] and best["tau_macro_ci95"]
                                     and row["tau_macro_ci95"][1] < best["tau_macro_ci95"][0])
            if best is None or row["tau_macro"] > best["tau_macro"]:
                best = row
        for row in rows:
            row["best"] = row is best
    return groups


def source_name(source: str) -> str:
    """A short name for a checkpoint source: its last two path parts."""
    return "/".join(Path(source.rstrip("/")).parts[-2:])
