"""A throwaway `prefect server start` for the benchmarks that need a real one (bench_fixed_cost.py,
ui_screenshots.py): its own PREFECT_HOME, analytics off, the UI pointed at its own port."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def api(url: str, path: str, body: dict | None = None, attempts: int = 5):
    """One call of the server's REST API (GET, or POST with a JSON body); retries a 503 (its SQLite
    database busy, e.g. while serve registers its deployments)."""
    request = urllib.request.Request(f"{url}{path}", data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"},
                                     method="GET" if body is None else "POST")
    for attempt in range(attempts):
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as e:
            if e.code != 503 or attempt == attempts - 1:
                raise
            time.sleep(0.5)


def stop(process: subprocess.Popen, seconds: float = 30) -> None:
    """Terminate a process started with start_new_session=True (its whole process group) and wait for it."""
    if process.poll() is not None:
        return
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    try:
        process.wait(timeout=seconds)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def start_prefect_server(home: Path, port: int, log: Path) -> tuple[subprocess.Popen, str]:
    """`prefect server start` on 127.0.0.1:port, healthy, its UI calling its own API (PREFECT_UI_API_URL:
    without it the UI calls port 4200); returns it and its API URL. RuntimeError when it does not come up."""
    url = f"http://127.0.0.1:{port}/api"
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_UI_API_URL": url}
    env.pop("PREFECT_API_URL", None)
    server = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                              env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while True:
        try:
            api(url, "/health")
            break
        except OSError as e:
            if server.poll() is not None:
                raise RuntimeError(f"prefect server start exited with {server.returncode}:\n{log.read_text()[-3000:]}") from e
            if time.monotonic() > deadline:
                stop(server)
                raise RuntimeError("the Prefect server did not become healthy within 120 s") from None
            time.sleep(0.5)
    settings = api(f"http://127.0.0.1:{port}", "/ui-settings")
    if settings.get("api_url") != url:
        stop(server)
        raise RuntimeError(f"the UI would call {settings.get('api_url')}, not {url} (PREFECT_UI_API_URL ignored?)")
    return server, url
