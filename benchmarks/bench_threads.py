"""How many torch threads each stage's ops should run on: 1 thread vs all of this process's cores.

Builds Qwen3 targets of a few sizes and a one-layer DFlash drafter for each (random weights, in
memory), and times the ops the stages run, in one process:

  decode    greedy decoding with a KV cache, one token per forward (the references stage, the
            reference server): time per token
  forward   teacher-forced forward of 8 sequences x 128 tokens (the features stage): time per batch
  replay    the drafter's replay over those features (the drafts and diagnostics stages), batches of
            up to 64 blocks: time per reference set

each with 1 thread (the baseline) and with N threads (default: this machine's cores), alternating, best
of --repeat, on an otherwise idle machine and with one other process keeping one core busy (another run, another agent). Prints the
work per op (parameters x tokens one forward processes, what tasks/threads.py's rule reads) and the
ratio N threads / 1 thread (below 1: more threads are faster). tasks/threads.py's SMALL_OP_WORK
was chosen from these numbers.

Run: .venv/bin/python benchmarks/bench_threads.py [--threads 2] [--repeat 3] [--sizes tiny,small,medium]
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from dflash_core.decoding import greedy_decode
from dflash_core.drafter import DFlashDrafter
from dflash_core.drafter_config import DrafterConfig
from dflash_core.features import extract_features
from dflash_core.replay import Reference, replay
from dflash_core.target import Target

# (hidden, intermediate, layers, heads, kv heads, vocab): tiny is the tiny trained fixture's shape
SIZES = {
    "tiny": (192, 576, 4, 6, 2, 512),
    "small": (512, 1536, 4, 8, 2, 4096),
    "medium": (768, 2048, 12, 12, 4, 32000),
    "large": (1024, 3072, 16, 16, 8, 32000),
}
BATCH, SEQ_LEN, PROMPT_LEN, NEW_TOKENS, BLOCK = 8, 128, 32, 32, 8


def build(size: str):
    hidden, inter, layers, heads, kv, vocab = SIZES[size]
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, head_dim=hidden // heads,
                         max_position_embeddings=1024, tie_word_embeddings=False)
    target = Target.from_model(Qwen3ForCausalLM(config))
    layer_ids = [1, layers - 2]
    drafter = DFlashDrafter(DrafterConfig.from_dict({
        "hidden_size": hidden, "num_hidden_layers": 1, "num_attention_heads": heads, "num_key_value_heads": kv,
        "head_dim": hidden // heads, "intermediate_size": inter, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
        "block_size": BLOCK, "num_target_layers": layers,
        "dflash_config": {"target_layer_ids": layer_ids, "mask_token_id": vocab - 1},
    })).eval()
    return target, drafter


def params(module) -> int:
    return sum(p.numel() for p in module.parameters())


def best_times(fn, counts: tuple[int, ...], repeat: int) -> dict[int, float]:
    """The best time of `fn` on each thread count. Counts alternate within each repeat, so that a burst of
    load from elsewhere slows every count alike instead of one of them."""
    best = {n: float("inf") for n in counts}
    for n in counts:  # warm-up: allocations, the thread pool at this size
        torch.set_num_threads(n)
        fn()
    for _ in range(repeat):
        for n in counts:
            torch.set_num_threads(n)
            t = time.perf_counter()
            fn()
            best[n] = min(best[n], time.perf_counter() - t)
    return best


def ops(target: Target, drafter: DFlashDrafter):
    """(name, work per op, what one call does, the call) of each op measured."""
    vocab = target.vocab_size
    g = torch.Generator().manual_seed(1)
    sequences = [torch.randint(0, vocab - 1, (SEQ_LEN,), generator=g).tolist() for _ in range(BATCH)]
    prompt = sequences[0][:PROMPT_LEN]
    references = [Reference(PROMPT_LEN, s) for s in sequences]
    with torch.no_grad():
        features = extract_features(target, sequences, drafter.target_layer_ids, batch_size=BATCH)
    target_params, drafter_params = params(target.model), params(drafter)
    # replay: every reference's block at its frontier, with its context: ~ blocks x (context + block) tokens
    replay_tokens = BATCH * (SEQ_LEN // 2 + BLOCK)
    return [
        ("decode", target_params * 1, f"{NEW_TOKENS} tokens",
         lambda: greedy_decode(target, prompt, NEW_TOKENS)),
        ("forward", target_params * BATCH * SEQ_LEN, f"{BATCH} x {SEQ_LEN} tokens",
         lambda: extract_features(target, sequences, drafter.target_layer_ids, batch_size=BATCH)),
        ("replay", drafter_params * replay_tokens, f"{BATCH} references",
         lambda: replay(drafter, target.embed_weight, target.head_weight, references, features)),
    ]


def measure(sizes: list[str], threads: int, repeat: int) -> list[dict]:
    rows = []
    for size in sizes:
        target, drafter = build(size)
        for name, work, unit, fn in ops(target, drafter):
            row = {"size": size, "op": name, "work": work, "unit": unit,
                   "target_M": params(target.model) / 1e6, "drafter_M": params(drafter) / 1e6}
            with torch.no_grad():
                row.update(best_times(fn, (1, threads), repeat))
            rows.append(row)
    torch.set_num_threads(threads)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--sizes", default="tiny,small,medium,large")
    args = parser.parse_args()
    sizes = args.sizes.split(",")
    print(f"load average (1 min) at start: {os.getloadavg()[0]:.2f}; {len(os.sched_getaffinity(0))} cores; "
          f"{args.threads} threads vs 1")
    idle = measure(sizes, args.threads, args.repeat)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])  # one core taken by someone else
    try:
        contended = measure(sizes, args.threads, args.repeat)
    finally:
        busy.kill()
        busy.wait()
    n = args.threads
    print(f"\n{'size':<7} {'op':<8} {'params':>9} {'work/op':>9} {'one call':<16} {'1 thread':>9} "
          f"{f'{n} threads':>10} {'ratio':>6} | {'busy: 1':>8} {f'{n}':>8} {'ratio':>6}")
    for a, b in zip(idle, contended):
        model = f"{a['drafter_M'] if a['op'] == 'replay' else a['target_M']:.1f}M"
        print(f"{a['size']:<7} {a['op']:<8} {model:>9} {a['work']:9.1e} {a['unit']:<16} {a[1] * 1e3:7.1f}ms "
              f"{a[n] * 1e3:8.1f}ms {a[n] / a[1]:6.2f} | {b[1] * 1e3:6.1f}ms {b[n] * 1e3:6.1f}ms {b[n] / b[1]:6.2f}")
    print(f"\nratio: {n} threads / 1 thread, best of {args.repeat} (below 1: more threads are faster); "
          "busy: one other process spinning on one core. Geometric mean of idle ratios by op: "
          + ", ".join(f"{op} {statistics.geometric_mean([r[n] / r[1] for r in idle if r['op'] == op]):.2f}"
                      for op in ("decode", "forward", "replay")))
    print(f"load average (1 min) at end: {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
