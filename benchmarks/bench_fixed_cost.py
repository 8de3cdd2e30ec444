"""Fixed cost of scoring a new checkpoint: the wall time of `dflash-eval run` against the flow run's own.

Starts a Prefect server (`prefect server start`, a temporary PREFECT_HOME, analytics off), runs one
full evaluation of the tiny trained Qwen3 run's first step to fill the store (references and features),
then times `dflash-eval run` (a subprocess, wall time from start to exit) for new checkpoints (the
later steps: fetch, drafts and scores run, references and features are cached) and reads each flow
run's own duration (start_time to end_time) from the server. Prints wall, flow and their ratio
(target: wall at most 1.5x the flow).

Run: .venv/bin/python benchmarks/bench_fixed_cost.py [--port 4251] [--profile DIR]
  --profile DIR: also write a cProfile of each timed command (DIR/<step>.prof; read with
  `python -m pstats`) and its `-X importtime` log (DIR/<step>.imports).
"""

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from dflash_core.tiny_build import TinyBuildSettings, default_cache_root, tiny_run

BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def api(url: str, path: str, body: dict | None = None):
    request = urllib.request.Request(f"{url}{path}", data=None if body is None else json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"},
                                     method="GET" if body is None else "POST")
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def start_server(home: Path, port: int) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
    env.pop("PREFECT_API_URL", None)
    server = subprocess.Popen([str(BIN / "prefect"), "server", "start", "--host", "127.0.0.1", "--port", str(port)],
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/api"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            api(url, "/health")
            return server, url
        except OSError:
            if server.poll() is not None:
                sys.exit(f"prefect server start exited with {server.returncode}")
            time.sleep(0.5)
    server.kill()
    sys.exit("the Prefect server did not become healthy within 120 s")


def flow_duration(url: str, name: str) -> float:
    """Seconds from start to end of the newest flow run called `name`."""
    runs = api(url, "/flow_runs/filter", {"flow_runs": {"name": {"any_": [name]}}, "sort": "START_TIME_DESC",
                                          "limit": 1})
    run = runs[0]
    from datetime import datetime

    start, end = (datetime.fromisoformat(run[k].replace("Z", "+00:00")) for k in ("start_time", "end_time"))
    return (end - start).total_seconds()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--port", type=int, default=None, help="The Prefect server's port (default: a free one).")
    parser.add_argument("--profile", type=Path, default=None, help="Write cProfile and importtime logs here.")
    args = parser.parse_args()

    tiny = tiny_run(default_cache_root(), TinyBuildSettings(arch="qwen3"))
    with tempfile.TemporaryDirectory(prefix="dflash-bench-fixed-") as tmp:
        root = Path(tmp)
        server, url = start_server(root / "prefect", args.port or free_port())
        try:
            env = {**os.environ, "PREFECT_API_URL": url, "PREFECT_HOME": str(root / "prefect"),
                   "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}

            def command(step: Path, prefix: list[str] = ()) -> list[str]:
                return [*prefix, str(BIN / "dflash-eval"), "run", "--target", str(tiny.target_dir),
                        "--drafter", str(step), "--prompts", str(tiny.prompts_file),
                        "--max-new-tokens", str(tiny.record["settings"]["max_new_tokens"]),
                        "--store", str(root / "store")]

            def timed(cmd: list[str]) -> float:
                t = time.perf_counter()
                result = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                wall = time.perf_counter() - t
                if result.returncode != 0:
                    sys.exit(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stdout}")
                return wall

            print(f"load average (1 min) at start: {os.getloadavg()[0]:.2f}")
            first = timed(command(tiny.drafter_steps[0]))
            print(f"warm-up: full evaluation of {tiny.drafter_steps[0].name}: {first:.1f} s wall")
            rows = []
            # with --profile the last step is kept for the profiled command (a scored one would be all cached)
            for step in tiny.drafter_steps[1:-1] if args.profile else tiny.drafter_steps[1:]:
                wall = timed(command(step))
                flow = flow_duration(url, f"evaluate {step.name}")
                rows.append((step.name, wall, flow))
                print(f"new checkpoint {step.name}: wall {wall:5.2f} s, flow run {flow:5.2f} s, "
                      f"wall / flow {wall / flow:4.2f}x")
            if args.profile:
                args.profile.mkdir(parents=True, exist_ok=True)
                step = tiny.drafter_steps[-1]
                wall = timed(command(step, [sys.executable, "-m", "cProfile", "-o",
                                            str(args.profile / f"{step.name}.prof")]))
                print(f"profiled {step.name}: wall {wall:.2f} s (with cProfile), flow run "
                      f"{flow_duration(url, f'evaluate {step.name}'):.2f} s")
                # the same command again (all cached now): which modules it imports, and how long each takes
                log = subprocess.run([sys.executable, "-X", "importtime", *command(step)], env=env,
                                     capture_output=True, text=True)
                (args.profile / f"{step.name}.imports").write_text(log.stderr)
                print(f"profiles: {args.profile}")
            walls, flows = [r[1] for r in rows], [r[2] for r in rows]
            print(f"mean over {len(rows)} new checkpoints: wall {sum(walls) / len(rows):.2f} s, flow "
                  f"{sum(flows) / len(rows):.2f} s, wall / flow {sum(walls) / sum(flows):.2f}x (target <= 1.5x)")
            print(f"load average (1 min) at end: {os.getloadavg()[0]:.2f}")
        finally:
            server.terminate()
            try:
                server.wait(timeout=30)
            except subprocess.TimeoutExpired:
                server.kill()


if __name__ == "__main__":
    main()
