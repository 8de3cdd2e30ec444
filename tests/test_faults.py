"""The fault suite: `dflash-eval run` SIGKILLed at 10 points spread over every stage, each followed by a
rerun that must give exactly the uninterrupted run's results, recompute no finished work and leave no
process behind.

Kill points are writes (tests/fault_run.py): just before or just after the K-th record, feature array
or file copy of a run. An uninterrupted counting run lists every write and the stage it belongs to;
the 10 points are drawn (seeded): 2 in each stage, so every stage is hit.
"""

import json
import os
import random
import subprocess
import sys
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.tiny_models import first_prompts

pytestmark = pytest.mark.slow

STAGES = ("fetch", "references", "features", "drafts", "scores")
N_KILLS = 10
N_PROMPTS = 3
MAX_NEW = 24
REPO = Path(__file__).parent.parent


@pytest.fixture(scope="module")
def prompts(tiny_qwen3_run, tmp_path_factory):
    path = first_prompts(tiny_qwen3_run, N_PROMPTS, tmp_path_factory.mktemp("faults") / "prompts.jsonl")
    return path


def run(tiny, prompts, store: Path, api_url: str, kill_at: tuple[str, int] | None = None, out: Path | None = None):
    """`dflash-eval run` in its own process (killed at `kill_at`, (before|after, write), or counting its
    writes)."""
    events = store.parent / f"{store.name}.events"
    runner = ["-m", "tests.fault_run", "{}:{}".format(*kill_at) if kill_at else "count", str(events)]
    command = [sys.executable, *runner, "run", "--target", str(tiny.target_dir),
               "--drafter", str(tiny.drafter_steps[-1]), "--prompts", str(prompts),
               "--max-new-tokens", str(MAX_NEW), "--store", str(store)]
    if out is not None:
        command += ["--out", str(out)]
    env = {**os.environ, "PREFECT_API_URL": api_url, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True, timeout=600,
                          start_new_session=True)
    return done, events


def stage_of(path: str, store: Path) -> str | None:
    parts = Path(path).relative_to(store).parts if path.startswith(str(store)) else ()
    return parts[0] if parts and parts[0] in STAGES else None


def finished_work(store: Path) -> dict[str, int]:
    """path -> mtime_ns of what a rerun must not redo: committed entries, complete feature arrays,
    finished references."""
    found = {}
    for marker in store.glob("*/??/*/entry.json"):
        found[str(marker)] = marker.stat().st_mtime_ns
    for array in store.glob("features/??/*/features.zarr/layer_*/seq_*/zarr.json"):
        if json.loads(array.read_text()).get("attributes", {}).get("complete"):
            found[str(array)] = array.stat().st_mtime_ns
    for reference in store.glob("references/??/*/seq_*.json"):
        found[str(reference)] = reference.stat().st_mtime_ns
    return found


def processes_naming(text: str) -> list[int]:
    """Live processes whose command line mentions `text`."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                if text in (proc / "cmdline").read_bytes().decode(errors="replace"):
                    pids.append(int(proc.name))
            except OSError:
                continue
    return pids


def test_sigkills_across_every_stage_each_resume_to_the_uninterrupted_results(
        tiny_qwen3_run, prompts, tmp_path, prefect_api_url):
    clean_store = tmp_path / "clean"
    done, events = run(tiny_qwen3_run, prompts, clean_store, prefect_api_url, out=tmp_path / "clean.json")
    assert done.returncode == 0, done.stdout + done.stderr
    clean = json.loads((tmp_path / "clean.json").read_text())
    writes = defaultdict(list)  # stage -> write indices
    for line in events.read_text().splitlines():
        index, _, path = line.split("\t")
        if stage := stage_of(path, clean_store):
            writes[stage].append(int(index))
    assert set(writes) == set(STAGES), dict(writes)

    rng = random.Random(13)
    points = {stage: [(k, when) for k in writes[stage] for when in ("before", "after")] for stage in STAGES}
    kill_points = {(k, when, stage) for stage in STAGES for k, when in rng.sample(points[stage], 2)}
    rest = sorted({(k, when, stage) for stage in STAGES for k, when in points[stage]} - kill_points)
    kill_points = sorted(kill_points | set(rng.sample(rest, N_KILLS - len(kill_points))))
    assert len(kill_points) == N_KILLS and {s for *_, s in kill_points} == set(STAGES)

    def kill_and_resume(point):
        k, when, stage = point
        store = tmp_path / f"killed_{when}_{k}"
        killed, _ = run(tiny_qwen3_run, prompts, store, prefect_api_url, kill_at=(when, k))
        assert killed.returncode == -9, f"{when} write {k} ({stage}): {killed.stdout[-2000:]}{killed.stderr[-2000:]}"
        assert processes_naming(str(store)) == [], f"{when} write {k} ({stage}): processes left behind"
        before = finished_work(store)

        out = tmp_path / f"resumed_{when}_{k}.json"
        resumed, _ = run(tiny_qwen3_run, prompts, store, prefect_api_url, out=out)
        assert resumed.returncode == 0, f"{when} write {k} ({stage}): {resumed.stdout[-3000:]}{resumed.stderr[-3000:]}"
        results = json.loads(out.read_text())
        assert results["per_prompt"] == clean["per_prompt"], f"{when} write {k} ({stage})"
        assert results["keys"] == clean["keys"] and results["tau_macro"] == clean["tau_macro"]
        after = finished_work(store)
        redone = sorted(p for p, mtime in before.items() if after.get(p) != mtime)
        assert not redone, f"{when} write {k} ({stage}): finished work recomputed: {redone}"
        assert processes_naming(str(store)) == []

    # Two at a time (each process runs one torch thread; most of a run is its ~9 s of imports): every
    # point has a store of its own, so they cannot meet.
    with ThreadPoolExecutor(max_workers=2) as pool:
        for done in [pool.submit(kill_and_resume, point) for point in kill_points]:
            done.result()
