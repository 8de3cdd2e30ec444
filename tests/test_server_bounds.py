"""Every server dflash-eval ships stays bounded whatever a client does (dflash_eval.services.http_server): 300 half-open
connections, and a 1 GB body sent without credentials, against the reference server, the report server and the
relay, each a process of its own whose threads and peak memory are read from /proc. And each stops alike
(`BackgroundServer.stop`): at once, ending the connections a client keeps open, the port free again."""

import http.client
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from dflash_eval.services.reference.server import ReferenceServer
from dflash_eval.services.relay.server import RelayServer
from dflash_eval.services.report_server import ReportServer

pytestmark = pytest.mark.slow  # starts processes

SERVERS = {  # name -> (how the child starts it, the most connections it serves at once)
    "reference": ("""
        from dflash_eval.services.reference.server import ReferenceServer
        server = ReferenceServer(sys.argv[1], api_key="s3cret")
    """, 64),
    "report": ("""
        from dflash_eval.services.report_server import ReportServer
        server = ReportServer(sys.argv[1], port=0)
    """, 32),
    "relay": ("""
        from dflash_eval.services.relay.server import RelayServer
        server = RelayServer(sys.argv[1], state_dir=sys.argv[1] + "-state", token="s3cret", settle_seconds=0)
    """, 32),  # per client: every socket here comes from 127.0.0.1
}
HALF_OPEN = 300
BODY_BYTES = 10**9
SENT_AT_MOST = 256 << 20  # what the test pushes of the claimed 1 GB before giving up


def _status(pid: int) -> dict[str, int]:
    """Threads, and resident / peak resident memory in kB, of a process."""
    fields = dict(line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines())
    return {name: int(fields[name].split()[0]) for name in ("Threads", "VmRSS", "VmHWM")}


@pytest.fixture
def started(request, tmp_path, qwen3_dir):
    name = request.param
    code, bound = SERVERS[name]
    folder = qwen3_dir if name == "reference" else tmp_path / "served"
    if name != "reference":
        folder.mkdir()
    script = "import sys\n" + textwrap.dedent(code) + "print(server.url, flush=True)\nserver.serve_forever()\n"
    child = subprocess.Popen([sys.executable, "-c", script, str(folder)], stdout=subprocess.PIPE, text=True,
                             env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    try:
        url = child.stdout.readline().strip()
        assert url.startswith("http://"), f"{name} server did not start"
        host, port = url.removeprefix("http://").rstrip("/").rsplit(":", 1)
        time.sleep(0.5)  # idle: its baseline
        yield child, ("127.0.0.1", int(port)), bound
    finally:
        child.kill()
        child.wait()


@pytest.mark.parametrize("started", list(SERVERS), indirect=True)
def test_half_open_connections_hold_at_most_the_bound_of_threads(started):
    child, address, bound = started
    before = _status(child.pid)["Threads"]
    sockets = []
    try:
        for _ in range(HALF_OPEN):
            s = socket.create_connection(address, timeout=5)
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n")  # the request never ends
            sockets.append(s)
        time.sleep(1)
        threads = _status(child.pid)["Threads"]
        assert threads <= before + bound + 2, (before, threads)
        # and it still answers someone else
        with socket.create_connection(address, timeout=5) as other:
            other.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            assert other.recv(64).startswith(b"HTTP/1.1 ")
    finally:
        for s in sockets:
            s.close()


@pytest.mark.parametrize("started", list(SERVERS), indirect=True)
def test_an_unauthenticated_gigabyte_is_never_read_into_memory(started):
    child, address, _ = started
    peak_before = _status(child.pid)["VmHWM"]
    sent, chunk = 0, b"x" * (1 << 20)
    with socket.create_connection(address, timeout=5) as s:
        s.sendall(f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  f"Content-Length: {BODY_BYTES}\r\n\r\n".encode())
        try:
            while sent < SENT_AT_MOST:
                s.sendall(chunk)
                sent += len(chunk)
        except OSError:  # the server answered and closed: what was sent after is refused
            pass
        s.settimeout(5)
        try:
            answer = s.recv(4096)
        except OSError:  # reset: the answer was lost with the unread bytes, which is all right here
            answer = b""
    assert answer == b"" or answer.split(b" ")[1] in (b"401", b"405", b"413"), answer[:200]
    grown_mb = (_status(child.pid)["VmHWM"] - peak_before) / 1024
    assert grown_mb < 32, f"peak memory grew by {grown_mb:.0f} MB while {sent >> 20} MB were sent"


BUILT_HERE = {  # name -> (folder it serves, state folder, port) -> the server, in this process: its stop() is tested
    "reference": lambda folder, state, port: ReferenceServer(folder, port=port),
    "report": lambda folder, state, port: ReportServer(folder, port=port),
    "relay": lambda folder, state, port: RelayServer(folder, port=port, state_dir=state, settle_seconds=0),
}


def _ended(sock: socket.socket, within: float) -> bool:
    """Whether the server ended the connection `sock` (FIN or reset) within `within` seconds."""
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


@pytest.mark.parametrize("name", list(BUILT_HERE))
def test_stop_ends_an_idle_keep_alive_connection_at_once_and_frees_the_port(name, tmp_path, qwen3_dir):
    folder = qwen3_dir if name == "reference" else tmp_path / "served"
    if name != "reference":
        folder.mkdir()
    build = BUILT_HERE[name]
    server = build(folder, tmp_path / "state", 0).start()
    client = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
    try:
        client.request("GET", "/health")
        response = client.getresponse()
        response.read()
        assert not response.will_close and client.sock is not None  # answered; kept open for a next request
        started = time.monotonic()
        server.stop()
        took = time.monotonic() - started
        assert took < 3, f"{name} server took {took:.1f} s to stop"
        assert _ended(client.sock, within=2), f"{name} server left the idle connection open"
    finally:
        client.close()
        server.stop()
    build(folder, tmp_path / "state", server.port).stop()  # the port is free again: a new server binds it at once
