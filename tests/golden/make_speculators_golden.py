"""Record speculators/ and speculators_golden.json: DFlash/DFlash2 training runs saved by vLLM's `speculators` 0.9.0.

What it writes. Four drafters for the tiny Qwen3 target of the DFlash golden case (`dflash010/target/`), each built
with speculators' own classes and written by speculators' own training-checkpoint code, as a speculators *run
folder* (the `--save-path` of `speculators train`) under `speculators/<name>/`:

- `dflash`: the trained tiny DFlash drafter of the DFlash golden case (`dflash010/drafter/`, z-lab format; adapted
  to sliding window 512, see "Sliding windows"), full vocabulary, block 8. Two saves: epoch 0, and epoch 1 with every trained weight slightly perturbed (as if trained
  further); TensorBoard log.
- `dflash_reduced`: the same backbone with a reduced draft vocabulary (`draft_vocab_size` REDUCED_VOCAB, its own
  `lm_head` [Vd, H] = the target head's rows of the kept tokens, `d2t`/`t2d`), the kept tokens being the most
  frequent tokens of the target's greedy outputs on the golden prompts, counted and mapped by speculators' own
  vocab-mapping code. Those outputs hold only 86 distinct tokens, so a draft vocabulary of 128..256 would keep
  every one of them; REDUCED_VOCAB (64) leaves some reference tokens outside the draft vocabulary, so the head and
  d2t change the drafts. One save.
- `dflash_anchor`: the same backbone with `sample_from_anchor: true` (slot 0 drafts too). Its drafts are poor (the
  weights were trained for the other convention); the golden values test the convention, not the quality. One save.
- `dflash2`: the trained tiny DFlash2 drafter of the DFlash2 golden case (`dflash2/drafter/`, z-lab format:
  attention_conv/mlp_conv, candidate_selector with bare codebook names), `speculators_model_type: dflash2`. Two
  saves: epoch 0, and epoch 1 saved mid-epoch (perturbed as for `dflash`; the run stopped there, so its latest link
  is `epoch1_step2`); TensorBoard log.

How each is built (speculators 0.9.0's own code throughout):
- the z-lab config is converted by speculators' z-lab converter (`DFlashConverter._build_config`, the code behind
  `speculators convert --algorithm dflash`): the z-lab-only keys dropped, `aux_hidden_state_layer_ids` =
  z-lab `target_layer_ids` + 1 (id L reads HF `hidden_states[L]`), `mask_token_id` and `block_size` carried over;
- the model is made by the trainer's constructor `<Model>.from_training_args` (as `speculators train` does), with
  t2d/d2t from `build_vocab_mappings_from_distribution` over a `save_token_frequency_distribution` count; it loads
  the verifier-owned weights itself (`embed_tokens`, the full or reduced `lm_head`, `verifier_norm`);
- the drafter's trained weights (bfloat16, names identical in both formats) are loaded into it with
  `load_state_dict` (no missing trained weight, no unexpected one), then adapted to the longer sliding window (see
  "Sliding windows"): fine-tuned with the model's own training forward and loss (the trainer kwargs of the run's
  TrainConfig: loss ce for dflash, kl_div for dflash2; AdamW lr ADAPT_LR, gradients clipped to 1 as the trainer
  does), ADAPT_PASSES passes over ADAPT_SEQUENCES sequences the target generates here (none of them golden: a
  32-token prefix sampled at temperature 1, then the greedy continuation), and rounded to bfloat16. dflash,
  dflash_reduced and dflash_anchor share the one adapted backbone;
- the run folder is written by the trainer's own methods, called for real: `Trainer.maybe_save_checkpoint`
  (`SingleGPUCheckpointer.save_checkpoint`: `<epoch>/` with config.json, config.py, model.safetensors in
  bfloat16, optimizer_state_dict.pt, scheduler_state_dict.pt; training_state.json with the global step; the
  links `epoch{E}_step{S}` / `epoch{E}_end`), `Trainer.maybe_update_best` (val_metrics.json, `checkpoint_best`),
  and `TrainConfig.save` (run.yaml and train_command.txt at the root, copied into every save), on a 4-step epoch
  with checkpoint_freq 0.5 (a mid-epoch save at step 2, then the end-of-epoch save);
- TensorBoard (`dflash`, `dflash2` only): speculators' own metric logger (`setup_metric_logger("tensorboard",
  ...)`, `log_run_config`, then the trainer's record shapes: `{"train": ..., "profile": ..., "epoch", "lr",
  "global_step"}` at every step and `{"val": {<metric>_epoch}, "epoch"}` at each epoch's end). The values are
  the drafter's own training/validation metrics (its forward with the trainer's loss kwargs, forward only: the
  weights change only by the epoch-1 perturbation; local step k = 1..4 of epoch e on golden sequence 4e + k - 1,
  validation on all 8), so the tags are the real ones
  (train/{loss,full_acc,eal,position_{i}_acc,error_records}, DFlash2's
  train/{teacher_forced_selector_acc,unary_candidate_recall_at_16,unary_top_16_oracle_accepted_length,...},
  val/<same>_epoch); `profile/*` holds this script's forward times. speculators' default log folder is `./logs`
  (relative to where `speculators train` runs, not inside the save path) with a run folder named by `--run-name`
  (default: the start time); here `--log-dir <run>/logs --run-name <name>`, so the events lie in
  `speculators/<name>/logs/<name>/` (two event files: the run config's hparams and the scalars).

Verifier path. Each save's `speculators_config.verifier.name_or_path` is VERIFIER ("../dflash010/target"), as a real
save names a hub id or a path: speculators resolves it against the working directory, and this script works from
speculators/ (so it names dflash010/target/ beside this script). A loader given the target should ignore it.

Sliding windows. The drafters were trained with sliding window 4 (z-lab/SGLang/vLLM semantics: a query at position
p sees keys at positions > p - W). speculators windows a block's context from its anchor instead (context
positions >= anchor - W, the same for every slot of the block). The two agree only when no context is cut, so
every drafter here gets sliding window WINDOW (512 = max_position_embeddings, far longer than any golden sequence,
at most 80 tokens). The layer types stay (sliding, full), and the sliding layer still differs from the full one by
its block mask: causal within the block for the dflash runs (`sliding_window_non_causal` false, as the drafters
were trained) and bidirectional for dflash2 (true: speculators' dflash2 default); full layers always see the whole
block. Under window 512 the weights trained with window 4 draft poorly (slot-1 agreement 0.20 for DFlash), hence
the adaptation above (0.65 after it; the summary prints both).

Golden values (speculators_golden.json). For every save of every run: the drafts of speculators' own model
(`SpeculatorModel.from_pretrained` of the save, float32 compute from the bfloat16 weights, eager attention,
CPU), through its training forward `_backbone_forward` with the anchors forced through the loss mask, over the
8 reference sequences of the DFlash golden case (prompt + the dflash 0.1.0 greedy output_ids of
dflash010_loop.json), the target's hidden states computed here (transformers, float32). Anchor convention:

- anchor a is the position of the block's first token (the bonus token, known): slot 0 embeds token a, slots
  1..B-1 embed the mask token; the context is the target's hidden states at positions < a; the block's positions
  are a..a+B-1.
- slot i drafts the token at position a + i (sample_from_anchor false: slots 1..B-1, B-1 drafts), or at position
  a + i + 1 (sample_from_anchor true: slots 0..B-1, B drafts).
- every anchor a = prompt_len - 1 .. len - B - 1 of each sequence (so every drafted position has a reference
  token); drafts are target token ids (reduced vocabulary: target = d + d2t[d]).
- DFlash: the argmax of each slot's logits (lowest index on ties). DFlash2: `drafts` is the greedy selector walk
  (`candidate_selector.select` over the unary top-K, argmax of the scores; the predecessor of the first drafted
  slot is the anchor token, then the token drafted at the previous slot); `unary` is the argmax alone and
  `teacher_forced` the selector with the reference token as predecessor.
- `near_ties`: [sequence, anchor, slot, margin] wherever the top two logits (DFlash2: selector scores) of a
  drafted slot differ by less than NEAR_TIE; a replay that differs only there is within float rounding.

It runs in its own venv. The values were recorded with the versions in metadata.versions: transformers 5.25.0,
over speculators 0.9.0's pin (transformers<=5.19.0), so speculators is installed without its dependencies and the
ones this script needs are named (torchvision, torchaudio and psutil, which it does not use, are left out):

    python3 -m venv /tmp/specvenv
    /tmp/specvenv/bin/pip install torch==2.13.0 transformers==5.25.0 safetensors==0.8.0 tensorboard==2.21.0 \\
        datasets==5.1.0 loguru==0.7.3 hs-connectors==0.9.0 pydantic pydantic-settings rich typer httpx aiohttp openai
    /tmp/specvenv/bin/pip install --no-deps speculators==0.9.0
    OMP_NUM_THREADS=1 /tmp/specvenv/bin/python tests/golden/make_speculators_golden.py

(about 75 s on one core). It (re)writes speculators/ and speculators_golden.json beside itself and reads
dflash010/, dflash2/drafter/ and dflash010_loop.json there. It imports only torch, transformers, safetensors,
speculators and their dependencies (nothing from this repository). The venv must lie outside any git checkout:
speculators' TrainConfig.save would otherwise record that checkout's diff as speculators.patch. As a cross-check
it also converts the adapted DFlash backbone, written in z-lab format, with speculators' public converter
(`convert_model(..., algorithm="dflash")`) and asserts that the converted model drafts exactly as the `dflash`
run's epoch-0 save.
"""

import copy
import hashlib
import json
import logging
import os
import platform
import shutil
import sys
import tempfile
import time
import types
import warnings
from importlib.metadata import version
from pathlib import Path

import speculators  # (also registers the config and model classes)
import torch
from datasets import Dataset
from loguru import logger as loguru_logger
from safetensors.torch import load_file, save_file
from speculators import SpeculatorModel, SpeculatorModelConfig
from speculators.convert.dflash.converter import DFlashConverter
from speculators.models.dflash import DFlashDraftModel
from speculators.models.dflash2 import DFlash2DraftModel
from speculators.provenance import find_repo_root
from speculators.train.checkpointer import SingleGPUCheckpointer
from speculators.train.config.schema import TrainConfig
from speculators.train.logger import _flatten_dict, log_run_config, setup_metric_logger
from speculators.train.trainer import Trainer
from speculators.train.utils import normalize_counted_metrics
from speculators.train.vocab_mapping import (
    build_vocab_mappings_from_distribution,
    save_token_frequency_distribution,
)
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoModelForCausalLM

HERE = Path(__file__).resolve().parent
OUT = HERE / "speculators"
GOLDEN = HERE / "speculators_golden.json"
LOOP = HERE / "dflash010_loop.json"
TARGET = HERE / "dflash010" / "target"
VERIFIER = "../dflash010/target"  # as the saves record it; resolved from OUT, the working directory while running
ZLAB = {"dflash": HERE / "dflash010" / "drafter", "dflash2": HERE / "dflash2" / "drafter"}

WINDOW = 512
REDUCED_VOCAB = 64
NEAR_TIE = 1e-3
STEPS_PER_EPOCH = 4
PERTURB = 0.03  # epoch 1: every trained weight w -> w * (1 + PERTURB * N(0, 1)), rounded to bfloat16
PERTURB_SEED = 1234
ADAPT_SEQUENCES = 64  # target-generated training sequences: a sampled 32-token prefix, then 48 greedy tokens
ADAPT_PASSES = 3
ADAPT_LR = 3e-4
ADAPT_SEED = 7

# name: (z-lab source, model class, from_training_args extras, epochs to run, steps of the last epoch, TensorBoard)
RUNS = {
    "dflash": ("dflash", DFlashDraftModel, {}, 2, STEPS_PER_EPOCH, True),
    "dflash_reduced": ("dflash", DFlashDraftModel, {"reduced": True}, 1, STEPS_PER_EPOCH, False),
    "dflash_anchor": ("dflash", DFlashDraftModel, {"sample_from_anchor": True}, 1, STEPS_PER_EPOCH, False),
    "dflash2": ("dflash2", DFlash2DraftModel, {}, 2, 2, True),
}
VERIFIER_FILLED = {"embed_tokens.weight", "lm_head.weight", "verifier_lm_head.weight", "verifier_norm.weight",
                   "t2d", "d2t"}


def sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# ------------------------------------------------------------------------------------------------------------
# The reference sequences and the target's hidden states

def load_sequences() -> list[dict]:
    loop = json.loads(LOOP.read_text())
    prompts = {p["id"]: p["input_ids"] for p in loop["metadata"]["prompts"]}
    return [{"id": g["id"], "prompt_len": len(prompts[g["id"]]), "input_ids": prompts[g["id"]] + g["output_ids"]}
            for g in loop["greedy"]]


@torch.no_grad()
def target_states(sequences: list[dict]) -> list[dict]:
    """Per sequence: HF hidden_states (tuple, [0] = embeddings, [L] = layer L's output), the last layer's output
    before the final norm (speculators' verifier_last_hidden_states), and the target's argmax."""
    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    return [states_of(target, seq) for seq in sequences]


@torch.no_grad()
def states_of(target, seq: dict) -> dict:
    ids = torch.tensor([seq["input_ids"]])
    pre_norm = {}
    hook = target.model.layers[-1].register_forward_hook(
        lambda m, i, o: pre_norm.__setitem__("x", o[0] if isinstance(o, tuple) else o))
    res = target(input_ids=ids, output_hidden_states=True)
    hook.remove()
    p = seq["prompt_len"]
    # the reference is the target's own greedy continuation
    assert res.logits[0, p - 1:-1].argmax(-1).tolist() == seq["input_ids"][p:], seq["id"]
    return {"ids": ids, "hs": res.hidden_states, "last": pre_norm["x"]}


# ------------------------------------------------------------------------------------------------------------
# Building the drafters

def zlab_config(kind: str) -> dict:
    cfg = json.loads((ZLAB[kind] / "config.json").read_text())
    cfg["sliding_window"] = WINDOW  # see the docstring: window semantics agree only when nothing is cut
    return cfg


def vocab_mapping(sequences: list[dict], vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """speculators' own count (tokens under the loss mask: the target's outputs) and mapping."""
    rows = {"input_ids": [], "loss_mask": []}
    for seq in sequences:
        rows["input_ids"].append(seq["input_ids"])
        rows["loss_mask"].append([0] * seq["prompt_len"] + [1] * (len(seq["input_ids"]) - seq["prompt_len"]))
    dataset = Dataset.from_dict(rows).with_format("torch")
    with tempfile.TemporaryDirectory() as tmp:
        save_token_frequency_distribution(dataset, Path(tmp) / "token_freq.pt")
        freq = torch.load(Path(tmp) / "token_freq.pt", weights_only=True)
    return build_vocab_mappings_from_distribution(freq, REDUCED_VOCAB, vocab_size)


def train_config(name: str, kind: str, extra: dict, zcfg: dict, aux: list[int], epochs: int) -> TrainConfig:
    dcfg = zcfg["dflash_config"]
    cli = {
        "speculator_type": kind, "verifier_name_or_path": VERIFIER, "target_layer_ids": aux,
        "mask_token_id": dcfg["mask_token_id"], "block_size": zcfg["block_size"], "draft_attn_impl": "eager",
        "sample_from_anchor": bool(extra.get("sample_from_anchor", False)),
        "loss_implementation": "eager", "epochs": epochs, "checkpoint_freq": 0.5, "save_path": name,
        "logger": "tensorboard", "log_dir": f"{name}/logs", "run_name": name,
    }
    if extra.get("reduced"):
        cli["draft_vocab_size"] = REDUCED_VOCAB
    if kind == "dflash":
        cli["sliding_window_non_causal"] = False  # the dflash default, stated (dflash2's default is true)
    if kind == "dflash2":
        cli |= {k: dcfg[k] for k in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k")}
    return TrainConfig.from_sources(cli=cli, argv=["python", "tests/golden/make_speculators_golden.py"])


def build(name: str, sequences: list[dict], adapted: dict):
    """The drafter as the trainer constructs it, with the z-lab weights, adapted to the window (once per backbone)."""
    kind, cls, extra, epochs, _, _ = RUNS[name]
    zcfg = zlab_config(kind)
    converted = DFlashConverter()._build_config(zcfg, VERIFIER, None)  # z-lab config -> speculators fields
    tlc = copy.deepcopy(converted.transformer_layer_config)
    aux = list(converted.aux_hidden_state_layer_ids)
    cfg = train_config(name, kind, extra, zcfg, aux, epochs)
    args = cfg.flatten()
    t2d = d2t = None
    draft_vocab = tlc.vocab_size
    if extra.get("reduced"):
        d2t, t2d = vocab_mapping(sequences, tlc.vocab_size)
        draft_vocab = REDUCED_VOCAB
    args["draft_vocab_size"] = draft_vocab
    assert args["block_size"] == converted.block_size and args["mask_token_id"] == converted.mask_token_id
    model = cls.from_training_args(verifier_config=tlc, t2d=t2d, d2t=d2t, **args)
    weights = load_file(ZLAB[kind] / "model.safetensors")
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and set(missing) <= VERIFIER_FILLED, (unexpected, missing)
    if kind not in adapted:
        before = agreement([drafts_of(model, s, st) for s, st in zip(sequences, adapted["golden_states"],
                                                                        strict=True)], sequences, False)
        adapt(model, cfg, adapted["train"])
        adapted[kind] = {k: v.clone() for k, v in model.state_dict().items() if k in weights}
        adapted["before"][kind] = before
    missing, unexpected = model.load_state_dict(adapted[kind], strict=False)
    assert not unexpected and set(missing) <= VERIFIER_FILLED, (unexpected, missing)
    return model.eval(), cfg


@torch.no_grad()
def adaptation_data() -> list[tuple[dict, dict]]:
    """Training sequences that are not the golden ones: the target's own text (a 32-token prefix sampled at
    temperature 1 from a random first token) and its greedy continuation (48 tokens), with its hidden states."""
    target = AutoModelForCausalLM.from_pretrained(TARGET, dtype=torch.float32).eval()
    torch.manual_seed(ADAPT_SEED)
    seqs = []
    for i in range(ADAPT_SEQUENCES):
        start = torch.randint(4, target.config.vocab_size, (1, 1))
        prefix = target.generate(start, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=31,
                                 min_new_tokens=31, pad_token_id=0)
        ids = target.generate(prefix, do_sample=False, max_new_tokens=48, pad_token_id=0)  # stops at eos
        seq = {"id": f"adapt-{i:03d}", "prompt_len": prefix.shape[1], "input_ids": ids[0].tolist()}
        seqs.append((seq, states_of(target, seq)))
    return seqs


def adapt(model, cfg: TrainConfig, train: list[tuple[dict, dict]]) -> None:
    """Fine-tune every trained weight with speculators' own training objective (the model's forward and loss with
    the trainer's kwargs; AdamW, gradients clipped to 1 as the trainer does), then round to bfloat16."""
    kwargs = model.get_trainer_kwargs(**cfg.flatten())[0]
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=ADAPT_LR)
    model.train()
    for _ in range(ADAPT_PASSES):
        for seq, state in train:
            T = len(seq["input_ids"])
            loss_mask = torch.ones(1, T)
            loss_mask[0, 0] = 0  # every position after the first: sampled text and greedy continuation alike
            _, loss, _ = model(hidden_states=aux_states(model, state), input_ids=state["ids"], loss_mask=loss_mask,
                               verifier_last_hidden_states=state["last"],
                               document_ids=torch.zeros(1, T, dtype=torch.long), **(kwargs | {"max_anchors": T}))
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    model.eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.copy_(p.to(torch.bfloat16).float())


# ------------------------------------------------------------------------------------------------------------
# The model's own training metrics (for TensorBoard and val_metrics.json)

def aux_states(model, state) -> torch.Tensor:
    return torch.cat([state["hs"][i] for i in model.target_layer_ids], dim=-1)  # aux id L = hidden_states[L]


@torch.no_grad()
def metrics_on(model, cfg: TrainConfig, seq: dict, state: dict) -> dict[str, float]:
    kwargs = model.get_trainer_kwargs(**cfg.flatten())[0]
    T = len(seq["input_ids"])
    loss_mask = torch.zeros(1, T)
    loss_mask[0, seq["prompt_len"]:] = 1
    kwargs["max_anchors"] = T  # every valid anchor (select_anchors keeps them all, sorted)
    _, _, metrics = model(hidden_states=aux_states(model, state), input_ids=state["ids"], loss_mask=loss_mask,
                          verifier_last_hidden_states=state["last"], document_ids=torch.zeros(1, T, dtype=torch.long),
                          **kwargs)
    return {k: float(v) for k, v in metrics.items()}


def perturb(model) -> None:
    g = torch.Generator().manual_seed(PERTURB_SEED)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            if p.requires_grad:
                noise = torch.randn(p.shape, generator=g)
                p.copy_((p * (1 + PERTURB * noise)).to(torch.bfloat16).float())


def fake_trainer(model, root: Path):
    """The trainer's own checkpoint methods on a stand-in `self` (no data loaders)."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    t = types.SimpleNamespace(
        config=types.SimpleNamespace(save_best=False, checkpoint_freq=0.5), checkpointer=SingleGPUCheckpointer(root),
        model=model, optimizers=[opt], schedulers=[sched], is_distributed=False, global_step=0, best_val_loss=1e9)
    t._save_training_state = lambda e, s: Trainer._save_training_state(t, e, s)
    t._training_state_path = lambda e: Trainer._training_state_path(t, e)
    return t


def run(name: str, sequences, states, adapted: dict) -> dict:
    """Build the drafter and write its run folder (and TensorBoard log) as `speculators train` would."""
    kind, _, _, epochs, last_epoch_steps, with_tb = RUNS[name]
    model, cfg = build(name, sequences, adapted)
    root = Path(name)
    cfg.save(str(root))
    metric_logger = logging.getLogger("speculators.metrics")
    if with_tb:
        setup_metric_logger(loggers="tensorboard", run_name=name, output_dir=str(root / "logs"))
        logging.getLogger("speculators").setLevel(logging.WARNING)
        log_run_config(cfg)
    logged: dict[str, list] = {}

    def log(record: dict, step: int) -> None:
        if with_tb:
            metric_logger.info(record, extra={"step": step})
            for tag, value in _flatten_dict(record).items():
                logged.setdefault(tag, []).append([step, value])

    tr = fake_trainer(model, root)
    step_interval = max(1, round(STEPS_PER_EPOCH * tr.config.checkpoint_freq))
    saves = {}
    for epoch in range(epochs):
        if epoch > 0:
            perturb(model)
        steps = last_epoch_steps if epoch == epochs - 1 else STEPS_PER_EPOCH
        for local_step in range(1, steps + 1):
            seq_index = (epoch * STEPS_PER_EPOCH + local_step - 1) % len(sequences)
            t0 = time.perf_counter()
            metrics = metrics_on(model, cfg, sequences[seq_index], states[seq_index])
            fwd_ms = (time.perf_counter() - t0) * 1000
            metrics |= {"error_records_sum": 0.0, "error_records_total": 1.0}
            metrics = normalize_counted_metrics(metrics, 1)
            n_tokens = len(sequences[seq_index]["input_ids"])
            profile = {"fetch_ms": 0.0, "fwd_ms": fwd_ms, "bwd_ms": 0.0, "opt_ms": 0.0, "step_ms": fwd_ms,
                       "tokens_per_s": n_tokens / (fwd_ms / 1000), "fetch_frac": 0.0, "queue_ms": 0.0,
                       "h2d_ms": 0.0, "clip_ms": 0.0}
            log({"train": metrics, "profile": profile, "epoch": epoch, "lr": tr.optimizers[0].param_groups[0]["lr"],
                 "global_step": tr.global_step}, tr.global_step)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "lr_scheduler.step() before optimizer.step()"
                tr.schedulers[0].step()
            tr.global_step += 1
            if local_step % step_interval == 0 and STEPS_PER_EPOCH - local_step >= step_interval * 0.25:
                Trainer.maybe_save_checkpoint(tr, epoch, local_step=local_step)  # mid-epoch save
        if steps < STEPS_PER_EPOCH:
            break  # the run stopped after this epoch's mid-epoch save
        Trainer.maybe_save_checkpoint(tr, epoch)  # end-of-epoch save
        acc: dict[str, float] = {}
        for seq, state in zip(sequences, states, strict=True):
            for k, v in metrics_on(model, cfg, seq, state).items():
                acc[k] = acc.get(k, 0.0) + v
        val = {f"{k}_epoch": v for k, v in normalize_counted_metrics(
            {k: v / len(sequences) for k, v in acc.items()}, 1).items()}
        log({"val": val, "epoch": epoch}, tr.global_step)
        Trainer.maybe_update_best(tr, epoch, val)
    if with_tb:
        for handler in metric_logger.handlers:
            handler.flush()
            handler.close()
        metric_logger.handlers.clear()
    for d in sorted(p for p in root.iterdir() if p.is_dir() and not p.is_symlink() and p.name.isdigit()):
        state = json.loads((d / "training_state.json").read_text())
        links = sorted(p.name for p in root.iterdir() if p.is_symlink() and p.readlink() == Path(d.name))
        saves[d.name] = {"links": links, "training_state": state,
                         "model.safetensors sha256": sha256(d / "model.safetensors")}
    return {"saves": saves, "logged": logged}


# ------------------------------------------------------------------------------------------------------------
# Golden drafts, from the saves

def load_save(path: Path):
    cfg = SpeculatorModelConfig.from_pretrained(path)
    # _attn_implementation is not serialized; unset, __init__ picks simple_flex_attention (needs torch.compile).
    # The trainer re-applies --draft-attn-impl the same way (train/cli.py build_draft_model).
    cfg.transformer_layer_config._attn_implementation = "eager"
    return SpeculatorModel.from_pretrained(path, config=cfg, dtype=torch.float32).eval()


def margin(scores: torch.Tensor) -> float:
    top = scores.topk(2).values
    return float(top[0] - top[1])


@torch.no_grad()
def drafts_of(model, seq: dict, state: dict) -> dict:
    B = model.block_size
    ids = state["ids"]
    T = ids.shape[1]
    anchors = list(range(seq["prompt_len"] - 1, T - B))
    loss_mask = torch.zeros(1, T)
    loss_mask[0, anchors] = 1
    hidden, logits, _, _, idx = model._backbone_forward(
        hidden_states=aux_states(model, state), input_ids=ids, loss_mask=loss_mask,
        verifier_last_hidden_states=state["last"], document_ids=torch.zeros(1, T, dtype=torch.long),
        max_anchors=len(anchors))
    assert idx.view(-1, B)[:, 0].tolist() == anchors
    hidden, logits = hidden.view(len(anchors), B, -1), logits.view(len(anchors), B, -1)
    s0 = 0 if model.config.sample_from_anchor else 1
    d2t = model.d2t if model.use_draft_vocab else None

    def to_target(d: torch.Tensor) -> torch.Tensor:
        return d if d2t is None else d + d2t[d]

    tokens = seq["input_ids"]
    out = {"id": seq["id"], "first_anchor": anchors[0], "drafts": [], "near_ties": []}
    selector = getattr(model, "candidate_selector", None)
    if selector is not None:
        out |= {"unary": [], "teacher_forced": []}
    for j, a in enumerate(anchors):
        unary = [int(to_target(logits[j, t].argmax())) for t in range(s0, B)]
        if selector is None:
            out["drafts"].append(unary)
            for t in range(s0, B):
                if (m := margin(logits[j, t])) < NEAR_TIE:
                    out["near_ties"].append([seq["id"], a, t, m])
            continue
        assert s0 == 1, "DFlash2 with sample_from_anchor: not recorded here"
        out["unary"].append(unary)
        walk, forced, pred = [], [], torch.tensor([tokens[a]])
        for t in range(s0, B):
            cand, scores = selector.select(logits[j, t:t + 1], hidden[j, t:t + 1], pred)
            tok = cand[0, scores[0].argmax()]
            if (m := margin(scores[0])) < NEAR_TIE:
                out["near_ties"].append([seq["id"], a, t, m])
            walk.append(int(tok))
            pred = tok.view(1)
            cand, scores = selector.select(logits[j, t:t + 1], hidden[j, t:t + 1], torch.tensor([tokens[a + t - 1]]))
            forced.append(int(cand[0, scores[0].argmax()]))
        out["drafts"].append(walk)
        out["teacher_forced"].append(forced)
    return out


def agreement(per_seq: list[dict], sequences: list[dict], sample_from_anchor: bool, key: str = "drafts") -> dict:
    """Per slot: how often the draft equals the reference token it predicts; and the mean accepted prefix."""
    shift = 1 if sample_from_anchor else 0
    hits: dict[int, list[int]] = {}
    prefix = []
    for rec, seq in zip(per_seq, sequences, strict=True):
        for j, draft in enumerate(rec[key]):
            a = rec["first_anchor"] + j
            s0 = 0 if sample_from_anchor else 1
            ok = [tok == seq["input_ids"][a + s0 + i + shift] for i, tok in enumerate(draft)]
            for i, o in enumerate(ok):
                hits.setdefault(s0 + i, []).append(int(o))
            n = 0
            while n < len(ok) and ok[n]:
                n += 1
            prefix.append(n)
    return {"slot_accuracy": {str(s): round(sum(h) / len(h), 4) for s, h in sorted(hits.items())},
            "mean_accepted_prefix": round(sum(prefix) / len(prefix), 4), "blocks": len(prefix)}


def tensorboard_scalars(root: Path) -> dict:
    """What the event files hold, read back with tensorboard's own reader."""
    out = {}
    for run_dir in sorted(p for p in (root / "logs").iterdir() if p.is_dir()):
        ea = EventAccumulator(str(run_dir))
        ea.Reload()
        files = sorted(p.name.split(".")[0] for p in run_dir.rglob("events.out.tfevents.*"))
        out[run_dir.name] = {"event_files": len(files), "scalars": {
            tag: [[e.step, e.value] for e in ea.Scalars(tag)] for tag in sorted(ea.Tags()["scalars"])}}
    return out


def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    loguru_logger.remove()
    loguru_logger.add(sys.stderr, level="WARNING")
    logging.getLogger("speculators").setLevel(logging.WARNING)
    if find_repo_root(Path(speculators.__file__)) is not None:
        sys.exit("speculators is installed inside a git checkout: TrainConfig.save would record its diff")
    t_start = time.time()
    sequences = load_sequences()
    states = target_states(sequences)
    if OUT.exists():
        shutil.rmtree(OUT)
    OUT.mkdir()
    os.chdir(OUT)  # the saves' verifier path, ../dflash010/target, is resolved from here

    adapted = {"train": adaptation_data(), "golden_states": states, "before": {}}
    golden: dict = {"drafters": {}}
    for name in RUNS:
        written = run(name, sequences, states, adapted)
        root = Path(name)
        entry = {"run": f"speculators/{name}"}
        cfg0 = json.loads((root / "0" / "config.json").read_text())
        entry["config"] = {k: cfg0.get(k) for k in (
            "speculators_model_type", "block_size", "draft_vocab_size", "mask_token_id",
            "aux_hidden_state_layer_ids", "sample_from_anchor", "sliding_window_non_causal")}
        entry["from"] = (f"{'dflash010' if RUNS[name][0] == 'dflash' else 'dflash2'}/drafter (z-lab format), "
                         f"sliding window {WINDOW}, adapted (see metadata.adaptation)")
        if name in adapted["before"]:
            entry["agreement_before_adaptation"] = adapted["before"][name]
        entry["checkpoint_best"] = (root / "checkpoint_best").readlink().name
        entry["latest"] = max(written["saves"], key=int)
        entry["saves"] = {}
        for epoch, info in written["saves"].items():
            model = load_save(root / epoch)
            recs = [drafts_of(model, seq, state) for seq, state in zip(sequences, states, strict=True)]
            save = dict(info)
            save["agreement"] = agreement(recs, sequences, model.config.sample_from_anchor)
            if "unary" in recs[0]:
                save["agreement_unary"] = agreement(recs, sequences, False, "unary")
            save["near_ties"] = [t for r in recs for t in r.pop("near_ties")]
            save["per_sequence"] = recs
            entry["saves"][epoch] = save
            if model.use_draft_vocab:
                kept = set((torch.arange(model.draft_vocab_size) + model.d2t).tolist())
                refs = [tok for seq in sequences for tok in seq["input_ids"][seq["prompt_len"]:]]
                entry["draft_vocab"] = {"size": model.draft_vocab_size, "target_ids": sorted(kept),
                                        "reference_tokens": len(refs),
                                        "reference_tokens_outside": sum(tok not in kept for tok in refs)}
        if written["logged"]:
            entry["tensorboard"] = {"dir": f"speculators/{name}/logs/{name}",
                                    "read_back": tensorboard_scalars(root)}
        golden["drafters"][name] = entry

    # the reduced head and d2t change drafts: compare with the full-vocabulary drafter on the same backbone
    full = golden["drafters"]["dflash"]["saves"]["0"]["per_sequence"]
    red = golden["drafters"]["dflash_reduced"]["saves"]["0"]["per_sequence"]
    pairs = [(x, y) for f, r in zip(full, red, strict=True) for df, dr in zip(f["drafts"], r["drafts"], strict=True)
             for x, y in zip(df, dr, strict=True)]
    golden["drafters"]["dflash_reduced"]["drafts_differing_from_dflash"] = sum(x != y for x, y in pairs)

    # cross-check: speculators' public z-lab converter gives the same `dflash` drafts as the run's epoch-0 save
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = Path(tmp) / "zlab", Path(tmp) / "converted"
        src.mkdir()
        (src / "config.json").write_text(json.dumps(zlab_config("dflash")))
        save_file({k: v.to(torch.bfloat16).contiguous() for k, v in adapted["dflash"].items()},
                  src / "model.safetensors", metadata={"format": "pt"})
        from speculators.convert.entrypoints import convert_model  # noqa: PLC0415
        convert_model(model=str(src), verifier=VERIFIER, algorithm="dflash", output_path=str(dst))
        conv = load_save(dst)
        conv_drafts = [drafts_of(conv, seq, state)["drafts"] for seq, state in zip(sequences, states, strict=True)]
        assert conv_drafts == [r["drafts"] for r in full], "convert_model's dflash drafts differ from the run's"

    golden = {
        "metadata": {
            "source": "speculators 0.9.0 (vLLM), its own model classes, converter, vocab mapping, trainer checkpoint "
                      "methods and metric logger; tests/golden/make_speculators_golden.py",
            "versions": {p: version(p) for p in ("speculators", "torch", "transformers", "safetensors",
                                                 "tensorboard", "datasets")} | {"python": platform.python_version()},
            "verifier": {"path": "dflash010/target", "recorded_in_saves_as": VERIFIER,
                         "sha256": {"model.safetensors": sha256(TARGET / "model.safetensors")},
                         "hidden_states": "transformers AutoModelForCausalLM, float32 from the bfloat16 weights, "
                                          "output_hidden_states (aux id L = hidden_states[L])"},
            "drafters_from": {"dflash010/drafter/model.safetensors": sha256(ZLAB["dflash"] / "model.safetensors"),
                              "dflash2/drafter/model.safetensors": sha256(ZLAB["dflash2"] / "model.safetensors")},
            "compute": "SpeculatorModel.from_pretrained(<save>, dtype=float32), eager attention, CPU; "
                       "_backbone_forward with the anchors forced through the loss mask",
            "sequences_from": "dflash010_loop.json: metadata.prompts[i].input_ids + greedy[i].output_ids",
            "anchor_convention": (
                "anchor a = position of the block's first (bonus) token; context = the target's hidden states at "
                "positions < a; block positions a..a+B-1 (slot 0 = token a, others the mask token); slot i drafts "
                "the token at a+i (sample_from_anchor false: slots 1..B-1) or a+i+1 (sample_from_anchor true: slots "
                "0..B-1). drafters.<run>.saves.<epoch>.per_sequence[k] is sequences[k]; its drafts[j] is anchor first_anchor + j (every a from prompt_len-1 to "
                "len-B-1), one target token id per drafted slot in slot order."),
            "dflash2": "drafts = greedy selector walk (predecessor of the first drafted slot = the anchor token, "
                       "then the previous drafted token); unary = argmax of the head; teacher_forced = selector "
                       "with the reference token at position a+i-1 as predecessor",
            "sliding_window": f"every drafter's sliding layers get window {WINDOW} (trained with 4) so that "
                              "speculators' anchor-relative window and a per-query window cut nothing; within the "
                              "block the sliding layer is causal for the dflash runs (sliding_window_non_causal "
                              "false) and bidirectional for dflash2 (true, its default); full layers always see the "
                              "whole block",
            "adaptation": f"before the runs, each backbone (dflash010's for dflash, dflash_reduced, dflash_anchor; "
                          f"dflash2's) is fine-tuned under its speculators config (window {WINDOW}) with the "
                          f"model's own training forward and loss (trainer kwargs of its TrainConfig: loss "
                          f"ce for dflash, kl_div for dflash2), AdamW lr {ADAPT_LR}, gradients clipped to 1, "
                          f"{ADAPT_PASSES} passes over {ADAPT_SEQUENCES} target-generated sequences (torch seed "
                          f"{ADAPT_SEED}: a first token uniform in 4..V-1, 31 tokens sampled at temperature 1, "
                          "48 greedy tokens; every position after the first an anchor candidate), none of them "
                          "golden, then rounded to bfloat16",
            "near_tie": NEAR_TIE,
            "perturbation": f"epoch-1 saves: every trained weight w -> w * (1 + {PERTURB} * N(0,1)) "
                            f"(torch.Generator seed {PERTURB_SEED}, parameters in name order), rounded to bfloat16",
            "seconds": round(time.time() - t_start, 1),
        },
        "sequences": sequences,
        **golden,
    }
    GOLDEN.write_text(json.dumps(golden, separators=(",", ":")) + "\n")
    summary(golden)


def summary(golden: dict) -> None:
    for name, entry in golden["drafters"].items():
        print(f"{name}: {entry['config']}  best={entry['checkpoint_best']} latest={entry['latest']}")
        if "agreement_before_adaptation" in entry:
            print(f"  before adaptation (window {WINDOW}, the z-lab weights): slot-1 agreement "
                  f"{entry['agreement_before_adaptation']['slot_accuracy']['1']:.3f}")
        if len(entry["saves"]) > 1:
            per_save = [[t for r in save["per_sequence"] for d in r["drafts"] for t in d]
                        for save in entry["saves"].values()]
            print(f"  drafted tokens differing between saves {list(entry['saves'])}: "
                  f"{sum(x != y for x, y in zip(*per_save))} of {len(per_save[0])}")
        for epoch, save in entry["saves"].items():
            ag = save["agreement"]
            first = min(ag["slot_accuracy"], key=int)
            print(f"  save {epoch} {save['links']} {save['training_state']}: slot-1 agreement "
                  f"{ag['slot_accuracy']['1']:.3f} (first drafted slot {first}: {ag['slot_accuracy'][first]:.3f}), "
                  f"per slot {ag['slot_accuracy']}, mean accepted prefix {ag['mean_accepted_prefix']:.3f} over "
                  f"{ag['blocks']} blocks, near ties {len(save['near_ties'])}")
            if "agreement_unary" in save:
                au = save["agreement_unary"]
                print(f"    unary head alone: slot-1 {au['slot_accuracy']['1']:.3f}, mean accepted prefix "
                      f"{au['mean_accepted_prefix']:.3f}")
        if "draft_vocab" in entry:
            dv = entry["draft_vocab"]
            print(f"  draft vocab {dv['size']}: {dv['reference_tokens_outside']} of {dv['reference_tokens']} "
                  f"reference output tokens outside it; {entry['drafts_differing_from_dflash']} drafts differ "
                  "from dflash's")
        if "tensorboard" in entry:
            tb = entry["tensorboard"]["read_back"]
            for run_name, content in tb.items():
                print(f"  TensorBoard {run_name}: {content['event_files']} event files, tags "
                      f"{sorted(content['scalars'])}")


if __name__ == "__main__":
    main()
