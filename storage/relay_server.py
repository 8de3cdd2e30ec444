"""Checkpoint relay: serves drafter checkpoints over HTTP (protocol v1, JSON), stdlib only.

A training box runs a relay over its checkpoint folder; the eval box downloads from it (or from a
relay in between, started with `upstream=`, which pulls each file through once and caches it).

What is a checkpoint
    A directory at any depth under the served DIR that holds drafter weights in a layout that
    `storage.checkpoint` knows: a `save_pretrained` folder (model.safetensors or an index and its
    shards, SpecForge's older `epoch_E_step_S/` too) or SpecForge's `{run_id}-stepN/` with its
    `training_state.pt`. Its relay path is its directory relative to DIR in POSIX form
    (`run1/step_1000`); its step comes from `storage.checkpoint.training_step`. Directories whose
    name starts with '.' are not searched. A symlinked directory inside DIR (SpecForge's
    `{run_id}-latest`, `-best`) is not listed, and a manifest asked through it is the manifest of
    the directory it points to, under that directory's path: the same checkpoint, never a second.

What is sent (only what evaluation needs)
    The manifest lists, hashes and totals only the files the drafter needs
    (`storage.checkpoint.checkpoint_files`: config, weights, trainer_state.json), plus those
    matching `?include=PATTERN` (repeatable). Optimizer, scheduler, RNG and per-rank state are
    never hashed; a client downloads the files of its manifest. A checkpoint without config.json
    whose parent folder (its run) holds one gets that one, named config.json, with
    `"config_source": "run folder"`.

When a checkpoint is listed (settle rule)
    Trainers such as SpecForge write no "done" marker, so a checkpoint still being written must be
    recognised otherwise: it is listed (and served) only when every regular file directly in it,
    hidden ones included (temp files), was last modified at least `settle_seconds` ago, no
    temporary file of a weight file is there, every shard an index names exists and every weight
    file is whole (`storage.checkpoint.not_ready`). Asked for meanwhile, its manifest and files
    answer 409 with Retry-After (a client waits and asks again), where an unknown path answers
    404; a settled checkpoint whose weights are not whole answers 422. The downloads are verified
    by sha256 against the manifest either way.

Endpoints (GET; HEAD too for files)
    /v1/checkpoints               {"checkpoints": [{"path", "step", "layout", "total_bytes", "n_files"}]}
    /v1/manifest/<path>[?include=PATTERN...]
                                  {"path", "step", "layout", "config_source", "total_bytes",
                                  "files": [{"name", "size", "sha256"}], "key"},
                                  key = key_of({"files": {name: sha256}})
    /v1/files/<path>/<name>       the bytes of any file of the checkpoint; Range `bytes=a-`,
                                  `bytes=a-b`, `bytes=-n` -> 206 + Content-Range, unsatisfiable
                                  -> 416; Content-Length always
    Errors are JSON {"error": "..."}: 400 malformed path, 401 missing/wrong token, 404 unknown,
    409 still being written (Retry-After), 422 broken weights, 502 upstream failure.

Security
    With a token, every request needs `Authorization: Bearer <token>` (constant-time compare);
    the token is never logged. Only checkpoints found by the scan and file names in their
    manifest are served: path segments are percent-decoded one by one and a segment that is
    empty, '.', '..', or holds '/', '\\' or NUL is refused (400), so `..`, `%2F` and `%2e%2e` never
    reach the filesystem. Symlinked directories are never searched, and served only as the
    directory inside DIR they point to; a symlinked file that resolves outside DIR is not part
    of any checkpoint (one that resolves inside DIR is). Plain HTTP: run it on a trusted network
    or behind TLS.

Digests are computed once per file (DigestCache in `state_dir/digests.json`, keyed by path, size
and mtime). A pull-through relay caches files in `state_dir/cache/<path>/<name>`.

Imports neither Prefect nor dflash_core.
"""

import hmac
import io
import json
import logging
import math
import os
import queue
import re
import threading
import time
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, unquote

from .checkpoint import (
    CONFIG,
    INDEX,
    TRAINING_STATE,
    WEIGHTS,
    CheckpointBroken,
    CheckpointFiles,
    NotACheckpoint,
    checkpoint_files,
    not_ready,
    training_step,
)
from .hashing import DigestCache, key_of
from .records import read_json, write_json_atomic
from .relay_client import RelayClient, RelayError, check_file_name, validate_manifest

log = logging.getLogger("storage.relay_server")

CHUNK_BYTES = 1 << 20
DEFAULT_STATE_DIR = Path("~/.cache/dflash-eval/relay")


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


def _decode_segments(raw: str) -> list[str]:
    """Split a raw URL path into percent-decoded segments; refuse anything that could traverse."""
    segments = []
    for part in raw.split("/"):
        segment = unquote(part, errors="strict")
        if segment in ("", ".", "..") or "/" in segment or "\\" in segment or "\x00" in segment:
            raise _HTTPError(400, "invalid path: segments must be plain names (no '..', separators or empty parts)")
        segments.append(segment)
    return segments


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


class RelayServer:
    """A relay over `root_dir` (local checkpoints) and/or `upstream` (another relay, pulled through).

    `url` is its base URL once constructed (the port is bound in the constructor). `faults` and
    `bytes_sent` are test hooks: put "cut", "corrupt" or "truncate" in `faults` and the next file
    response misbehaves that way once; `bytes_sent` counts file body bytes sent. `max_rate` caps
    the bytes/s sent over all downloads together (so a relay next to a trainer leaves it bandwidth).
    """

    def __init__(
        self,
        root_dir: str | os.PathLike | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        token: str | None = None,
        upstream: str | None = None,
        upstream_token: str | None = None,
        state_dir: str | os.PathLike = DEFAULT_STATE_DIR,
        settle_seconds: float = 30,
        max_rate: float | None = None,
    ):
        if root_dir is None and upstream is None:
            raise ValueError("a relay needs a root_dir to serve, an upstream relay to pull from, or both")
        self.root = Path(root_dir).resolve() if root_dir is not None else None
        if self.root is not None and not self.root.is_dir():
            raise FileNotFoundError(f"not a directory: {self.root}")
        self.token = token or None
        self.settle_seconds = settle_seconds
        self.state_dir = Path(state_dir).expanduser()
        self.state_dir.mkdir(parents=True, exist_ok=True)
        self.digests = DigestCache(self.state_dir / "digests.json")
        self.upstream = RelayClient(upstream, token=upstream_token) if upstream else None
        self.faults: queue.Queue[str] = queue.Queue()
        self.bytes_sent = 0
        self.max_rate = max_rate  # bytes/s over all downloads together; None: as fast as the link goes
        self._next_send = time.monotonic()
        self._lock = threading.Lock()
        self._path_locks: dict[str, threading.Lock] = {}
        self._manifests: dict[str, tuple[Any, dict]] = {}  # path -> (fingerprint, manifest)
        self._verified: dict[str, tuple[int, int, str]] = {}  # cache file -> (size, mtime_ns, sha256)
        self._pulls: dict[str, _Pull] = {}  # "<path>/<name>" -> its download from the upstream
        self._thread: threading.Thread | None = None
        self._httpd = ThreadingHTTPServer((host, port), self._handler_class())
        self._httpd.daemon_threads = True
        bound_host, bound_port = self._httpd.server_address[:2]
        shown = host if host not in ("", "0.0.0.0", "::") else bound_host
        if ":" in shown:
            shown = f"[{shown}]"
        self.url = f"http://{shown}:{bound_port}"

    # ------------------------------------------------------------ lifecycle

    def start(self) -> "RelayServer":
        """Serve in a daemon thread; returns self."""
        self._thread = threading.Thread(target=self._httpd.serve_forever, args=(0.1,), name="relay-server", daemon=True)
        self._thread.start()
        return self

    def serve_forever(self) -> None:
        try:
            self._httpd.serve_forever()
        finally:
            self._httpd.server_close()

    def stop(self) -> None:
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join()
            self._thread = None
        self._httpd.server_close()
        if self.upstream is not None:
            self.upstream.close()

    def __enter__(self) -> "RelayServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def _pace(self, n: int) -> None:
        """Under `max_rate`, wait for `n` bytes' turn on the shared outgoing link."""
        if not self.max_rate:
            return
        with self._lock:
            now = time.monotonic()
            self._next_send = max(self._next_send, now) + n / self.max_rate
            wait = self._next_send - now
        time.sleep(wait)

    def _count_sent(self, n: int) -> None:
        with self._lock:
            self.bytes_sent += n

    def _lock_for(self, key: str) -> threading.Lock:
        with self._lock:
            return self._path_locks.setdefault(key, threading.Lock())

    # ------------------------------------------------------------ local checkpoints

    def _checkpoint(self, directory: Path, include: tuple[str, ...] = ()) -> CheckpointFiles | None:
        """The evaluation files of the checkpoint in `directory`, without any file that resolves
        outside DIR (a symlink out of DIR is never part of a checkpoint); None if it holds no weights."""
        found = checkpoint_files(directory, include)
        if found is None:
            return None
        root = str(self.root)
        files = {n: p for n, p in found.files.items() if _inside(os.path.realpath(p), root)}
        if not any(n in files for n in found.weight_files):
            return None
        return replace(found, files=files, config_source=found.config_source if CONFIG in files else None)

    def _local_dir(self, segments: list[str]) -> tuple[str, Path] | None:
        """(canonical relay path, directory) that `segments` name. A symlinked folder (SpecForge's
        `{run_id}-latest`, `-best`) names the folder it points to when that lies inside DIR: the same
        checkpoint under its own path, never a second one. Anything else symlinked is not followed."""
        if self.root is None or any(s.startswith(".") for s in segments):
            return None
        directory = self.root.joinpath(*segments)
        real = os.path.realpath(directory)
        if real == str(directory):
            return "/".join(segments), directory
        if not _inside(real, str(self.root)) or real == str(self.root):
            return None
        canonical = Path(real).relative_to(self.root).parts
        if any(s.startswith(".") for s in canonical):
            return None
        return "/".join(canonical), Path(real)

    def _local_checkpoint(self, segments: list[str], include: tuple[str, ...] = ()) -> tuple[str, CheckpointFiles] | None:
        """(canonical path, files) of a ready checkpoint; None when there is no such folder here.

        Raises _HTTPError 409 (with Retry-After) while the folder is still being written, 404 for a
        folder without drafter weights, 422 for a settled checkpoint whose weight files are broken."""
        located = self._local_dir(segments)
        if located is None or not located[1].is_dir():
            return None
        path, directory = located
        found = self._checkpoint(directory, include)
        try:
            pending = not_ready(directory, self.settle_seconds, found)
        except CheckpointBroken as e:
            raise _HTTPError(422, f"checkpoint {path} is broken: {e}; the trainer's save did not complete")
        except NotACheckpoint:
            raise _HTTPError(404, f"no checkpoint {path}: the folder holds no drafter weights "
                                  f"({WEIGHTS}, {INDEX} or {TRAINING_STATE})")
        except FileNotFoundError:
            return None
        if pending is not None:
            raise _HTTPError(409, f"checkpoint {path} is still being written: {pending}",
                             headers={"Retry-After": str(max(1, math.ceil(self.settle_seconds / 3)))})
        return path, found

    def _scan(self) -> list[dict]:
        found = []
        if self.root is None:
            return found
        root = str(self.root)
        for dirpath, dirnames, _ in os.walk(root):  # symlinked directories are not followed
            dirnames[:] = sorted(d for d in dirnames if not d.startswith("."))
            rel = Path(dirpath).relative_to(root).as_posix()
            if rel == ".":
                continue
            checkpoint = self._checkpoint(Path(dirpath))
            try:
                if checkpoint is None or not_ready(dirpath, self.settle_seconds, checkpoint) is not None:
                    continue
            except (CheckpointBroken, FileNotFoundError):
                continue  # a manifest request says why
            found.append({
                "path": rel,
                "step": training_step(dirpath),
                "layout": checkpoint.layout,
                "total_bytes": sum(p.stat().st_size for p in checkpoint.files.values()),
                "n_files": len(checkpoint.files),
            })
        return found

    def _local_manifest(self, path: str, checkpoint: CheckpointFiles) -> dict:
        files = {name: file.stat() for name, file in checkpoint.files.items()}
        fingerprint = (checkpoint.config_source, tuple(sorted((n, st.st_size, st.st_mtime_ns) for n, st in files.items())))
        cached = self._manifests.get(path)
        if cached and cached[0] == fingerprint:
            return cached[1]
        with self._lock_for("manifest:" + path):  # one hashing per checkpoint at a time
            cached = self._manifests.get(path)
            if cached and cached[0] == fingerprint:
                return cached[1]
            entries = [
                {"name": name, "size": files[name].st_size, "sha256": self.digests.sha256(checkpoint.files[name])}
                for name in sorted(files)
            ]
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

    # ------------------------------------------------------------ API

    def list_checkpoints(self) -> list[dict]:
        checkpoints = {c["path"]: c for c in self._scan()}
        if self.upstream is not None:
            try:
                for c in self.upstream.list_checkpoints():
                    if isinstance(c, dict) and isinstance(c.get("path"), str):
                        checkpoints.setdefault(c["path"], c)
            except RelayError as e:
                raise _HTTPError(502, f"upstream relay: {e}")
        return [checkpoints[p] for p in sorted(checkpoints)]

    def manifest(self, segments: list[str], include: tuple[str, ...] = ()) -> dict:
        """The manifest of the evaluation files of a checkpoint (plus files matching `include`)."""
        local = self._local_checkpoint(segments, include)
        if local is not None:
            return self._local_manifest(*local)
        path = "/".join(segments)
        if self.upstream is not None:
            return self._upstream_manifest(path, include)
        raise _HTTPError(404, f"no checkpoint {path}")

    def _manifest_copy(self, path: str) -> Path:
        return self.state_dir / "cache" / path / ".relay-manifest.json"

    def _upstream_manifest(self, path: str, include: tuple[str, ...] = ()) -> dict:
        try:
            manifest = self.upstream.manifest(path, include)
        except RelayError as e:
            if e.status in (404, 409, 422):  # the upstream's own answer: passed on as it is
                raise _HTTPError(e.status, str(e.detail or e), headers=e.headers)
            try:  # the upstream is away: what was fetched before is still good (content is verified)
                return validate_manifest(read_json(self._manifest_copy(path)), str(self._manifest_copy(path)))
            except (OSError, ValueError, RelayError):
                raise _HTTPError(502, f"upstream relay: {e}")
        manifest = dict(manifest)  # its path is the upstream's own (a link's target's)
        try:
            if read_json(self._manifest_copy(path)) == manifest:
                return manifest
        except (OSError, ValueError):
            pass
        write_json_atomic(self._manifest_copy(path), manifest)
        return manifest

    def open_file(self, segments: list[str]) -> tuple[Path, int]:
        """(file to send, its size) for /v1/files/<path>/<name>; pulls it through from upstream if needed."""
        if len(segments) < 2:
            raise _HTTPError(404, "expected /v1/files/<checkpoint path>/<file name>")
        *path_segments, name = segments
        path = "/".join(path_segments)
        local = self._local_checkpoint(path_segments, include=("*",))  # any file of it, hashed or not
        if local is not None:
            _, checkpoint = local
            if name not in checkpoint.files:
                raise _HTTPError(404, f"no file {name} in checkpoint {path}")
            file = Path(os.path.realpath(checkpoint.files[name]))
            return file, file.stat().st_size
        if self.upstream is None:
            raise _HTTPError(404, f"no checkpoint {path}")
        manifest = self._upstream_manifest(path)
        entry = next((e for e in manifest["files"] if e["name"] == name), None)
        if entry is None:  # a file only a client's include pattern asked for: hash that one alone
            manifest = self._upstream_manifest(path, (re.sub(r"([*?\[])", r"[\1]", name),))
            entry = next((e for e in manifest["files"] if e["name"] == name), None)
        if entry is None:
            raise _HTTPError(404, f"no file {name} in checkpoint {path}")
        cache_dir = self.state_dir / "cache" / path
        cached = cache_dir / name
        key = f"{path}/{name}"
        with self._lock_for("file:" + key):
            if self._cached_ok(cached, entry):
                return cached, entry["size"]
            pull = self._pulls.get(key)
            if pull is None or (pull.done.is_set() and (pull.error or not cached.exists())):
                pull = self._pulls[key] = _Pull(self, path, entry, cache_dir)
        if not pull.wait_started():
            raise _HTTPError(502, f"upstream relay: {pull.error}")
        return pull, entry["size"]

    def _cached_ok(self, cached: Path, entry: dict) -> bool:
        try:
            st = cached.stat()
        except FileNotFoundError:
            return False
        if st.st_size != entry["size"]:
            return False
        if self._verified.get(str(cached)) == (st.st_size, st.st_mtime_ns, entry["sha256"]):
            return True
        return self.digests.sha256(cached) == entry["sha256"]

    def check_token(self, header: str | None) -> bool:
        if self.token is None:
            return True
        if not header or not header.startswith("Bearer "):
            return False
        return hmac.compare_digest(header[len("Bearer ") :].strip().encode(), self.token.encode())

    def take_fault(self) -> str | None:
        try:
            return self.faults.get_nowait()
        except queue.Empty:
            return None

    # ------------------------------------------------------------ HTTP

    def _handler_class(self):
        relay = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            server_version = "dflash-relay/1"

            def log_message(self, format: str, *args) -> None:  # noqa: A002 - stdlib signature
                # The request line and status only: headers (the token) are never logged.
                log.info("%s %s", self.address_string(), format % args)

            def _json(self, status: int, obj: Any, headers: dict[str, str] | None = None) -> None:
                body = json.dumps(obj, sort_keys=True).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                for name, value in (headers or {}).items():
                    self.send_header(name, value)
                if status == 401:
                    self.send_header("WWW-Authenticate", 'Bearer realm="dflash-relay"')
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def do_HEAD(self) -> None:
                self.do_GET()

            def do_GET(self) -> None:
                try:
                    if not relay.check_token(self.headers.get("Authorization")):
                        raise _HTTPError(401, "missing or wrong bearer token")
                    raw, _, query = self.path.split("#", 1)[0].partition("?")
                    if raw in ("/v1/checkpoints", "/v1/checkpoints/"):
                        return self._json(200, {"checkpoints": relay.list_checkpoints()})
                    for kind in ("manifest", "files"):
                        prefix = f"/v1/{kind}/"
                        if raw.startswith(prefix):
                            segments = _decode_segments(raw[len(prefix) :])
                            if kind == "manifest":
                                include = tuple(parse_qs(query).get("include", ()))
                                return self._json(200, relay.manifest(segments, include))
                            return self._send_file(*relay.open_file(segments))
                    raise _HTTPError(404, "unknown endpoint; the API is /v1/checkpoints, /v1/manifest/<path>, /v1/files/<path>/<name>")
                except _HTTPError as e:
                    self._json(e.status, {"error": e.message}, e.headers)
                except UnicodeDecodeError:
                    self._json(400, {"error": "invalid percent-encoding in the path"})
                except (BrokenPipeError, ConnectionResetError):
                    self.close_connection = True
                except Exception as e:  # noqa: BLE001 - answer 500 instead of dropping the connection
                    log.exception("relay request failed")
                    self._json(500, {"error": f"{type(e).__name__}: {e}"})

            def _range(self, size: int) -> tuple[int, int] | None:
                """(start, end inclusive) of a satisfiable single Range, None for the whole file."""
                value = self.headers.get("Range")
                if not value:
                    return None
                match = re.fullmatch(r"\s*bytes=(\d*)-(\d*)\s*", value)
                if not match or (not match.group(1) and not match.group(2)):
                    return None  # multiple or malformed ranges: ignored, the whole file (RFC 9110)
                first, last = match.group(1), match.group(2)
                if first:
                    start = int(first)
                    end = min(int(last), size - 1) if last else size - 1
                    if start >= size or (last and int(last) < start):
                        raise _RangeNotSatisfiable()
                else:  # suffix: the last n bytes
                    n = int(last)
                    if n == 0 or size == 0:
                        raise _RangeNotSatisfiable()
                    start, end = max(0, size - n), size - 1
                return start, end

            def _send_file(self, source: "Path | _Pull", size: int) -> None:
                try:
                    byte_range = self._range(size)
                except _RangeNotSatisfiable:
                    self.send_response(416)
                    self.send_header("Content-Range", f"bytes */{size}")
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                start, end = byte_range if byte_range else (0, size - 1)
                length = end - start + 1
                self.send_response(206 if byte_range else 200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(length))
                self.send_header("Accept-Ranges", "bytes")
                if byte_range:
                    self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
                self.end_headers()
                if self.command == "HEAD":
                    return
                fault = relay.take_fault()
                limit = length
                if fault == "cut":
                    limit = length // 2
                elif fault == "truncate":
                    limit = max(0, length - 1 - length // 10)
                corrupt_at = length // 2 if fault == "corrupt" else -1
                sent = 0
                if fault is None and isinstance(source, Path):
                    # A finished local file: the kernel copies it to the socket (sendfile), which
                    # leaves the CPU to the clients' sha256 when both share a machine.
                    self.wfile.flush()
                    with open(source, "rb") as f:
                        while sent < length:
                            n = min(CHUNK_BYTES, length - sent)
                            relay._pace(n)
                            n = self.connection.sendfile(f, offset=start + sent, count=n)
                            if not n:
                                break  # the file shrank: a short body, the client retries
                            sent += n
                            relay._count_sent(n)
                    if sent < length:
                        self.close_connection = True
                    return
                f, more = (open(source, "rb"), lambda: False) if isinstance(source, Path) else source.open()
                with f:
                    f.seek(start)
                    while sent < limit:
                        data = f.read(min(CHUNK_BYTES, limit - sent))
                        if not data:
                            if more():  # a file still arriving from the upstream
                                continue
                            break  # the file shrank, or the pull failed: a short body, the client retries
                        if sent <= corrupt_at < sent + len(data):
                            data = bytearray(data)
                            data[corrupt_at - sent] ^= 0xFF
                        relay._pace(len(data))
                        self.wfile.write(data)
                        sent += len(data)
                        relay._count_sent(len(data))
                if sent < length:
                    self.close_connection = True  # Content-Length promised more: end the connection

        return Handler


class _RangeNotSatisfiable(Exception):
    pass


class _Pull:
    """One file being downloaded from the upstream into the cache, served while it arrives.

    Clients get the bytes as they land in `cache/<path>/.partial/<name>` instead of waiting for
    the whole (17 GB) file: they verify the sha256 themselves. The cached file is only used as a
    finished file once verified (RelayClient.download_file renames it into place then).
    """

    def __init__(self, relay: RelayServer, path: str, entry: dict, cache_dir: Path):
        self.relay, self.path, self.entry, self.cache_dir = relay, path, entry, cache_dir
        self.final = cache_dir / entry["name"]
        self.partial = cache_dir / ".partial" / entry["name"]
        self.done = threading.Event()
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, name=f"relay-pull {path}/{entry['name']}", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        log.info("pulling %s/%s (%d bytes) from upstream %s", self.path, self.entry["name"], self.entry["size"], self.relay.upstream.base_url)
        try:
            self.relay.upstream.download_file(self.path, self.entry, self.cache_dir)
            st = self.final.stat()
            self.relay._verified[str(self.final)] = (st.st_size, st.st_mtime_ns, self.entry["sha256"])
        except Exception as e:  # noqa: BLE001 - reported to the clients waiting on it
            self.error = str(e) or type(e).__name__
            log.warning("pulling %s/%s from upstream failed: %s", self.path, self.entry["name"], self.error)
        finally:
            self.done.set()

    def wait_started(self, timeout: float = 600) -> bool:
        """Wait until bytes can be served (the partial file exists or the pull ended); False if it failed."""
        deadline = time.monotonic() + timeout
        while not self.done.wait(0.02):
            if self.partial.exists() or time.monotonic() > deadline:
                return True
        return self.error is None

    def open(self):
        """(file object, more): read the file as it grows; `more()` waits and says whether to read again."""
        while True:
            for candidate in (self.final, self.partial) if self.done.is_set() else (self.partial, self.final):
                try:
                    f = open(candidate, "rb")
                    break
                except FileNotFoundError:
                    continue
            else:
                if self.done.wait(0.02) and not self.final.exists() and not self.partial.exists():
                    return io.BytesIO(b""), lambda: False  # failed before any byte: a short body
                continue
            break
        last_read = [False]

        def more() -> bool:
            if self.done.is_set():
                # One more read after the end: bytes written just before it are not missed.
                if last_read[0]:
                    return False
                last_read[0] = True
                return True
            self.done.wait(0.05)
            return True

        return f, more
