"""Train a DFlash drafter on a target's own greedy continuations (the published recipe, small).

Recipe (SpecForge / DFlash): for each training sequence pick random anchors among the completion
tokens; each anchor's block is [anchor token, MASK x (B-1)] at positions anchor .. anchor+B-1; its
context is the target's features of the tokens strictly before the anchor; its labels are the
target's tokens at anchor+1 .. anchor+B-1. The loss is cross-entropy through the frozen target
head, weighted exp(-(k-1)/gamma) by block position k; the target's embeddings are frozen too.

A DFlash2 drafter also trains its candidate selector (as SpecForge's and NeMo Automodel's DFlash2 recipes do):
cross-entropy of its scores over the head's top K at each block position, given the label before it (the anchor
at position 1), with the label put among the candidates where the head left it out; the two losses are added
(HEAD_LOSS_WEIGHT). Its convolutions start as the identity.

A DSpark drafter trains as DeepSpec does (deepspec/modeling/dspark): its block convention, every slot drafting (slot k
learns the token at anchor + k + 1, the config's drafts_from_anchor; weights exp(-k / gamma) from slot 0), and its
head's loss alone (DSpark.head_loss: the Markov head's biased logits and the confidence head; DeepSpec never trains the
backbone's own logits, so the Markov head's lift over them shows). It is saved in DeepSpec's layout (save_checkpoint:
the target's embed_tokens and lm_head beside the drafter's weights).

Blocks never see each other: each block is its own batch row, so the attention mask cannot leak
across blocks (SpecForge #470), and a block sees the context only before its own anchor.

Saves checkpoints at steps like a real run (step_100/, step_200/, ...) in the published format; given a
log folder, logs what SpecForge's trainer logs, under its names, with TensorBoard's writer: `train/loss`,
`train/acc` and per draft position `train/acc_<k>` (teacher-forced: the argmax at block position k + 1
against its label, whatever the positions before it did; for DFlash2 too the head's argmax, not the selector's
choice, as the trainers log it), and for DFlash2 `train/selector_acc` (the selector's choice, teacher-forced).
Given held-out references too, at every save it logs what SpecForge's evaluator logs for a DFlash run
(specforge/eval/evaluator.py, a scalar strategy): `eval/avg_loss`, `eval/avg_acc` (the teacher-forced accuracy
over every drafted position of the held-out blocks) and `eval/simulated_acc_len` (for DFlash SpecForge logs that
same accuracy under this name; its CheckpointManager ranks saves by it). The log is flushed before each save is
handed on (`on_save`), so whoever evaluates the save reads what the trainer knew then. Logging changes no weight:
the held-out blocks are drawn with a generator of their own, without gradients.

For the tests of the train/eval alarm and the diagnostics only, `planted_bug` trains with one of the
bugs the seed project had (PLANTED_BUGS); the published recipe has none.
"""

import json
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from dflash_core.drafter import SAVED_TOKEN_HEAD, DFlashDrafter, save_drafter
from dflash_core.drafter_config import DrafterConfig
from dflash_core.replay import Reference

# tests only: the bugs a drafter can be trained with, and what each does
PLANTED_BUGS = {
    "leaked_block": "each block sees its own answers: its masks replaced by the tokens they must predict "
                    "(attention leaking into the block's future)",
    "shifted_label": "labels one position late: block position k learns the token at anchor + k + 1",
    "noisy_features": "the target's features drowned in noise (3x their spread) while training",
}

LOG_EVERY = 10  # steps between logged training scalars
EVAL_SEED_OFFSET = 1  # the held-out blocks' anchors: a generator seeded settings.seed + this, the same at every save
HEAD_LOSS_WEIGHT = 1.0  # a head's loss added to the backbone's with this weight (DFlash2's selector), unless it is
# the whole loss (Generation.HEAD_LOSS_ONLY)

Progress = Callable[[str, int, int], None]
"""Told how far a long step of the tiny build is: (the step's name, units done, units in all), e.g.
("drafter training", 40, 400); called after each unit. The command line draws it as progress bars."""


@dataclass(frozen=True)
class DrafterTrainingSettings:
    steps: int = 400
    save_every: int = 100
    sequences_per_step: int = 8
    anchors_per_sequence: int = 32
    lr: float = 2e-3
    warmup_steps: int = 20
    weight_decay: float = 0.0
    loss_decay_gamma: float = 4.0  # SpecForge uses 7 for blocks of 16; 4 suits blocks of 8
    seed: int = 0
    planted_bug: str | None = None  # tests only: one of PLANTED_BUGS

    def __post_init__(self):
        if self.planted_bug is not None and self.planted_bug not in PLANTED_BUGS:
            raise ValueError(f"planted_bug {self.planted_bug!r}: not one of {', '.join(PLANTED_BUGS)}")


def learning_rate(step: int, steps: int, peak: float, warmup: int) -> float:
    """The learning rate at 0-based `step` of `steps`: linear warmup to `peak` over `warmup` steps,
    then cosine decay to peak / 10 (the tiny target's and the drafter's training share it)."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def init_drafter(raw_config: dict, seed: int = 0, sliding_semantics: str = "causal") -> DFlashDrafter:
    """A freshly initialised drafter (normal(0, 0.02) projections and codebooks, unit norms; DFlash2's convolutions
    the identity), float32."""
    torch.manual_seed(seed)
    model = DFlashDrafter(DrafterConfig.from_dict(raw_config), sliding_semantics)
    for p in model.parameters():
        if p.ndim == 2:
            torch.nn.init.normal_(p, std=0.02)
    return model


def block_loss(drafter, embed, head, tokens, features, prompt_lens, n_anchors, gamma, generator,
               planted_bug: str | None = None,
               label_tokens=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weighted cross-entropy of n_anchors random blocks from each of a batch of sequences (DFlash2: plus its
    selector's; DSpark: its head's loss instead, Generation.HEAD_LOSS_ONLY), and per draft position the blocks whose
    argmax matched its label, the blocks with a label there and those whose head's choice matched it (DFlash2's selector,
    DSpark's Markov walk; [B-1] each; zeros for DFlash).

    tokens[i] [T_i] (prompt + completion), features[i] [K, >= T_i - 1, H], prompt_lens[i]; label_tokens[i]
    [T_i]: what each position is trained to predict (default tokens[i], the reference itself).
    All blocks run as one batch; each row sees only its own sequence's context before its anchor.
    A drafter whose every slot drafts (drafts_from_anchor: DeepSpec's DSpark) learns at slot k the token at
    anchor + k + 1, B drafts per block: its counts are [B] each.
    """
    B, n_seq = drafter.block_size, len(tokens)
    from_anchor = drafter.cfg.drafts_from_anchor
    if from_anchor and planted_bug is not None:
        raise ValueError("planted bugs are planted in DFlash drafters (block position k learning anchor + k) only")
    first = 0 if from_anchor else 1  # the block's first drafting slot
    drafting = slice(first, None)
    K, H = features[0].shape[0], features[0].shape[2]
    context_len = max(len(t) - 1 for t in tokens)
    padded = torch.zeros(n_seq, K, context_len, H)
    for i, (t, f) in enumerate(zip(tokens, features)):
        padded[i, :, : len(t) - 1] = f[:, : len(t) - 1]
    context = drafter.context_kv(padded)  # per layer (k, v) [n_seq, n_kv, context_len, hd]

    row_list, anchor_list = [], []
    for i, (t, prompt_len) in enumerate(zip(tokens, prompt_lens)):
        # anchors among the completion tokens that have at least one label after them
        candidates = len(t) - 1 - prompt_len
        chosen = prompt_len + torch.randperm(candidates, generator=generator)[: min(n_anchors, candidates)]
        row_list += [i] * len(chosen)
        anchor_list.append(chosen)
    rows, anchors = torch.tensor(row_list), torch.cat(anchor_list)
    offsets = torch.arange(B)
    positions = anchors[:, None] + offsets  # [N, B]
    lengths = torch.tensor([len(t) for t in tokens])[rows]
    all_tokens = torch.nn.utils.rnn.pad_sequence(list(tokens), batch_first=True)  # [n_seq, T_max]
    labelled = positions + 1 if planted_bug == "shifted_label" or from_anchor else positions
    label_source = all_tokens if label_tokens is None else torch.nn.utils.rnn.pad_sequence(list(label_tokens),
                                                                                          batch_first=True)
    labels = label_source[rows[:, None], labelled.clamp(max=all_tokens.shape[1] - 1)]
    labels = torch.where(labelled < lengths[:, None], labels, -100)[:, drafting]  # [N, D]: D drafts, B-1 or B
    ids = torch.full_like(positions, drafter.mask_token_id)
    ids[:, 0] = all_tokens[rows, anchors]
    if planted_bug == "leaked_block":
        ids[:, 1:] = torch.where(labels >= 0, labels, drafter.mask_token_id)

    S = int(anchors.max())
    block_context = [(k[rows, :, :S], v[rows, :, :S]) for k, v in context]
    hidden = drafter(F.embedding(ids, embed), anchors, block_context)  # [N, B, H]
    logits = hidden[:, drafting] @ head.T  # [N, D, V]
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1), reduction="none",
                         ignore_index=-100).view(labels.shape)
    weights = torch.exp(-(offsets[drafting] - first) / gamma)[None].expand_as(ce) * (labels != -100)  # exp(-j/gamma)
    labelled_here = labels != -100
    correct = ((logits.argmax(-1) == labels) & labelled_here).sum(0)
    loss = (ce * weights).sum() / weights.sum()
    selector_correct = torch.zeros_like(correct)
    if (head := drafter.generation.head_loss(drafter, hidden[:, drafting], logits, ids[:, 0], labels)) is not None:
        head_ce, chosen = head
        if drafter.generation.HEAD_LOSS_ONLY:
            loss = (head_ce * weights).sum() / weights.sum()
        else:
            loss = loss + HEAD_LOSS_WEIGHT * (head_ce * weights).sum() / weights.sum()
        selector_correct = ((chosen == labels) & labelled_here).sum(0)
    return loss, correct.detach(), labelled_here.sum(0), selector_correct.detach()


def drafts_per_block(drafter: DFlashDrafter) -> int:
    """The drafts a block of the drafter holds: B - 1, or B when every slot drafts (DeepSpec's convention)."""
    return drafter.cfg.verified_tokens(drafter.block_size) - 1


def save_checkpoint(drafter: DFlashDrafter, path: Path, embed: torch.Tensor, head: torch.Tensor) -> None:
    """A save in its config's format: the published one (save_drafter), or DeepSpec's (a Qwen3DSparkModel's
    save_pretrained: config.json, the target's config with its fields, and model.safetensors with the target's
    embed_tokens.weight and lm_head.weight, its frozen copies, beside the drafter's weights)."""
    if drafter.cfg.source_format != "deepspec":
        save_drafter(drafter, path)
        return
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(drafter.cfg.raw, indent=2, sort_keys=True))
    weights = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    weights.update(zip(SAVED_TOKEN_HEAD, (embed.detach().contiguous().cpu(), head.detach().contiguous().cpu())))
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})


def train_drafter(
    raw_config: dict,
    embed_weight: torch.Tensor,
    head_weight: torch.Tensor,
    references: Sequence[Reference],
    features: Sequence[torch.Tensor],
    out_dir: str | Path,
    settings: DrafterTrainingSettings = DrafterTrainingSettings(),
    sliding_semantics: str = "causal",
    log: Callable[[str], None] | None = print,
    progress: Progress | None = None,
    log_dir: str | Path | None = None,
    label_tokens: Sequence[torch.Tensor] | None = None,
    held_out: tuple[Sequence[Reference], Sequence[torch.Tensor]] | None = None,
    on_save: Callable[[Path], None] | None = None,
) -> list[Path]:
    """Train a drafter with `raw_config` (a DFlash config.json dict) and save step_N checkpoints.

    features[i]: the target's features [K, T_i, H] of reference i for the config's target_layer_ids.
    Returns the saved checkpoint directories in step order. `progress` is told each step done. log_dir:
    where TensorBoard scalars go (the module docstring), every LOG_EVERY steps; None: none. label_tokens (tests
    only): per reference, what each position is trained to predict instead of the reference's own token.
    held_out: (references, their features) the eval scalars are computed on at each save (with log_dir).
    on_save: told each save's folder once it is written (and the log flushed), while training goes on.
    """
    drafter = init_drafter(raw_config, settings.seed, sliding_semantics).train()
    embed = embed_weight.detach().float()
    head = head_weight.detach().float()
    tokens = [torch.as_tensor(list(r.token_ids)) for r in references]
    usable = [i for i, r in enumerate(references) if len(r.token_ids) - 1 > r.prompt_len]
    if not usable:
        raise ValueError("no reference has a completion of two or more tokens to train on")

    decay = [p for p in drafter.parameters() if p.ndim == 2]
    no_decay = [p for p in drafter.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": settings.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=settings.lr, betas=(0.9, 0.95))

    generator = torch.Generator().manual_seed(settings.seed)
    if settings.planted_bug == "noisy_features":
        features = [f.float() + 3 * f.float().std() * torch.randn(f.shape, generator=generator) for f in features]
    out_dir = Path(out_dir)
    writer = None
    if log_dir is not None:
        from torch.utils.tensorboard import SummaryWriter

        # written out at each save (flush) and at the end only: a reader between saves finds whole records
        writer = SummaryWriter(str(log_dir), max_queue=100_000, flush_secs=24 * 3600)
    window = torch.zeros(3, drafts_per_block(drafter))  # (correct, labelled, head correct) per position, since a log
    saved, started, running = [], time.perf_counter(), None
    for step in range(1, settings.steps + 1):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step - 1, settings.steps, settings.lr, settings.warmup_steps)
        pick = [usable[j] for j in torch.randint(len(usable), (settings.sequences_per_step,), generator=generator)]
        loss, correct, labelled, selector_correct = block_loss(
            drafter, embed, head, [tokens[i] for i in pick], [features[i].float() for i in pick],
            [references[i].prompt_len for i in pick], settings.anchors_per_sequence, settings.loss_decay_gamma,
            generator, settings.planted_bug, None if label_tokens is None else [label_tokens[i] for i in pick])
        window += torch.stack([correct, labelled, selector_correct]).float()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
        optimizer.step()
        running = loss.item() if running is None else 0.9 * running + 0.1 * loss.item()
        if writer is not None and step % LOG_EVERY == 0:
            accuracy = window[0] / window[1].clamp(min=1)
            writer.add_scalar("train/loss", running, step)
            writer.add_scalar("train/acc", float(window[0].sum() / window[1].sum().clamp(min=1)), step)
            for k, a in enumerate(accuracy.tolist()):
                writer.add_scalar(f"train/acc_{k}", a, step)
            if drafter.generation.TRAINING_ACCURACY:  # a head's own teacher-forced accuracy (DFlash2: selector_acc)
                writer.add_scalar(f"train/{drafter.generation.TRAINING_ACCURACY}",
                                  float(window[2].sum() / window[1].sum().clamp(min=1)), step)
            window.zero_()
        if progress:
            progress("drafter training", step, settings.steps)
        if step % settings.save_every == 0 or step == settings.steps:
            path = out_dir / f"step_{step}"
            save_checkpoint(drafter, path, embed, head)
            saved.append(path)
            if writer is not None and held_out is not None:
                for name, value in held_out_scalars(drafter, embed, head, *held_out, settings).items():
                    writer.add_scalar(name, value, step)
            if writer is not None:
                writer.flush()
            if log:
                log(f"drafter step {step}: loss {running:.3f} ({time.perf_counter() - started:.0f} s) -> {path}")
            if on_save:
                on_save(path)
    if writer is not None:
        writer.close()
    return saved


@torch.no_grad()
def held_out_scalars(drafter, embed, head, references: Sequence[Reference], features: Sequence[torch.Tensor],
                     settings: DrafterTrainingSettings) -> dict[str, float]:
    """What SpecForge's evaluator logs for a DFlash run (the module docstring), on blocks anchored as in training
    (settings.anchors_per_sequence per reference, settings.sequences_per_step references per batch), the same
    anchors at every save."""
    generator = torch.Generator().manual_seed(settings.seed + EVAL_SEED_OFFSET)
    usable = [i for i, r in enumerate(references) if len(r.token_ids) - 1 > r.prompt_len]
    loss_sum, batches, correct, labelled = 0.0, 0, 0.0, 0.0
    for first in range(0, len(usable), settings.sequences_per_step):
        pick = usable[first: first + settings.sequences_per_step]
        loss, right, counted, _ = block_loss(
            drafter, embed, head, [torch.as_tensor(list(references[i].token_ids)) for i in pick],
            [features[i].float() for i in pick], [references[i].prompt_len for i in pick],
            settings.anchors_per_sequence, settings.loss_decay_gamma, generator)
        loss_sum, batches = loss_sum + loss.item(), batches + 1
        correct, labelled = correct + float(right.sum()), labelled + float(counted.sum())
    if not batches:
        return {}
    accuracy = correct / max(labelled, 1.0)
    return {"eval/avg_loss": loss_sum / batches, "eval/avg_acc": accuracy, "eval/simulated_acc_len": accuracy}
