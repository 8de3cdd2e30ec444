"""Content keys: sha256 of canonical JSON, streaming file digests, a file-digest cache.

Keys are pure functions of content, never of paths or timestamps, so the same
inputs give the same key on every machine and in every run (DVC's stage cache
does the same). The digest cache is the one place where paths and mtimes
appear, and only to avoid re-reading unchanged files: it never changes a key.
"""

import hashlib
import json
import math
import os
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .file_lock import file_lock
from .records import read_json, write_json_atomic

CHUNK_BYTES = 1 << 20  # 1 MiB: large enough for full disk throughput, small enough to never matter in RAM

# What identifies a Hugging Face checkpoint: config and weights, tokenizer files (tokenizer.json,
# tokenizer.model, vocab/merges .txt, tiktoken), chat templates and remote code.
CHECKPOINT_PATTERNS = ("*.json", "*.safetensors", "*.model", "*.tiktoken", "*.txt", "*.jinja", "*.py")


# ---------------------------------------------------------------- keys from JSON


def _check_json_value(obj: Any, where: str) -> None:
    # json.dumps alone would accept values that make keys unstable or ambiguous:
    # {1: ...} and {"1": ...} both become '"1"', NaN is not JSON, and numpy integers fail
    # deep inside json with a message that does not say where.
    if obj is None or isinstance(obj, (str, bool, int)):
        return
    if isinstance(obj, float):
        if not math.isfinite(obj):
            raise ValueError(f"{where}: {obj!r} is not valid JSON; a key needs finite floats")
        return
    if isinstance(obj, dict):
        for k, v in obj.items():
            if not isinstance(k, str):
                raise TypeError(f"{where}: dict keys must be str, got {type(k).__name__} {k!r}")
            _check_json_value(v, f"{where}.{k}")
        return
    if isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _check_json_value(v, f"{where}[{i}]")
        return
    raise TypeError(
        f"{where}: {type(obj).__name__} is not a JSON type (str, int, float, bool, None, list, dict); "
        "convert it first (numpy/torch scalars with .item(), paths with str())"
    )


def canonical_json(obj: Any) -> str:
    """The canonical JSON text of `obj`: sorted keys, no whitespace, ASCII only.

    Floats are written as Python's shortest round-trip repr (`0.1` -> `0.1`), which is
    the same on every platform. `1` and `1.0` stay different (`1` vs `1.0`): normalize
    types before keying if a value may arrive as either. Tuples are written as lists.
    Raises `TypeError` for non-JSON types or non-str dict keys and `ValueError` for NaN
    or infinities, naming where in `obj` the offending value sits.
    """
    _check_json_value(obj, "$")
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def key_of(obj: Any) -> str:
    """The content key of `obj`: sha256 hex digest of `canonical_json(obj)` (64 characters)."""
    return hashlib.sha256(canonical_json(obj).encode("ascii")).hexdigest()


# ---------------------------------------------------------------- file digests


def file_sha256(path: str | os.PathLike, chunk_bytes: int = CHUNK_BYTES) -> str:
    """sha256 hex digest of a file, read in `chunk_bytes` pieces (never whole: shards reach 17 GB)."""
    digest = hashlib.sha256()
    buffer = bytearray(chunk_bytes)
    view = memoryview(buffer)
    # readinto one reused buffer: no allocation per chunk.
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


class DigestCache:
    """sha256 of files, remembered by (absolute path, size, mtime_ns) in a small JSON file.

    A 54 GB target is hashed once; later runs only stat it. A change of size or
    mtime re-hashes. The JSON file is rewritten after every newly hashed file (so a
    run killed after hashing 9 of 10 shards keeps the 9) by merging with what is on
    disk under an flock and replacing it atomically: several processes can share one
    cache without corrupting it or losing each other's entries. A corrupt cache file
    is warned about and ignored (it is only a cache).

    `hits` and `misses` count lookups answered from the cache and files actually read.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.hits = 0
        self.misses = 0
        self._entries: dict[str, dict[str, Any]] = self._load(warn=True)

    def _load(self, warn: bool) -> dict[str, dict[str, Any]]:
        try:
            data = read_json(self.path)
        except FileNotFoundError:
            return {}
        except ValueError as e:
            data = f"not JSON ({e})"
        if isinstance(data, dict) and isinstance(data.get("files"), dict):
            return data["files"]
        if warn:
            warnings.warn(f"ignoring corrupt digest cache {self.path}: {str(data)[:200]}", stacklevel=3)
        return {}

    def sha256(self, path: str | os.PathLike) -> str:
        """sha256 hex digest of the file at `path`, from the cache when its size and mtime match."""
        # resolve(): symlinked files (Hugging Face snapshots point into blobs/) share one entry,
        # and os.stat follows the link anyway.
        name = str(Path(path).resolve())
        before = os.stat(name)
        cached = self._entries.get(name)
        if (
            isinstance(cached, dict)
            and cached.get("size") == before.st_size
            and cached.get("mtime_ns") == before.st_mtime_ns
            and isinstance(cached.get("sha256"), str)
        ):
            self.hits += 1
            return cached["sha256"]
        self.misses += 1
        sha = file_sha256(name)
        after = os.stat(name)
        if (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns):
            # Only remember a digest of a file that did not change while it was read.
            self._entries[name] = {"size": after.st_size, "mtime_ns": after.st_mtime_ns, "sha256": sha}
            self._save({name: self._entries[name]})
        return sha

    def _save(self, new_entries: dict[str, dict[str, Any]]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # The flock serializes read-merge-replace between processes so no one's entries are lost;
        # os.replace alone would only prevent corruption. A killed holder's flock is released by the OS.
        with file_lock(self.path.with_name(self.path.name + ".lock")):
            on_disk = self._load(warn=False)  # warned about when this instance loaded it
            on_disk.update(new_entries)
            # Forget files that no longer exist, so the cache does not grow forever.
            merged = {name: entry for name, entry in on_disk.items() if os.path.exists(name)}
            write_json_atomic(self.path, {"format": 1, "files": merged})
            self._entries = {**merged, **self._entries}


# ---------------------------------------------------------------- directories


@dataclass(frozen=True)
class DirectoryDigest:
    """Digests of the files of a directory.

    files: relative POSIX name -> sha256 hex digest, sorted by name.
    key: `key_of({"files": files})`, the content key of the whole set (independent of
         where the directory lives).
    """

    files: dict[str, str]
    key: str


def directory_digest(
    path: str | os.PathLike,
    patterns: Iterable[str] = CHECKPOINT_PATTERNS,
    cache: DigestCache | None = None,
) -> DirectoryDigest:
    """Digest every regular file (or symlink to one) under `path` matching any of `patterns`.

    Patterns are `Path.glob` patterns relative to `path` (`"*.json"` matches the top level
    only, `"**/*.json"` recurses). With a `cache`, unchanged files are not re-read.
    Raises `FileNotFoundError` when `path` is not a directory or nothing matches (a key of
    nothing is almost always a wrong path).
    """
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"not a directory: {root}")
    patterns = tuple(patterns)
    names = sorted({p.relative_to(root).as_posix() for pattern in patterns for p in root.glob(pattern) if p.is_file()})
    if not names:
        raise FileNotFoundError(f"no files matching {list(patterns)} in {root}")
    files = {name: (cache.sha256(root / name) if cache else file_sha256(root / name)) for name in names}
    return DirectoryDigest(files=files, key=key_of({"files": files}))
