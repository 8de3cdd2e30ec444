"""Build the target family matrix's stored models: tests/golden/families/<family>/.

For each family of tests/target_families.py (all, or those named):

    target/        its tiny random target as its published checkpoints are saved (wrappers and towers included),
                   weights in bfloat16 (loaded and run in float32 by the tests: the cast is exact), a word-level
                   tokenizer of its 64 tokens (t0 .. t63; t1 is eos), generation_config.json
    drafter/       a DFlash drafter trained on the target's greedy continuations (the tiny run's recipe: two layers,
                   sliding then full, block 8, reading target layers 1 and 2; Gemma: input_embedding_scale
                   sqrt(hidden)), weights in bfloat16
    prompts.jsonl  8 held-out prompts of 16 tokens ({"id", "input_ids"})

tests/golden/make_families_golden.py then records z-lab's own loop on them (families_loop.json). Run on one thread
(trained weights depend on the thread count), from the repository root, in the project's venv:

    OMP_NUM_THREADS=1 .venv/bin/python -m tests.golden.make_families [FAMILY ...]
"""

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import PreTrainedTokenizerFast

from dflash_core.drafter import load_drafter
from dflash_core.features import extract_features
from dflash_core.replay import Reference, replay
from dflash_core.target import choose_attention, load_target
from dflash_eval.tiny.build import tau_of
from dflash_eval.tiny.training import DrafterTrainingSettings, train_drafter
from tests.target_families import EOS, FAMILIES, LAYERS, MASK_TOKEN_ID, PROMPT_IDS, VOCAB_SIZE, Family, build_target

HERE = Path(__file__).resolve().parent / "families"
PROMPT_LEN = 16
TRAIN_PROMPTS = 256
EVAL_PROMPTS = 8
MAX_NEW_TOKENS = 48
LAYER_IDS = (1, 2)
BLOCK_SIZE = 8
TRAINING = DrafterTrainingSettings(steps=600, save_every=600)


def tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer of the 64 ids (`t0` .. `t63`): what a run needs to read prompts given as ids."""
    words = Tokenizer(WordLevel({f"t{i}": i for i in range(VOCAB_SIZE)}, unk_token="t0"))
    words.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=words, unk_token="t0", pad_token="t0", eos_token=f"t{EOS}")


def drafter_config(family: Family) -> dict:
    """The tiny drafter's config.json, in z-lab's format (with `use_sliding_window`, which transformers' Qwen3Config
    needs to keep the window z-lab's loop reads)."""
    extra = {"input_embedding_scale": family.input_embedding_scale} if family.input_embedding_scale != 1.0 else {}
    return {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "dtype": "bfloat16",
        "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
        "intermediate_size": 128, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 256,
        "vocab_size": VOCAB_SIZE, "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 4,
        "use_sliding_window": True, "block_size": BLOCK_SIZE, "num_target_layers": LAYERS,
        "dflash_config": {"target_layer_ids": list(LAYER_IDS), "mask_token_id": MASK_TOKEN_ID, **extra},
    }


def to_bfloat16(folder: Path) -> None:
    """Every weight of the folder's model.safetensors cast to bfloat16, and its config saying so."""
    weights = folder / "model.safetensors"
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in load_file(weights).items()}, weights,
              metadata={"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config["dtype"] = "bfloat16"
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def prompts(n: int, seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.tensor(PROMPT_IDS)
    return [ids[torch.randint(len(ids), (PROMPT_LEN,), generator=generator)].tolist() for _ in range(n)]


@torch.no_grad()
def greedy(model, prompt_batch: list[list[int]]) -> list[list[int]]:
    """Greedy continuations (transformers' generate on the loaded model, wrapper and all), cut after eos."""
    batch = torch.tensor(prompt_batch)
    out = model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=MAX_NEW_TOKENS, do_sample=False,
                         eos_token_id=EOS, pad_token_id=0)
    sequences = []
    for row in out.tolist():
        completion = row[PROMPT_LEN:]
        if EOS in completion:
            completion = completion[:completion.index(EOS) + 1]
        sequences.append(row[:PROMPT_LEN] + completion)
    return sequences


def make(family: Family, log=print) -> None:
    started = time.perf_counter()
    folder = HERE / family.name
    shutil.rmtree(folder, ignore_errors=True)
    target_dir = build_target(family, folder / "target")
    to_bfloat16(target_dir)
    tokenizer().save_pretrained(target_dir)
    target = load_target(target_dir, dtype=torch.float32, attention=choose_attention(target_dir))
    train = [Reference(PROMPT_LEN, s) for s in greedy(target.model, prompts(TRAIN_PROMPTS, seed=1))]
    held_out = prompts(EVAL_PROMPTS, seed=2)
    evals = [Reference(PROMPT_LEN, s) for s in greedy(target.model, held_out)]
    features = extract_features(target, [r.token_ids for r in train], LAYER_IDS)
    with tempfile.TemporaryDirectory() as scratch:
        (saved,) = train_drafter(drafter_config(family), target.embed_weight, target.head_weight, train, features,
                                 scratch, TRAINING, log=None)
        shutil.copytree(saved, folder / "drafter")
    config = json.loads((folder / "drafter" / "config.json").read_text())
    config.update(use_sliding_window=True, dtype="bfloat16")
    (folder / "drafter" / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    to_bfloat16(folder / "drafter")
    with open(folder / "prompts.jsonl", "w") as f:
        for i, p in enumerate(held_out):
            f.write(json.dumps({"id": f"{family.name}-{i}", "input_ids": p}) + "\n")
    eval_features = extract_features(target, [r.token_ids for r in evals], LAYER_IDS)
    tau = tau_of(folder / "drafter", target, evals, eval_features)
    lengths = sorted({a for r in replay(load_drafter(folder / "drafter"), target.embed_weight, target.head_weight,
                                        evals, eval_features) for a in r.acceptance_lengths})
    log(f"{family.name}: {target.attention} attention, tau {tau:.2f} on the held-out prompts (step lengths "
        f"{lengths}), {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    torch.set_num_threads(1)
    for name in sys.argv[1:] or FAMILIES:
        make(FAMILIES[name])
