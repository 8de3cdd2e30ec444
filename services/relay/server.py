"""The checkpoint relay's server: serves drafter checkpoints over HTTP (protocol v1, JSON), stdlib only.

A training box runs a relay over its checkpoint folder; the eval box downloads from it (or from a
relay in between, started with `upstream=`, which pulls each file through once and caches it).
The protocol (endpoints, answers, what a checkpoint is and when it is listed) and what the relay
guarantees against hostile clients and a changing folder: docs/relay.md, "Protocol" and "Security".

Here: `RelayServer` (which checkpoint, manifest or file a request gets, from the folder or the
upstream) and its request handler. Beside it: `local_checkpoints` (the checkpoints of the folder),
`served_files` (opening files only inside the served folder, ranges), `dflash_eval.services.http_server` (the
bounded threading HTTP server), `pull_through` (files pulled from an upstream relay into the cache).

The relay imports no Prefect, and of dflash_core only `dflash_core.checkpoint_files` (files alone, no torch).
"""

import hmac
import json
import logging
import os
import queue
import re
import threading
import time
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import parse_qs

from dflash_eval.services.http_server import BackgroundServer, DeadlineRequestHandler, ErrorResponse
from dflash_eval.storage.hashing import DigestCache
from dflash_eval.storage.records import read_json, write_json_atomic

from .client import RelayClient, RelayError, validate_manifest
from .local_checkpoints import LocalCheckpoints
from .pull_through import UpstreamPull
from .served_files import (
    InvalidPath,
    NotServable,
    RangeNotSatisfiable,
    decode_segments,
    fd_path,
    file_identity,
    open_inside,
    parse_range,
)

log = logging.getLogger("dflash_eval.services.relay.server")

CHUNK_BYTES = 1 << 20
DEFAULT_STATE_DIR = Path("~/.cache/dflash-eval/relay")


class RelayServer(BackgroundServer):
    """A relay over `root_dir` (local checkpoints) and/or `upstream` (another relay, pulled through).

    Binds, starts, serves and stops as every server (BackgroundServer): `url` is its base URL once
    constructed. `faults` and `bytes_sent` are test hooks: put "cut", "corrupt" or "truncate" in
    `faults` and the next file response misbehaves that way once; `bytes_sent` counts file body
    bytes sent. `max_rate` caps the bytes/s sent over all downloads together (so a relay next to a
    trainer leaves it bandwidth).

    Bounds (docs/relay.md, Security): `max_connections` served at once (default 128) and
    `max_connections_per_client` from one address (32; a client downloads with a few parallel
    connections), beyond which a connection gets 503 + Retry-After; `request_timeout` seconds
    (30) for a request's line and headers to arrive, counted from when the connection is ready
    for one (so also how long an idle keep-alive connection stays); `send_timeout` seconds (60)
    without progress on a send before a connection is dropped.
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
        max_connections: int = 128,
        max_connections_per_client: int = 32,
        request_timeout: float = 30,
        send_timeout: float = 60,
    ):
        if root_dir is None and upstream is None:
            raise ValueError("a relay needs a root_dir to serve, an upstream relay to pull from, or both")
        if not (max_connections >= 1 and max_connections_per_client >= 1):
            raise ValueError(f"max_connections ({max_connections}) and max_connections_per_client "
                             f"({max_connections_per_client}) must be at least 1")
        if not (request_timeout > 0 and send_timeout > 0):
            raise ValueError(f"request_timeout ({request_timeout}) and send_timeout ({send_timeout}) must be > 0")
        self.root = Path(root_dir).resolve() if root_dir is not None else None
        if self.root is not None and not self.root.is_dir():
            raise FileNotFoundError(f"not a directory: {self.root}")
        self.token = token or None
        self.settle_seconds = settle_seconds
        self.request_timeout = request_timeout
        self.send_timeout = send_timeout
        self.state_dir = Path(state_dir).expanduser()
        (self.state_dir / "cache").mkdir(parents=True, exist_ok=True)
        self._cache_roots = (os.path.realpath(self.state_dir / "cache"),)
        try:  # every file sent is checked through its descriptor: refuse to start where that is impossible
            probe = os.open(self._cache_roots[0], os.O_RDONLY)
            try:
                fd_path(probe)
            finally:
                os.close(probe)
        except OSError as e:
            raise RuntimeError(f"the relay cannot check where an opened file lives here ({e}); "
                               "it needs Linux /proc or macOS") from e
        self.digests = DigestCache(self.state_dir / "digests.json")
        self.local = LocalCheckpoints(self.root, settle_seconds, self.digests) if self.root is not None else None
        self.upstream = RelayClient(upstream, token=upstream_token) if upstream else None
        self.faults: queue.Queue[str] = queue.Queue()
        self.bytes_sent = 0
        self.max_rate = max_rate  # bytes/s over all downloads together; None: as fast as the link goes
        self._next_send = time.monotonic()
        self._lock = threading.Lock()
        self._file_locks: dict[str, threading.Lock] = {}  # "<path>/<name>" -> held while opening or pulling it
        self._verified: dict[str, tuple[int, int, str]] = {}  # cache file -> (size, mtime_ns, sha256)
        self._pulls: dict[str, UpstreamPull] = {}  # "<path>/<name>" -> its download from the upstream
        super().__init__(host, port, self._handler_class(), max_connections, max_connections_per_client,
                         name="relay", logger=log)

    def stop(self) -> None:
        """As every server (BackgroundServer.stop), then close the session to the upstream relay."""
        super().stop()
        if self.upstream is not None:
            self.upstream.close()

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
            return self._file_locks.setdefault(key, threading.Lock())

    # ------------------------------------------------------------ API

    def list_checkpoints(self) -> list[dict]:
        checkpoints = {c["path"]: c for c in (self.local.scan() if self.local is not None else [])}
        if self.upstream is not None:
            try:
                for c in self.upstream.list_checkpoints():
                    if isinstance(c, dict) and isinstance(c.get("path"), str):
                        checkpoints.setdefault(c["path"], c)
            except RelayError as e:
                raise ErrorResponse(502, f"upstream relay: {e}") from e
        return [checkpoints[p] for p in sorted(checkpoints)]

    def manifest(self, segments: list[str], include: tuple[str, ...] = ()) -> dict:
        """The manifest of the evaluation files of a checkpoint (plus files matching `include`)."""
        if self.local is not None and (local := self.local.find(segments, include)) is not None:
            return self.local.manifest(*local)
        path = "/".join(segments)
        if self.upstream is not None:
            return self._upstream_manifest(path, include)
        raise ErrorResponse(404, f"no checkpoint {path}")

    def _manifest_copy(self, path: str) -> Path:
        return self.state_dir / "cache" / path / ".relay-manifest.json"

    def _upstream_manifest(self, path: str, include: tuple[str, ...] = ()) -> dict:
        if self.upstream is None:
            raise ErrorResponse(404, f"no checkpoint {path}")
        try:
            manifest = self.upstream.manifest(path, include)
        except RelayError as e:
            if e.status in (404, 409, 422):  # the upstream's own answer: passed on as it is
                raise ErrorResponse(e.status, str(e.detail or e), headers=e.headers) from e
            try:  # the upstream is away: what was fetched before is still good (content is verified)
                return validate_manifest(read_json(self._manifest_copy(path)), str(self._manifest_copy(path)))
            except (OSError, ValueError, RelayError):
                raise ErrorResponse(502, f"upstream relay: {e}") from e
        manifest = dict(manifest)  # its path is the upstream's own (a link's target's)
        try:
            if read_json(self._manifest_copy(path)) == manifest:
                return manifest
        except (OSError, ValueError):
            pass
        write_json_atomic(self._manifest_copy(path), manifest)
        return manifest

    def open_file(self, segments: list[str]) -> "tuple[BinaryIO | UpstreamPull, int]":
        """(what to send, its size) for /v1/files/<path>/<name>: an open file checked to be a regular
        file inside DIR (or the cache) with the size of that same open file, or a pull from upstream
        still arriving (its size is the manifest's). The caller closes an open file."""
        if len(segments) < 2:
            raise ErrorResponse(404, "expected /v1/files/<checkpoint path>/<file name>")
        *path_segments, name = segments
        path = "/".join(path_segments)
        # include="*": any file of the checkpoint may be asked for, hashed or not
        if self.local is not None and (local := self.local.find(path_segments, include=("*",))) is not None:
            _, checkpoint = local
            if name not in checkpoint.files:
                raise ErrorResponse(404, f"no file {name} in checkpoint {path}")
            try:
                f, st = self.local.open(checkpoint.files[name])
            except NotServable:
                raise ErrorResponse(404, f"no file {name} in checkpoint {path}") from None
            return f, st.st_size
        if self.upstream is None:
            raise ErrorResponse(404, f"no checkpoint {path}")
        manifest = self._upstream_manifest(path)
        entry = next((e for e in manifest["files"] if e["name"] == name), None)
        if entry is None:  # a file only a client's include pattern asked for: hash that one alone
            manifest = self._upstream_manifest(path, (re.sub(r"([*?\[])", r"[\1]", name),))
            entry = next((e for e in manifest["files"] if e["name"] == name), None)
        if entry is None:
            raise ErrorResponse(404, f"no file {name} in checkpoint {path}")
        cache_dir = self.state_dir / "cache" / path
        cached = cache_dir / name
        key = f"{path}/{name}"
        with self._lock_for(key):  # one pull per file at a time
            opened = self._open_cached(cached, entry)
            if opened is not None:
                return opened, entry["size"]
            pull = self._pulls.get(key)
            if pull is None or (pull.done.is_set() and (pull.error or not cached.exists())):
                pull = self._pulls[key] = UpstreamPull(self.upstream, path, entry, cache_dir, self._open_cache_file,
                                                        self._verified)
        if not pull.wait_started():
            raise ErrorResponse(502, f"upstream relay: {pull.error}")
        return pull, entry["size"]

    def _open_cache_file(self, path: Path) -> tuple[BinaryIO, os.stat_result]:
        return open_inside(path, self._cache_roots)

    def _open_cached(self, cached: Path, entry: dict) -> BinaryIO | None:
        """The pulled-through copy of `entry`, opened and checked, if it is whole and verified."""
        try:
            f, st = self._open_cache_file(cached)
        except NotServable:
            return None
        try:
            if st.st_size == entry["size"]:
                verified = (st.st_size, st.st_mtime_ns, entry["sha256"])
                if self._verified.get(str(cached)) == verified:
                    return f
                if self.digests.sha256(cached) == entry["sha256"] and file_identity(os.stat(cached)) == file_identity(st):
                    self._verified[str(cached)] = verified
                    return f
        except OSError:
            pass
        f.close()
        return None

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

        class Handler(DeadlineRequestHandler):
            server_version = "dflash-relay/1"
            request_timeout = relay.request_timeout
            send_timeout = relay.send_timeout
            _responded = False  # whether this request's status line and headers went out

            def handle_one_request(self) -> None:
                self._responded = False
                super().handle_one_request()

            def end_headers(self) -> None:
                self._responded = True
                super().end_headers()

            def log_message(self, format: str, *args) -> None:  # the stdlib's signature (its name `format`)
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

            def _refuse_method(self) -> None:
                self.close_connection = True  # its body is never read
                self._json(405, {"error": "read-only: GET and HEAD only"}, {"Allow": "GET, HEAD", "Connection": "close"})

            do_POST = do_PUT = do_DELETE = do_PATCH = _refuse_method

            def do_GET(self) -> None:
                try:
                    if not relay.check_token(self.headers.get("Authorization")):
                        raise ErrorResponse(401, "missing or wrong bearer token")
                    raw, _, query = self.path.split("#", 1)[0].partition("?")
                    if raw in ("/v1/checkpoints", "/v1/checkpoints/"):
                        return self._json(200, {"checkpoints": relay.list_checkpoints()})
                    for kind in ("manifest", "files"):
                        prefix = f"/v1/{kind}/"
                        if raw.startswith(prefix):
                            segments = decode_segments(raw[len(prefix) :])
                            if kind == "manifest":
                                include = tuple(parse_qs(query).get("include", ()))
                                return self._json(200, relay.manifest(segments, include))
                            source, size = relay.open_file(segments)
                            try:
                                return self._send_file(source, size)
                            finally:
                                if not isinstance(source, UpstreamPull):
                                    source.close()
                    raise ErrorResponse(404, "unknown endpoint; the API is /v1/checkpoints, /v1/manifest/<path>, /v1/files/<path>/<name>")
                except ErrorResponse as e:
                    self._json(e.status, {"error": e.message}, e.headers)
                except InvalidPath as e:
                    self._json(400, {"error": str(e)})
                except UnicodeDecodeError:
                    self._json(400, {"error": "invalid percent-encoding in the path"})
                except (ConnectionError, TimeoutError):  # the client went away or stopped reading
                    self.close_connection = True
                except Exception:  # answer 500 instead of dropping the connection
                    log.exception("relay request %r failed", self.requestline)
                    if self._responded:  # mid-body: the status is sent, only ending the connection tells
                        self.close_connection = True
                    else:  # the details are in the log; an answer never carries exception text
                        self._json(500, {"error": "internal error in the relay (its log says more)"})

            def _send_file(self, source: "BinaryIO | UpstreamPull", size: int) -> None:
                try:
                    byte_range = parse_range(self.headers.get("Range"), size)
                except RangeNotSatisfiable:
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
                if fault is None and not isinstance(source, UpstreamPull):
                    # A finished local file: the kernel copies it to the socket (sendfile), which
                    # leaves the CPU to the clients' sha256 when both share a machine. Exactly
                    # `length` bytes of this open file, whatever happens to its path meanwhile.
                    self.wfile.flush()
                    while sent < length:
                        n = min(CHUNK_BYTES, length - sent)
                        relay._pace(n)
                        n = self.connection.sendfile(source, offset=start + sent, count=n)
                        if not n:
                            break  # the file shrank: a short body, the client retries
                        sent += n
                        relay._count_sent(n)
                    if sent < length:
                        self.close_connection = True
                    return
                f, more = (source, lambda: False) if not isinstance(source, UpstreamPull) else source.open()
                try:
                    f.seek(start)
                    while sent < limit:
                        data = f.read(min(CHUNK_BYTES, limit - sent))
                        if not data:
                            if more():  # a file still arriving from the upstream
                                continue
                            break  # the file shrank, or the pull failed: a short body, the client retries
                        if sent <= corrupt_at < sent + len(data):
                            flipped = bytearray(data)
                            flipped[corrupt_at - sent] ^= 0xFF
                            data = bytes(flipped)
                        relay._pace(len(data))
                        self.wfile.write(data)
                        sent += len(data)
                        relay._count_sent(len(data))
                finally:
                    if isinstance(source, UpstreamPull):
                        f.close()
                if sent < length:
                    self.close_connection = True  # Content-Length promised more: end the connection

        return Handler
