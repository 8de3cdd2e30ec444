"""Checkpoint relay under attack: link swapping, half-open and trickled requests, connection floods,
hostile Range values, and a client resume that meets 416 then 200. Real servers on loopback, each
test bounded to a few seconds."""

import hashlib
import http.client
import json
import math
import os
import select
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from dflash_eval.services.relay.client import RelayClient
from dflash_eval.services.relay.server import RelayServer
from tests.checkpoints import settle, write_checkpoint
from tests.test_relay import get

INSIDE = b"inside-" * 300  # 2100 bytes: what a swapped link may serve
SECRET = b"TOP-SECRET-" * 700  # 7700 bytes: what it must never serve (another size, so lengths tell too)


@pytest.fixture
def root(tmp_path):
    root = tmp_path / "runs"
    write_checkpoint(root / "run1" / "step_1000", {"model.safetensors": 4096})
    return root


def _port(relay: RelayServer) -> int:
    return int(relay.url.rsplit(":", 1)[1])


def _swap_link(link, targets, tmp, stop: threading.Event, swaps: list) -> None:
    """Point `link` at each of `targets` in turn, atomically (a new link renamed over it), until stopped."""
    i = 0
    while not stop.is_set():
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(targets[i % 2])
        os.replace(tmp, link)
        i += 1
    swaps.append(i)


@pytest.mark.slow  # starts processes or waits on purpose
@pytest.mark.parametrize("borrowed", [False, True], ids=["checkpoint-file", "run-folder-config"])
def test_link_swapped_during_downloads_never_serves_outside_bytes(root, tmp_path, borrowed):
    """A link swapped between a file inside DIR and a secret outside it, as fast as a thread can, while
    four clients download it and ask for manifests: no response ever holds the secret, its size or its
    digest, and every Content-Length is its body's length."""
    (root / "shared").mkdir()
    inside = root / "shared" / "blob.bin"
    inside.write_bytes(INSIDE)
    secret = tmp_path / "secret.bin"
    secret.write_bytes(SECRET)
    if borrowed:  # a checkpoint without config.json borrows its run folder's, which is the link
        write_checkpoint(root / "run2" / "ckpt", {"model.safetensors": 4096})
        (root / "run2" / "ckpt" / "config.json").unlink()
        link, file_url, manifest_url = (root / "run2" / "config.json", "/v1/files/run2/ckpt/config.json",
                                        "/v1/manifest/run2/ckpt")
    else:
        link = root / "run1" / "step_1000" / "extra.bin"
        file_url, manifest_url = "/v1/files/run1/step_1000/extra.bin", "/v1/manifest/run1/step_1000?include=extra.bin"
    link.symlink_to(inside)
    secret_sha = hashlib.sha256(SECRET).hexdigest()
    problems, served, stop, swaps = [], [0], threading.Event(), []

    def client(port: int) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        n = 0
        while not stop.is_set():
            n += 1
            try:
                conn.request("GET", manifest_url if n % 4 == 0 else file_url)
                response = conn.getresponse()
                body = response.read()
            except (http.client.HTTPException, OSError):
                conn.close()  # a connection ended short: a new one
                continue
            if b"TOP-SECRET" in body or secret_sha.encode() in body or b'"size": 7700' in body:
                problems.append(f"the secret, its size or digest in a {response.status} answer (request {n})")
            length = response.getheader("Content-Length")
            if length is not None and int(length) != len(body):
                problems.append(f"Content-Length {length} for a body of {len(body)} bytes")
            if n % 4 and response.status == 200:
                if body != INSIDE:
                    problems.append(f"a 200 with {len(body)} bytes that are not the inside file")
                served[0] += 1
            elif n % 4 and response.status != 404:
                problems.append(f"status {response.status} for the file")
            if problems:
                stop.set()
        conn.close()

    with RelayServer(root, state_dir=tmp_path / "state", settle_seconds=0) as relay:
        swapper = threading.Thread(target=_swap_link, args=(link, (inside, secret), tmp_path / "swap.tmp", stop, swaps))
        clients = [threading.Thread(target=client, args=(_port(relay),)) for _ in range(4)]
        for t in [swapper, *clients]:
            t.start()
        stop.wait(3)  # or earlier, at the first problem
        stop.set()
        for t in [swapper, *clients]:
            t.join(10)
    assert not problems, problems[:5]
    assert served[0] > 20 and swaps[0] > 100  # the race really ran: many swaps, many files served


def test_links_inside_dir_are_still_served(root, tmp_path):
    """A file linked to another file of DIR and a run-latest folder link keep working."""
    (root / "shared").mkdir()
    (root / "shared" / "blob.bin").write_bytes(INSIDE)
    (root / "run1" / "step_1000" / "extra.bin").symlink_to(root / "shared" / "blob.bin")
    (root / "run1" / "run1-latest").symlink_to(root / "run1" / "step_1000", target_is_directory=True)
    with RelayServer(root, state_dir=tmp_path / "state", settle_seconds=0) as relay:
        status, headers, body = get(relay, "/v1/files/run1/step_1000/extra.bin")
        assert status == 200 and body == INSIDE and headers["Content-Length"] == str(len(INSIDE))
        status, _, body = get(relay, "/v1/manifest/run1/run1-latest?include=extra.bin")
        manifest = json.loads(body)
        assert status == 200 and manifest["path"] == "run1/step_1000"
        assert {f["name"]: f["size"] for f in manifest["files"]}["extra.bin"] == len(INSIDE)
        assert get(relay, "/v1/files/run1/run1-latest/extra.bin")[2] == INSIDE


@pytest.mark.parametrize("weights", ["model.safetensors", "model-00001-of-00001.safetensors"])
def test_weights_linked_out_of_dir_are_a_404_not_a_500(root, tmp_path, weights):
    """A checkpoint whose only weights file is a link to a file outside DIR (one file, or the shard of an
    index) is no checkpoint here: listed nowhere, and its manifest and files are a clean 404."""
    outside = write_checkpoint(tmp_path / "outside", {weights: 4096})
    step = root / "run1" / "step_2000"
    step.mkdir()
    (step / "config.json").write_text((outside / "config.json").read_text())
    (step / weights).symlink_to(outside / weights)
    if weights != "model.safetensors":
        (step / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": weights}}))
    settle(step, 120)
    with RelayServer(root, state_dir=tmp_path / "state", settle_seconds=0) as relay:
        assert [c["path"] for c in RelayClient(relay.url).list_checkpoints()] == ["run1/step_1000"]
        for path in ("/v1/manifest/run1/step_2000", f"/v1/files/run1/step_2000/{weights}",
                     "/v1/files/run1/step_2000/config.json"):
            status, _, body = get(relay, path)
            assert status == 404 and b"Traceback" not in body, (path, status, body)


def _closed_by_server(socks: list[socket.socket], within: float) -> list[socket.socket]:
    """The sockets in `socks` that the server has not closed `within` seconds from now (it may
    answer 503 first; what it sends is read and dropped)."""
    open_socks, deadline = set(socks), time.monotonic() + within
    while open_socks and time.monotonic() < deadline:
        ready, _, _ = select.select(list(open_socks)[:500], [], [], 0.05)
        for s in ready:
            try:
                if not s.recv(65536):
                    open_socks.discard(s)
            except OSError:  # reset: closed as well
                open_socks.discard(s)
    return list(open_socks)


@pytest.mark.slow  # starts processes or waits on purpose
def test_half_open_requests_do_not_exhaust_the_server(root, tmp_path):
    """450 connections from one address each send half a request and stop, no token needed: with the
    default bounds the relay serves at most 32 of them (one thread each) and answers the rest 503 at
    once, a client from another address still gets answers, and after request_timeout the held
    connections are dropped and the threads are gone."""
    socks = []
    with RelayServer(root, state_dir=tmp_path / "state", settle_seconds=0, token="t0ken", request_timeout=1) as relay:
        port = _port(relay)
        baseline, started = threading.active_count(), time.monotonic()
        try:
            for _ in range(450):
                s = socket.create_connection(("127.0.0.1", port), timeout=5)
                s.sendall(b"GET /v1/checkpoints HTTP/1.1\r\nHost: relay\r\n")  # never finished
                socks.append(s)
            status, _, body = get(relay, "/v1/checkpoints", source="127.0.0.2", Authorization="Bearer t0ken")
            assert status == 200 and json.loads(body)["checkpoints"][0]["path"] == "run1/step_1000"
            assert relay.active_connections <= 32 + 1  # + the other client's, maybe not ended yet
            assert threading.active_count() <= baseline + 32 + 1
            # Accepted in order, so all 450 were admitted or refused before that answer; at most 32
            # were admitted per request_timeout (a held one frees its slot only when dropped).
            windows = math.ceil(time.monotonic() - started) + 1
            assert relay.refused_connections >= 450 - 32 * windows
            # The held ones are dropped once their second is up; every socket ends closed by the server.
            assert not _closed_by_server(socks, within=4)
            deadline = time.monotonic() + 3
            while (relay.active_connections or threading.active_count() > baseline) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert relay.active_connections == 0
            assert threading.active_count() <= baseline
        finally:
            for s in socks:
                s.close()


@pytest.mark.slow  # starts processes or waits on purpose
def test_trickled_request_and_idle_keep_alive_are_dropped(root, tmp_path):
    """A request whose header bytes trickle in (one line every 0.2 s, so no single read ever waits
    long) is dropped at request_timeout, and so is a keep-alive connection left idle after an answer."""
    with RelayServer(root, state_dir=tmp_path / "state", settle_seconds=0, request_timeout=1) as relay:
        port = _port(relay)
        trickle = socket.create_connection(("127.0.0.1", port), timeout=5)
        trickle.sendall(b"GET /v1/checkpoints HTTP/1.1\r\n")
        idle = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        idle.request("GET", "/v1/checkpoints")
        response = idle.getresponse()
        assert response.status == 200 and response.getheader("Connection") != "close"
        response.read()
        started, dropped = time.monotonic(), None
        try:
            for i in range(25):  # 5 s at most
                time.sleep(0.2)
                trickle.sendall(f"X-Slow-{i}: a\r\n".encode())
        except OSError:  # the relay closed it: writing to it fails
            dropped = time.monotonic() - started
        assert dropped is not None and dropped < 2.5, dropped
        assert not _closed_by_server([idle.sock], within=2)  # idle since its answer: closed as well
        trickle.close()
        idle.close()


def _wait_for(condition, seconds: float = 2) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


@pytest.mark.slow  # starts processes or waits on purpose
def test_connection_bounds_answer_503_with_retry_after(root, tmp_path):
    """Over the bound per client and over the bound in all, a connection is answered 503 with
    Retry-After at once; a RelayClient waits and gets through once slots are free."""
    with RelayServer(root, state_dir=tmp_path / "state", settle_seconds=0, request_timeout=1,
                     max_connections=4, max_connections_per_client=2) as relay:
        port = _port(relay)
        held = []
        for source in ("127.0.0.3", "127.0.0.3", "127.0.0.4"):
            s = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=(source, 0))
            s.sendall(b"GET /v1/checkpoints HTTP/1.1\r\n")
            held.append(s)
        _wait_for(lambda: relay.active_connections == 3)  # accepted and counted
        status, headers, body = get(relay, "/v1/checkpoints", source="127.0.0.3")  # its third
        assert status == 503 and headers["Retry-After"] == "1" and b"too many connections" in body
        assert get(relay, "/v1/checkpoints", source="127.0.0.5")[0] == 200  # the fourth in all
        _wait_for(lambda: relay.active_connections == 3)  # that one ended
        s = socket.create_connection(("127.0.0.1", port), timeout=5, source_address=("127.0.0.4", 0))
        s.sendall(b"GET /v1/checkpoints HTTP/1.1\r\n")
        held.append(s)
        _wait_for(lambda: relay.active_connections == 4)
        status, headers, _ = get(relay, "/v1/checkpoints", source="127.0.0.6")  # a fifth in all
        assert status == 503 and headers["Retry-After"] == "1"
        started = time.monotonic()
        listed = RelayClient(relay.url, backoff=0.3, retries=4).list_checkpoints()  # 503 first, then in
        assert [c["path"] for c in listed] == ["run1/step_1000"] and time.monotonic() - started >= 0.2
        for s in held:
            s.close()


@pytest.mark.parametrize("value", [
    "bytes=" + "9" * 5000 + "-",
    "bytes=0-" + "9" * 5000,
    "bytes=-" + "9" * 5000,
    "bytes=" + "1" * 20 + "-",
    "bytes=abc",
    "bytes=5",
    "bytes=-",
    "bytes=1-2-3",
    "bytes=0-1,x",
])
def test_unparseable_or_huge_range_answers_416(root, tmp_path, value):
    with RelayServer(root, state_dir=tmp_path / "state", settle_seconds=0) as relay:
        status, headers, body = get(relay, "/v1/files/run1/step_1000/model.safetensors", Range=value)
    assert status == 416 and headers["Content-Range"] == "bytes */4096" and body == b""


def test_other_range_units_and_several_ranges_get_the_whole_file(root, tmp_path):
    data = (root / "run1" / "step_1000" / "model.safetensors").read_bytes()
    with RelayServer(root, state_dir=tmp_path / "state", settle_seconds=0) as relay:
        for value in ("items=0-5", "bytes=0-1,5-6"):
            status, headers, body = get(relay, "/v1/files/run1/step_1000/model.safetensors", Range=value)
            assert status == 200 and body == data and headers["Content-Length"] == "4096"


def test_500_never_carries_exception_text(root, tmp_path, caplog):
    with RelayServer(root, state_dir=tmp_path / "state", settle_seconds=0) as relay:
        def broken():
            raise RuntimeError("/very/private/path leaked")

        relay.list_checkpoints = broken
        status, _, body = get(relay, "/v1/checkpoints")
    assert status == 500 and b"private" not in body and b"RuntimeError" not in body
    assert json.loads(body)["error"].startswith("internal error")
    assert "/very/private/path leaked" in caplog.text  # the details are in the relay's log


class _ResumeThen416Then200(BaseHTTPRequestHandler):
    """Serves one 300 kB file: the first download is cut after 100 kB, the resume of it is refused
    with 416 (as when the relay's file was replaced by a shorter one), the next whole request works."""

    protocol_version = "HTTP/1.1"
    data = os.urandom(300_000)
    ranges: list = []

    def do_GET(self):
        if self.path.startswith("/v1/manifest/"):
            entry = {"name": "model.safetensors", "size": len(self.data), "sha256": hashlib.sha256(self.data).hexdigest()}
            return self._send(200, json.dumps({"path": "r/s", "files": [entry]}).encode())
        self.ranges.append(self.headers.get("Range"))
        if len(self.ranges) == 1:
            self.send_response(200)
            self.send_header("Content-Length", str(len(self.data)))
            self.end_headers()
            self.wfile.write(self.data[:100_000])
            self.wfile.flush()
            self.close_connection = True  # cut: Content-Length promised more
        elif self.headers.get("Range"):
            self.send_response(416)
            self.send_header("Content-Range", f"bytes */{len(self.data)}")
            self.send_header("Content-Length", "0")
            self.end_headers()
        else:
            self._send(200, self.data)

    def _send(self, status, body):
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_resume_refused_with_416_then_a_whole_200_completes(tmp_path):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _ResumeThen416Then200)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        client = RelayClient(f"http://127.0.0.1:{server.server_address[1]}", backoff=0.01)
        client.download("r/s", tmp_path / "dest")
    finally:
        server.shutdown()
        server.server_close()
    assert (tmp_path / "dest" / "model.safetensors").read_bytes() == _ResumeThen416Then200.data
    assert _ResumeThen416Then200.ranges == [None, "bytes=100000-", None]
    assert not (tmp_path / "dest" / ".partial").exists()
