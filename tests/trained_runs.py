"""The trained tiny runs the tests share (conftest's fixtures) and the drafters trained with a bug planted
(tests/test_planted_bugs.py): built once per machine into the tiny cache ($DFLASH_TINY_CACHE, else
~/.cache/dflash-eval/tiny), about 15 minutes of one core in all when missing.

`pytest -n 2` runs two workers on one thread each, and the first to need a run would build it while the other
waits for it. So before a parallel session starts, conftest builds the trained runs that are missing two at a
time, then trains the planted drafters at a low priority while the tests run (`build_before_a_parallel_session`),
each builder a process of its own on one thread:

    python -m tests.trained_runs qwen3 planted:clean ...
"""

import os
import subprocess
import sys
from pathlib import Path

from dflash_eval.tiny.build import BUILD_RECORD, TinyBuildSettings, TinyRun, default_cache_root, tiny_run, tiny_run_key
from dflash_eval.tiny.training import DrafterTrainingSettings

RUNS = {
    "qwen3": TinyBuildSettings(arch="qwen3"),
    # two saved steps are enough here (the Qwen3 run covers tau rising with training)
    "qwen3_5": TinyBuildSettings(arch="qwen3_5", drafter_training=DrafterTrainingSettings(steps=200, save_every=100)),
    # a DFlash2 drafter (convolutions, candidate selector) on the Qwen3 run's target
    "qwen3_dflash2": TinyBuildSettings(arch="qwen3", drafter_architecture="DFlash2DraftModel"),
    # a DSpark drafter (Markov and confidence heads) on the Qwen3 run's target, trained and saved as DeepSpec does:
    # block 7 (every slot drafts: 7 drafts, up to 8 tokens a step), full attention layers of the target's shapes
    "qwen3_dspark": TinyBuildSettings(arch="qwen3", drafter_architecture="Qwen3DSparkModel", block_size=7,
                                      drafter_layer_types=("full_attention", "full_attention")),
}
PLANTED = ("planted:clean", "planted:leaked_block", "planted:shifted_label", "planted:noisy_features",
           "planted:noisy_logits")


def trained_run(name: str) -> TinyRun:
    """The trained run `name` (a key of RUNS), built first if the cache lacks it, on one thread: trained weights
    depend on the thread count (a target trained on 2 threads differs from one trained on 1), and every other
    builder of these runs (the builders below, `demo`) trains on one, so whoever builds a run first builds the same."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return tiny_run(default_cache_root(), RUNS[name])
    finally:
        torch.set_num_threads(threads)


def build(jobs: list[str]) -> None:
    """Build each job in turn: a key of RUNS, or `planted:<bug>` (`planted:clean`: the clean twin)."""
    from tests.planted import planted_run

    for job in jobs:
        if job.startswith("planted:"):
            bug = job.removeprefix("planted:")
            planted_run(trained_run("qwen3"), None if bug == "clean" else bug)
        else:
            trained_run(job)


def build_before_a_parallel_session() -> subprocess.Popen | None:
    """Build the trained runs the cache lacks two at a time (one process each, one thread each) and wait for them;
    then start training the planted drafters in a process of its own at a low priority, which uses the cores
    while the tests wait on servers and processes (tests/test_planted_bugs.py runs last, and waits for what is not
    built yet). Returns that process (None when nothing is missing); a failed build raises with its output's end."""
    root = Path(__file__).resolve().parents[1]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    builders = {name: subprocess.Popen([sys.executable, "-m", "tests.trained_runs", name], cwd=root, env=env,
                                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                for name in RUNS if not (tiny_run_folder(name) / BUILD_RECORD).exists()}
    failed = []
    for name, builder in builders.items():
        output, _ = builder.communicate()
        if builder.returncode != 0:
            failed.append(f"{name} failed ({builder.returncode}):\n{output[-3000:]}")
    if failed:
        raise RuntimeError("building the trained tiny runs: " + "\n".join(failed))
    return subprocess.Popen(["nice", "-n", "10", sys.executable, "-m", "tests.trained_runs", *PLANTED], cwd=root,
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def tiny_run_folder(name: str) -> Path:
    """Where the trained run `name` is (or will be) cached."""
    return default_cache_root() / tiny_run_key(RUNS[name])


if __name__ == "__main__":
    build(sys.argv[1:])
