"""The features and drafts stages on a Dask cluster (`--dask`, tasks/cluster.py): a `dask scheduler` and two
`dask worker --nthreads 1` processes on loopback, reporting to the session's Prefect server.

What must hold: the arrays and drafts.json are bit for bit those of a single-process run with the same
settings; both workers take shards, and the results say which one computed each; a worker killed while a
stage is midway costs nothing but time (Dask runs its shards again on the other); a scheduler that does not
answer gets one message before any work.
"""

import os
import shutil
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.dask_cluster import Cluster
from tests.ports import free_port
from tests.tiny_models import first_prompts

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

N_PROMPTS = 24  # three feature batches (tasks/features.py: BATCH_SIZE 8), three replay groups of REPLAY_GROUP
MAX_NEW = 48
REPLAY_GROUP = 8
SHARD_SECONDS = 1.0  # each shard's compute takes this much longer on the test's workers (cluster_worker_preload.py)
PRELOAD = Path(__file__).parent / "cluster_worker_preload.py"


def wait_for(condition, seconds: float, what: str, every: float = 0.05):
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if found := condition():
            return found
        time.sleep(every)
    raise AssertionError(f"timed out after {seconds} s waiting for {what}")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, prefect_api_url, s3_server):  # the workers inherit the S3 server's environment
    started = Cluster(tmp_path_factory.mktemp("dask-logs"), api_url=prefect_api_url, preload=PRELOAD,
                      env={"DFLASH_TEST_SHARD_SECONDS": str(SHARD_SECONDS)})
    try:
        yield started
    finally:
        started.stop()


@pytest.fixture(scope="module")
def prompts(tiny_qwen3_run, tmp_path_factory):
    return first_prompts(tiny_qwen3_run, N_PROMPTS, tmp_path_factory.mktemp("cluster-prompts") / "prompts.jsonl")


def arguments(run, prompts, store, **kwargs) -> dict:
    return dict(target=str(run.target_dir), drafter=str(run.drafter_steps[-1]), prompts=str(prompts),
                max_new_tokens=MAX_NEW, store=str(store), replay_group=REPLAY_GROUP, **kwargs)


def evaluate(run, prompts, store, **kwargs) -> dict:
    from tests.evaluations import run_evaluation

    return run_evaluation(**arguments(run, prompts, store, **kwargs))


@pytest.fixture(scope="module")
def single(tiny_qwen3_run, prompts, tmp_path_factory, prefect_api_url):
    """(results, store) of the evaluation in this process, no cluster, with the same settings."""
    store = tmp_path_factory.mktemp("single") / "store"
    return evaluate(tiny_qwen3_run, prompts, store), store


def store_with_references(single, path: Path) -> Path:
    """A new store holding (a copy of) the single run's references only: the runs on the cluster compute
    their features and drafts from the same references without generating them again."""
    shutil.copytree(single[1] / "references", path / "references")
    return path


def feature_bytes(store: Path, results: dict) -> dict[tuple[int, int], bytes]:
    from dflash_eval.storage import Store

    features = Store(store).feature_store(results["keys"]["features"])
    return {(layer, n): features.read_layer(layer, n, verify=True).numpy().tobytes()
            for layer in results["layer_ids"] for n in range(N_PROMPTS)}


def drafts_bytes(store: Path, results: dict) -> bytes:
    from dflash_eval.storage import Store

    return (Store(store).local_entry("drafts", results["keys"]["drafts"]) / "drafts.json").read_bytes()


def assert_same_as_single_process(results: dict, store: Path, single) -> None:
    expected, single_store = single
    assert results["keys"] == expected["keys"]  # the same content keys, replay group included
    assert feature_bytes(store, results) == feature_bytes(single_store, expected)
    assert drafts_bytes(store, results) == drafts_bytes(single_store, expected)
    assert [p["acceptance_lengths"] for p in results["per_prompt"]] == \
        [p["acceptance_lengths"] for p in expected["per_prompt"]]
    assert results["tau_macro"] == expected["tau_macro"]
    # the shards' pieces were merged into drafts.json and removed
    from dflash_eval.storage import Store

    assert not [key for stage, key, _ in Store(store).entries() if stage == "draft-shards"]


def test_a_run_on_the_cluster_equals_one_in_this_process(cluster, tiny_qwen3_run, prompts, single, tmp_path):
    store = store_with_references(single, tmp_path / "store")
    results = evaluate(tiny_qwen3_run, prompts, store, dask_address=cluster.address)
    assert results["stages"] == {"fetch": "ran", "references": "cached", "features": "ran", "drafts": "ran",
                                 "scores": "ran"}
    assert_same_as_single_process(results, store, single)
    assert "cluster" not in single[0] and results["replay_group"] == REPLAY_GROUP == single[0]["replay_group"]

    # each shard names the worker that computed it, and both workers took shards
    shards = results["cluster"]["shards"]
    workers = set(cluster.worker_pids())
    assert sorted(n for s in shards["features"] for n in s["sequences"]) == list(range(N_PROMPTS))
    assert [s["prompts"] for s in shards["drafts"]] == [[0, 8], [8, 16], [16, 24]]
    for stage in ("features", "drafts"):
        assert {s["worker"] for s in shards[stage]} == workers, shards[stage]
        assert all(s["host"] == socket.gethostname() and s["pid"] != os.getpid() and s["seconds"] >= SHARD_SECONDS
                   for s in shards[stage])
    # the records hold them too; the single-process entries hold none (their records are as before)
    from dflash_eval.storage import Store

    assert list(Store(store).read_record("drafts", results["keys"]["drafts"])["shards"]) == shards["drafts"]
    assert "shards" not in Store(single[1]).read_record("features", results["keys"]["features"])

    # a second run finds everything in the store: nothing goes to the cluster
    again = evaluate(tiny_qwen3_run, prompts, store, dask_address=cluster.address)
    assert again["stages"]["features"] == again["stages"]["drafts"] == "cached"
    assert again["cluster"]["shards"] == shards


def test_a_run_on_the_cluster_with_its_store_on_object_storage_equals_one_in_this_process(
        cluster, tiny_qwen3_run, prompts, single, s3_url, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_STORE_CACHE", str(tmp_path / "flow-machine"))
    results = evaluate(tiny_qwen3_run, prompts, s3_url, dask_address=cluster.address)
    assert set(results["stages"].values()) == {"ran"}
    assert_same_as_single_process(results, s3_url, single)
    for stage in ("features", "drafts"):
        assert {s["worker"] for s in results["cluster"]["shards"][stage]} == set(cluster.worker_pids())
    # the workers wrote the arrays into the bucket, and copied only what they read (references, the checkpoint)
    assert not list((tmp_path / "flow-machine").rglob("features.zarr"))
    copies = sorted(cluster.logs.glob("store-copy-*"))
    assert copies and all(not list(c.rglob("features.zarr")) for c in copies)
    assert any(list(c.rglob("references/*/*/seq_0.json")) for c in copies)


def test_a_worker_killed_midway_costs_only_time(cluster, tiny_qwen3_run, prompts, single, tmp_path):
    from dflash_eval.storage import Store

    store = store_with_references(single, tmp_path / "store")
    expected = single[0]
    features = Store(store).feature_store(expected["keys"]["features"])
    arrays = [(layer, n) for layer in expected["layer_ids"] for n in range(N_PROMPTS)]
    shard_dir = store / "draft-shards"

    with ThreadPoolExecutor(1) as pool:
        run = pool.submit(evaluate, tiny_qwen3_run, prompts, store, dask_address=cluster.address)
        # features midway: a batch's arrays are written, others are not
        batch = 8 * len(expected["layer_ids"])
        wait_for(lambda: run.done() or batch <= sum(features.has(*a) for a in arrays) < len(arrays), 180,
                 "the first feature batch")
        assert not run.done(), "the features stage ended before a worker could be killed"
        first, busy = cluster.kill_busy_worker()
        assert busy and sum(features.has(*a) for a in arrays) < len(arrays)  # killed with a shard to run
        cluster.start_worker()  # joins while the run goes on
        # drafts midway: a replay group is committed as its shard, others are not
        wait_for(lambda: run.done() or 1 <= len([p for p in shard_dir.glob("*/*/entry.json")]) < 3, 180,
                 "the first drafts shard")
        assert not run.done(), "the drafts stage ended before a worker could be killed"
        second, _ = cluster.kill_busy_worker()
        results = run.result(timeout=300)
    assert_same_as_single_process(results, store, single)
    # every shard is recorded once, by a worker that finished it (the killed ones' shards were run again, and
    # those they had finished were kept: feature arrays held, drafts shards committed)
    shards = results["cluster"]["shards"]
    assert sorted(n for s in shards["features"] for n in s["sequences"]) == list(range(N_PROMPTS))
    assert [s["prompts"] for s in shards["drafts"]] == [[0, 8], [8, 16], [16, 24]]
    assert {s["worker"] for stage in ("features", "drafts") for s in shards[stage]} <= \
        set(cluster.worker_pids()) | {first, second}
    cluster.start_worker()
    cluster.wait_for_workers(2)


def test_a_scheduler_that_does_not_answer_gets_one_message_and_nothing_runs(tiny_qwen3_run, prompts, tmp_path,
                                                                           prefect_api_url, monkeypatch):
    from typer.testing import CliRunner

    from dflash_eval.cli import app
    from dflash_eval.flows.checks import InputError
    from dflash_eval.tasks import cluster as cluster_tasks

    monkeypatch.setattr(cluster_tasks, "CONNECT_TIMEOUT_SECONDS", 1.0)  # nothing listens: no need to wait long
    nowhere = f"tcp://127.0.0.1:{free_port()}"
    store = tmp_path / "store"
    parameters = arguments(tiny_qwen3_run, prompts, store)
    command = ["run", *[x for name, value in parameters.items() for x in (f"--{name.replace('_', '-')}", str(value))]]
    result = CliRunner().invoke(app, [*command, "--dask", nowhere])
    assert result.exit_code == 2, result.output
    message = f"--dask {nowhere}: no Dask scheduler answered there"
    assert message in result.output and "dask scheduler" in result.output and "without --dask" in result.output
    assert len(result.output.strip().splitlines()) == 1
    assert not store.exists()  # refused before the input checks create the store
    result = CliRunner().invoke(app, command, env={"DFLASH_DASK_ADDRESS": nowhere})  # the variable says the same
    assert result.exit_code == 2 and message in result.output

    # a deployment's run (no command line before it): the flow run fails with it, before any stage
    from tests.evaluations import run_evaluation

    with pytest.raises(InputError, match=message):
        run_evaluation(**parameters, dask_address=nowhere)
    assert not (store / "references").exists() and not (store / "features").exists()


def test_a_sampled_run_at_fewer_draft_tokens_on_the_cluster_equals_one_in_this_process(cluster, tiny_qwen3_run,
                                                                                         prompts, tmp_path):
    served = dict(temperature=0.6, top_k=20, top_p=0.95, samples=2, seed=0, block_size=4, block_sizes=[2, 4])
    here_store = tmp_path / "here"
    here = evaluate(tiny_qwen3_run, prompts, here_store, **served)
    store = tmp_path / "store"
    shutil.copytree(here_store / "references", store / "references")
    results = evaluate(tiny_qwen3_run, prompts, store, dask_address=cluster.address, **served)
    assert results["stages"]["references"] == "cached" and results["stages"]["drafts"] == "ran"
    assert results["keys"] == here["keys"] and results["per_prompt"] == here["per_prompt"]
    assert drafts_bytes(store, results) == drafts_bytes(here_store, here)
    assert len(results["per_prompt"]) == 2 * N_PROMPTS and results["block_size"] == 4
    assert results["block_sweep"] == here["block_sweep"] and results["cluster"]["shards"]["drafts"]
