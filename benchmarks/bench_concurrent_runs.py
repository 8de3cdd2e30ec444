"""Several `dflash-eval run` commands on one machine at once: do they share the CPU or fight over it?

On the tiny trained Qwen3 run (built or reused from the cache): one `dflash-eval run` alone on a
fresh store, then N of them started together, each on its own fresh store (so each computes every
stage: references, features, drafts, scores), all with default settings (no --threads) unless
--threads is given. Each command starts its own temporary Prefect server, as a user's runs by hand do;
they share one PREFECT_HOME, warmed by a first run that is not timed. Prints the time one run takes
alone, the time until the last of the N together finished, and their ratio (target: at most 2.5x for
3 runs on 2 cores; perfect sharing of 2 busy cores would be 1.5x).

--busy N keeps N more processes spinning on the CPU meanwhile (a test suite, another user), for alone and
together alike.

Run: .venv/bin/python benchmarks/bench_concurrent_runs.py [--runs 3] [--threads N] [--repeat 1] [--busy 0]
"""

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dflash_eval.tiny.build import TinyBuildSettings, default_cache_root, tiny_run

CLI = str(Path(sys.executable).with_name("dflash-eval"))


def run_command(tiny, store: Path, threads: int | None) -> list[str]:
    command = [CLI, "run", "--target", str(tiny.target_dir), "--drafter", str(tiny.drafter_steps[-1]),
               "--prompts", str(tiny.prompts_file), "--max-new-tokens", str(tiny.record["settings"]["max_new_tokens"]),
               "--store", str(store)]
    return command + (["--threads", str(threads)] if threads else [])


def start(command: list[str], env: dict) -> subprocess.Popen:
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def finish(process: subprocess.Popen) -> float:
    """Waits for `process`; its wall time since `process.started`."""
    output, _ = process.communicate()
    if process.returncode != 0:
        sys.exit(f"{' '.join(process.args)} failed ({process.returncode}):\n{output}")
    return time.perf_counter() - process.started


def timed_runs(tiny, root: Path, n: int, threads: int | None, env: dict, label: str) -> list[float]:
    """Start n runs together, each on a new store under root; their wall times."""
    processes = []
    for i in range(n):
        process = start(run_command(tiny, root / f"{label}-{i}", threads), env)
        process.started = time.perf_counter()
        processes.append(process)
    return [finish(p) for p in processes]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="Runs started together.")
    parser.add_argument("--threads", type=int, default=None, help="Pass --threads N to every run (default: none).")
    parser.add_argument("--repeat", type=int, default=1, help="Measure alone / together this many times (best kept).")
    parser.add_argument("--busy", type=int, default=0, help="Processes spinning on the CPU meanwhile.")
    args = parser.parse_args()

    tiny = tiny_run(default_cache_root(), TinyBuildSettings(arch="qwen3"))
    load_at_start = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="dflash-bench-concurrent-") as tmp:
        root = Path(tmp)
        env = {**os.environ, "PREFECT_HOME": str(root / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
               "PREFECT_LOGGING_LEVEL": "WARNING"}
        env.pop("PREFECT_API_URL", None)  # runs by hand: each command starts its own temporary server
        timed_runs(tiny, root, 1, args.threads, env, "warm")  # creates PREFECT_HOME's database, fills page caches
        busy = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.busy)]
        try:
            alone, together = [], []
            for r in range(args.repeat):
                alone.append(timed_runs(tiny, root, 1, args.threads, env, f"alone{r}")[0])
                together.append(max(timed_runs(tiny, root, args.runs, args.threads, env, f"together{r}")))
        finally:
            for process in busy:
                process.kill()
                process.wait()
    one, all_n = min(alone), min(together)
    print(f"load average (1 min): {load_at_start:.2f} at start, {os.getloadavg()[0]:.2f} at end")
    print(f"threads: {args.threads or 'default'}; cores: {len(os.sched_getaffinity(0))}; "
          f"{args.busy} other processes spinning")
    print(f"one run alone:          {one:6.1f} s   (each try: {', '.join(f'{t:.1f}' for t in alone)})")
    print(f"{args.runs} runs together:       {all_n:6.1f} s   (until the last finished; each try: "
          f"{', '.join(f'{t:.1f}' for t in together)})")
    print(f"together / alone:       {all_n / one:6.2f}x  (target <= 2.5x)")


if __name__ == "__main__":
    main()
