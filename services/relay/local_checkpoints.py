"""The checkpoints in the folder a relay serves (DIR): found by walking it, listed and served only once
finished (the settle rule), their manifests hashed once per file, every file of them checked to lie inside
DIR by opening it. What a checkpoint is and when it is listed: docs/relay.md, Protocol.
"""

import math
import os
import threading
from dataclasses import replace
from pathlib import Path
from typing import Any, BinaryIO

from dflash_core.checkpoint_files import (
    CONFIG,
    WEIGHT_FILE_NAMES,
    CheckpointBroken,
    CheckpointFiles,
    NotACheckpoint,
    checkpoint_files,
    not_ready,
    saves_beneath,
    training_step,
)
from dflash_eval.services.http_server import ErrorResponse
from dflash_eval.storage.hashing import DigestCache, key_of

from .served_files import NotServable, fd_path, file_identity, is_inside, open_inside


class LocalCheckpoints:
    """The checkpoints under `root` (resolved), as a relay serves them: `scan()` lists the finished ones,
    `find()` names one from URL path segments, `manifest()` hashes its files, `open()` opens a file of DIR.

    A checkpoint still being written (not settled `settle_seconds` after its last change, or not whole)
    is not listed, and `find` answers 409 for it. Digests are kept in `digests`, keyed by path, size and mtime.
    """

    def __init__(self, root: Path, settle_seconds: float, digests: DigestCache):
        self.root = root
        self.settle_seconds = settle_seconds
        self.digests = digests
        self._roots = (str(root),)
        self._lock = threading.Lock()
        self._manifest_locks: dict[str, threading.Lock] = {}  # checkpoint path -> held while hashing it
        self._manifests: dict[str, tuple[Any, dict]] = {}  # path -> (fingerprint, manifest)

    def _lock_for(self, path: str) -> threading.Lock:
        with self._lock:
            return self._manifest_locks.setdefault(path, threading.Lock())

    def open(self, path: str | os.PathLike) -> tuple[BinaryIO, os.stat_result]:
        """(open file, its fstat) if `path` is, once opened, a regular file inside DIR; raises NotServable."""
        return open_inside(path, self._roots)

    def stat(self, path: str | os.PathLike) -> tuple[str, os.stat_result]:
        """(where the file is, its fstat), checked as for sending it; raises NotServable."""
        f, st = self.open(path)
        with f:
            return fd_path(f.fileno()), st

    def _files_of(self, directory: Path, include: tuple[str, ...] = ()) -> CheckpointFiles | None:
        """The evaluation files of the checkpoint in `directory`, each as its resolved path inside DIR
        (checked by opening it), without any file that is not (a link out of DIR is never part of a
        checkpoint); None if it holds no weights."""
        found = checkpoint_files(directory, include)
        if found is None:
            return None
        files = {}
        for name, path in found.files.items():
            try:
                files[name] = Path(self.stat(path)[0])
            except NotServable:
                continue
        if not any(n in files for n in found.weight_names):
            return None
        return replace(found, files=files, config_source=found.config_source if CONFIG in files else None)

    def _locate(self, segments: list[str]) -> tuple[str, Path] | None:
        """(canonical relay path, directory) that `segments` name. A symlinked folder (SpecForge's
        `{run_id}-latest`, `-best`) names the folder it points to when that lies inside DIR: the same
        checkpoint under its own path, never a second one. Anything else symlinked is not followed."""
        if any(s.startswith(".") for s in segments):
            return None
        directory = self.root.joinpath(*segments)
        real = os.path.realpath(directory)
        if real == str(directory):
            return "/".join(segments), directory
        if not is_inside(real, str(self.root)) or real == str(self.root):
            return None
        canonical = Path(real).relative_to(self.root).parts
        if any(s.startswith(".") for s in canonical):
            return None
        return "/".join(canonical), Path(real)

    def find(self, segments: list[str], include: tuple[str, ...] = ()) -> tuple[str, CheckpointFiles] | None:
        """(canonical path, files) of a ready checkpoint; None when there is no such folder here.

        Raises ErrorResponse 409 (with Retry-After) while the folder is still being written, 404 for a
        folder without drafter weights, 422 for a settled checkpoint whose weight files are broken."""
        located = self._locate(segments)
        if located is None or not located[1].is_dir():
            return None
        path, directory = located
        found = self._files_of(directory, include)
        try:
            pending = not_ready(directory, self.settle_seconds, found)
        except CheckpointBroken as e:
            raise ErrorResponse(422, f"checkpoint {path} is broken: {e}; the trainer's save did not complete") from e
        except NotACheckpoint as e:
            inner = saves_beneath(directory, self.settle_seconds, "the relay's --settle-seconds")
            raise ErrorResponse(404, f"no checkpoint {path}: the folder holds no drafter weights ({WEIGHT_FILE_NAMES})"
                                + (f"; {inner}" if inner else "")) from e
        except FileNotFoundError:
            return None
        if pending is not None:
            raise ErrorResponse(409, f"checkpoint {path} is still being written: {pending}",
                                headers={"Retry-After": str(max(1, math.ceil(self.settle_seconds / 3)))})
        if found is None:  # weights only behind links out of DIR: never served
            raise ErrorResponse(404, f"no checkpoint {path}: the folder holds no drafter weights ({WEIGHT_FILE_NAMES})")
        return path, found

    def scan(self) -> list[dict]:
        """The finished checkpoints under DIR: [{"path", "step", "layout", "total_bytes", "n_files"}], by path."""
        found: list[dict] = []
        root = str(self.root)
        for dirpath, dirnames, _ in os.walk(root):  # symlinked directories are not followed
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            rel = Path(dirpath).relative_to(root).as_posix()
            if rel == ".":
                continue
            checkpoint = self._files_of(Path(dirpath))
            try:
                if checkpoint is None or not_ready(dirpath, self.settle_seconds, checkpoint) is not None:
                    continue
                total = sum(self.stat(p)[1].st_size for p in checkpoint.files.values())
            except (CheckpointBroken, FileNotFoundError, NotServable):
                continue  # a manifest request says why
            found.append({
                "path": rel,
                "step": training_step(dirpath),
                "layout": checkpoint.layout,
                "total_bytes": total,
                "n_files": len(checkpoint.files),
            })
        return found

    def _changed(self, path: str) -> ErrorResponse:
        return ErrorResponse(409, f"a file of checkpoint {path} changed while it was read; ask again",
                             headers={"Retry-After": "1"})

    def manifest(self, path: str, checkpoint: CheckpointFiles) -> dict:
        """The manifest of `checkpoint` (as `find` returned it under `path`), hashed once per file version.
        Raises ErrorResponse 409 when a file changed while it was hashed."""
        try:
            files = {name: self.stat(file)[1] for name, file in checkpoint.files.items()}
        except NotServable:
            raise self._changed(path) from None
        fingerprint = (checkpoint.config_source, tuple(sorted((n, *file_identity(st)) for n, st in files.items())))
        cached = self._manifests.get(path)
        if cached and cached[0] == fingerprint:
            return cached[1]
        with self._lock_for(path):  # one hashing per checkpoint at a time
            cached = self._manifests.get(path)
            if cached and cached[0] == fingerprint:
                return cached[1]
            entries: list[dict[str, Any]] = []
            for name in sorted(files):
                sha = self.digests.sha256(checkpoint.files[name])
                try:  # the file hashed by path must be the one checked: same inode, size and mtime
                    same = file_identity(self.stat(checkpoint.files[name])[1]) == file_identity(files[name])
                except NotServable:
                    same = False
                if not same:
                    raise self._changed(path)
                entries.append({"name": name, "size": files[name].st_size, "sha256": sha})
            manifest = {
                "path": path,
                "step": training_step(checkpoint.directory),
                "layout": checkpoint.layout,
                "config_source": checkpoint.config_source,
                "total_bytes": sum(e["size"] for e in entries),
                "files": entries,
                "key": key_of({"files": {e["name"]: e["sha256"] for e in entries}}),
            }
            self._manifests[path] = (fingerprint, manifest)
            return manifest
