"""Build a tiny trained target and a DFlash drafter training run, for the demo, tests and smoke tests.

`build_tiny(out)` writes:

    out/target/               HF model directory (safetensors, tokenizer, chat template)
    out/target_vlm/           (arch "qwen3_5" only) the same text weights wrapped as
                              Qwen3_5ForConditionalGeneration with a tiny vision tower
    out/drafter/step_N/       drafter checkpoints in the published format, as a training run saves them (a DSpark
                              drafter, Qwen3DSparkModel: in DeepSpec's, as its trainer saves them)
    out/drafter/runs/         the drafter trainer's TensorBoard log, as SpecForge's tracker writes it: train/loss,
                              train/acc, train/acc_<k> every 10 steps, eval/avg_loss, eval/avg_acc and
                              eval/simulated_acc_len on the held-out prompts at each save (training.py)
    out/prompts.jsonl         held-out eval prompts: {"id", "category", "input_ids", "decoded"}
    out/build.json            settings, content key, timings, tau per saved step (written last)

`tiny_run(cache_root, settings)` returns a finished build from the cache, keyed by a hash of the
builder's code and settings, or builds it in place under a lock: a folder is a finished build once its
build.json is there (written last, atomically), so an interrupted build never looks finished, and its
saves keep the paths they are evaluated under while the drafter still trains (`demo` evaluates each one
as it is written: `on_save`).

Both take `log` (a line per finished step) and `progress` (how far the long steps are: training the
target, its greedy references, training the drafter, scoring the saved steps; see training.Progress),
`on_save` (told each drafter save's folder once written, while training goes on) and `drafter_compute`
(a context entered around the drafter's training in the building thread: `demo` leases it one thread there,
so that the saves are evaluated on the other cores meanwhile).
"""

import fcntl
import hashlib
import inspect
import json
import os
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
import transformers

from dflash_core import drafter, drafter_config, features, generations, replay
from dflash_core.drafter import load_drafter
from dflash_core.features import extract_features
from dflash_core.metrics import tau_macro
from dflash_core.replay import Reference
from dflash_core.target import Target

from . import target as tiny_target
from . import training as drafter_training
from .training import DrafterTrainingSettings, Progress, train_drafter

BUILD_RECORD = "build.json"
TRAINER_LOG = "runs"  # under the drafter's run folder, where SpecForge's tracker writes its TensorBoard log


@dataclass(frozen=True)
class TinyBuildSettings:
    arch: str = "qwen3"  # "qwen3" or "qwen3_5" (hybrid Gated DeltaNet + full attention)
    target_steps: int | None = None  # None: tiny_target.DEFAULT_STEPS[arch]
    corpus_bytes: int = tiny_target.DEFAULT_CORPUS_BYTES
    vocab_size: int = 512
    # drafter: two layers, sliding then full, like the Qwen3.6 drafters (four sliding, one full)
    block_size: int = 8
    layer_ids: tuple[int, ...] = (1, 2)  # of the target's 4 layers
    drafter_layer_types: tuple[str, ...] = ("sliding_attention", "full_attention")
    # Shorter than the block, so a sliding layer's semantics (causal or not within the block) decide
    # what each position sees: switching them costs ~0.7 tau here, a fault tests must catch. With a
    # window far longer than the block the switch moved tau by only ~0.01 on this model.
    sliding_window: int = 4
    # another generation's architecture (dflash_core.generations): its drafter, with the fields its generation gives
    # a tiny one (Generation.TINY_FIELDS; DFlash2DraftModel: the published drafter's convolutions and top K, a smaller
    # selector rank), its head trained beside the backbone's
    drafter_architecture: str = "DFlashDraftModel"
    train_prompts: int = 384
    eval_prompts: int = 32
    prompt_len: int = 32
    max_new_tokens: int = 96
    drafter_training: DrafterTrainingSettings = field(default_factory=DrafterTrainingSettings)
    seed: int = 0


@dataclass
class TinyRun:
    """A finished tiny build (paths into its folder)."""

    root: Path
    record: dict

    @property
    def target_dir(self) -> Path:
        return self.root / "target"

    @property
    def target_vlm_dir(self) -> Path:
        return self.root / "target_vlm"

    @property
    def drafter_steps(self) -> list[Path]:
        return [self.root / "drafter" / f"step_{s}" for s in self.record["steps"]]

    @property
    def prompts_file(self) -> Path:
        return self.root / "prompts.jsonl"

    @property
    def drafter_run(self) -> Path:
        """The drafter's training run folder: its saves and the trainer's log (TRAINER_LOG)."""
        return self.root / "drafter"


def tiny_run_key(settings: TinyBuildSettings) -> str:
    """Content key of a build: the code that shapes the trained weights, the settings and the library
    versions (replay and decoding only report tau here: they are left out, so editing them does not
    force a rebuild)."""
    shaping = (tiny_target, drafter, drafter_config, drafter_training, features, generations.base,
               *(sys.modules[type(g).__module__] for g in generations.generations()))  # (each generation's modules)
    code = "".join(inspect.getsource(m) for m in shaping)
    code += inspect.getsource(sys.modules[__name__])
    identity = {
        "code": hashlib.sha256(code.encode()).hexdigest(),
        "settings": asdict(settings),
        "python": sys.version_info[:2],  # the corpus is the stdlib of this Python
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True, default=str).encode()).hexdigest()[:16]


def buildable_architectures() -> list[str]:
    """The drafter architectures a tiny build trains: each registered generation's first, as its own trainer saves it
    (DSpark's: DeepSpec's Qwen3DSparkModel, the tiny Qwen3 target's kind)."""
    return [generation.ARCHITECTURES[0] for generation in generations.generations()]


def tiny_drafter_config(settings: TinyBuildSettings, target: Target, mask_token_id: int,
                        target_config: dict | None = None) -> dict:
    """The drafter's config.json: the published format of its generation, or for a DeepSpec architecture
    (Qwen3DSparkModel) DeepSpec's, which needs the target's config.json (`target_config`: deepspec_drafter_config)."""
    hidden = target.hidden_size
    generation = generations.by_architecture(settings.drafter_architecture)
    if generation is None or settings.drafter_architecture not in buildable_architectures():
        raise ValueError(f"drafter architecture {settings.drafter_architecture!r}: use one of "
                         f"{', '.join(buildable_architectures())}")
    if settings.drafter_architecture in drafter_config.DEEPSPEC_ARCHITECTURES:
        if target_config is None:
            raise ValueError(f"a {settings.drafter_architecture} drafter's config is the target's config.json with "
                             "DeepSpec's fields: pass target_config")
        return deepspec_drafter_config(settings, target_config, mask_token_id, generation.TINY_FIELDS)
    return {
        "architectures": [settings.drafter_architecture], "model_type": "qwen3",
        "hidden_size": hidden, "num_hidden_layers": len(settings.drafter_layer_types),
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": hidden // 4,
        "intermediate_size": 2 * hidden, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "max_position_embeddings": target.max_positions, "vocab_size": target.vocab_size,
        "layer_types": list(settings.drafter_layer_types), "sliding_window": settings.sliding_window,
        "block_size": settings.block_size, "num_target_layers": target.num_layers,
        "dflash_config": {"target_layer_ids": list(settings.layer_ids), "mask_token_id": mask_token_id,
                          **generation.TINY_FIELDS},
    }


def deepspec_drafter_config(settings: TinyBuildSettings, target_config: dict, mask_token_id: int,
                            head_fields: Mapping[str, Any]) -> dict:
    """DeepSpec's config.json of a drafter (deepspec/modeling/dspark/qwen3/config.py, build_draft_config): the
    target's config with the drafter's layers, every one full attention (DeepSpec builds no other), its block, its
    taps, the mask token, the anchors drawn per sequence in training and its heads' fields; the layer shapes are the
    target's."""
    if set(settings.drafter_layer_types) != {"full_attention"}:
        raise ValueError(f"drafter_layer_types {settings.drafter_layer_types}: DeepSpec's drafters have full attention "
                         "layers only (build_draft_config)")
    return {**target_config, "architectures": [settings.drafter_architecture],
            "num_target_layers": target_config["num_hidden_layers"],
            "num_hidden_layers": len(settings.drafter_layer_types), "block_size": settings.block_size,
            "tie_word_embeddings": False, "layer_types": list(settings.drafter_layer_types),
            "mask_token_id": mask_token_id, "target_layer_ids": list(settings.layer_ids),
            "num_anchors": settings.drafter_training.anchors_per_sequence, **head_fields}


def _train_prompts(tokenizer, text: str, n: int, length: int, seed: int) -> list[list[int]]:
    """n windows from the training part of the corpus (the eval prompts come from the held-out tail)."""
    train_text, _ = tiny_target.split_corpus(text)
    ids = tiny_target.encode_documents(tokenizer, train_text)
    generator = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, len(ids) - length, (n,), generator=generator)
    return [ids[s : s + length].tolist() for s in starts]


@torch.no_grad()
def _greedy_batch(model, prompts: list[list[int]], max_new_tokens: int, eos: int,
                  progress: Callable[[int], None] | None = None) -> list[list[int]]:
    """Greedy continuations of equal-length prompts in batches (training data; no padding needed).
    `progress` is told the number of prompts done after each batch."""
    out = []
    for i in range(0, len(prompts), 64):
        batch = torch.tensor(prompts[i : i + 64])
        generated = model.generate(batch, attention_mask=torch.ones_like(batch), max_new_tokens=max_new_tokens,
                                   do_sample=False, eos_token_id=eos, pad_token_id=eos)
        for row in generated.tolist():
            completion = row[batch.shape[1]:]
            if eos in completion:
                completion = completion[: completion.index(eos) + 1]
            out.append(row[: batch.shape[1]] + completion)
        if progress:
            progress(len(out))
    return out


def tau_of(drafter_dir: Path, target: Target, references, feats, sliding_semantics="causal") -> float:
    """Macro tau (mean over prompts of each prompt's mean acceptance length) of a drafter checkpoint."""
    model = load_drafter(drafter_dir, sliding_semantics=sliding_semantics)
    results = replay.replay(model, target.embed_weight, target.head_weight, references, feats)
    return tau_macro([r for r in results if r.acceptance_lengths])


def build_tiny(out: str | Path, settings: TinyBuildSettings = TinyBuildSettings(),
               log: Callable[[str], None] | None = print, progress: Progress | None = None,
               on_save: Callable[[Path], None] | None = None,
               drafter_compute: Callable[[], AbstractContextManager] | None = None) -> TinyRun:
    """Train the tiny target and a drafter run into `out` (see the module docstring)."""
    log = log or (lambda message: None)
    progress = progress or (lambda what, done, total: None)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    timings = {}
    started = time.perf_counter()

    text, corpus_sha256 = tiny_target.build_corpus(settings.corpus_bytes)
    tokenizer = tiny_target.train_tokenizer(text, settings.vocab_size)
    model, stats = tiny_target.train_target(tokenizer, text, settings.arch, settings.target_steps, settings.seed,
                                            progress=progress)
    tiny_target.save_target(model, tokenizer, out / "target")
    if settings.arch == "qwen3_5":
        tiny_target.save_qwen3_5_vlm(model, tokenizer, out / "target_vlm")
    timings["target"] = time.perf_counter() - started
    log(f"target: {stats.num_params / 1e6:.1f}M params, loss {stats.final_loss:.2f} "
        f"(held-out {stats.held_out_loss:.2f}), {timings['target']:.0f} s")

    target = Target.from_model(model)
    eos = tokenizer.eos_token_id
    mask_token_id = tiny_target.token_id(tokenizer, tiny_target.MASK_TOKEN)
    t = time.perf_counter()
    references = settings.train_prompts + settings.eval_prompts
    train_refs = [Reference(settings.prompt_len, seq) for seq in _greedy_batch(
        model, _train_prompts(tokenizer, text, settings.train_prompts, settings.prompt_len, settings.seed),
        settings.max_new_tokens, eos, lambda done: progress("greedy references", done, references))]
    eval_prompts = tiny_target.prompt_snippets(tokenizer, text, settings.eval_prompts, settings.prompt_len, settings.seed)
    eval_refs = [Reference(settings.prompt_len, seq) for seq in _greedy_batch(
        model, eval_prompts, settings.max_new_tokens, eos,
        lambda done: progress("greedy references", settings.train_prompts + done, references))]
    train_feats = extract_features(target, [r.token_ids for r in train_refs], settings.layer_ids)
    eval_feats = extract_features(target, [r.token_ids for r in eval_refs], settings.layer_ids)
    timings["references_and_features"] = time.perf_counter() - t
    log(f"references + features: {len(train_refs)} train, {len(eval_refs)} eval, {timings['references_and_features']:.0f} s")
    with open(out / "prompts.jsonl", "w") as f:  # before the first save: its evaluation reads them
        for i, p in enumerate(eval_prompts):
            # "decoded" is for people reading the file; the prompt is input_ids (other fields are ignored)
            f.write(json.dumps({"id": f"tiny-{i:03d}", "category": "code", "input_ids": p,
                                "decoded": tokenizer.decode(p)}) + "\n")

    t = time.perf_counter()
    raw = tiny_drafter_config(settings, target, mask_token_id, json.loads((out / "target" / "config.json").read_text()))
    with (drafter_compute or nullcontext)():
        saved = train_drafter(raw, target.embed_weight, target.head_weight, train_refs, train_feats,
                              out / "drafter", settings.drafter_training, log=log, progress=progress,
                              log_dir=out / "drafter" / TRAINER_LOG, held_out=(eval_refs, eval_feats),
                              on_save=on_save)
    timings["drafter"] = time.perf_counter() - t

    taus: dict[str, float] = {}
    for checkpoint in saved:
        taus[checkpoint.name] = tau_of(checkpoint, target, eval_refs, eval_feats)
        progress("scoring saved steps", len(taus), len(saved))
    timings["total"] = time.perf_counter() - started
    for name, tau in taus.items():
        log(f"{name}: tau {tau:.2f} (block {settings.block_size}, {len(eval_refs)} held-out prompts)")

    record = {
        "key": tiny_run_key(settings), "settings": asdict(settings), "corpus_sha256": corpus_sha256,
        "target": asdict(stats), "steps": [int(p.name.removeprefix("step_")) for p in saved],
        "tau": taus, "timings_s": {k: round(v, 1) for k, v in timings.items()},
    }
    partial = out / f".{BUILD_RECORD}.partial"  # whole or absent: a reader never finds half a record
    partial.write_text(json.dumps(record, indent=2))
    os.replace(partial, out / BUILD_RECORD)
    return TinyRun(out, record)


def default_cache_root() -> Path:
    """$DFLASH_TINY_CACHE, else ~/.cache/dflash-eval/tiny."""
    return Path(os.environ.get("DFLASH_TINY_CACHE") or Path.home() / ".cache" / "dflash-eval" / "tiny")


def tiny_run_folder(cache_root: str | Path, settings: TinyBuildSettings = TinyBuildSettings()) -> Path:
    """Where the build for these settings is (or will be) under cache_root."""
    return Path(cache_root) / tiny_run_key(settings)


def tiny_run(cache_root: str | Path, settings: TinyBuildSettings = TinyBuildSettings(),
             log: Callable[[str], None] | None = print, progress: Progress | None = None,
             on_save: Callable[[Path], None] | None = None,
             drafter_compute: Callable[[], AbstractContextManager] | None = None) -> TinyRun:
    """The cached build for these settings under cache_root/<key>, built first (in place: the module docstring)
    if missing; on_save and drafter_compute: as build_tiny's, used only when it builds."""
    final = tiny_run_folder(cache_root, settings)
    if not (final / BUILD_RECORD).exists():
        with building(final):  # another process building the same run: wait for it, then use its build
            if not (final / BUILD_RECORD).exists():
                shutil.rmtree(final, ignore_errors=True)  # a folder without its record is no build: start again
                build_tiny(final, settings, log, progress, on_save, drafter_compute)
    return TinyRun(final, json.loads((final / BUILD_RECORD).read_text()))


@contextmanager
def building(folder: Path) -> Iterator[None]:
    """Hold `<folder>.lock` (an flock, which the OS releases if this process dies): one process at a time
    builds into `folder`, so processes that need the same build at once build it once."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(folder.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield
