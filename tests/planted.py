"""Drafters trained with a bug planted, on a tiny run's target: what the train/eval alarm and the diagnostics
must name (tests only).

`planted_run(tiny, bug)` trains a drafter like the tiny run's own (same recipe, settings and data, fewer
steps) with one of the bugs the seed project had, or none (`bug=None`: its clean twin, the control), and
logs what SpecForge's trainer logs into `runs/` beside its step folders:

    <tiny run>/planted/<bug or clean>-<key>/step_N/   drafter checkpoints, as a training run saves them
    <tiny run>/planted/<bug or clean>-<key>/runs/     TensorBoard: train/loss, train/acc, train/acc_<k>

Bugs: training.PLANTED_BUGS (the block seeing its own answers, labels one position late, features drowned
in noise) and "noisy_logits": trained to predict the target's next token through logits with noise added once, when the
training data was made (LOGIT_NOISE times their spread), instead of the target's own next token.
"""

import hashlib
import inspect
import json
import os
import shutil
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

from dflash_core.features import extract_features
from dflash_core.replay import Reference
from dflash_core.target import Target
from dflash_eval.tiny import build, training
from dflash_eval.tiny import target as tiny_target
from dflash_eval.tiny.build import TinyBuildSettings, TinyRun, _greedy_batch, _train_prompts, tiny_drafter_config
from dflash_eval.tiny.training import DrafterTrainingSettings, train_drafter

PLANTED = (*training.PLANTED_BUGS, "noisy_logits")
LOGIT_NOISE = 2.0
STEPS, SAVE_EVERY = 200, 100


def planted_run(tiny: TinyRun, bug: str | None, log=print) -> Path:
    """The folder of a drafter run trained on `tiny`'s target with `bug` planted (PLANTED), or its clean twin
    (None); built once, then cached (the key: the training and build code, the bug, the tiny run's key)."""
    if bug is not None and bug not in PLANTED:
        raise ValueError(f"bug {bug!r}: not one of {', '.join(PLANTED)}")
    key = hashlib.sha256(json.dumps({
        "tiny": tiny.record["key"], "bug": bug, "steps": STEPS,
        "code": hashlib.sha256("".join(inspect.getsource(m) for m in (training, build, sys.modules[__name__]))
                               .encode()).hexdigest()}, sort_keys=True).encode()).hexdigest()[:12]
    final = tiny.root / "planted" / f"{bug or 'clean'}-{key}"
    if not (final / f"step_{STEPS}").is_dir():
        with build.building(final):  # another process training the same run: wait for it, then use its run
            if not (final / f"step_{STEPS}").is_dir():
                partial = final.with_name(f"{final.name}.partial-{os.getpid()}")
                shutil.rmtree(partial, ignore_errors=True)
                _train(tiny, bug, partial, log)
                shutil.rmtree(final, ignore_errors=True)  # a folder without its last step is no run
                partial.rename(final)
    return final


def _train(tiny: TinyRun, bug: str | None, out: Path, log) -> None:
    raw_settings = dict(tiny.record["settings"])
    drafter_settings = DrafterTrainingSettings(**raw_settings.pop("drafter_training"))
    settings = TinyBuildSettings(**{**raw_settings, "layer_ids": tuple(raw_settings["layer_ids"]),
                                    "drafter_layer_types": tuple(raw_settings["drafter_layer_types"])},
                                 drafter_training=drafter_settings)
    model = AutoModelForCausalLM.from_pretrained(tiny.target_dir, dtype=torch.float32).eval()
    tokenizer = PreTrainedTokenizerFast.from_pretrained(tiny.target_dir)
    target = Target.from_model(model)
    text, _ = tiny_target.build_corpus(settings.corpus_bytes)
    prompts = _train_prompts(tokenizer, text, settings.train_prompts, settings.prompt_len, settings.seed)
    refs = [Reference(settings.prompt_len, seq) for seq in
            _greedy_batch(model, prompts, settings.max_new_tokens, tokenizer.eos_token_id)]
    feats = extract_features(target, [r.token_ids for r in refs], settings.layer_ids)
    raw = tiny_drafter_config(settings, target, tiny_target.token_id(tokenizer, tiny_target.MASK_TOKEN))
    planted = bug if bug in training.PLANTED_BUGS else None
    labels = noisy_labels(target, refs) if bug == "noisy_logits" else None
    train_drafter(raw, target.embed_weight, target.head_weight, refs, feats, out,
                  replace(settings.drafter_training, steps=STEPS, save_every=SAVE_EVERY, planted_bug=planted),
                  log=log, log_dir=out / "runs", label_tokens=labels)
    (out / "planted.json").write_text(json.dumps({"bug": bug, "settings": asdict(settings)}, indent=2, default=str))


def noisy_labels(target: Target, refs: list[Reference], seed: int = 0) -> list[torch.Tensor]:
    """Per reference, the token each position is trained to predict: the argmax of the target's logits at the
    position before plus noise of LOGIT_NOISE times their spread, drawn once (the first token keeps its own)."""
    generator = torch.Generator().manual_seed(seed)
    last = [f[0] for f in extract_features(target, [r.token_ids for r in refs], [target.num_layers - 1])]  # [T, H] each
    labels = []
    with torch.no_grad():
        for ref, hidden in zip(refs, last):
            logits = target.apply_head(hidden.to(target.dtype)).float()  # [T, V]
            noisy = logits + LOGIT_NOISE * logits.std() * torch.randn(logits.shape, generator=generator)
            labels.append(torch.cat([torch.as_tensor(ref.token_ids[:1]), noisy.argmax(-1)[:-1]]))
    return labels
