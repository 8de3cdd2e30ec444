"""`entry.json`, the completion marker of a store entry: what it holds, sealed at commit and checked on every
read (the store's layout and the meaning of each field: storage/store.py)."""

import json
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from .hashing import key_of

MARKER_NAME = "entry.json"
MARKER_FORMAT = 1

FileDigests = dict[str, dict[str, Any]]  # {path relative to the entry: {"size", "sha256"}}


@dataclass(frozen=True)
class Entry:
    """A committed entry, as its `entry.json` describes it."""

    stage: str
    key: str
    record: dict[str, Any]
    files: FileDigests | None  # None: committed before digests were recorded
    content: str | None  # digest of `files`; None as for files
    upstream: dict[str, str | None] | None  # content digests of what it was built from; None: not recorded
    committed_at: str | None


class MarkerDamaged(ValueError):
    """An `entry.json` that is not a valid marker of its entry (the message says why)."""


def content_digest(files: FileDigests) -> str:
    """The content digest of an entry's files: what entries built on it record as its content."""
    return key_of({path: f["sha256"] for path, f in files.items()})


def seal(stage: str, key: str, record: dict[str, Any], files: FileDigests,
         upstream: Mapping[str, str | None] | None) -> bytes:
    """The marker of entry (stage, key), as the bytes to write: the record, the files' digests and their
    content digest, the upstream (if given), the time, and a checksum over what a reader must trust."""
    sealed: dict[str, Any] = {"record": record, "files": files, "content": content_digest(files)}
    if upstream is not None:
        sealed["upstream"] = dict(upstream)
    # normalized through JSON, so the checksum is computed on exactly what a reader parses back
    sealed = json.loads(json.dumps(sealed, allow_nan=False))
    marker = {
        "format": MARKER_FORMAT,
        "stage": stage,
        "key": key,
        # microseconds: history orders checkpoints without a training step by it
        "committed_at": datetime.now(UTC).isoformat(timespec="microseconds"),
        **sealed,
        "checksum": key_of(sealed),
    }
    # as records.write_json_atomic writes JSON: sorted keys, UTF-8
    return json.dumps(marker, sort_keys=True, indent=1, ensure_ascii=False, allow_nan=False).encode("utf-8")


def parse(raw: bytes, stage: str, key: str) -> Entry:
    """The entry a marker read for (stage, key) describes; `MarkerDamaged` unless it is a valid marker of
    this very entry, intact since its commit."""
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise MarkerDamaged(f"not JSON ({e})") from None
    if not isinstance(data, dict) or not isinstance(data.get("record"), dict):
        raise MarkerDamaged("no 'record' object")
    if data.get("format") != MARKER_FORMAT:
        raise MarkerDamaged(f"unknown format {data.get('format')!r}")
    if (data.get("stage"), data.get("key")) != (stage, key):
        # A directory copied or renamed by hand: its content belongs to another key.
        raise MarkerDamaged(f"belongs to {data.get('stage')}/{data.get('key')}")
    files, upstream = data.get("files"), data.get("upstream")
    if "checksum" in data:
        sealed = {name: data[name] for name in ("record", "files", "content", "upstream") if name in data}
        try:
            intact = key_of(sealed) == data["checksum"]
        except (TypeError, ValueError):
            intact = False
        if not intact:
            raise MarkerDamaged("checksum mismatch (the record or its digests changed since commit)")
        if not isinstance(files, dict) or not all(
            isinstance(f, dict) and isinstance(f.get("size"), int) and isinstance(f.get("sha256"), str)
            and not Path(name).is_absolute() and ".." not in Path(name).parts  # damaged files are deleted
            for name, f in files.items()
        ):
            raise MarkerDamaged("malformed 'files'")
    elif files is not None:
        raise MarkerDamaged("digests without a checksum")
    return Entry(stage, key, data["record"], files, data.get("content"),
                 upstream if isinstance(upstream, dict) else None, data.get("committed_at"))
