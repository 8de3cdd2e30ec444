"""What store entries were built from (staleness), and verifying and repairing a whole store.

Every entry records, at commit, the content digests of the entries it was built from (`upstream`,
storage.store). A label names one upstream:

- `<stage>/<key>`: that entry's content digest (the digest of its files, recorded at its commit);
- `features/<key>/layers=1,2/n=10`: the digest of those feature arrays (`FeatureStore.digest`, from the
  sha256 in each array's marker): a drafts entry depends on the layers it read, not on layers that
  other checkpoints added to the same features entry later.

An entry whose recorded digests differ from its upstream's current ones was built on output that has
changed since (a refresh that did not reproduce it): it is stale and is recomputed when next used
(`changed_upstream`, applied by `Store.get_or_compute`).

`verify_store` walks every entry: marker, checksums of its files and of every feature array, chunk
files, JSON that parses, staleness; with `repair` it removes what is damaged so that the next run
recomputes exactly that.
"""

from dataclasses import dataclass, field

from .feature_store import FeatureMissing, array_name
from .schema import Stage
from .store import Damage, Entry, EntryMissing, LockTimeout, Store, changed_upstream


class StaleEntryWarning(UserWarning):
    """An entry was skipped: it was built on content that has changed since; the next run recomputes it."""


def entry_label(stage: str, key: str) -> str:
    """The upstream label of a whole entry."""
    return f"{stage}/{key}"


def features_label(key: str, layer_ids, n_sequences: int) -> str:
    """The upstream label of some layers of a features entry, for sequences 0..n_sequences-1."""
    return f"{Stage.FEATURES}/{key}/layers={','.join(str(int(i)) for i in layer_ids)}/n={int(n_sequences)}"


def upstream_digest(store: Store, label: str) -> str | None:
    """The current content digest of an upstream label; None when that upstream is absent or incomplete
    (or was committed before digests were recorded)."""
    parts = label.split("/")
    try:
        if len(parts) == 2:
            return store.content(parts[0], parts[1])
        if (len(parts) == 4 and parts[0] == Stage.FEATURES and parts[2].startswith("layers=")
                and parts[3].startswith("n=")):
            ids = [int(i) for i in parts[2].removeprefix("layers=").split(",") if i]
            features = store.feature_store(parts[1])
            return features.digest(ids, int(parts[3].removeprefix("n=")))
    except (EntryMissing, FeatureMissing):
        return None
    raise ValueError(f"not an upstream label: {label!r} (see storage.integrity)")


def upstream_digests(store: Store, labels) -> dict[str, str | None]:
    """{label: current content digest} for each label."""
    return {label: upstream_digest(store, label) for label in labels}


def stale_upstream(store: Store, entry: Entry) -> list[str]:
    """The upstream labels of `entry` whose content has changed since it was committed. An upstream
    that is gone says nothing (it may be recomputed to the same content), so it is not counted."""
    if not entry.upstream:
        return []
    current = upstream_digests(store, entry.upstream)
    return [label for label in changed_upstream(entry.upstream, current) if current.get(label) is not None]


# ---------------------------------------------------------------- verifying a whole store


@dataclass(frozen=True)
class Problem:
    """Something wrong with one entry: damaged files or marker, a damaged feature array, or stale."""

    stage: str
    key: str
    kind: str  # "damaged", "damaged array", "stale" or "unreadable" (permissions: not repaired)
    what: str  # a path in the entry, an array (layer_i/seq_n), or an upstream label
    reason: str
    damage: Damage | None = None  # for "damaged": what Store.discard removes
    array: tuple[int, int] | None = None  # for "damaged array": (layer id, sequence index)

    def __str__(self) -> str:
        return f"{self.kind.split()[0]:<7} {self.stage}/{self.key}: {self.what}: {self.reason}"


@dataclass
class VerifyReport:
    """What `verify_store` found (and repaired)."""

    entries: int = 0
    arrays: int = 0
    problems: list[Problem] = field(default_factory=list)
    incomplete: list[str] = field(default_factory=list)  # stage/key without a marker: a rerun resumes them
    repaired: list[Problem] = field(default_factory=list)
    busy: list[str] = field(default_factory=list)  # entries another process held locked: not repaired


def check_entry(store: Store, stage: str, key: str) -> tuple[list[Problem], int]:
    """(problems of one committed entry, feature arrays checked); every file and array hashed. Raises
    EntryMissing when the entry is incomplete."""
    entry, damage = store.check(stage, key, full=True)
    problems = [Problem(stage, key, "damaged", d.path, d.reason, damage=d) for d in damage]
    if entry is None:
        return problems, 0
    n_arrays = 0
    if stage == Stage.FEATURES:
        features = store.feature_store(key)
        layer_ids, n = entry.record.get("layer_ids") or [], int(entry.record.get("n") or 0)
        expected = {(layer, seq) for layer in layer_ids for seq in range(n)}
        for layer, seq in sorted(expected | {a for a in features.arrays() if features.has(*a)}):
            n_arrays += 1
            try:
                features.read_layer(layer, seq, verify=True)
            except FeatureMissing as e:
                problems.append(Problem(stage, key, "damaged array", array_name(layer, seq), e.reason,
                                        array=(layer, seq)))
    for label in stale_upstream(store, entry):
        problems.append(Problem(stage, key, "stale", label, "built on content that has changed since: "
                                "recomputed when next used"))
    return problems, n_arrays


def repair_entry(store: Store, stage: str, key: str, problems: list[Problem]) -> None:
    """Remove what `problems` name, so the next run recomputes exactly that: a stale entry whole; a
    damaged entry's marker and damaged files; a damaged feature array, and its entry's marker (the
    features stage then extracts the arrays that are missing, and only those, and commits again)."""
    if any(p.kind == "stale" for p in problems):
        store.remove(stage, key)
        return
    for p in problems:
        if p.array is not None:
            store.feature_store(key).discard(*p.array)
    if problems:
        store.discard(stage, key, [p.damage for p in problems if p.damage is not None])


def verify_store(store: Store, repair: bool = False) -> VerifyReport:
    """Check every entry of the store (`check_entry`); with `repair`, remove what is damaged or stale
    (`repair_entry`), each entry under its lock, checked again there; an entry another process holds
    is left alone and listed in `busy`."""
    report = VerifyReport()
    for stage, key, complete in store.entries():
        if not complete:
            report.incomplete.append(f"{stage}/{key}")
            continue
        try:
            problems, n_arrays = check_entry(store, stage, key)
        except EntryMissing:  # removed or begun again meanwhile
            continue
        except PermissionError as e:  # not damage: this user may not read it (nothing to repair either)
            report.entries += 1
            report.problems.append(Problem(stage, key, "unreadable", e.filename or f"{stage}/{key}",
                                           "permission denied: verify as a user who can read the whole store"))
            continue
        report.entries += 1
        report.arrays += n_arrays
        report.problems += problems
        if not (repair and problems):
            continue
        try:
            with store.lock(stage, key, timeout=0):
                try:
                    problems, _ = check_entry(store, stage, key)  # what holds now, under the lock
                except EntryMissing:
                    continue
                repair_entry(store, stage, key, problems)
                report.repaired += problems
        except LockTimeout:
            report.busy.append(f"{stage}/{key}")
    return report

