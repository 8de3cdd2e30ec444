"""Before a run: whether it would start a new series beside one the store holds that differs in one setting only.

A series' taus are comparable because they share their references (reporting.history). A run on the same target and
prompts at another `--max-new-tokens` (the demo evaluates at 96, `run` defaults to 256) computes references and
features anew and starts a series of its own, silently. When the store holds references of this target and prompt
set that differ from this run's in exactly one setting, and none that equal them, `new_series_note` says so in one
line: the setting, this run's value and the value that would join the series there.
"""

from dataclasses import dataclass
from typing import Any

from dflash_eval.storage import EntryMissing, Store
from dflash_eval.storage.schema import ReferencesRecord, Stage


@dataclass(frozen=True)
class ReferenceSettings:
    """What a references entry was made with, of the settings a person may set otherwise by accident."""

    max_new_tokens: int
    lookahead: bool
    dtype: str | None  # the local target's compute dtype; None: a server's references
    sampling: str  # "greedy" or "temperature 0.6, top-k 20, ..., 4 samples, seed 0"
    protocol: str | None  # published benchmarks' protocol

    def differences(self, other: "ReferenceSettings") -> list[tuple[str, Any, Any]]:
        """(setting, this value, the other's) for each setting that differs."""
        return [(name, getattr(self, name), getattr(other, name)) for name in self.__dataclass_fields__
                if getattr(self, name) != getattr(other, name)]


# how the command line names each setting, and how a value is written on it
_FLAGS = {"max_new_tokens": "--max-new-tokens", "lookahead": "--lookahead", "dtype": "--dtype",
          "sampling": "the sampling options", "protocol": "--protocol"}


def _written(name: str, value: Any) -> str:
    if name == "lookahead":
        return "--lookahead" if value else "--no-lookahead"
    if name == "sampling":
        return str(value)
    return f"{_FLAGS[name]} {value}"


def _sampling(record: dict | None) -> str:
    if not record:
        return "greedy"
    return ", ".join(f"{k} {record[k]:g}" if isinstance(record[k], float) else f"{k} {record[k]}"
                     for k in ("temperature", "top_k", "top_p", "min_p", "samples", "seed") if k in record)


def settings_of(record: ReferencesRecord) -> ReferenceSettings:
    """The settings a stored references record was made with."""
    local = record.backend.get("kind") == "transformers"
    return ReferenceSettings(record.max_new_tokens, record.lookahead > 0, record.backend.get("dtype") if local else None,
                             _sampling(record.sampling), (record.benchmarks or {}).get("protocol"))


def this_run(max_new_tokens: int, lookahead: bool, dtype: str | None, sampling: dict | None,
             protocol: str | None) -> ReferenceSettings:
    """This run's settings (`sampling`: as a sampled references record holds it, None when greedy)."""
    return ReferenceSettings(max_new_tokens, lookahead, dtype, _sampling(sampling), protocol)


def new_series_note(store: Store, target: str, prompts: str, ours: ReferenceSettings) -> str | None:
    """One line when this run would start a new series beside one of the same target and prompts that differs in one
    setting only (naming it, this run's value and the one that joins it); None when it joins a series, or when every
    series of this target and prompts differs in more than one setting (then it is a new comparison, not a slip)."""
    one_off = []
    for key in store.keys(Stage.REFERENCES):
        try:
            record = ReferencesRecord.from_record(store.read_record(Stage.REFERENCES, key, verify=False,
                                                                    discard_damaged=False))
        except (EntryMissing, KeyError, ValueError, TypeError):
            continue
        if record.target != target or record.prompts != prompts:
            continue
        differences = settings_of(record).differences(ours)
        if not differences:
            return None  # joins a series the store holds
        if len(differences) == 1:
            one_off.append(differences[0])
    if not one_off:
        return None
    name, theirs, mine = one_off[0]
    return (f"note: the store holds this target's references on these prompts made with {_written(name, theirs)}; "
            f"this run's {_written(name, mine)} starts a new series (references and features computed anew): give "
            f"{_written(name, theirs)} to join that series")
