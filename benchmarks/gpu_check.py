"""GPU check: exactness of the replay on CUDA, drafts-stage speed at the published drafter shape, CPU vs CUDA.

One command that needs nothing but the repo (no downloads, no network), to be run once on a CUDA machine:

  1. replay == online loop, CUDA, float32. The tiny trained run (dflash_eval.tiny.build, built on first use and
     cached under $DFLASH_TINY_CACHE or ~/.cache/dflash-eval/tiny; its key includes the torch version, so a CUDA
     build of torch builds it afresh). tiny_build has no device option: the build trains on the CPU (a few
     minutes on 2 cores; --threads gives it more). For --prompts held-out prompts: greedy references, features,
     offline replay and real greedy speculative decoding with the target in the loop, all on the device;
     starts and acceptance lengths must be equal step by step.
  2. The drafts stage at the published Qwen3.6-27B drafter shape, bf16, random weights: hidden 5120, 5 layers
     (4 sliding of window 2048, then 1 full), 32 heads of 128, 4 kv heads, intermediate 17408, vocab 248320,
     block 16, 5 target layers of features (benchmarks/bench_realshape.py builds it). Times replay(), counts the
     FLOPs it cannot skip (bench_realshape.replay_gflop), and prints its GFLOP/s against bf16 GEMMs of the layers' projections at
     M = blocks per batch x block size, timed in the same process; and the peak CUDA memory.
  3. CPU vs device: the tiny replay of check 1's references on the CPU; float32 must be identical, bfloat16 is
     reported (fraction of references identical, tau difference).

Exit status: 0 passed; 1 check 1 or the float32 part of check 3 failed; 2 no CUDA (without --device cpu).
An error in check 2 (only informative) is printed and shown in the summary without changing the status.

Run: python benchmarks/gpu_check.py [--threads 16] [--prompts 8]        (a few minutes; plus the tiny build)
CPU smoke (every code path, small real-shape sizes): .venv/bin/python benchmarks/gpu_check.py --device cpu
     --prompts 2 --real-refs 1 --real-prompt 32 --real-completion 3 --real-layers 2 --real-vocab 8192
"""

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers.utils import logging as hf_logging

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # runs from a plain checkout, not installed too
from benchmarks.bench_realshape import real_shape_drafter, replay_gflop
from dflash_core.decoding import greedy_decode, speculative_decode
from dflash_core.drafter import load_drafter
from dflash_core.features import extract_features
from dflash_core.replay import Reference, replay
from dflash_core.target import load_target
from dflash_eval.tiny.build import TinyBuildSettings, default_cache_root, tiny_run


def sync(device):
    """Wait for queued kernels, so wall-clock times cover the work."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def tau(results) -> float:
    """Macro tau: the mean over references of each one's mean acceptance length."""
    per_ref = [sum(r.acceptance_lengths) / len(r.acceptance_lengths) for r in results if r.acceptance_lengths]
    return sum(per_ref) / len(per_ref)


def tiny_replay(run, references, device, dtype):
    """Features of the references from the tiny target, then the final drafter's replay, on one device and dtype."""
    target = load_target(run.target_dir, dtype=dtype, device=device)
    drafter = load_drafter(run.drafter_steps[-1], dtype=dtype, device=device)
    feats = extract_features(target, [r.token_ids for r in references], drafter.target_layer_ids, device=None)
    return replay(drafter, target.embed_weight, target.head_weight, references, feats)


def check_online(run, prompts, eos, max_new, device):
    """Check 1: greedy references and the online speculative loop on the device vs the replay (float32)."""
    target = load_target(run.target_dir, dtype=torch.float32, device=device)
    drafter = load_drafter(run.drafter_steps[-1], dtype=torch.float32, device=device)
    references = [Reference(len(p), greedy_decode(target, p, max_new, [eos])) for p in prompts]
    replayed = tiny_replay(run, references, device, torch.float32)
    failures, steps = [], 0
    for i, (ref, rp) in enumerate(zip(references, replayed)):
        online = speculative_decode(target, drafter, list(ref.token_ids[: ref.prompt_len]), max_new, [eos])
        steps += len(online.acceptance_lengths)
        if online.output_ids != list(ref.token_ids):
            failures.append(f"prompt {i}: speculative output != greedy")
        elif (online.starts, online.acceptance_lengths) != (rp.starts, rp.acceptance_lengths):
            k = next((k for k, (a, b) in enumerate(zip(online.acceptance_lengths, rp.acceptance_lengths)) if a != b),
                     min(len(online.acceptance_lengths), len(rp.acceptance_lengths)))
            failures.append(f"prompt {i}: first difference at step {k}")
    return references, replayed, failures, steps


def check_cpu_agreement(run, references, device, device_fp32):
    """Check 3: the same references replayed on the CPU, float32 (must match) and bfloat16 (reported)."""
    cpu_fp32 = tiny_replay(run, references, "cpu", torch.float32)
    fp32_same = sum(a.acceptance_lengths == b.acceptance_lengths for a, b in zip(cpu_fp32, device_fp32))
    cpu_bf16 = tiny_replay(run, references, "cpu", torch.bfloat16)
    dev_bf16 = tiny_replay(run, references, device, torch.bfloat16)
    bf16_same = sum(a.acceptance_lengths == b.acceptance_lengths for a, b in zip(cpu_bf16, dev_bf16))
    return fp32_same, bf16_same, tau(cpu_bf16) - tau(dev_bf16), tau(dev_bf16)


def best_time(fn, device, repeats: int) -> float:
    """Best wall-clock seconds of `repeats` calls after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        sync(device)
        t = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t)
    return min(times)


def check_real_shape(args, device):
    """Check 2: replay's speed at the real shape vs bf16 GEMMs of its projections at the decode batch's M."""
    torch.manual_seed(0)
    drafter = real_shape_drafter(args.real_layers, args.real_vocab, device)
    dt, H, T = torch.bfloat16, drafter.cfg.hidden_size, args.real_prompt + args.real_completion
    embed = torch.empty(args.real_vocab, H, dtype=dt, device=device).normal_(0.0, 0.02)
    head = torch.empty(args.real_vocab, H, dtype=dt, device=device).normal_(0.0, 0.02)
    refs = [Reference(args.real_prompt, torch.randint(0, args.real_vocab - 1, (T,)).tolist()) for _ in range(args.real_refs)]
    feats = [torch.randn(len(drafter.target_layer_ids), T, H, dtype=dt, device=device) for _ in refs]

    def run():
        return replay(drafter, embed, head, refs, feats)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t_stage = best_time(run, device, args.repeats)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    results = run()
    flops = replay_gflop(drafter.cfg, refs, results, args.real_vocab) * 1e9  # what the replay cannot skip

    # The projections of every layer at M = blocks per decode batch x block size (replay batches <= 64 blocks)
    M = min(len(refs), 64) * drafter.block_size
    weights = [p for name, p in drafter.named_parameters() if name.endswith("_proj.weight")]
    inputs = {w.shape[1]: torch.randn(M, w.shape[1], dtype=dt, device=device) for w in weights}
    gemm_flops = sum(2 * M * w.shape[0] * w.shape[1] for w in weights)
    t_gemm = best_time(lambda: [F.linear(inputs[w.shape[1]], w) for w in weights], device, max(args.repeats, 5))
    steps = sum(len(r.acceptance_lengths) for r in results)
    params = sum(p.numel() for p in drafter.parameters()) / 1e9
    return {"params_b": params, "steps": steps, "t_stage": t_stage, "stage_gflops": flops / t_stage / 1e9,
            "gflop": flops / 1e9, "M": M, "t_gemm": t_gemm, "gemm_gflops": gemm_flops / t_gemm / 1e9, "peak_gib": peak}


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (a smoke run of every code path)")
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads (the tiny build and check 3 use them)")
    parser.add_argument("--prompts", type=int, default=8, help="tiny held-out prompts for checks 1 and 3 (of 32)")
    parser.add_argument("--real-refs", type=int, default=8, help="check 2: references (one decode batch)")
    parser.add_argument("--real-prompt", type=int, default=256, help="check 2: prompt tokens per reference")
    parser.add_argument("--real-completion", type=int, default=32, help="check 2: completion tokens per reference")
    parser.add_argument("--real-layers", type=int, default=5, help="check 2: drafter layers (smoke runs: fewer)")
    parser.add_argument("--real-vocab", type=int, default=248320, help="check 2: vocabulary (smoke runs: smaller)")
    parser.add_argument("--repeats", type=int, default=3, help="check 2: timed replays after the warm-up (best kept)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    hf_logging.disable_progress_bar()  # one "Loading weights" bar per model load would bury the results
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"CUDA is not available (torch {torch.__version__}): this check needs a CUDA GPU; "
              "`--device cpu` runs a smoke version on the CPU.")
        sys.exit(2)
    device = torch.device(args.device)
    # Float32 must mean float32: TF32 matmuls would make CUDA's acceptance lengths differ from the CPU's for
    # reasons that are not the code's.
    torch.set_float32_matmul_precision("highest")
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(f"device {device} ({name}), torch {torch.__version__}, {args.threads} CPU threads")

    t0 = time.perf_counter()
    run = tiny_run(default_cache_root(), TinyBuildSettings(arch="qwen3"))
    print(f"tiny run {run.root} ready in {time.perf_counter() - t0:.0f} s")
    prompts = [json.loads(line)["input_ids"] for line in run.prompts_file.read_text().splitlines()][: args.prompts]
    eos = json.loads((run.target_dir / "config.json").read_text())["eos_token_id"]
    max_new = run.record["settings"]["max_new_tokens"]

    t0 = time.perf_counter()
    references, dev_fp32, failures, steps = check_online(run, prompts, eos, max_new, device)
    t1 = time.perf_counter() - t0
    for f in failures:
        print(f"check 1 FAILED: {f}")
    t0 = time.perf_counter()
    fp32_same, bf16_same, tau_diff, tau_bf16 = check_cpu_agreement(run, references, device, dev_fp32)
    t3 = time.perf_counter() - t0
    n = len(references)
    ok1, ok3 = not failures, fp32_same == n
    rows = [("1 replay == online, fp32", "PASS" if ok1 else "FAIL",
             f"{n - len(failures)}/{n} prompts, {steps} steps, tau {tau(dev_fp32):.2f}, {t1:.0f} s")]

    t0 = time.perf_counter()
    try:
        real = check_real_shape(args, device)
        t2 = time.perf_counter() - t0
        peak = f"{real['peak_gib']:.1f} GiB" if device.type == "cuda" else "n/a on the CPU"
        rows += [
            ("2 drafts stage, real shape bf16", "info",
             (f"{real['params_b']:.2f}B params, {args.real_refs} refs x ({args.real_prompt}+{args.real_completion}), "
              f"{real['steps']} steps: replay {real['t_stage'] * 1e3:.1f} ms, {real['gflop']:.0f} GFLOP, check {t2:.0f} s")),
            ("  stage GFLOP/s / GEMM GFLOP/s", "info",
             (f"{real['stage_gflops']:.0f} / {real['gemm_gflops']:.0f} = {real['stage_gflops'] / real['gemm_gflops']:.2f}"
              f" (GEMMs at M={real['M']}: {real['t_gemm'] * 1e3:.2f} ms)")),
            ("  peak CUDA memory (weights incl.)", "info", peak),
        ]
    except Exception as e:  # noqa: BLE001 - check 2 only informs: an error there (out of memory) must not hide 1 and 3
        traceback.print_exc()
        rows.append(("2 drafts stage, real shape bf16", "ERROR", f"{type(e).__name__}: {str(e)[:120]}"))
    rows += [
        ("3 CPU vs device, fp32", "PASS" if ok3 else "FAIL", f"{fp32_same}/{n} references identical, {t3:.0f} s"),
        ("3 CPU vs device, bf16", "info", (f"{bf16_same}/{n} = {bf16_same / n:.2f} identical, tau {tau_bf16:.3f} "
                                           f"on device, CPU - device {tau_diff:+.3f}")),
    ]
    print()
    for check, status, detail in rows:
        print(f"{check:<34} {status:<5} {detail}")
    sys.exit(0 if ok1 and ok3 else 1)


if __name__ == "__main__":
    main()
