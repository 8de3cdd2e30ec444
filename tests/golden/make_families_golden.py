"""Record families_loop.json: z-lab's published decode loop (PyPI `dflash` 0.1.0) on the target family matrix.

What it records. For each family folder under families/ (written by make_families.py: a tiny random target of that
family, saved as its published checkpoints are, and a DFlash drafter trained on its greedy continuations),
`dflash.model.dflash_generate` (the speculative decoding loop of the `dflash` 0.1.0 wheel) run greedily (temperature
0) on CPU in float32, target in the loop, over the folder's 8 prompts, 48 new tokens, the target's eos as the stop
id and the drafter's own block size: per prompt the tokens after the prompt and the acceptance lengths (tokens
emitted per target step), and whether the tokens equal the target's own argmax decoding (a full forward per token).
The target is loaded as a user of the package loads it: the class its config.json names, transformers' default
attention (SDPA where a sub-model takes it, else eager: gpt-oss and Gemma 4's audio tower take none).

The package runs as published: its code is imported from the installed wheel, never copied into this repository.
Patched at run time, and nothing else:
- `dflash.model._cuda_time` (a timing helper that calls `torch.cuda.synchronize()`) -> `time.perf_counter`, as
  in make_dflash010_golden.py;
- for the targets with recurrent layers (Gated DeltaNet: Qwen3.5-MoE, Qwen3-Next; Mamba-2: Nemotron-H),
  `dflash.model._make_cache` -> the same cache with `activate_past_recording(recurrent_states_to_keep=block size)`:
  under transformers 5.25 the package's call leaves `recurrent_states_to_keep` None, and the first forward (the
  prefill) fails comparing it with a number. Keeping one recurrent state per verified position is what lets the
  package's `crop` roll a partly accepted block back (transformers 5.24 and older cannot roll them back at all).

It runs in a venv of its own (transformers 5.25.0: the release whose cache rolls recurrent states back):

    python3 -m venv /tmp/dflash010
    /tmp/dflash010/bin/pip install torch==2.13.0 transformers==5.25.0 safetensors jinja2 tqdm requests
    /tmp/dflash010/bin/pip install --no-deps dflash==0.1.0
    OMP_NUM_THREADS=1 /tmp/dflash010/bin/python tests/golden/make_families_golden.py

It imports only torch, transformers, safetensors and dflash, and the DFlash golden case's script beside it (nothing
else from this repository).
"""

import json
import platform
import sys
import time
from importlib.metadata import version
from pathlib import Path

import dflash
import dflash.model
import safetensors
import torch
import transformers
from make_dflash010_golden import MAX_NEW_TOKENS, generate, render, sha256, target_greedy, tau_summary

HERE = Path(__file__).resolve().parent
FAMILIES = HERE / "families"
GOLDEN = HERE / "families_loop.json"
PACKAGE_MAKE_CACHE = dflash.model._make_cache


def load_target(folder: Path):
    """The target as a user loads it: the class its config names, float32, transformers' default attention."""
    (architecture,) = json.loads((folder / "config.json").read_text())["architectures"]
    model = getattr(transformers, architecture).from_pretrained(folder, dtype=torch.float32).eval()
    assert all(p.dtype == torch.float32 for p in model.parameters())
    return model


def load_drafter(folder: Path):
    """0.1.0's DFlashDraftModel in float32, every stored weight loaded (none left to its random init)."""
    drafter, info = dflash.model.DFlashDraftModel.from_pretrained(folder, dtype=torch.float32, output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs")), info
    return drafter.eval()


def has_recurrent_layers(target) -> bool:
    config = target.config.get_text_config(decoder=True)
    return any(kind in ("linear_attention", "mamba") for kind in
               getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None) or ())


def record(folder: Path) -> dict:
    target, drafter = load_target(folder / "target"), load_drafter(folder / "drafter")
    adapted = has_recurrent_layers(target)
    if adapted:
        def make_cache(config):
            cache = transformers.DynamicCache(config=config)
            cache.activate_past_recording(recurrent_states_to_keep=int(drafter.block_size))
            return cache
        dflash.model._make_cache = make_cache
    else:
        dflash.model._make_cache = PACKAGE_MAKE_CACHE
    stop_ids = [int(json.loads((folder / "target" / "generation_config.json").read_text())["eos_token_id"])]
    prompts = [json.loads(line) for line in (folder / "prompts.jsonl").read_text().splitlines()]
    runs = []
    for prompt in prompts:
        tokens, lengths, count = generate(drafter, target, prompt["input_ids"], stop_ids, temperature=0.0)
        reference = target_greedy(target, prompt["input_ids"], stop_ids)
        if tokens != reference:
            print(f"warning: {folder.name} {prompt['id']}: greedy speculative output differs from the target's own "
                  "argmax", file=sys.stderr)
        runs.append({"id": prompt["id"], "input_ids": prompt["input_ids"], "output_ids": tokens,
                     "num_output_tokens": count, "acceptance_lengths": lengths,
                     "equals_target_argmax": tokens == reference})
    text = target.config.get_text_config(decoder=True)
    return {
        "target_class": type(target).__name__,
        "attention": text._attn_implementation,
        "cache_adaptation": "activate_past_recording(recurrent_states_to_keep=block size)" if adapted else None,
        "block_size": int(drafter.block_size),
        "stop_token_ids": stop_ids,
        # (a prompt whose first token is the stop token takes no step: left out, as the package's summary leaves it)
        "tau": tau_summary([[r["acceptance_lengths"]] for r in runs if r["acceptance_lengths"]])["tau"],
        "sha256": {"target/model.safetensors": sha256(folder / "target" / "model.safetensors"),
                   "drafter/model.safetensors": sha256(folder / "drafter" / "model.safetensors")},
        "greedy": runs,
    }


def main() -> None:
    started = time.perf_counter()
    torch.set_num_threads(1)
    # The one patch every family gets: a timing helper used only for return_stats timings.
    dflash.model._cuda_time = time.perf_counter
    families = {}
    for folder in sorted(p for p in FAMILIES.iterdir() if p.is_dir()):
        families[folder.name] = record(folder)
        found = families[folder.name]
        equal = sum(r["equals_target_argmax"] for r in found["greedy"])
        print(f"{folder.name}: {found['target_class']} ({found['attention']}), tau {found['tau']:.3f}, "
              f"{equal}/{len(found['greedy'])} outputs equal the target's argmax "
              f"({time.perf_counter() - started:.0f}s)")
    metadata = {
        "source": "PyPI dflash 0.1.0 (z-lab), dflash.model.dflash_generate(model, target, input_ids, max_new_tokens, "
                  "stop_token_ids, temperature=0.0, block_size=None, return_stats=True); CPU, float32; patched: "
                  "dflash.model._cuda_time (to time.perf_counter) and, for targets with recurrent layers, "
                  "dflash.model._make_cache (recurrent_states_to_keep = block size)",
        "versions": {"dflash": version("dflash"), "torch": torch.__version__,
                     "transformers": transformers.__version__, "safetensors": safetensors.__version__,
                     "python": platform.python_version()},
        "weights": "bfloat16 on disk, loaded as float32",
        "max_new_tokens": MAX_NEW_TOKENS,
        "seconds": round(time.perf_counter() - started, 1),
    }
    GOLDEN.write_text(render({"metadata": metadata, "families": families}) + "\n")
    print(f"wrote {GOLDEN} in {metadata['seconds']}s")


if __name__ == "__main__":
    main()
