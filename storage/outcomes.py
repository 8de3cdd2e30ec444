"""What the store answers besides records: `EntryMissing` (and `CorruptEntryWarning`) when a read finds no
usable entry, `Damage` for what is wrong with one, and for `Store.get_or_compute` its `Outcome` and, when it
computed the entry, the `Miss` that says why (storage/store.py)."""

from dataclasses import dataclass
from typing import Any

from .marker import Entry


class EntryMissing(LookupError):
    """A store entry is absent or incomplete (no valid `entry.json`): the stage must run. `damaged`: it
    was committed, but found damaged and removed (`reason` names what was wrong)."""

    def __init__(self, stage: str, key: str, reason: str, *, damaged: bool = False):
        super().__init__(f"{stage}/{key}: {reason}")
        self.stage = stage
        self.key = key
        self.reason = reason
        self.damaged = damaged


class CorruptEntryWarning(UserWarning):
    """A damaged entry (an unreadable `entry.json`, or files that no longer match their digests): its
    marker and damaged files were removed and the entry counts as a miss."""


@dataclass(frozen=True)
class Damage:
    """One thing wrong with an entry: `path` relative to the entry (`entry.json` for the marker)."""

    path: str
    reason: str

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


# Why `Store.get_or_compute` computed an entry (`Miss.kind`).
ABSENT = "absent"  # no entry, or an incomplete one (a killed writer's files: resumed)
DAMAGED = "damaged"  # committed, but damaged: its marker and damaged files were removed (resumed)
STALE = "stale"  # built on upstream content that has changed since: removed whole, recomputed
REFRESH = "refresh"  # the caller asked for it: removed whole, recomputed
LACKING = "lacking"  # fresh, but without everything asked (`holds`): extended in place


@dataclass(frozen=True)
class Miss:
    """Why `Store.get_or_compute` computed an entry, named for people in `reason`."""

    kind: str  # ABSENT, DAMAGED, STALE, REFRESH or LACKING
    reason: str
    entry: Entry | None = None  # the committed entry found: replaced (STALE, REFRESH) or extended (LACKING)
    stale: tuple[str, ...] = ()  # STALE: the upstream labels whose content has changed

    def __str__(self) -> str:
        return self.reason


@dataclass(frozen=True)
class Outcome:
    """What `Store.get_or_compute` gives: the entry's record and content digest, and why it was computed
    (`miss`; None when it was read from the store)."""

    record: dict[str, Any]
    content: str | None
    miss: Miss | None = None

    @property
    def computed(self) -> bool:
        """Whether this call computed the entry (rather than reading it)."""
        return self.miss is not None
