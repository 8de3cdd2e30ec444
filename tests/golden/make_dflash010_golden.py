"""Record dflash010_loop.json: z-lab's published decode loop (PyPI `dflash` 0.1.0) on a tiny trained pair.

What it records. `dflash.model.dflash_generate` (the speculative decoding loop of the `dflash` 0.1.0 wheel,
z-lab's DFlash benchmark) run on CPU in float32 with the tiny Qwen3 target and its trained DFlash drafter
stored beside this script (`dflash010/target/`, `dflash010/drafter/`, weights in bfloat16, loaded and run in
float32: the cast is exact), over the first 8 held-out prompts of the tiny run, 48 new tokens, the target's
eos ids as stop ids and the drafter's own block size:

- `greedy`: temperature 0, one run per prompt: the tokens after the prompt, their count and the acceptance
  lengths (tokens emitted per target step).
- `sampled`: for {temperature 1, top_k 0, top_p 1} and {temperature 0.6, top_k 20, top_p 0.95}, R runs per
  prompt, each seeded with `torch.manual_seed(seed)` right before its call (`seeds`, the same list for every
  prompt): per run the acceptance lengths and the number of output tokens.
- `metadata`: package versions, sha256 of each model.safetensors, the prompts' token ids, the settings, and
  `summary`: tau per setting (mean over runs of each run's mean acceptance length, then over prompts) with its
  standard error over runs (prompts held fixed).

The package runs as published: its code is imported from the installed wheel, never copied into this
repository. The one thing patched is `dflash.model._cuda_time` (a timing helper that calls
`torch.cuda.synchronize()`, needed only for the timings `return_stats=True` adds; not part of the loop's
logic), replaced by `time.perf_counter` so the loop runs on a machine without CUDA.

It runs in its own venv, with the wheel's pinned `local` dependencies (not this repository's):

    python3 -m venv /tmp/dflash010
    /tmp/dflash010/bin/pip install torch==2.13.0 'dflash[local]==0.1.0'   # torch 2.13.0 CPU, transformers 5.15.0
    # (or, from the downloaded wheel: pip install torch==2.13.0 'dflash-0.1.0-py3-none-any.whl[local]')
    OMP_NUM_THREADS=1 /tmp/dflash010/bin/python tests/golden/make_dflash010_golden.py \\
        ~/.cache/dflash-eval/tiny/<key> [--runs 500]

With a tiny run folder (target/, drafter/step_400/, prompts.jsonl) it first (re)writes the model folders from
it, every weight cast to bfloat16, the configs as they are but for `dtype` (bfloat16) and, in the drafter's,
`use_sliding_window: true` (see write_case); without one it reuses the model folders and prompts already here.
It imports only torch, transformers, safetensors and dflash (nothing from this repository).
"""

import argparse
import hashlib
import json
import math
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
from safetensors.torch import load_file, save_file

HERE = Path(__file__).resolve().parent
CASE = HERE / "dflash010"
GOLDEN = HERE / "dflash010_loop.json"
DRAFTER_STEP = "step_400"
NUM_PROMPTS = 8
MAX_NEW_TOKENS = 48
SETTINGS = [
    {"temperature": 1.0, "top_k": 0, "top_p": 1.0},
    {"temperature": 0.6, "top_k": 20, "top_p": 0.95},
]
SEED_BASE = [10_000, 20_000]  # setting i uses seeds SEED_BASE[i] + r, r = 0 .. R-1, for every prompt


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def write_bf16(src: Path, dst: Path, metadata: dict | None) -> None:
    tensors = {name: t.to(torch.bfloat16).contiguous() for name, t in load_file(src).items()}
    save_file(tensors, dst, metadata=metadata)


def write_case(run: Path) -> None:
    """The case's model folders from a tiny run folder: configs as they are (dtype noted as bfloat16), weights in bf16."""
    target, drafter = CASE / "target", CASE / "drafter"
    for folder in (target, drafter):
        if folder.exists():
            shutil.rmtree(folder)
        folder.mkdir(parents=True)
    config = json.loads((run / "target" / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (target / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    shutil.copyfile(run / "target" / "generation_config.json", target / "generation_config.json")
    write_bf16(run / "target" / "model.safetensors", target / "model.safetensors", {"format": "pt"})
    config = json.loads((run / "drafter" / DRAFTER_STEP / "config.json").read_text())
    config["dtype"] = "bfloat16"
    if "sliding_attention" in config.get("layer_types", []) and config.get("sliding_window") is not None:
        # Qwen3Config (transformers) drops sliding_window unless use_sliding_window is true, and the package then
        # fails building its DynamicCache (a sliding layer with window None). The tiny run's config leaves it out;
        # stating it keeps the window the drafter was trained with (the same model, in the form transformers reads).
        config["use_sliding_window"] = True
    (drafter / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_bf16(run / "drafter" / DRAFTER_STEP / "model.safetensors", drafter / "model.safetensors", {"format": "pt"})


def read_prompts(run: Path | None) -> list[dict]:
    if run is None:
        return json.loads(GOLDEN.read_text())["metadata"]["prompts"]
    lines = (run / "prompts.jsonl").read_text().splitlines()[:NUM_PROMPTS]
    return [{"id": row["id"], "input_ids": row["input_ids"]} for row in map(json.loads, lines)]


def generate(drafter, target, prompt: list[int], stop_ids: list[int], **sampling):
    out = dflash.model.dflash_generate(drafter, target, torch.tensor([prompt]), MAX_NEW_TOKENS, stop_ids,
                                       return_stats=True, **sampling)
    return out.output_ids[0, len(prompt):].tolist(), list(map(int, out.acceptance_lengths)), int(out.num_output_tokens)


def target_greedy(target, prompt: list[int], stop_ids: list[int]) -> list[int]:
    """The target alone, argmax, full forward each step: what temperature 0 must reproduce."""
    ids = list(prompt)
    with torch.inference_mode():
        for _ in range(MAX_NEW_TOKENS):
            ids.append(int(target(torch.tensor([ids])).logits[0, -1].argmax()))
            if ids[-1] in stop_ids:
                break
    return ids[len(prompt):]


def tau_summary(per_prompt_runs: list[list[list[int]]]) -> dict:
    """Mean over runs of each run's mean acceptance length, then over prompts; SE over runs, prompts held fixed.

    A run whose first token (sampled from the prefill) is a stop token takes no target step and has no acceptance
    length: it is left out of its prompt's mean (and counted)."""
    means, variances, empty = [], [], 0
    for runs in per_prompt_runs:
        run_means = [sum(a) / len(a) for a in runs if a]
        empty += len(runs) - len(run_means)
        m = sum(run_means) / len(run_means)
        means.append(m)
        variances.append(sum((x - m) ** 2 for x in run_means) / max(len(run_means) - 1, 1) / len(run_means))
    return {"tau": sum(means) / len(means), "se": math.sqrt(sum(variances)) / len(means),
            "tau_per_prompt": [round(m, 4) for m in means], "runs_without_steps": empty}


def render(obj, indent: int = 0) -> str:
    """JSON with dicts and lists of dicts laid out one item a line, every other list on one line."""
    pad, inner = " " * indent, " " * (indent + 1)
    if isinstance(obj, dict) and obj:
        items = [f"{inner}{json.dumps(k)}: {render(v, indent + 1)}" for k, v in obj.items()]
        return "{\n" + ",\n".join(items) + "\n" + pad + "}"
    if isinstance(obj, list) and obj and all(isinstance(x, dict) for x in obj):
        return "[\n" + ",\n".join(inner + render(x, indent + 1) for x in obj) + "\n" + pad + "]"
    return json.dumps(obj, separators=(",", ":"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", nargs="?", type=Path, help="tiny run folder; omit to reuse the case already here")
    parser.add_argument("--runs", type=int, default=500, help="seeded runs per prompt and sampled setting")
    args = parser.parse_args()
    started = time.perf_counter()
    torch.set_num_threads(1)
    # The one patch: a timing helper (torch.cuda.synchronize + perf_counter) used only for return_stats timings.
    dflash.model._cuda_time = time.perf_counter

    prompts = read_prompts(args.run)
    if args.run is not None:
        write_case(args.run)
    target = transformers.AutoModelForCausalLM.from_pretrained(CASE / "target", dtype=torch.float32).eval()
    drafter = dflash.model.DFlashDraftModel.from_pretrained(CASE / "drafter", dtype=torch.float32).eval()
    assert all(p.dtype == torch.float32 for p in [*target.parameters(), *drafter.parameters()])
    eos = json.loads((CASE / "target" / "generation_config.json").read_text())["eos_token_id"]
    stop_ids = [eos] if isinstance(eos, int) else list(eos)

    greedy = []
    for prompt in prompts:
        tokens, lengths, count = generate(drafter, target, prompt["input_ids"], stop_ids, temperature=0.0)
        reference = target_greedy(target, prompt["input_ids"], stop_ids)
        if tokens != reference:
            print(f"warning: {prompt['id']}: greedy speculative output differs from the target's own argmax",
                  file=sys.stderr)
        greedy.append({"id": prompt["id"], "output_ids": tokens, "num_output_tokens": count,
                       "acceptance_lengths": lengths, "equals_target_argmax": tokens == reference})
    print(f"greedy done ({time.perf_counter() - started:.0f}s): tau {tau_summary([[g['acceptance_lengths']] for g in greedy])['tau']:.3f}")

    sampled, summary = [], {"greedy": {"tau": tau_summary([[g["acceptance_lengths"]] for g in greedy])["tau"]}}
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
                  "stop_token_ids, temperature, top_p, top_k, block_size=None, return_stats=True); CPU, float32; "
                  "only dflash.model._cuda_time patched (to time.perf_counter)",
        "versions": {"dflash": version("dflash"),
                     "torch": torch.__version__, "transformers": transformers.__version__,
                     "safetensors": safetensors.__version__, "python": platform.python_version()},
        "models": {"target": "dflash010/target", "drafter": "dflash010/drafter",
                   "drafter_from": f"tiny run drafter/{DRAFTER_STEP}", "weights": "bfloat16 on disk, loaded as float32",
                   "sha256": {"target/model.safetensors": sha256(CASE / "target" / "model.safetensors"),
                              "drafter/model.safetensors": sha256(CASE / "drafter" / "model.safetensors")}},
        "max_new_tokens": MAX_NEW_TOKENS,
        "stop_token_ids": stop_ids,
        "block_size": int(drafter.block_size),
        "seeding": "torch.manual_seed(seed) right before each dflash_generate call",
        "runs_per_prompt": args.runs,
        "seconds": round(time.perf_counter() - started, 1),
        "summary": summary,
        "prompts": prompts,
    }
    GOLDEN.write_text(render({"metadata": metadata, "greedy": greedy, "sampled": sampled}) + "\n")
    print(f"wrote {GOLDEN} in {metadata['seconds']}s")


if __name__ == "__main__":
    main()
