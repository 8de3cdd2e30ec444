"""Record dflash2_loop.json: z-lab's published decode loop (PyPI `dflash` 0.1.0) with a tiny trained DFlash2 drafter.

What it records. `dflash.model.dflash_generate` (the speculative decoding loop of the `dflash` 0.1.0 wheel) run
with its `DFlash2DraftModel` (grouped dynamic convolutions and a candidate selector) on CPU in float32: the tiny
Qwen3 target of the DFlash golden case (`dflash010/target/`, reused as it is) and a DFlash2 drafter trained on the
same tiny target, stored beside this script (`dflash2/drafter/`, weights in bfloat16, loaded and run in float32:
the cast is exact), over the prompts of the DFlash golden case (dflash010_loop.json: the first 8 held-out prompts
of the tiny run), 48 new tokens, the target's eos ids as stop ids and the drafter's own block size:

- `greedy`: temperature 0, one run per prompt: the tokens after the prompt, their count and the acceptance
  lengths (tokens emitted per target step).
- `greedy_variant`: the same with the drafter's config given `dflash_config` entries VARIANT (output_multiplier
  and final_logit_softcapping, which 0.1.0's `compute_logits` applies to the logits the selector scores; the
  selector adds them to a pairing term, so they change its choices), passed as the config at load time: the same
  weights, no second folder.
- `sampled`: for {temperature 1, top_k 0, top_p 1} and {temperature 0.6, top_k 20, top_p 0.95}, R runs per
  prompt, each seeded with `torch.manual_seed(seed)` right before its call (`seeds`, the same list for every
  prompt): per run the acceptance lengths and the number of output tokens. 0.1.0 samples each draft from its
  selector's softmax(score / temperature) over the top-K candidates, walking from the anchor, and verifies by
  rejection sampling against the target's distribution (temperature, top-k, top-p).
- `metadata`: package versions, sha256 of each model.safetensors, the prompts' token ids, the settings, and
  `summary`: tau per setting (mean over runs of each run's mean acceptance length, then over prompts) with its
  standard error over runs (prompts held fixed).

The package runs as published: its code is imported from the installed wheel, never copied into this
repository. The one thing patched is `dflash.model._cuda_time` (a timing helper that calls
`torch.cuda.synchronize()`, needed only for the timings `return_stats=True` adds; not part of the loop's
logic), replaced by `time.perf_counter` so the loop runs on a machine without CUDA.

It runs in the venv make_dflash010_golden.py describes (torch 2.13.0 CPU, 'dflash[local]==0.1.0'):

    OMP_NUM_THREADS=1 /tmp/dflash010/bin/python tests/golden/make_dflash2_golden.py \\
        <DFlash2 drafter checkpoint folder> [--runs 350]

The checkpoint folder (config.json + model.safetensors, e.g. a tiny-run-style training of a DFlash2DraftModel on
the tiny target for 400 steps) is first (re)written into dflash2/drafter/: every weight cast to bfloat16, the
codebooks under their published bare names (`candidate_selector.{predecessor,successor}_codebook`, no `.weight`:
0.1.0's DFlash2DraftModel.from_pretrained maps them onto its nn.Embedding weights), the config as it is but for
`dtype` (bfloat16) and `use_sliding_window: true` (as make_dflash010_golden.py's write_case says). Without a
folder it reuses the drafter already here. The load is checked to leave no weight missing or unexpected
(transformers would initialise a missing one at random). It imports only torch, transformers, safetensors and
dflash, and the DFlash golden case's script beside it (nothing else from this repository).
"""

import argparse
import json
import platform
import shutil
import sys
import time
from importlib.metadata import version
from pathlib import Path

import dflash
import dflash.model
import safetensors
import torch
import transformers
from make_dflash010_golden import (  # (beside this script: the same loop, prompts and summary)
    MAX_NEW_TOKENS,
    generate,
    render,
    sha256,
    target_greedy,
    tau_summary,
)
from safetensors.torch import load_file, save_file

HERE = Path(__file__).resolve().parent
TARGET = HERE / "dflash010" / "target"  # the DFlash golden case's target
DRAFTER = HERE / "dflash2" / "drafter"
PROMPTS_FROM = HERE / "dflash010_loop.json"  # the DFlash golden case's prompts
GOLDEN = HERE / "dflash2_loop.json"
SETTINGS = [
    {"temperature": 1.0, "top_k": 0, "top_p": 1.0},
    {"temperature": 0.6, "top_k": 20, "top_p": 0.95},
]
SEED_BASE = [30_000, 40_000]  # setting i uses seeds SEED_BASE[i] + r, r = 0 .. R-1, for every prompt
# dflash_config entries of the greedy variant: logits x 1.5, then tanh(x / 6) * 6 (both change the selector's walk)
VARIANT = {"output_multiplier": 1.5, "final_logit_softcapping": 6.0}
CODEBOOKS = ("candidate_selector.predecessor_codebook", "candidate_selector.successor_codebook")


def write_drafter(checkpoint: Path) -> None:
    """dflash2/drafter/ from a DFlash2 checkpoint folder: the config as it is (dtype bfloat16, use_sliding_window
    stated), the weights in bf16 with the codebooks under their bare names."""
    if DRAFTER.exists():
        shutil.rmtree(DRAFTER)
    DRAFTER.mkdir(parents=True)
    config = json.loads((checkpoint / "config.json").read_text())
    if config.get("architectures") != ["DFlash2DraftModel"]:
        raise SystemExit(f"{checkpoint}: architectures {config.get('architectures')}, not ['DFlash2DraftModel']")
    config["dtype"] = "bfloat16"
    if "sliding_attention" in config.get("layer_types", []) and config.get("sliding_window") is not None:
        config["use_sliding_window"] = True  # see make_dflash010_golden.py's write_case
    (DRAFTER / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tensors = {}
    for name, tensor in load_file(checkpoint / "model.safetensors").items():
        if name.removesuffix(".weight") in CODEBOOKS:
            name = name.removesuffix(".weight")
        tensors[name] = tensor.to(torch.bfloat16).contiguous()
    assert all(name in tensors for name in CODEBOOKS), "a DFlash2 checkpoint has both codebooks"
    save_file(tensors, DRAFTER / "model.safetensors", metadata={"format": "pt"})


def load_drafter(overrides: dict | None = None):
    """0.1.0's DFlash2DraftModel from dflash2/drafter/ in float32, dflash_config updated with `overrides`; every
    stored weight loaded, none left to its random init."""
    config = transformers.AutoConfig.from_pretrained(DRAFTER)
    config.dflash_config = {**config.dflash_config, **(overrides or {})}
    drafter, info = dflash.model.DFlash2DraftModel.from_pretrained(DRAFTER, config=config, dtype=torch.float32,
                                                                   output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    state = drafter.state_dict()
    for name, tensor in load_file(DRAFTER / "model.safetensors").items():
        loaded = state[name + ".weight" if name in CODEBOOKS else name]
        assert loaded.dtype == torch.float32 and torch.equal(loaded, tensor.float()), name
    return drafter.eval()


def greedy_runs(drafter, target, prompts: list[dict], stop_ids: list[int]) -> list[dict]:
    runs = []
    for prompt in prompts:
        tokens, lengths, count = generate(drafter, target, prompt["input_ids"], stop_ids, temperature=0.0)
        reference = target_greedy(target, prompt["input_ids"], stop_ids)
        if tokens != reference:
            print(f"warning: {prompt['id']}: greedy speculative output differs from the target's own argmax",
                  file=sys.stderr)
        runs.append({"id": prompt["id"], "output_ids": tokens, "num_output_tokens": count,
                     "acceptance_lengths": lengths, "equals_target_argmax": tokens == reference})
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", nargs="?", type=Path,
                        help="DFlash2 drafter checkpoint folder; omit to reuse the drafter already here")
    parser.add_argument("--runs", type=int, default=350, help="seeded runs per prompt and sampled setting")
    args = parser.parse_args()
    started = time.perf_counter()
    torch.set_num_threads(1)
    # The one patch: a timing helper (torch.cuda.synchronize + perf_counter) used only for return_stats timings.
    dflash.model._cuda_time = time.perf_counter

    prompts = json.loads(PROMPTS_FROM.read_text())["metadata"]["prompts"]
    if args.checkpoint is not None:
        write_drafter(args.checkpoint)
    target = transformers.AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    drafter, variant = load_drafter(), load_drafter(VARIANT)
    assert all(p.dtype == torch.float32 for p in target.parameters())
    eos = json.loads((TARGET / "generation_config.json").read_text())["eos_token_id"]
    stop_ids = [eos] if isinstance(eos, int) else list(eos)

    greedy = greedy_runs(drafter, target, prompts, stop_ids)
    greedy_variant = greedy_runs(variant, target, prompts, stop_ids)
    summary = {name: {"tau": tau_summary([[g["acceptance_lengths"]] for g in runs])["tau"]}
               for name, runs in (("greedy", greedy), ("greedy_variant", greedy_variant))}
    print(f"greedy done ({time.perf_counter() - started:.0f}s): tau {summary['greedy']['tau']:.3f}, "
          f"variant {summary['greedy_variant']['tau']:.3f}")

    sampled = []
    for setting, base in zip(SETTINGS, SEED_BASE):
        seeds = list(range(base, base + args.runs))
        rows = []
        for prompt in prompts:
            lengths, counts = [], []
            for seed in seeds:
                torch.manual_seed(seed)
                _, run_lengths, count = generate(drafter, target, prompt["input_ids"], stop_ids, **setting)
                lengths.append(run_lengths)
                counts.append(count)
            rows.append({"id": prompt["id"], "acceptance_lengths": lengths, "num_output_tokens": counts})
        stats = tau_summary([row["acceptance_lengths"] for row in rows])
        name = f"t{setting['temperature']}_k{setting['top_k']}_p{setting['top_p']}"
        summary[name] = {**setting, **stats}
        sampled.append({**setting, "seeds": seeds, "prompts": rows})
        print(f"{name} done ({time.perf_counter() - started:.0f}s): tau {stats['tau']:.4f} +- {stats['se']:.4f}")

    metadata = {
        "source": "PyPI dflash 0.1.0 (z-lab), dflash.model.dflash_generate(model, target, input_ids, max_new_tokens, "
                  "stop_token_ids, temperature, top_p, top_k, block_size=None, return_stats=True) with "
                  "dflash.model.DFlash2DraftModel; CPU, float32; only dflash.model._cuda_time patched (to "
                  "time.perf_counter)",
        "versions": {"dflash": version("dflash"),
                     "torch": torch.__version__, "transformers": transformers.__version__,
                     "safetensors": safetensors.__version__, "python": platform.python_version()},
        "models": {"target": "dflash010/target", "drafter": "dflash2/drafter",
                   "drafter_from": "a DFlash2DraftModel trained 400 steps on the tiny run's target (the DFlash case's)",
                   "weights": "bfloat16 on disk, loaded as float32",
                   "sha256": {"target/model.safetensors": sha256(TARGET / "model.safetensors"),
                              "drafter/model.safetensors": sha256(DRAFTER / "model.safetensors")}},
        "variant": {"dflash_config": VARIANT,
                    "note": "greedy_variant: the drafter's config with these dflash_config entries added"},
        "max_new_tokens": MAX_NEW_TOKENS,
        "stop_token_ids": stop_ids,
        "block_size": int(drafter.block_size),
        "seeding": "torch.manual_seed(seed) right before each dflash_generate call",
        "runs_per_prompt": args.runs,
        "seconds": round(time.perf_counter() - started, 1),
        "summary": summary,
        "prompts": prompts,
    }
    GOLDEN.write_text(render({"metadata": metadata, "greedy": greedy, "greedy_variant": greedy_variant,
                              "sampled": sampled}) + "\n")
    print(f"wrote {GOLDEN} in {metadata['seconds']}s")


if __name__ == "__main__":
    main()
