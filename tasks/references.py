"""References stage: the target's greedy completion of every prompt, one file per prompt (resumable)."""

from dataclasses import dataclass
from pathlib import Path

import torch
from prefect import task
from prefect.cache_policies import NONE
from transformers import AutoTokenizer

from dflash_core.decoding import greedy_decode
from dflash_core.prompts import Prompt, prompt_set_identity, read_prompts
from dflash_core.replay import Reference
from dflash_core.target import read_target_config
from storage import Store, key_of, read_json, write_json_atomic

from .progress import StageProgress
from .stage import cached, run_entry
from .target import loaded_target, target_key

STAGE = "references"


@dataclass(frozen=True)
class ReferenceSet:
    """Greedy references of a prompt set, held in the store."""

    key: str
    path: str  # the entry folder: seq_<n>.json per prompt
    n: int


@dataclass(frozen=True)
class ReferenceItem:
    """One prompt's reference, as stored."""

    id: str
    category: str | None
    reference: Reference  # prompt + completion token ids
    finish: str  # "stop" (a stop token) or "length" (max_new_tokens reached)


def load_prompts(prompts_file: str, target_dir: str, thinking: bool = False) -> list[Prompt]:
    """Parse the prompt file with the target's tokenizer (errors name the file and line)."""
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    return read_prompts(prompts_file, tokenizer, thinking=thinking, vocab_size=read_target_config(target_dir).vocab_size)


def load_references(refs: ReferenceSet) -> list[ReferenceItem]:
    """Read a reference set back from the store, in prompt order."""
    items = []
    for n in range(refs.n):
        r = read_json(Path(refs.path) / f"seq_{n}.json")
        items.append(ReferenceItem(r["id"], r["category"], Reference(r["prompt_len"], r["token_ids"]), r["finish"]))
    return items


@task(name="references", cache_policy=NONE, persist_result=False)
def generate_references(
    target_dir: str,
    prompts_file: str,
    max_new_tokens: int,
    store_root: str,
    dtype: str = "float32",
    device: str = "cpu",
    thinking: bool = False,
    refresh: bool = False,
):
    """Greedy completions from the target through transformers (the embedded backend), temperature 0."""
    store = Store(store_root)
    prompts = load_prompts(prompts_file, target_dir, thinking)
    stop_ids = list(read_target_config(target_dir).eos_token_ids)
    key = key_of({
        "prompts": prompt_set_identity(prompts),
        "backend": {"kind": "transformers", "target": target_key(target_dir, store), "dtype": dtype,
                    "device": torch.device(device).type},
        "sampling": {"temperature": 0.0},
        "max_new_tokens": max_new_tokens,
        "stop_token_ids": stop_ids,
    })

    def compute(entry: Path) -> dict:
        todo = [n for n in range(len(prompts)) if not (entry / f"seq_{n}.json").exists()]  # resume
        if todo:
            target = loaded_target(target_dir, dtype, device)
            with StageProgress(STAGE, "greedy references", len(prompts)) as progress:
                for done, n in enumerate(todo, start=len(prompts) - len(todo) + 1):
                    prompt = prompts[n]
                    ids = greedy_decode(target, list(prompt.input_ids), max_new_tokens, stop_ids)
                    finish = "stop" if ids[-1] in stop_ids and len(ids) > len(prompt.input_ids) else "length"
                    write_json_atomic(entry / f"seq_{n}.json", {
                        "id": prompt.id, "category": prompt.category, "prompt_len": len(prompt.input_ids),
                        "token_ids": ids, "finish": finish,
                    })
                    progress.update(done)
        return {"n": len(prompts), "prompts_file": str(prompts_file), "max_new_tokens": max_new_tokens,
                "stop_token_ids": stop_ids, "backend": "transformers", "dtype": dtype}

    record, computed = run_entry(store, STAGE, key, compute, refresh)
    refs = ReferenceSet(key=key, path=str(store.entry(STAGE, key)), n=record["n"])
    return refs if computed else cached(refs)
