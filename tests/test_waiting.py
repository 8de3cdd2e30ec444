"""The wait every harness that starts a server uses (tests/waiting.py): on a real socket that accepts connections
but answers later than a request's own timeout, as a server on busy cores does, the wait goes on to its deadline
instead of failing on the first read timeout; a deadline passed or a server's process gone fails it, named."""

import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from tests.waiting import NeverReady, answers, wait_until


@contextmanager
def late_server(ready_after: float):
    """An HTTP server on loopback that accepts at once but, for its first `ready_after` seconds, answers each
    request only after 1 s; then at once. Yields its URL and the number of requests it answered late."""
    started = time.monotonic()
    late = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):
            if time.monotonic() - started < ready_after:
                late.append(self.path)
                time.sleep(1.0)
            try:
                self.send_response(200)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"ok")
            except OSError:  # the client gave up waiting (its read timed out) and closed
                pass

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}/health", late
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.slow  # waits on purpose
def test_a_server_that_answers_late_is_waited_for_until_it_answers_in_time():
    with late_server(ready_after=2.0) as (url, late):
        started = time.monotonic()
        assert wait_until(answers(url, timeout=0.3), 20, "the late server") is True
        assert late  # at least one request timed out on a read, and the wait went on
        assert time.monotonic() - started >= 1.5


@pytest.mark.slow  # waits on purpose
def test_a_server_that_never_answers_in_time_fails_at_the_deadline_naming_the_last_answer():
    with late_server(ready_after=60) as (url, _):
        started = time.monotonic()
        with pytest.raises(NeverReady, match=r"the late server was not ready after 2 s \(ReadTimeout"):
            wait_until(answers(url, timeout=0.3), 2, "the late server")
        assert time.monotonic() - started < 10


def test_a_server_whose_process_exited_fails_the_wait_at_once():
    process = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    process.wait()
    started = time.monotonic()
    with pytest.raises(NeverReady, match=r"the server exited with code 3 before it was ready \(ConnectionError"):
        wait_until(answers("http://127.0.0.1:9/health", timeout=0.3), 60, "the server", process)
    assert time.monotonic() - started < 5


def test_an_error_status_is_waited_through_as_not_ready():
    answered = iter([RuntimeError("HTTP 503"), None, "a client"])

    def probe():
        answer = next(answered)
        if isinstance(answer, Exception):
            raise answer
        return answer

    assert wait_until(probe, 5, "the probe", every=0.01) == "a client"
