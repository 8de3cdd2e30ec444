"""services/http_session.py: the retrying session of the relay's and the reference backends' clients, against a
real loopback server that answers what each test scripts."""

import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dflash_eval.services.http_session import retrying_session


class Scripted(BaseHTTPRequestHandler):
    """Answers each request with the next (status, headers) of `script` (the last one again once it runs out),
    and records (method, Authorization) of every request in `seen`."""

    protocol_version = "HTTP/1.1"
    script: list[tuple[int, dict[str, str]]] = []
    seen: list[tuple[str, str | None]] = []

    def _answer(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.seen.append((self.command, self.headers.get("Authorization")))
        status, headers = self.script[min(len(self.seen), len(self.script)) - 1]
        body = f"answer {len(self.seen)}".encode()
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, format, *args) -> None:
        pass


@pytest.fixture
def serve():
    servers = []

    def serve(*script: tuple[int, dict[str, str]]) -> tuple[str, list]:
        handler = type("Handler", (Scripted,), {"script": list(script), "seen": []})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        servers.append(server)
        return f"http://127.0.0.1:{server.server_address[1]}/", handler.seen

    yield serve
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.mark.slow  # waits a Retry-After of 1 s on purpose
def test_a_busy_server_s_retry_after_is_waited_for_instead_of_the_backoff(serve):
    url, seen = serve((503, {"Retry-After": "1"}), (200, {}))
    session = retrying_session(retries=2, backoff=0, methods=frozenset({"GET"}), pool_maxsize=1, bearer_token="k")
    started = time.monotonic()
    response = session.get(url, timeout=10)
    assert response.status_code == 200 and response.text == "answer 2"
    assert time.monotonic() - started >= 1  # backoff 0 would have asked again at once
    assert seen == [("GET", "Bearer k")] * 2


def test_spent_retries_give_back_the_last_answer(serve):
    url, seen = serve((500, {}), (502, {}), (503, {}))
    response = retrying_session(retries=2, backoff=0, methods=frozenset({"GET"}), pool_maxsize=1).get(url, timeout=10)
    assert response.status_code == 503 and response.text == "answer 3"  # an answer to quote, not an exception
    assert seen == [("GET", None)] * 3


def test_only_the_methods_given_and_only_5xx_are_retried(serve):
    url, seen = serve((500, {}), (500, {}), (200, {}))
    get_only = retrying_session(retries=3, backoff=0, methods=frozenset({"GET"}), pool_maxsize=1)
    assert get_only.post(url, json={}, timeout=10).status_code == 500
    assert retrying_session(retries=3, backoff=0, methods=frozenset({"GET", "POST"}),
                            pool_maxsize=1).post(url, json={}, timeout=10).status_code == 200
    assert [method for method, _ in seen] == ["POST"] * 3  # the first POST once, the second twice
    url, seen = serve((404, {}), (200, {}))
    assert get_only.get(url, timeout=10).status_code == 404 and len(seen) == 1  # a retry cannot fix a 4xx
