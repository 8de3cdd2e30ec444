"""Beyond one machine: the features stage of the tiny run on a Dask cluster of 2 workers against 1, and store
reads from an S3 server against a local store.

1. extraction: a `dask scheduler` and `dask worker --nthreads 1` processes on loopback (as the tests start
   them), then the features stage of the tiny run (its eval prompts) through `--dask`, into a fresh store
   each time: once with 1 worker, once with 2. Prints seconds and the ratio (2 workers / 1). Each worker
   computes with one torch thread; on this 2-core machine the flow process and the scheduler share the
   cores with them, so the ratio is the floor of what real machines give.
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
    parser.add_argument("--skip-extraction", action="store_true")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as work:
        if not args.skip_extraction:
            extraction(Path(work))
        store_reads(args, Path(work))


if __name__ == "__main__":
    main()
