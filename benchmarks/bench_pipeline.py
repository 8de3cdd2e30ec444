"""Pipeline speed: scoring a new checkpoint with warm caches vs the first full run; feature reads.

1. On the tiny trained run (built or reused from the cache), in one process against Prefect's local
   server (started before timing): the first full flow run for step_100 into an empty store, then
   the run for the last step into the same store (references and features cached). Prints both
   times and their ratio (target: the warm run costs a small fraction of the first).
2. The store's read rate of hidden states (FeatureStore.read of every sequence, bf16 [K, T, H])
   vs np.load of the same bytes from .npy files, both from the page cache (best of 3 passes).

Run: .venv/bin/python benchmarks/bench_pipeline.py [--sequences 64] [--tokens 1024] [--hidden 1024]
"""

import argparse
import os
import tempfile
import time
from pathlib import Path

os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
os.environ.setdefault("PREFECT_LOGGING_LEVEL", "WARNING")

import numpy as np
import torch
from prefect import flow

from dflash_eval.flows.evaluate import evaluate_checkpoint
from dflash_eval.flows.settings import by_group
from dflash_eval.storage.feature_store import FeatureStore
from dflash_eval.tiny.build import default_cache_root, tiny_run


@flow
def start_prefect():
    """An empty flow: starts Prefect's temporary server before anything is timed."""


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def bench_new_checkpoint(store: Path) -> None:
    tiny = tiny_run(default_cache_root(), log=None)
    start_prefect()
    common = dict(target=str(tiny.target_dir), prompts=str(tiny.prompts_file),
                  max_new_tokens=tiny.record["settings"]["max_new_tokens"], store=str(store))
    first, t_first = timed(lambda: evaluate_checkpoint(**by_group({**common, "drafter": str(tiny.drafter_steps[0])})))
    warm, t_warm = timed(lambda: evaluate_checkpoint(**by_group({**common, "drafter": str(tiny.drafter_steps[-1])})))
    print(f"first full run ({tiny.drafter_steps[0].name}): {t_first:6.2f} s   stages {first['stages']}")
    print(f"new checkpoint ({tiny.drafter_steps[-1].name}): {t_warm:6.2f} s   stages {warm['stages']}")
    print(f"new checkpoint / first run: {t_warm / t_first:.2f}x  (32 prompts x up to 96 new tokens, tiny target)")


def bench_feature_reads(root: Path, sequences: int, tokens: int, hidden: int) -> None:
    layer_ids = [1, 2]
    features = FeatureStore(root / "features.zarr")
    generator = torch.Generator().manual_seed(0)
    for n in range(sequences):
        rows = tokens // 2 + (n * 37) % tokens  # ragged, as references are
        for layer in layer_ids:
            hidden_states = torch.randn(rows, hidden, generator=generator).to(torch.bfloat16)
            features.write(layer, n, hidden_states)
            np.save(root / f"{layer}_{n}.npy", hidden_states.view(torch.int16).numpy())
    total_bytes = sum((root / f"{layer}_{n}.npy").stat().st_size - 128 for layer in layer_ids for n in range(sequences))

    def read_store():
        return [features.read(layer_ids, n) for n in range(sequences)]

    def read_numpy():
        return [torch.stack([torch.from_numpy(np.load(root / f"{layer}_{n}.npy")).view(torch.bfloat16)
                             for layer in layer_ids]) for n in range(sequences)]

    read_store(), read_numpy()  # page cache warm for both
    a, t_store = min((timed(read_store) for _ in range(3)), key=lambda r: r[1])  # best of 3
    b, t_numpy = min((timed(read_numpy) for _ in range(3)), key=lambda r: r[1])
    assert all(torch.equal(x.view(torch.int16), y.view(torch.int16)) for x, y in zip(a, b))
    mb = total_bytes / 1e6
    print(f"feature reads, {sequences} sequences x {len(layer_ids)} layers, {mb:.0f} MB bf16 (warm page cache):")
    print(f"  store {mb / t_store:7.0f} MB/s   np.load {mb / t_numpy:7.0f} MB/s   store / np.load: {t_numpy / t_store:.2f}x rate")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=1024)
    args = parser.parse_args()
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    with tempfile.TemporaryDirectory() as tmp:
        bench_new_checkpoint(Path(tmp) / "store")
    with tempfile.TemporaryDirectory() as tmp:
        bench_feature_reads(Path(tmp), args.sequences, args.tokens, args.hidden)


if __name__ == "__main__":
    main()
