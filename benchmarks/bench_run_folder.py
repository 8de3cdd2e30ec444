"""Several checkpoints in one command against one command each: `dflash-eval run --drafter RUN_FOLDER` over the
tiny trained Qwen3 run's saves, against one `dflash-eval run --drafter STEP` per save.

Both ways run with Prefect's temporary server (no PREFECT_API_URL: its start in each process is part of what one
process saves), each into a store of its own that the same references and features were first put into (`stage
features`, not timed), so both do the same work per checkpoint: fetch, drafts, scores. Prints
the wall time of each way, their ratio, and whether every checkpoint's acceptance lengths agree.

Run: OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_run_folder.py [--prompts N]
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a plain checkout, not installed too
from benchmarks.prefect_server import BIN  # noqa: E402
from dflash_eval.tiny.build import TinyBuildSettings, default_cache_root, tiny_run  # noqa: E402


def dflash_eval(*arguments: str, env: dict) -> float:
    """Run `dflash-eval ARGUMENTS`; its wall time in seconds (exits on failure)."""
    started = time.perf_counter()
    result = subprocess.run([str(BIN / "dflash-eval"), *arguments], env=env, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"dflash-eval {' '.join(arguments)} failed ({result.returncode}):\n{result.stdout[-2000:]}"
                 f"\n{result.stderr[-2000:]}")
    return time.perf_counter() - started


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=10, help="Held-out prompts of the tiny run to evaluate on.")
    args = parser.parse_args()
    tiny = tiny_run(default_cache_root(), TinyBuildSettings(arch="qwen3"))
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    with tempfile.TemporaryDirectory(prefix="bench-run-folder-") as tmp:
        root = Path(tmp)
        env.update(PREFECT_HOME=str(root / "prefect"), PREFECT_SERVER_ANALYTICS_ENABLED="false")
        prompts = root / "prompts.jsonl"
        prompts.write_text("".join(tiny.prompts_file.read_text().splitlines(keepends=True)[:args.prompts]))
        run = root / "run"
        for step in tiny.drafter_steps:
            shutil.copytree(step, run / step.name)
        common = ["--target", str(tiny.target_dir), "--prompts", str(prompts), "--max-new-tokens",
                  str(tiny.record["settings"]["max_new_tokens"])]
        first = run / tiny.drafter_steps[0].name
        for way in ("each", "folder"):  # the same references and features in both stores, before the clock starts
            dflash_eval("stage", "features", *common, "--drafter", str(first), "--store", str(root / way), env=env)
        steps = [run / step.name for step in tiny.drafter_steps]
        each = sum(dflash_eval("run", *common, "--drafter", str(step), "--store", str(root / "each"), "--out",
                               str(root / "each-out" / f"{step.name}.json"), env=env) for step in steps)
        folder = dflash_eval("run", *common, "--drafter", str(run), "--store", str(root / "folder"), "--out",
                             str(root / "folder-out"), env=env)
        agree = all(
            [p["acceptance_lengths"] for p in json.loads((root / "each-out" / f"{step.name}.json").read_text())
             ["per_prompt"]]
            == [p["acceptance_lengths"] for p in json.loads((root / "folder-out" / f"{step.name}.json").read_text())
                ["per_prompt"]]
            for step in steps)
    print(f"{len(steps)} checkpoints, {args.prompts} prompts, threads {os.environ.get('OMP_NUM_THREADS', 'default')}")
    print(f"one command each:    {each:6.1f} s ({each / len(steps):.1f} s per checkpoint)")
    print(f"one for the folder:  {folder:6.1f} s ({folder / len(steps):.1f} s per checkpoint)")
    print(f"ratio (all / each): {folder / each:.2f}; acceptance lengths {'identical' if agree else 'DIFFER'}")
    return 0 if agree else 1


if __name__ == "__main__":
    sys.exit(main())
