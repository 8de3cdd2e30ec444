"""Beyond one machine: the features stage of the tiny run on a Dask cluster of 2 workers against 1, and store
reads from an S3 server against a local store.

1. extraction: the features stage of the tiny run (its 32 eval prompts: 4 batches, so 4 shards) in this
   process, then through `--dask` on a `dask scheduler` with 1 and with 2 `dask worker --nthreads 1`
   processes on loopback (tests/dask_cluster.py, as the tests start them), each into a fresh store holding
   the same references (in this process on one thread, as each worker), twice per cluster: new workers (each imports the stages and loads the target on its
   first shard) and warm ones (a long-lived cluster's steady state: the target stays loaded in each worker
   process). The features task run's own time (its Running to its end, from the Prefect server) is timed.
   Prints seconds and the ratios (2 workers / 1, 1 worker / this process). Each worker
   computes on one torch thread; on a 2-core machine the flow process and the scheduler share the cores
   with them, and the tiny target extracts a batch in well under a second, so per-shard overheads (a
   Prefect task run, the first load of the target in each worker) weigh far more than at a real shape.
2. store reads: the feature arrays the drafts stage reads (float32 [T, H] per layer and sequence, verified
   against their sha256 as FeatureReader reads them), from a local store and from a store on moto's S3
   server (a Python process on loopback: far slower per request than S3 itself, so the ratio is the
   worst case), best of 3; and a second machine's first read of a references entry (every file copied
   and hashed). Prints MB/s and the ratios (S3 / local).

Run: .venv/bin/python benchmarks/bench_cluster.py [--layers 5] [--hidden 1024] [--sequences 32] [--tokens 512]
"""

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the S3 server and cluster the tests start
from dflash_eval.storage import Store, key_of, write_json_atomic  # noqa: E402
from tests.s3_server import fresh_prefix, running_s3_server  # noqa: E402

KEY = key_of({"bench": "cluster"})


def best_of(n: int, fn) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return min(times)


def extraction(args, work: Path) -> None:
    import shutil

    from dflash_eval.tiny.build import TinyBuildSettings, default_cache_root, tiny_run
    from tests.dask_cluster import Cluster
    from tests.evaluations import run_evaluation

    tiny = tiny_run(default_cache_root(), TinyBuildSettings(arch="qwen3"))
    common = dict(target=str(tiny.target_dir), drafter=str(tiny.drafter_steps[-1]), prompts=str(tiny.prompts_file),
                  max_new_tokens=args.max_new_tokens)
    # the references once: every timed run extracts from a copy of them
    run_evaluation(**common, store=str(work / "references"), until="references")

    def features_seconds(name: str, dask_address: str | None) -> float:
        store = work / name
        shutil.copytree(work / "references" / "references", store / "references")
        state = run_evaluation(**common, store=str(store), until="features", dask_address=dask_address,
                                    return_state=True)
        results = state.result()
        assert results["stages"]["features"] == "ran"
        seconds = task_run_seconds(state.state_details.flow_run_id, "features")
        shards = results.get("cluster", {}).get("shards", {}).get("features", [])
        workers = len({s["worker"] for s in shards})
        print(f"features stage, {name}: {seconds:.1f} s" + (f" ({len(shards)} shards on {workers} workers)"
                                                            if shards else ""))
        return seconds

    features_seconds("in this process, first", None)  # this process's first target load, not timed
    seconds = {"here": features_seconds("in this process", None)}
    for n in (1, 2):
        logs = work / f"dask-{n}"
        logs.mkdir()
        cluster = Cluster(logs, workers=n)
        workers = f"{n} worker{'s' if n > 1 else ''}"
        try:
            seconds[n, "new"] = features_seconds(f"{workers}, new (imports, target loads)", cluster.address)
            seconds[n] = features_seconds(f"{workers}, warm", cluster.address)
        finally:
            cluster.stop()
    print(f"extraction, warm workers: 2 workers / 1 worker = {seconds[2] / seconds[1]:.2f} (time); "
          f"1 worker / in this process = {seconds[1] / seconds['here']:.2f}; new workers: 2 / 1 = "
          f"{seconds[2, 'new'] / seconds[1, 'new']:.2f}")


def task_run_seconds(flow_run_id, name: str) -> float:
    """How long the flow run's task `name` ran, from its Running to its final state (the server's clock: the
    flow run's own start and end, and its polling, left out)."""
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    with get_client(sync_client=True) as client:
        runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
    (run,) = [r for r in runs if r.name.rsplit("-", 1)[0] == name]
    return (run.end_time - run.start_time).total_seconds()


def store_reads(args, work: Path) -> None:
    layer_ids = list(range(args.layers))
    hidden = {(layer, n): torch.randn(args.tokens, args.hidden) for layer in layer_ids for n in range(args.sequences)}
    total_mb = sum(t.numel() * 4 for t in hidden.values()) / 1e6
    with running_s3_server():
        stores = {"local": Store(work / "local"), "s3": Store(fresh_prefix("bench"), cache=work / "cache")}
        rates = {}
        for name, store in stores.items():
            features = store.feature_store(KEY)
            for (layer, n), tensor in hidden.items():
                features.write(layer, n, tensor)

            def read_all():
                for n in range(args.sequences):
                    features.read(layer_ids, n, verify=True)

            seconds = best_of(3, read_all)
            rates[name] = total_mb / seconds
            print(f"features, {name:5}: {total_mb:.0f} MB in {seconds:.2f} s, {rates[name]:.0f} MB/s")
        print(f"feature reads: S3 rate / local rate = {rates['s3'] / rates['local']:.2f}")

        # a references entry (one small JSON per prompt) read by a machine that has none of it yet
        copies = {}
        for name, store in stores.items():
            directory = store.begin("references", KEY)
            for n in range(args.sequences * 8):
                write_json_atomic(directory / f"seq_{n}.json", {"token_ids": list(range(n, n + 1024))})
            store.commit("references", KEY, {"n": args.sequences * 8})
            fresh = Store(store.location, cache=work / f"fresh-{name}") if store.remote else store
            copies[name] = best_of(1, lambda: fresh.local_entry("references", KEY))
            print(f"references entry ({args.sequences * 8} files), first read on a machine, {name:5}: "
                  f"{copies[name] * 1e3:.0f} ms")
        print(f"first read of an entry: S3 time / local time = {copies['s3'] / copies['local']:.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=5)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--sequences", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--max-new-tokens", type=int, default=448,
                        help="of the tiny run's references (extraction; the tiny target has 512 positions)")
    parser.add_argument("--skip-extraction", action="store_true")
    args = parser.parse_args()
    from dflash_eval.tasks.threads import configure_threads

    configure_threads(1)  # as each worker computes (dask worker --nthreads 1): the in-process run is comparable
    with tempfile.TemporaryDirectory() as work:
        if not args.skip_extraction:
            extraction(args, Path(work))
        store_reads(args, Path(work))


if __name__ == "__main__":
    main()
