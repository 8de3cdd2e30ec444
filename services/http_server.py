"""A threading HTTP server (stdlib `http.server`) whose resources stay bounded, whatever clients do.

- `BoundedHTTPServer`: at most `max_connections` connections served at once, `max_per_client` from one
  client address (an IPv6 /64 counts as one); over either bound the accepting thread itself answers
  503 with Retry-After and closes the socket once the client's request is read (within
  LINGER_SECONDS), so threads stay one per served connection.
- `DeadlineRequestHandler`: a request's line and headers must all arrive within `request_timeout`
  seconds of the connection being ready for it (just opened, or idle after an answer: keep-alive),
  however slowly their bytes trickle; a send that makes no progress for `send_timeout` seconds ends
  the connection; `read_body` takes a body of at most `max_body_bytes`, also within `request_timeout`
  (413 over the cap, before a byte of it is read: a handler checks who asks before it reads).
- `BackgroundServer`: the lifecycle every server shares (bind, start in a thread or serve in this one,
  stop); each server subclasses it with its own handler.

Every server dflash-eval ships uses these: the relay, the reference server, the report server. Why the
stdlib and not Starlette/uvicorn: docs/relay.md, Security. Knows nothing of what is served.
"""

import errno
import io
import ipaddress
import json
import logging
import socket
import sys
import threading
import time
from collections import deque
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Self

_log = logging.getLogger(__name__)


class ErrorResponse(Exception):
    """An answer other than success, raised where it is decided: its status, the message a handler puts
    in its body, and extra headers (e.g. Retry-After)."""

    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.headers = headers or {}


class DeadlineReader(io.RawIOBase):
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


class DeadlineRequestHandler(BaseHTTPRequestHandler):
    """A request handler whose requests must arrive whole within `request_timeout` seconds and whose
    sends end the connection after `send_timeout` seconds without progress (set both on a subclass)."""

    protocol_version = "HTTP/1.1"  # keep-alive: the deadline is armed again for each next request
    request_timeout: float = 30
    send_timeout: float = 60
    max_body_bytes: int = 0  # the largest request body read_body takes

    def setup(self) -> None:
        super().setup()
        self.connection.settimeout(self.send_timeout)
        self.rfile.close()  # replaced by one that enforces the whole-request deadline
        self._reader = DeadlineReader(self.connection, self.send_timeout)
        self.rfile = io.BufferedReader(self._reader)

    def handle_one_request(self) -> None:
        # From now (connected, or done with the last answer) the next request has
        # request_timeout to arrive whole: covers slow headers and idle keep-alive alike.
        self._reader.deadline = time.monotonic() + self.request_timeout
        super().handle_one_request()

    def parse_request(self) -> bool:
        ok = super().parse_request()  # reads the headers: still under the deadline
        self._reader.deadline = None
        self.connection.settimeout(self.send_timeout)
        return ok

    def read_body(self) -> bytes:
        """The request's body: Content-Length bytes, at most `max_body_bytes`, arriving whole within
        `request_timeout`. Raises ErrorResponse 400 (no usable length, Content-Length headers that disagree, a
        chunked body, one cut short) or 413 (over the cap); then the connection closes, as its unread bytes cannot
        be skipped."""
        given = [value.strip() for value in self.headers.get_all("Content-Length") or []]
        if len(set(given)) > 1:  # which one ends the body? RFC 9112, 6.3: a 400, and the connection closed
            self.close_connection = True
            raise ErrorResponse(400, f"the request has {len(given)} Content-Length headers that disagree: send one")
        text = given[0] if given and given[0] else "0"
        length = int(text) if text.isascii() and text.isdigit() else -1  # digits only (int() also takes "+1", "1_0")
        if length < 0 or self.headers.get("Transfer-Encoding"):
            self.close_connection = True
            raise ErrorResponse(400, "the request needs a Content-Length (chunked bodies are not taken)")
        if length > self.max_body_bytes:
            self.close_connection = True
            raise ErrorResponse(413, f"a request body of {length} bytes is over this server's limit of "
                                     f"{self.max_body_bytes}")
        self._reader.deadline = time.monotonic() + self.request_timeout
        try:
            body = self.rfile.read(length) if length else b""
        finally:
            self._reader.deadline = None
        if len(body) < length:
            self.close_connection = True
            raise ErrorResponse(400, f"the request body ended after {len(body)} of its {length} bytes")
        return body


def client_key(host: str) -> str:
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


class BoundedHTTPServer(ThreadingHTTPServer):
    """ThreadingHTTPServer with a bounded number of connections, in all and per client address.

    Over a bound the accepting thread answers 503 itself and closes: no thread is started. `name`
    says what is served in the 503 body and the log ("too many connections to this relay");
    `logger` is where refusals and connection failures are logged."""

    daemon_threads = True
    block_on_close = False  # stop() ends the connections itself instead of waiting on idle ones
    request_queue_size = 128  # bursts of parallel downloads wait in the kernel, not refused
    LINGER_SECONDS = 2  # a refused socket's longest wait for its client's request before closing
    MAX_LINGERING = 1024  # refused sockets waiting at most (file descriptors stay bounded)

    def __init__(self, address, handler, max_connections: int, max_per_client: int, *,
                 name: str = "server", logger: logging.Logger = _log):
        self.max_connections = max_connections
        self.max_per_client = max_per_client
        self.name = name
        self.log = logger
        self._active: dict[socket.socket, str] = {}  # served connection -> client key
        self._per_client: dict[str, int] = {}
        self._active_changed = threading.Condition()
        self.refused = 0  # connections answered 503 since start
        self._refused_logged = (0.0, 0)  # (when, refused count) at the last warning
        self._lingering: deque[tuple[float, socket.socket]] = deque()  # (close by, refused socket)
        super().__init__(address, handler)

    def process_request(self, request, client_address) -> None:
        key = client_key(str(client_address[0]))
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
        body = json.dumps({"error": f"too many connections to this {self.name}; retry later"}).encode()
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
            self.log.warning("refused %d connection(s) over the bounds (%d in all, %d per client; last from %s)",
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
        self.log.exception("%s connection from %s failed", self.name, client_address[0])

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
        """Connections being served now (each holds one thread)."""
        return len(self._active)


class _IPv6HTTPServer(BoundedHTTPServer):
    address_family = socket.AF_INET6


class PortInUse(OSError):
    """Another process listens on the address a server was asked to bind; the message names it."""


class BackgroundServer:
    """A `BoundedHTTPServer` and its lifecycle, the same for every server we ship.

    The constructor binds (PortInUse if the port is taken), so a caller fails before doing any work;
    `url` and `port` say where it listens (port=0 picks a free one). `start()` serves in a daemon
    thread, `serve_forever()` in this one until Ctrl+C; `with server:` starts and stops it.

    `stop()` stops accepting, ends every live connection (its socket is shut down, so a handler
    waiting for a client's next request or sending to it returns at once), waits up to
    STOP_WAIT_SECONDS for the connections' threads, then releases the port. Chosen so that a stop is
    prompt whatever clients do: an idle keep-alive connection would otherwise hold its thread up to
    `request_timeout` (30 s) and go on answering after the stop. The port is free for the next start
    at once, and what a client loses it recovers: the relay's client resumes a cut download, the
    reference backends retry a request.
    """

    POLL_SECONDS = 0.1  # how often the serving loop looks for a stop (and closes refused sockets)
    STOP_WAIT_SECONDS = 5.0  # the longest stop() waits for a thread still computing an answer

    def __init__(self, host: str, port: int, handler: type[BaseHTTPRequestHandler], max_connections: int,
                 max_per_client: int, *, name: str, logger: logging.Logger = _log):
        server_class = _IPv6HTTPServer if ":" in host else BoundedHTTPServer
        try:
            self._httpd = server_class((host, port), handler, max_connections, max_per_client, name=name,
                                       logger=logger)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise PortInUse(e.errno, f"port {port} on {host} is already in use") from None
            raise
        self.port: int = self._httpd.server_address[1]
        # a wildcard address is no address a client elsewhere could use: name this machine instead
        shown = socket.getfqdn() if host in ("", "0.0.0.0", "::") else host
        self.url = f"http://[{shown}]:{self.port}" if ":" in shown else f"http://{shown}:{self.port}"
        self._thread: threading.Thread | None = None
        self._serving = False  # a serving loop runs (in the thread, or in serve_forever's caller)
        self._stop_lock = threading.Lock()

    def start(self) -> Self:
        """Serve in a daemon thread; returns self."""
        if self._thread is None:
            self._serving = True
            self._thread = threading.Thread(target=self._httpd.serve_forever, args=(self.POLL_SECONDS,),
                                            name=self._httpd.name, daemon=True)
            self._thread.start()
        return self

    def serve_forever(self) -> None:
        """Serve in this thread until Ctrl+C (or stop() from another thread); then stop."""
        self._serving = True
        try:
            self._httpd.serve_forever(self.POLL_SECONDS)
        except KeyboardInterrupt:
            pass
        finally:
            self._serving = False
            self.stop()

    def stop(self) -> None:
        """Stop accepting, end the live connections, release the port (the class docstring says why so)."""
        with self._stop_lock:
            if self._serving:
                self._httpd.shutdown()  # returns once the serving loop has ended
                self._serving = False
            if self._thread is not None:
                self._thread.join()
                self._thread = None
            self._httpd.server_close()
            self._httpd.close_connections(wait=self.STOP_WAIT_SECONDS)

    def __enter__(self) -> Self:
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
