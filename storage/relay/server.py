"""Checkpoint relay: serves drafter checkpoints over HTTP (protocol v1, JSON), stdlib only.

A training box runs a relay over its checkpoint folder; the eval box downloads from it (or from a
relay in between, started with `upstream=`, which pulls each file through once and caches it).

What is a checkpoint
    A directory at any depth under the served DIR that holds drafter weights in a layout that
    `dflash_core.checkpoint_files` knows: a `save_pretrained` folder (model.safetensors or an index and its
    shards, SpecForge's older `epoch_E_step_S/` too) or SpecForge's `{run_id}-stepN/` with its
    `training_state.pt`. Its relay path is its directory relative to DIR in POSIX form
    (`run1/step_1000`); its step comes from `dflash_core.checkpoint_files.training_step`. Directories whose
    name starts with '.' are not searched. A symlinked directory inside DIR (SpecForge's
    `{run_id}-latest`, `-best`) is not listed, and a manifest asked through it is the manifest of
    the directory it points to, under that directory's path: the same checkpoint, never a second.

What is sent (only what evaluation needs)
    The manifest lists, hashes and totals only the files the drafter needs
    (`dflash_core.checkpoint_files.checkpoint_files`: config, weights, trainer_state.json), plus those
    matching `?include=PATTERN` (repeatable). Optimizer, scheduler, RNG and per-rank state are
    never hashed; a client downloads the files of its manifest. A checkpoint without config.json
    whose parent folder (its run) holds one gets that one, named config.json, with
    `"config_source": "run folder"`.

When a checkpoint is listed (settle rule)
    Trainers such as SpecForge write no "done" marker, so a checkpoint still being written must be
    recognised otherwise: it is listed (and served) only when every regular file directly in it,
    hidden ones included (temp files), was last modified at least `settle_seconds` ago, no
    temporary file of a weight file is there, every shard an index names exists and every weight
    file is whole (`dflash_core.checkpoint_files.not_ready`). Asked for meanwhile, its manifest and files
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
                                  `bytes=a-b`, `bytes=-n` -> 206 + Content-Range; unsatisfiable,
                                  malformed, or a number of more than 19 digits -> 416; another
                                  unit or several ranges -> ignored (200, the whole file);
                                  Content-Length always
    Errors are JSON {"error": "..."}: 400 malformed path, 401 missing/wrong token, 404 unknown,
    409 still being written or changed while read (Retry-After), 422 broken weights, 500 a bug
    (the text says only that; the details are in the relay's log, never in the answer), 502
    upstream failure, 503 too many connections (Retry-After).

Security (what is guaranteed)
    - Token: with one, every request needs `Authorization: Bearer <token>` (constant-time
      compare); the token is never logged. Plain HTTP: run it on a trusted network or behind TLS.
    - Names: only checkpoints found by the scan and file names in their manifest are served. Path
      segments are percent-decoded one by one and a segment that is empty, '.', '..', or holds
      '/', '\\' or NUL is refused (400), so `..`, `%2F` and `%2e%2e` never reach the filesystem.
    - Bytes: a file body is the bytes of one opened file that, once open, was checked to be a
      regular file whose location (asked of the kernel through the open descriptor: /proc/self/fd/N
      on Linux, F_GETPATH on macOS) lies inside DIR, or inside the relay's own `state_dir/cache` for
      pulled-through files. Its Content-Length comes from fstat of that same descriptor and exactly
      that many bytes of it are sent (a file truncated meanwhile ends the connection short of it:
      never other bytes). The last path component is opened with O_NOFOLLOW after the path was
      resolved, so no symlink is followed at open time; a link swapped, a directory renamed or
      replaced by a link between any check and the open gives the file inside DIR or 404, never a
      byte from outside. This covers the run folder's config.json that a checkpoint borrows too.
      Links that resolve inside DIR keep working (a file linked to another file of DIR; a symlinked
      folder such as `run-latest` is served as the folder it points to); links out of DIR never.
      FIFOs and devices are never read (opened non-blocking, then refused as not regular files).
      Hard links are files of DIR like any other (the kernel's fs.protected_hardlinks keeps users
      from linking files they cannot write). The relay refuses to start where it cannot ask the
      kernel where an open file is.
    - Manifest and listing: sizes come from the same open-and-check; a file's sha256 is only
      reported when the file hashed (by its resolved path inside DIR) is, before and after hashing,
      the same inode of the same size and mtime as the checked open file (else 409: ask again); only
      a directory replaced by a link and put back while it is hashed could slip a digest past that.
      Left: `dflash_core.checkpoint_files` itself reads weight headers, step numbers and index files by path
      while it decides whether a folder is a finished checkpoint; the relay hands it resolved paths
      inside DIR, so only a directory swapped for a link during that read could make a 409/422
      message or a step number describe a file outside DIR.
    - Resources: every connection has socket timeouts; a request whose line and headers are not all
      received within `request_timeout` seconds of the connection being ready for it (just opened,
      or idle after an answer: keep-alive) is dropped, however slowly its bytes trickle; a send that
      makes no progress for `send_timeout` seconds ends the connection. At most `max_connections`
      connections are served at once, `max_connections_per_client` from one client address (one IPv6
      /64 counts as one); over either bound a connection is answered 503 with Retry-After at once by
      the accepting thread (no thread of its own; closed once its request is read, within 2 s), so
      the number of threads stays bounded (one per served connection, plus one per file being pulled
      from upstream).

Why http.server and not Starlette/uvicorn
    Prefect installs Starlette (1.10 here) and uvicorn (0.54), and Starlette's FileResponse does
    ranges. The relay stays on the stdlib because (1) it runs on training boxes with a minimal
    install (this module, `dflash_core.checkpoint_files`, `dflash_eval.storage.hashing`, requests for the client):
    Starlette and uvicorn would become hard dependencies of the relay that dflash-eval only has
    through Prefect today; (2) FileResponse would not fix the race: it stats a path and opens it
    again by name when sending, so the open-then-check-the-descriptor logic and the Content-Length
    from the same fstat would have to be written here anyway; (3) uvicorn has a keep-alive timeout
    (armed only after an answer, cancelled by any byte received) and a global `limit_concurrency`,
    but no bound on how long a request may take to arrive nor per client, so the bounds above would
    also stay ours. What the stdlib lacks (a whole-request deadline, connection bounds) is about a
    hundred lines below.

Digests are computed once per file (DigestCache in `state_dir/digests.json`, keyed by path, size
and mtime). A pull-through relay caches files in `state_dir/cache/<path>/<name>`.

Imports no Prefect, and of dflash_core only `dflash_core.checkpoint_files` (files alone, no torch).
"""

import errno
import hmac
import io
import ipaddress
import json
import logging
import math
import os
import queue
import re
import socket
import stat
import sys
import threading
import time
from collections import deque
from dataclasses import replace
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, BinaryIO
from urllib.parse import parse_qs, unquote

from dflash_core.checkpoint_files import (
    CONFIG,
    WEIGHT_FILE_NAMES,
    CheckpointBroken,
    CheckpointFiles,
    NotACheckpoint,
    checkpoint_files,
    not_ready,
    training_step,
)

from ..hashing import DigestCache, key_of
from ..records import read_json, write_json_atomic
from .client import RelayClient, RelayError, validate_manifest

log = logging.getLogger("dflash_eval.storage.relay.server")

CHUNK_BYTES = 1 << 20
DEFAULT_STATE_DIR = Path("~/.cache/dflash-eval/relay")
MAX_RANGE_DIGITS = 19  # 10**19 bytes is more than any file; longer numbers are refused before int()

# Opening never follows a link in the last component (the path was resolved just before), never
# waits on a FIFO and never makes a terminal ours; the descriptor is then checked (_open_inside).
_OPEN_FLAGS = (os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
               | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0))


class _HTTPError(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


class _NotServable(Exception):
    """A file that may not be sent: not there, not a regular file, or not inside the served folder."""


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


def fd_path(fd: int) -> str:
    """Where the open file `fd` is now, as the kernel tracks it (not a path resolved by us).

    Linux: /proc/self/fd/N (a file deleted since it was opened reads '<path> (deleted)');
    macOS: fcntl F_GETPATH. Raises OSError where neither exists."""
    if sys.platform.startswith("linux"):
        return os.readlink(f"/proc/self/fd/{fd}")
    import fcntl

    if hasattr(fcntl, "F_GETPATH"):
        return os.fsdecode(fcntl.fcntl(fd, fcntl.F_GETPATH, bytes(1024)).split(b"\0", 1)[0])
    raise OSError(errno.ENOSYS, f"cannot tell where an open file lives on {sys.platform}")


def _open_inside(path: str | os.PathLike, roots: tuple[str, ...]) -> tuple[BinaryIO, os.stat_result]:
    """(open file, its fstat) for `path` if, once opened, it is a regular file inside one of `roots`;
    raises _NotServable otherwise. What is checked is the opened file itself, so whatever a link or
    directory is swapped for meanwhile, the bytes read later are those of a file that was inside."""
    real = os.path.realpath(path)
    if not any(_inside(real, root) for root in roots):  # don't even open what resolves outside
        raise _NotServable(f"{path} resolves outside the served folder")
    try:
        fd = os.open(real, _OPEN_FLAGS)
    except OSError as e:  # gone, unreadable, or its last component became a link (ELOOP)
        raise _NotServable(f"cannot open {path}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _NotServable(f"{path} is not a regular file")
        where = fd_path(fd)
        if where.endswith(" (deleted)") or not any(_inside(where, root) for root in roots):
            raise _NotServable(f"{path} is not inside the served folder")
        os.set_blocking(fd, True)
        return os.fdopen(fd, "rb", buffering=0), st
    except BaseException:
        os.close(fd)
        raise


def _identity(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _client_key(host: str) -> str:
    """What one client is for the per-client bound: its IPv4 address, or its IPv6 /64 (one host
    usually holds a whole /64, so counting addresses would not bound it)."""
    try:
        ip = ipaddress.ip_address(host.split("%", 1)[0])
    except ValueError:
        return host
    if ip.version == 6:
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.ip_network(f"{ip}/64", strict=False))
    return str(ip)


class _RangeNotSatisfiable(Exception):
    pass


_RANGE_SPEC = re.compile(r"\s*(\d*)\s*-\s*(\d*)\s*")


def parse_range(value: str | None, size: int) -> tuple[int, int] | None:
    """(start, end inclusive) of a Range header for a file of `size` bytes; None for the whole file.

    Another unit than bytes, or several ranges, are ignored (RFC 9110 lets a server send the whole
    file). Raises _RangeNotSatisfiable (416) for a range outside the file, a `bytes=` value that
    does not parse, or a number of more than MAX_RANGE_DIGITS digits (never int() on it: Python
    refuses to convert 4,300+ digits, and no file is that large anyway)."""
    if value is None or not value.strip():
        return None
    unit, eq, specs = value.partition("=")
    if unit.strip().lower() != "bytes":
        return None
    parts = [_RANGE_SPEC.fullmatch(part) for part in specs.split(",")] if eq else [None]
    for match in parts:
        if (match is None or not (match.group(1) or match.group(2))
                or max(len(match.group(1)), len(match.group(2))) > MAX_RANGE_DIGITS):
            raise _RangeNotSatisfiable()
    if len(parts) > 1:
        return None
    first, last = parts[0].group(1), parts[0].group(2)
    if first:
        start = int(first)
        if start >= size or (last and int(last) < start):
            raise _RangeNotSatisfiable()
        return start, min(int(last), size - 1) if last else size - 1
    n = int(last)  # suffix: the last n bytes
    if n == 0 or size == 0:
        raise _RangeNotSatisfiable()
    return max(0, size - n), size - 1


class _DeadlineReader(io.RawIOBase):
    """A connection's incoming bytes under a deadline for the whole request (line and headers), not
    only between two bytes: a client trickling a byte at a time cannot hold its connection."""

    def __init__(self, sock: socket.socket, timeout: float):
        self.sock = sock
        self.timeout = timeout  # between two bytes when no deadline is set
        self.deadline: float | None = None  # time.monotonic() by which the request must be in

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        if self.deadline is None:
            self.sock.settimeout(self.timeout)
        else:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("the request was not received in time")
            self.sock.settimeout(left)
        return self.sock.recv_into(buffer)


class _BoundedHTTPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with a bounded number of connections, in all and per client address.

    Over a bound the accepting thread answers 503 itself and closes: no thread is started."""

    daemon_threads = True
    block_on_close = False  # stop() ends the connections itself instead of waiting on idle ones
    request_queue_size = 128  # bursts of parallel downloads wait in the kernel, not refused
    LINGER_SECONDS = 2  # a refused socket's longest wait for its client's request before closing
    MAX_LINGERING = 1024  # refused sockets waiting at most (file descriptors stay bounded)

    def __init__(self, address, handler, max_connections: int, max_per_client: int):
        self.max_connections = max_connections
        self.max_per_client = max_per_client
        self._active: dict[socket.socket, str] = {}  # served connection -> client key
        self._per_client: dict[str, int] = {}
        self._active_changed = threading.Condition()
        self.refused = 0  # connections answered 503 since start
        self._refused_logged = (0.0, 0)  # (when, refused count) at the last warning
        self._lingering: deque[tuple[float, socket.socket]] = deque()  # (close by, refused socket)
        super().__init__(address, handler)

    def process_request(self, request, client_address) -> None:
        key = _client_key(str(client_address[0]))
        with self._active_changed:
            admit = (len(self._active) < self.max_connections
                     and self._per_client.get(key, 0) < self.max_per_client)
            if admit:
                self._active[request] = key
                self._per_client[key] = self._per_client.get(key, 0) + 1
            else:
                self.refused += 1
        if not admit:
            self._refuse(request, key)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:  # no thread (e.g. the process' limit): the slot is not held
            self._release(request)
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._release(request)

    def _release(self, request) -> None:
        with self._active_changed:
            key = self._active.pop(request, None)
            if key is not None:
                self._per_client[key] -= 1
                if not self._per_client[key]:
                    del self._per_client[key]
            self._active_changed.notify_all()

    def _refuse(self, request: socket.socket, key: str) -> None:
        """Answer 503 without a thread: send it, half-close, and leave the socket to service_actions
        to close once the client's request is read (closing with unread bytes would send a reset
        that can destroy the 503 before the client reads it)."""
        body = json.dumps({"error": "too many connections to this relay; retry later"}).encode()
        head = ("HTTP/1.1 503 Service Unavailable\r\nRetry-After: 1\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        try:
            request.setblocking(False)  # never wait on this client in the accepting thread
            request.send(head + body)
            request.shutdown(socket.SHUT_WR)
        except OSError:
            request.close()
        else:
            self._lingering.append((time.monotonic() + self.LINGER_SECONDS, request))
            while len(self._lingering) > self.MAX_LINGERING:  # a flood: the oldest are reset
                self._lingering.popleft()[1].close()
        now = time.monotonic()
        when, count = self._refused_logged
        if now - when >= 10:  # one line per 10 s under a flood, not one per connection
            log.warning("refused %d connection(s) over the bounds (%d in all, %d per client; last from %s)",
                        self.refused - count, self.max_connections, self.max_per_client, key)
            self._refused_logged = (now, self.refused)

    def service_actions(self) -> None:
        """Between accepts (serve_forever calls it every poll interval): read what refused clients
        sent and close their sockets once they closed theirs or LINGER_SECONDS passed."""
        now = time.monotonic()
        keep: deque[tuple[float, socket.socket]] = deque()
        for deadline, request in self._lingering:
            try:
                for _ in range(4):  # a few reads per pass: a client sending forever cannot hold this thread
                    if not request.recv(65536):
                        raise EOFError
            except BlockingIOError:
                pass
            except (OSError, EOFError):
                request.close()
                continue
            if now < deadline:
                keep.append((deadline, request))
            else:
                request.close()
        self._lingering = keep

    def server_close(self) -> None:
        super().server_close()
        while self._lingering:
            self._lingering.popleft()[1].close()

    def handle_error(self, request, client_address) -> None:
        if isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            return  # a client that went away or stalled: nothing to report
        log.exception("relay connection from %s failed", client_address[0])

    def close_connections(self, wait: float = 5) -> None:
        """End every served connection and wait up to `wait` seconds for their threads to finish."""
        with self._active_changed:
            for request in list(self._active):
                try:
                    request.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
            self._active_changed.wait_for(lambda: not self._active, timeout=wait)

    @property
    def active_connections(self) -> int:
        return len(self._active)


class RelayServer:
    """A relay over `root_dir` (local checkpoints) and/or `upstream` (another relay, pulled through).

    `url` is its base URL once constructed (the port is bound in the constructor). `faults` and
    `bytes_sent` are test hooks: put "cut", "corrupt" or "truncate" in `faults` and the next file
    response misbehaves that way once; `bytes_sent` counts file body bytes sent. `max_rate` caps
    the bytes/s sent over all downloads together (so a relay next to a trainer leaves it bandwidth).

    Bounds (module docstring, Security): `max_connections` served at once (default 128) and
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
        self._local_roots = (str(self.root),) if self.root is not None else ()
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
        self._httpd = _BoundedHTTPServer((host, port), self._handler_class(), max_connections, max_connections_per_client)
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
        """Serve in this thread until interrupted; then close every connection."""
        try:
            self._httpd.serve_forever()
        finally:
            self._httpd.server_close()
            self._httpd.close_connections()

    def stop(self) -> None:
        """Stop accepting, end the connections being served, release the port."""
        if self._thread is not None:
            self._httpd.shutdown()
            self._thread.join()
            self._thread = None
        self._httpd.server_close()
        self._httpd.close_connections()
        if self.upstream is not None:
            self.upstream.close()

    def __enter__(self) -> "RelayServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def active_connections(self) -> int:
        """Connections being served now (each holds one thread)."""
        return self._httpd.active_connections

    @property
    def refused_connections(self) -> int:
        """Connections answered 503 since start because a bound was reached."""
        return self._httpd.refused

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

    def _open_local(self, path: str | os.PathLike) -> tuple[BinaryIO, os.stat_result]:
        return _open_inside(path, self._local_roots)

    def _stat_local(self, path: str | os.PathLike) -> tuple[str, os.stat_result]:
        """(where the file is, its fstat), checked as for sending it; raises _NotServable."""
        f, st = self._open_local(path)
        with f:
            return fd_path(f.fileno()), st

    def _checkpoint(self, directory: Path, include: tuple[str, ...] = ()) -> CheckpointFiles | None:
        """The evaluation files of the checkpoint in `directory`, each as its resolved path inside DIR
        (checked by opening it), without any file that is not (a link out of DIR is never part of a
        checkpoint); None if it holds no weights."""
        found = checkpoint_files(directory, include)
        if found is None:
            return None
        files = {}
        for name, path in found.files.items():
            try:
                files[name] = Path(self._stat_local(path)[0])
            except _NotServable:
                continue
        if not any(n in files for n in found.weight_names):
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
            raise _HTTPError(404, f"no checkpoint {path}: the folder holds no drafter weights ({WEIGHT_FILE_NAMES})")
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
                total = sum(self._stat_local(p)[1].st_size for p in checkpoint.files.values())
            except (CheckpointBroken, FileNotFoundError, _NotServable):
                continue  # a manifest request says why
            found.append({
                "path": rel,
                "step": training_step(dirpath),
                "layout": checkpoint.layout,
                "total_bytes": total,
                "n_files": len(checkpoint.files),
            })
        return found

    def _changed(self, path: str) -> _HTTPError:
        return _HTTPError(409, f"a file of checkpoint {path} changed while it was read; ask again",
                          headers={"Retry-After": "1"})

    def _local_manifest(self, path: str, checkpoint: CheckpointFiles) -> dict:
        try:
            files = {name: self._stat_local(file)[1] for name, file in checkpoint.files.items()}
        except _NotServable:
            raise self._changed(path) from None
        fingerprint = (checkpoint.config_source, tuple(sorted((n, *_identity(st)) for n, st in files.items())))
        cached = self._manifests.get(path)
        if cached and cached[0] == fingerprint:
            return cached[1]
        with self._lock_for("manifest:" + path):  # one hashing per checkpoint at a time
            cached = self._manifests.get(path)
            if cached and cached[0] == fingerprint:
                return cached[1]
            entries = []
            for name in sorted(files):
                sha = self.digests.sha256(checkpoint.files[name])
                try:  # the file hashed by path must be the one checked: same inode, size and mtime
                    same = _identity(self._stat_local(checkpoint.files[name])[1]) == _identity(files[name])
                except _NotServable:
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

    def open_file(self, segments: list[str]) -> "tuple[BinaryIO | _Pull, int]":
        """(what to send, its size) for /v1/files/<path>/<name>: an open file checked to be a regular
        file inside DIR (or the cache) with the size of that same open file, or a pull from upstream
        still arriving (its size is the manifest's). The caller closes an open file."""
        if len(segments) < 2:
            raise _HTTPError(404, "expected /v1/files/<checkpoint path>/<file name>")
        *path_segments, name = segments
        path = "/".join(path_segments)
        local = self._local_checkpoint(path_segments, include=("*",))  # any file of it, hashed or not
        if local is not None:
            _, checkpoint = local
            if name not in checkpoint.files:
                raise _HTTPError(404, f"no file {name} in checkpoint {path}")
            try:
                f, st = self._open_local(checkpoint.files[name])
            except _NotServable:
                raise _HTTPError(404, f"no file {name} in checkpoint {path}") from None
            return f, st.st_size
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
            opened = self._open_cached(cached, entry)
            if opened is not None:
                return opened, entry["size"]
            pull = self._pulls.get(key)
            if pull is None or (pull.done.is_set() and (pull.error or not cached.exists())):
                pull = self._pulls[key] = _Pull(self, path, entry, cache_dir)
        if not pull.wait_started():
            raise _HTTPError(502, f"upstream relay: {pull.error}")
        return pull, entry["size"]

    def _open_cache_file(self, path: Path) -> tuple[BinaryIO, os.stat_result]:
        return _open_inside(path, self._cache_roots)

    def _open_cached(self, cached: Path, entry: dict) -> BinaryIO | None:
        """The pulled-through copy of `entry`, opened and checked, if it is whole and verified."""
        try:
            f, st = self._open_cache_file(cached)
        except _NotServable:
            return None
        try:
            if st.st_size == entry["size"]:
                verified = (st.st_size, st.st_mtime_ns, entry["sha256"])
                if self._verified.get(str(cached)) == verified:
                    return f
                if self.digests.sha256(cached) == entry["sha256"] and _identity(os.stat(cached)) == _identity(st):
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

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            server_version = "dflash-relay/1"
            timeout = relay.send_timeout  # StreamRequestHandler sets it on the socket
            _responded = False

            def setup(self) -> None:
                super().setup()
                self.rfile.close()  # replaced by one that enforces the whole-request deadline
                self._reader = _DeadlineReader(self.connection, relay.send_timeout)
                self.rfile = io.BufferedReader(self._reader)

            def handle_one_request(self) -> None:
                # From now (connected, or done with the last answer) the next request has
                # request_timeout to arrive whole: covers slow headers and idle keep-alive alike.
                self._reader.deadline = time.monotonic() + relay.request_timeout
                self._responded = False
                super().handle_one_request()

            def parse_request(self) -> bool:
                ok = super().parse_request()  # reads the headers: still under the deadline
                self._reader.deadline = None
                self.connection.settimeout(relay.send_timeout)
                return ok

            def end_headers(self) -> None:
                self._responded = True
                super().end_headers()

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
                            source, size = relay.open_file(segments)
                            try:
                                return self._send_file(source, size)
                            finally:
                                if not isinstance(source, _Pull):
                                    source.close()
                    raise _HTTPError(404, "unknown endpoint; the API is /v1/checkpoints, /v1/manifest/<path>, /v1/files/<path>/<name>")
                except _HTTPError as e:
                    self._json(e.status, {"error": e.message}, e.headers)
                except UnicodeDecodeError:
                    self._json(400, {"error": "invalid percent-encoding in the path"})
                except (ConnectionError, TimeoutError):  # the client went away or stopped reading
                    self.close_connection = True
                except Exception:  # noqa: BLE001 - answer 500 instead of dropping the connection
                    log.exception("relay request %r failed", self.requestline)
                    if self._responded:  # mid-body: the status is sent, only ending the connection tells
                        self.close_connection = True
                    else:  # the details are in the log; an answer never carries exception text
                        self._json(500, {"error": "internal error in the relay (its log says more)"})

            def _send_file(self, source: "BinaryIO | _Pull", size: int) -> None:
                try:
                    byte_range = parse_range(self.headers.get("Range"), size)
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
                if fault is None and not isinstance(source, _Pull):
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
                f, more = (source, lambda: False) if not isinstance(source, _Pull) else source.open()
                try:
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
                finally:
                    if isinstance(source, _Pull):
                        f.close()
                if sent < length:
                    self.close_connection = True  # Content-Length promised more: end the connection

        return Handler


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
        """(file object, more): read the file as it grows; `more()` waits and says whether to read again.
        The file is opened as any file sent is: checked, through its descriptor, to lie in the cache."""
        while True:
            for candidate in (self.final, self.partial) if self.done.is_set() else (self.partial, self.final):
                try:
                    f, _ = self.relay._open_cache_file(candidate)
                    break
                except _NotServable:
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
