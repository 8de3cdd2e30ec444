"""Relay download throughput on loopback vs a plain single-stream `requests` download of the same files.

Writes a checkpoint of random bytes (config.json + N safetensors-named files), serves it with
`dflash-eval relay serve` in its own process, then downloads it twice into fresh folders, best of 3:
  relay client: RelayClient.download (parallel files, resumable, every file sha256-verified)
  plain:        requests.get(stream=True) of each file in turn, written in 1 MiB chunks, no check
  plain+sha256: the same, then each file's sha256 (what the relay client's verification costs)
and prints MB/s and the ratios (target: relay client >= 0.9x plain). On loopback out of the page
cache the link is not the limit: sha256 (~1.8 GB/s on one core) is, on a 2-core machine also running
the relay.

Run: .venv/bin/python benchmarks/bench_relay.py [--files 3] [--mb 128]
"""

import argparse
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

from storage.hashing import file_sha256
from storage.relay_client import RelayClient


def start_relay(root: Path, state: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "flows.cli", "relay", "serve", str(root), "--port", str(port),
                                "--settle-seconds", "0", "--state-dir", str(state)],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
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


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", type=int, default=3)
    parser.add_argument("--mb", type=int, default=128)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        checkpoint = tmp / "served" / "run1" / "step_1000"
        checkpoint.mkdir(parents=True)
        (checkpoint / "config.json").write_text(json.dumps({"block_size": 16}))
        names = [f"model-{i:05d}-of-{args.files:05d}.safetensors" for i in range(1, args.files + 1)]
        for name in names:
            with open(checkpoint / name, "wb") as f:
                for _ in range(args.mb):
                    f.write(os.urandom(1 << 20))
        total_mb = sum(p.stat().st_size for p in checkpoint.iterdir()) / 1e6
        relay, url = start_relay(tmp / "served", tmp / "state")
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

            t_plain = best_of(3, plain, tmp / "plain")
            t_checked = best_of(3, plain_then_verified, tmp / "checked")
            t_relay = best_of(3, lambda d: client.download("run1/step_1000", d), tmp / "relay")
        finally:
            relay.kill()
    print(f"{total_mb:.0f} MB in {args.files + 1} files over loopback (best of 3):")
    print(f"  plain requests       {total_mb / t_plain:7.0f} MB/s   relay client / plain:            {t_plain / t_relay:.2f}x")
    print(f"  plain, then sha256   {total_mb / t_checked:7.0f} MB/s   relay client / plain + sha256:   {t_checked / t_relay:.2f}x")
    print(f"  relay client         {total_mb / t_relay:7.0f} MB/s   (resumable, every file sha256-verified, "
          f"{args.files} files in parallel)")


if __name__ == "__main__":
    main()
