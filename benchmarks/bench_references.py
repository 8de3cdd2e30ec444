"""Reference throughput from a server: 8 requests in flight vs 1.

Starts `dflash-eval serve-reference` on the tiny trained target (built or reused from the cache) in
its own process, then asks it for the greedy completions of the same prompts through the SGLang
backend with a pool of 1 and of 8 connections, and prints tokens per second and their ratio. Both
runs must give identical completions (checked).

Run: .venv/bin/python benchmarks/bench_references.py [--prompts 32] [--new-tokens 64]
"""

import argparse
import json
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from transformers import AutoTokenizer

from dflash_core.target import read_target_config
from dflash_eval.services.reference.backends import SGLangBackend
from dflash_eval.tiny.build import default_cache_root, tiny_run


def start_server(target_dir) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen([sys.executable, "-m", "dflash_eval.cli", "serve-reference", "--target", str(target_dir),
                                "--port", str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    for line in process.stdout:
        if "listening on" in line:
            threading.Thread(target=process.stdout.read, daemon=True).start()  # keep the pipe drained
            return process, f"http://127.0.0.1:{port}"
    raise RuntimeError(f"serve-reference exited with {process.wait()}")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=64)
    args = parser.parse_args()
    tiny = tiny_run(default_cache_root(), log=None)
    prompts = [json.loads(line)["input_ids"] for line in tiny.prompts_file.read_text().splitlines()][: args.prompts]
    tokenizer = AutoTokenizer.from_pretrained(tiny.target_dir)
    stop = list(read_target_config(tiny.target_dir).eos_token_ids)
    server, url = start_server(tiny.target_dir)
    try:
        results = {}
        for concurrency in (1, 8, 1, 8):  # twice each, the second pair reported (warm server)
            backend = SGLangBackend(url, tokenizer, concurrency=concurrency)
            started = time.perf_counter()
            with ThreadPoolExecutor(concurrency) as pool:
                completions = list(pool.map(lambda p: backend.generate(p, args.new_tokens, stop).token_ids, prompts))
            results[concurrency] = (time.perf_counter() - started, completions)
    finally:
        server.kill()
    assert results[1][1] == results[8][1], "concurrency changed the completions"
    tokens = sum(len(c) for c in results[1][1])
    rate = {c: tokens / seconds for c, (seconds, _) in results.items()}
    print(f"{len(prompts)} prompts, {tokens} completion tokens, tiny target on CPU, server in its own process")
    print(f"  concurrency 1: {rate[1]:7.0f} tokens/s   concurrency 8: {rate[8]:7.0f} tokens/s   "
          f"8 vs 1: {rate[8] / rate[1]:.2f}x")


if __name__ == "__main__":
    main()
