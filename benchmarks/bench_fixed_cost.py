"""Fixed cost of scoring a new checkpoint: its wall time against the flow run's own, two ways.

Starts a Prefect server (`prefect server start`, a temporary PREFECT_HOME, analytics off), runs one
full evaluation of the tiny trained Qwen3 run's first step to fill the store (references and features),
then scores new checkpoints (the later steps: fetch, drafts and scores run, references and features are
cached) and reads each flow run's own duration (start_time to end_time) from the server:

  by hand   `dflash-eval run` in a new process: wall time from start to exit
  served    `dflash-eval serve` running (warm, flows/warm_runs.py); a flow run of evaluate-checkpoint is
            created through the API, as a `dflash-eval notify` event's trigger does: wall time from its
            creation to its Completed state, split into the wait for the runner's poll (creation to
            Pending) and the rest

Prints wall, flow and their ratio (target: wall at most 1.5x the flow).

Run: .venv/bin/python benchmarks/bench_fixed_cost.py [--mode by-hand|served|both] [--port 4251] [--profile DIR]
  --profile DIR: also write a cProfile of each timed command (DIR/<step>.prof; read with
  `python -m pstats`) and its `-X importtime` log (DIR/<step>.imports).
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a plain checkout, not installed too
from benchmarks.prefect_server import BIN, api, free_port, start_prefect_server, stop  # noqa: E402
from dflash_eval.flows.evaluate import run_name  # noqa: E402
from dflash_eval.tiny.build import TinyBuildSettings, default_cache_root, tiny_run  # noqa: E402


def timestamp(text: str) -> float:
    return datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def flow_duration(url: str, name: str) -> float:
    """Seconds from start to end of the newest flow run called `name`."""
    runs = api(url, "/flow_runs/filter", {"flow_runs": {"name": {"any_": [name]}}, "sort": "START_TIME_DESC",
                                          "limit": 1})
    return timestamp(runs[0]["end_time"]) - timestamp(runs[0]["start_time"])


def served_run(url: str, deployment_id: str, drafter: Path) -> tuple[float, float, float]:
    """Create a flow run of the deployment and wait for it: (wall, wait for pick-up, flow run's own) seconds."""
    created = time.time()
    run = api(url, f"/deployments/{deployment_id}/create_flow_run", {"parameters": {"drafter": str(drafter)}})
    while True:
        run = api(url, f"/flow_runs/{run['id']}")
        if run["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED"):
            break
        time.sleep(0.05)
    if run["state"]["type"] != "COMPLETED":
        sys.exit(f"served flow run of {drafter.name}: {run['state']['type']} {run['state'].get('message')}")
    wall = timestamp(run["state"]["timestamp"]) - created
    states = api(url, f"/flow_run_states/?flow_run_id={run['id']}")

    pending = min(timestamp(s["timestamp"]) for s in states if s["type"] == "PENDING")
    return wall, pending - created, timestamp(run["end_time"]) - timestamp(run["start_time"])


def start_serve(env: dict, tiny, store: Path, log: Path, url: str) -> tuple[subprocess.Popen, str]:
    """`dflash-eval serve` on the tiny run; returns it and the evaluate-checkpoint deployment's id."""
    serve = subprocess.Popen([str(BIN / "dflash-eval"), "serve", "--target", str(tiny.target_dir),
                              "--prompts", str(tiny.prompts_file), "--store", str(store),
                              "--max-new-tokens", str(tiny.record["settings"]["max_new_tokens"]),
                              "--report-port", "0"],
                             env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if serve.poll() is not None:
            sys.exit(f"dflash-eval serve exited with {serve.returncode}:\n{log.read_text()[-3000:]}")
        found = api(url, "/deployments/filter", {"deployments": {"name": {"any_": ["evaluate-checkpoint"]}}})
        if found:
            return serve, found[0]["id"]
        time.sleep(0.5)
    stop(serve)
    sys.exit("dflash-eval serve registered no deployment within 120 s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=["by-hand", "served", "both"], default="both")
    parser.add_argument("--port", type=int, default=None, help="The Prefect server's port (default: a free one).")
    parser.add_argument("--profile", type=Path, default=None,
                        help="By hand: write cProfile and importtime logs of the last step's command here.")
    args = parser.parse_args()

    tiny = tiny_run(default_cache_root(), TinyBuildSettings(arch="qwen3"))
    with tempfile.TemporaryDirectory(prefix="dflash-bench-fixed-") as tmp:
        root = Path(tmp)
        server, url = start_prefect_server(root / "prefect", args.port or free_port(), root / "prefect-server.log")
        try:
            env = {**os.environ, "PREFECT_API_URL": url, "PREFECT_HOME": str(root / "prefect"),
                   "PREFECT_SERVER_ANALYTICS_ENABLED": "false"}
            print(f"load average (1 min) at start: {os.getloadavg()[0]:.2f}")
            if args.mode in ("by-hand", "both"):
                by_hand(tiny, root / "store-by-hand", env, url, args.profile)
            if args.mode in ("served", "both"):
                served(tiny, root / "store-served", env, url, root / "serve.log")
            print(f"load average (1 min) at end: {os.getloadavg()[0]:.2f}")
        finally:
            stop(server)


def summary(rows: list[tuple[str, float, float]]) -> str:
    walls, flows = [r[1] for r in rows], [r[2] for r in rows]
    return (f"mean over {len(rows)} new checkpoints: wall {sum(walls) / len(rows):.2f} s, flow "
            f"{sum(flows) / len(rows):.2f} s, wall / flow {sum(walls) / sum(flows):.2f}x (target <= 1.5x)")


def by_hand(tiny, store: Path, env: dict, url: str, profile: Path | None) -> None:
    """`dflash-eval run` per checkpoint, each a new process."""
    def command(step: Path, prefix: list[str] = ()) -> list[str]:
        return [*prefix, str(BIN / "dflash-eval"), "run", "--target", str(tiny.target_dir),
                "--drafter", str(step), "--prompts", str(tiny.prompts_file),
                "--max-new-tokens", str(tiny.record["settings"]["max_new_tokens"]), "--store", str(store)]

    def timed(cmd: list[str]) -> float:
        t = time.perf_counter()
        result = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        wall = time.perf_counter() - t
        if result.returncode != 0:
            sys.exit(f"{' '.join(cmd)} failed ({result.returncode}):\n{result.stdout}")
        return wall

    print("by hand: `dflash-eval run`, a new process per checkpoint")
    first = timed(command(tiny.drafter_steps[0]))
    print(f"  warm-up: full evaluation of {tiny.drafter_steps[0].name}: {first:.1f} s wall")
    rows = []
    # with --profile the last step is kept for the profiled command (a scored one would be all cached)
    for step in tiny.drafter_steps[1:-1] if profile else tiny.drafter_steps[1:]:
        wall = timed(command(step))
        flow = flow_duration(url, run_name(str(step)))
        rows.append((step.name, wall, flow))
        print(f"  new checkpoint {step.name}: wall {wall:5.2f} s, flow run {flow:5.2f} s, "
              f"wall / flow {wall / flow:4.2f}x")
    if profile:
        profile.mkdir(parents=True, exist_ok=True)
        step = tiny.drafter_steps[-1]
        wall = timed(command(step, [sys.executable, "-m", "cProfile", "-o", str(profile / f"{step.name}.prof")]))
        print(f"  profiled {step.name}: wall {wall:.2f} s (with cProfile), flow run "
              f"{flow_duration(url, run_name(str(step))):.2f} s")
        # the same command again (all cached now): which modules it imports, and how long each takes
        log = subprocess.run([sys.executable, "-X", "importtime", *command(step)], env=env,
                             capture_output=True, text=True)
        (profile / f"{step.name}.imports").write_text(log.stderr)
        print(f"  profiles: {profile}")
    print("  by hand, " + summary(rows))


def served(tiny, store: Path, env: dict, url: str, log: Path) -> None:
    """Flow runs of a running `dflash-eval serve`, one per checkpoint."""
    print("served: `dflash-eval serve` running, a flow run of evaluate-checkpoint per checkpoint")
    serve, deployment = start_serve(env, tiny, store, log, url)
    try:
        wall, _, _ = served_run(url, deployment, tiny.drafter_steps[0])
        print(f"  warm-up: full evaluation of {tiny.drafter_steps[0].name}: {wall:.1f} s wall")
        rows = []
        for step in tiny.drafter_steps[1:]:
            wall, pickup, flow = served_run(url, deployment, step)
            rows.append((step.name, wall, flow))
            print(f"  new checkpoint {step.name}: wall {wall:5.2f} s (runner's poll {pickup:4.2f} s, then "
                  f"{wall - pickup:4.2f} s), flow run {flow:5.2f} s, wall / flow {wall / flow:4.2f}x, "
                  f"without the poll {(wall - pickup) / flow:4.2f}x")
        print("  served, " + summary(rows))
    finally:
        stop(serve, seconds=60)


if __name__ == "__main__":
    main()
