"""Record package_outputs.json: seeded sampled runs of z-lab's published decode loop (PyPI `dflash` 0.1.0) with the
tokens each run emitted, for the DFlash and the DFlash2 golden pair.

What it records. dflash010_loop.json and dflash2_loop.json (make_dflash010_golden.py, make_dflash2_golden.py) keep
per sampled run only its acceptance lengths and its number of output tokens. Scoring completions one already has
(`--references FILE`) with sampled drafts needs the tokens too: this script runs the same loop,
`dflash.model.dflash_generate`, on the same pairs (the tiny Qwen3 target `dflash010/target/` with the DFlash drafter
`dflash010/drafter/`, and with the DFlash2 drafter `dflash2/drafter/`; CPU, float32, weights bfloat16 on disk: the
cast is exact), prompts (the DFlash case's 8), 48 new tokens and stop ids, and for each SETTING, R runs per prompt,
each seeded with `torch.manual_seed(seed)` right before its call (seeds SEED_BASE[pair] + 1000 * setting + r, the
same list for every prompt), keeping per run:

- `output_ids`: the tokens after the prompt (what the loop returns, up to and including a stop token);
- `acceptance_lengths`: the tokens each target step emitted (the loop's own count, what its tau is the mean of).

`metadata` holds the package versions, the sha256 of each model.safetensors, the prompts, the settings and a
`summary` per pair and setting: tau (mean over runs of each run's mean acceptance length, then over prompts) and
its standard error over runs (prompts held fixed), as the other golden files give it.

The package runs as published: its code is imported from the installed wheel, never copied into this repository;
the one thing patched is `dflash.model._cuda_time` (make_dflash010_golden.py says why). It runs in a venv with
the wheel's pinned `local` dependencies (transformers 5.15.0, as the other golden files were recorded):

    python3 -m venv /tmp/dflash015
    /tmp/dflash015/bin/pip install torch==2.13.0 'dflash[local]==0.1.0'
    OMP_NUM_THREADS=1 /tmp/dflash015/bin/python tests/golden/make_package_outputs_golden.py [--runs 150]

It imports only torch, transformers, safetensors and dflash, and the two golden scripts beside it (nothing else
from this repository).
"""

import argparse
import json
import platform
import time
from importlib.metadata import version
from pathlib import Path

import dflash
import dflash.model
import safetensors
import torch
import transformers
from make_dflash010_golden import MAX_NEW_TOKENS, generate, render, sha256, tau_summary
from make_dflash2_golden import load_drafter as load_dflash2_drafter

HERE = Path(__file__).resolve().parent
TARGET = HERE / "dflash010" / "target"
PROMPTS_FROM = HERE / "dflash010_loop.json"  # the DFlash golden case's prompts
GOLDEN = HERE / "package_outputs.json"
# the setting teams serve Qwen3's thinking mode at (and z-lab's benchmark can run), and the plain temperature 1
SETTINGS = [
    {"temperature": 0.6, "top_k": 20, "top_p": 0.95},
    {"temperature": 1.0, "top_k": 0, "top_p": 1.0},
]
PAIRS = {"dflash": "dflash010/drafter", "dflash2": "dflash2/drafter"}
SEED_BASE = {"dflash": 50_000, "dflash2": 60_000}  # setting i: SEED_BASE[pair] + 1000 * i + r, r = 0 .. R-1


def load_dflash_drafter():
    """0.1.0's DFlashDraftModel of the DFlash case, in float32."""
    return dflash.model.DFlashDraftModel.from_pretrained(HERE / PAIRS["dflash"], dtype=torch.float32).eval()


def sampled_runs(drafter, target, prompts: list[dict], stop_ids: list[int], setting: dict, seeds: list[int]) -> list:
    """Per prompt, each seeded run's output tokens and acceptance lengths."""
    rows = []
    for prompt in prompts:
        runs = []
        for seed in seeds:
            torch.manual_seed(seed)
            tokens, lengths, count = generate(drafter, target, prompt["input_ids"], stop_ids, **setting)
            assert count == len(tokens), (prompt["id"], seed)
            runs.append({"output_ids": tokens, "acceptance_lengths": lengths})
        rows.append({"id": prompt["id"], "runs": runs})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=150, help="seeded runs per prompt, pair and setting")
    args = parser.parse_args()
    started = time.perf_counter()
    torch.set_num_threads(1)
    dflash.model._cuda_time = time.perf_counter  # (the one patch: make_dflash010_golden.py)

    prompts = json.loads(PROMPTS_FROM.read_text())["metadata"]["prompts"]
    target = transformers.AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    assert all(p.dtype == torch.float32 for p in target.parameters())
    eos = json.loads((TARGET / "generation_config.json").read_text())["eos_token_id"]
    stop_ids = [eos] if isinstance(eos, int) else list(eos)

    pairs, summary = {}, {}
    for pair, load in (("dflash", load_dflash_drafter), ("dflash2", load_dflash2_drafter)):
        drafter = load()
        pairs[pair] = []
        for i, setting in enumerate(SETTINGS):
            seeds = list(range(SEED_BASE[pair] + 1000 * i, SEED_BASE[pair] + 1000 * i + args.runs))
            rows = sampled_runs(drafter, target, prompts, stop_ids, setting, seeds)
            stats = tau_summary([[run["acceptance_lengths"] for run in row["runs"]] for row in rows])
            name = f"{pair}_t{setting['temperature']}_k{setting['top_k']}_p{setting['top_p']}"
            summary[name] = {**setting, **stats}
            pairs[pair].append({**setting, "seeds": seeds, "prompts": rows})
            print(f"{name} done ({time.perf_counter() - started:.0f}s): tau {stats['tau']:.4f} +- {stats['se']:.4f}")

    metadata = {
        "source": "PyPI dflash 0.1.0 (z-lab), dflash.model.dflash_generate(model, target, input_ids, max_new_tokens, "
                  "stop_token_ids, temperature, top_p, top_k, block_size=None, return_stats=True) with "
                  "dflash.model.DFlashDraftModel and DFlash2DraftModel; CPU, float32; only dflash.model._cuda_time "
                  "patched (to time.perf_counter)",
        "versions": {"dflash": version("dflash"), "torch": torch.__version__,
                     "transformers": transformers.__version__, "safetensors": safetensors.__version__,
                     "python": platform.python_version()},
        "models": {"target": "dflash010/target", **{f"drafter_{pair}": path for pair, path in PAIRS.items()},
                   "weights": "bfloat16 on disk, loaded as float32",
                   "sha256": {f"{path}/model.safetensors": sha256(HERE / path / "model.safetensors")
                              for path in ("dflash010/target", *PAIRS.values())}},
        "max_new_tokens": MAX_NEW_TOKENS,
        "stop_token_ids": stop_ids,
        "seeding": "torch.manual_seed(seed) right before each dflash_generate call",
        "runs_per_prompt": args.runs,
        "seconds": round(time.perf_counter() - started, 1),
        "summary": summary,
        "prompts": prompts,
    }
    GOLDEN.write_text(render({"metadata": metadata, **pairs}) + "\n")
    print(f"wrote {GOLDEN} in {metadata['seconds']}s")


if __name__ == "__main__":
    main()
