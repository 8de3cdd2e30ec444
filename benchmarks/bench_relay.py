"""Relay download throughput vs a plain single-stream `requests` download of the same files.

Writes a checkpoint of random bytes (config.json + N safetensors-named files), serves it with
`dflash-eval relay serve` in its own process, then downloads it into fresh folders, best of 3:
  relay client: RelayClient.download (parallel files, resumable, every file sha256-verified)
  plain:        requests.get(stream=True) of each file in turn, written in 1 MiB chunks, no check
  plain+sha256: the same, then each file's sha256 (what verification costs when done afterwards)
and prints MB/s and the ratios (target: relay client >= 0.9x plain), for each link:
  loopback: no limit. Client, relay and sha256 share this machine's cores, so the CPU is the link:
            the plain download's client needs ~1 core at ~3 GB/s, and sha256 runs at ~1.8 GB/s on
            one core; with 2 cores no verified download can reach 0.9x (printed as the bound).
  --link-mb R: the relay caps what it sends at R MB/s in total (`relay serve --max-rate-mb`), as a
            network link would: 1250 is 10 GbE, 125 is 1 GbE.

A single file's sha256 runs on one core, so on loopback a checkpoint of few large files is
verified at most at sha256's rate; over a real link (<= 10 GbE) hashing keeps up.

Run: .venv/bin/python benchmarks/bench_relay.py [--files 3] [--mb 128] [--link-mb 1250 125]
"""

import argparse
import hashlib
import inspect
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

from dflash_eval.services.relay.client import RelayClient
from dflash_eval.storage.hashing import file_sha256


def start_relay(root: Path, state: Path, max_rate_mb: float | None = None) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "dflash_eval.cli", "relay", "serve", str(root), "--port", str(port),
               "--settle-seconds", "0", "--state-dir", str(state)]
    if max_rate_mb:
        command += ["--max-rate-mb", str(max_rate_mb)]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in process.stdout:
        if "listening on" in line:
            threading.Thread(target=process.stdout.read, daemon=True).start()  # keep the pipe drained
            return process, f"http://127.0.0.1:{port}"
    raise RuntimeError(f"relay exited with {process.wait()}")


def best_of(n, fn, fresh: Path) -> float:
    times = []
    for _ in range(n):
        shutil.rmtree(fresh, ignore_errors=True)
        fresh.mkdir(parents=True)
        started = time.perf_counter()
        fn(fresh)
        times.append(time.perf_counter() - started)
    return min(times)


def sha256_rate(n_bytes: int = 256 << 20) -> float:
    """sha256 bytes/s on one core."""
    data = os.urandom(n_bytes)
    started = time.perf_counter()
    hashlib.sha256(data).digest()
    return n_bytes / (time.perf_counter() - started)


def measure(served: Path, state: Path, names: list[str], max_rate_mb: float | None, scratch: Path) -> dict[str, float]:
    """Seconds (best of 3) for each way of downloading run1/step_1000 from a relay over `served`."""
    relay, url = start_relay(served, state, max_rate_mb)
    try:
        client = RelayClient(url)
        client.manifest("run1/step_1000")  # the relay hashes the files once, before timing

        def plain(destination: Path):
            for name in ["config.json", *names]:
                with requests.get(f"{url}/v1/files/run1/step_1000/{name}", stream=True, timeout=60) as response:
                    response.raise_for_status()
                    with open(destination / name, "wb") as f:
                        for chunk in response.iter_content(1 << 20):
                            f.write(chunk)

        def plain_then_verified(destination: Path):
            plain(destination)
            for name in ["config.json", *names]:
                file_sha256(destination / name)

        return {
            "plain": best_of(3, plain, scratch / "plain"),
            "plain+sha256": best_of(3, plain_then_verified, scratch / "checked"),
            "relay": best_of(3, lambda d: client.download("run1/step_1000", d), scratch / "relay"),
        }
    finally:
        relay.kill()
        client.close()


def write_shard(path: Path, tensor: str, nbytes: int) -> None:
    """A safetensors file of one uint8 tensor of random bytes (the relay checks that a weight file is as
    long as its header says)."""
    header = json.dumps({tensor: {"dtype": "U8", "shape": [nbytes], "data_offsets": [0, nbytes]}}).encode()
    with open(path, "wb") as f:
        f.write(len(header).to_bytes(8, "little") + header)
        for _ in range(nbytes >> 20):
            f.write(os.urandom(1 << 20))


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=3)
    parser.add_argument("--mb", type=int, default=128)
    parser.add_argument("--link-mb", type=float, nargs="*", default=[1250, 125],
                        help="link speeds (MB/s) to measure besides unlimited loopback")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        checkpoint = tmp / "served" / "run1" / "step_1000"
        checkpoint.mkdir(parents=True)
        (checkpoint / "config.json").write_text(json.dumps({"block_size": 16}))
        names = [f"model-{i:05d}-of-{args.files:05d}.safetensors" for i in range(1, args.files + 1)]
        for i, name in enumerate(names):
            write_shard(checkpoint / name, f"layers.{i}.weight", args.mb << 20)
        # The index the relay requires of a sharded save before it publishes it (finished, not being written).
        index = {"metadata": {}, "weight_map": {f"layers.{i}.weight": name for i, name in enumerate(names)}}
        (checkpoint / "model.safetensors.index.json").write_text(json.dumps(index))
        names.append("model.safetensors.index.json")
        total_mb = sum(p.stat().st_size for p in checkpoint.iterdir()) / 1e6
        sha_mb = sha256_rate() / 1e6
        parallel = inspect.signature(RelayClient.download).parameters["parallel"].default
        print(f"{total_mb:.0f} MB in {len(names) + 1} files, best of 3; relay client: up to {parallel} files in "
              f"parallel, resumable, every file sha256-verified")
        for rate in [None, *args.link_mb]:
            t = measure(tmp / "served", tmp / "state", names, rate, tmp / "scratch")
            link = f"link {rate:.0f} MB/s" if rate else "loopback, no limit"
            print(f"\n{link}:")
            print(f"  plain requests       {total_mb / t['plain']:7.0f} MB/s")
            print(f"  plain, then sha256   {total_mb / t['plain+sha256']:7.0f} MB/s")
            print(f"  relay client         {total_mb / t['relay']:7.0f} MB/s   "
                  f"relay client / plain: {t['plain'] / t['relay']:.2f}x   "
                  f"/ plain + sha256: {t['plain+sha256'] / t['relay']:.2f}x")
            if rate is None:
                cores = os.cpu_count() or 1
                # Client CPU at least: receiving like the plain client (~1 core at the plain rate) + sha256.
                bound_s = (total_mb / (total_mb / t["plain"]) + total_mb / sha_mb) / cores
                print(f"  bound on {cores} cores: sha256 {sha_mb:.0f} MB/s per core, so a verified download "
                      f"is at most ~{t['plain'] / bound_s:.2f}x plain here (client CPU only)")


if __name__ == "__main__":
    main()
