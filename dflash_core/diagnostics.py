"""Why a drafter's tau is what it is: replays of the same references with its inputs changed.

All of these reuse the target features already cached for scoring (plus, for the offset probe, the
neighbouring layers), so each costs one drafter replay, never a target run:

  layer ablation   tau with one target layer's features zeroed, for each layer, and with all of them
                   (a drafter that uses its context falls to ~1 with all of them gone)
  noise            tau with every feature replaced by noise of the same mean and spread (a drafter
                   that keeps its tau does not read the target's features)
  offset probe     tau with the features of layers id+o instead of id: a drafter trained on the wrong
                   layers (an off-by-one in the training features) peaks at o != 0
  sliding switch   tau with the other sliding-window semantics (choices.SLIDING_SEMANTICS)
  first divergence per prompt, the first step that rejected a draft: where, and the drafted block
                   next to the reference's tokens, as text
  agreement        with a block at every position: how often the first drafted token is the target's own
                   next token, on the context (blocks anchored in the prompt) and on the references (in the
                   completion); the target's next tokens come from its last layer's cached features (its
                   final-norm output) through its head, so this too needs no target run; and how often the
                   drafted tokens match the reference one position earlier, at their own, one later

`findings` names what these say about how the drafter was trained: it leans on one layer alone (collapses
without it: an fc input holding a layer that nearly gives the answer, such as the target's last one, whose
output the head reads), it hardly reads the features (hardly changed under noise: trained on noisy or missing
features), its drafts match the reference one position off better than at their own positions (labels one
position off in training), or its first token agrees with the target's on neither the context nor the
references (it learned something other than the target's next token: noisy target logits, or labels that are
not the target's).
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .drafter import DFlashDrafter
from .replay import BlockScorer, Reference, ReplayResult

DEFAULT_OFFSETS = (-2, -1, 0, 1, 2)
NOISE = "noise instead of the features"
COLLAPSE = 0.2  # a layer whose ablation leaves less than this share of the drafter's gain over tau 1
# noise in place of every feature keeping at least this share of the gain: the features are hardly read (the tiny
# run: 11% clean, 50% trained on features drowned in noise; tests/test_planted_bugs.py)
UNCHANGED = 0.35
AGREEMENT = 0.5  # a first drafted token that is the target's own next one less often than this, on both
LABEL_OFFSETS = {"offset -1": -1, "offset 0": 0, "offset +1": 1}  # drafted tokens against the reference's, shifted
OFFSET_MARGIN = 0.1  # a neighbour matching this much more often than the token's own position: labels shifted


@dataclass(frozen=True)
class Variant:
    """One way of feeding the drafter: which target layers, and which of them zeroed."""

    name: str  # "ablate layer 2", "all layers ablated", "offset -1"
    layer_ids: tuple[int, ...]  # target layers whose features feed the drafter, in its order
    zeroed: tuple[int, ...] = ()  # layer ids whose features are replaced by zeros
    offset: int = 0  # layer_ids are the drafter's shifted by this many layers
    noised: bool = False  # every layer's features replaced by noise of their own mean and spread


def diagnostic_variants(layer_ids: Sequence[int], num_target_layers: int,
                        offsets: Sequence[int] = DEFAULT_OFFSETS) -> tuple[list[Variant], list[int]]:
    """The ablation and offset variants of a drafter trained on `layer_ids`, and the offsets left out
    because they fall outside the target's layers 0..num_target_layers-1."""
    ids = tuple(layer_ids)
    variants = [Variant(f"ablate layer {i}", ids, (i,)) for i in ids]
    variants.append(Variant("all layers ablated", ids, ids))
    variants.append(Variant(NOISE, ids, noised=True))
    out_of_range = []
    for offset in offsets:
        shifted = tuple(i + offset for i in ids)
        if offset == 0:
            continue  # the unmodified replay, which the caller has
        if min(shifted) < 0 or max(shifted) >= num_target_layers:
            out_of_range.append(offset)
        else:
            variants.append(Variant(f"offset {offset:+d}", shifted, offset=offset))
    return variants, out_of_range


def variant_features(variant: Variant, features: dict[int, torch.Tensor], seed: int = 0) -> torch.Tensor:
    """The drafter's input for one sequence: [K, T, H] from per-layer features {layer id: [T, H]}; seed: the
    noise's (one per sequence, so a rerun draws the same)."""
    if variant.noised:
        generator = torch.Generator().manual_seed(seed)
        return torch.stack([
            (features[i].float().mean() + features[i].float().std()
             * torch.randn(features[i].shape, generator=generator)).to(features[i])
            for i in variant.layer_ids])
    return torch.stack([
        torch.zeros_like(features[i]) if i in variant.zeroed else features[i] for i in variant.layer_ids
    ])


def next_tokens(last_layer: torch.Tensor, head_weight: torch.Tensor, rows: int = 256) -> torch.Tensor:
    """The target's greedy next token after each position [T] from its last layer's features [T, H] (the
    final-norm output) and its head [V, H]; `rows` positions at a time (a whole [T, V] is GBs at real size)."""
    head = head_weight.to(last_layer.dtype)
    return torch.cat([(last_layer[i:i + rows] @ head.T).argmax(-1) for i in range(0, len(last_layer), rows)])


def agreement_counts(
    drafter: DFlashDrafter,
    embed_weight: torch.Tensor,
    head_weight: torch.Tensor,
    references: Sequence[Reference],
    features: Sequence[torch.Tensor],
    target_next: Sequence[torch.Tensor],
    block_size: int | None = None,
    blocks_per_pass: int = 256,
) -> dict[str, list[int]]:
    """With a block anchored at every position, [agreed, compared] counts of:
      "context", "references": the drafter's first drafted token against the target's own next token, for
          blocks whose first drafted token falls in the prompt, and in the completion;
      "offset -1", "offset 0", "offset +1": every drafted token of the completion's blocks against the
          reference's token one position earlier, at its own position, one position later (a drafter trained
          with labels one position late matches the later one best).
    target_next[i][p]: the target's next token after token p of reference i (next_tokens)."""
    scorer = BlockScorer(drafter, embed_weight, head_weight, references, features, block_size)
    counts = {name: [0, 0] for name in ("context", "references", *LABEL_OFFSETS)}
    # from 1: a block needs some context; up to T-2: its first drafted token must be in the reference
    blocks = [(i, p) for i, r in enumerate(references) for p in range(1, len(r.token_ids) - 1)]
    for start in range(0, len(blocks), blocks_per_pass):
        chunk = blocks[start:start + blocks_per_pass]
        in_prompt = [p + 1 < references[i].prompt_len for i, p in chunk]
        context = [b for b, inside in zip(chunk, in_prompt) if inside]
        completion = [b for b, inside in zip(chunk, in_prompt) if not inside]
        for (i, p), (first,) in zip(context, scorer.draft_tokens(context, positions=1) if context else ()):
            counts["context"][0] += int(first == int(target_next[i][p]))
            counts["context"][1] += 1
        for (i, p), drafted in zip(completion, scorer.draft_tokens(completion) if completion else ()):
            counts["references"][0] += int(drafted[0] == int(target_next[i][p]))
            counts["references"][1] += 1
            tokens = references[i].token_ids
            for name, shift in LABEL_OFFSETS.items():
                for k, token in enumerate(drafted, start=1):
                    if 0 <= p + k + shift < len(tokens):
                        counts[name][0] += int(token == tokens[p + k + shift])
                        counts[name][1] += 1
    return counts


def findings(tau: float, ablated: dict[int, float], noise_tau: float | None,
             agreement: dict[str, list[int]] | None = None) -> list[dict]:
    """What the diagnostics say about how the drafter was trained, each {"kind", "message"}: tau unmodified,
    {layer id: tau with it zeroed}, tau with noise for every feature, agreement_counts (module docstring)."""
    found = []
    gain = tau - 1
    if gain >= 0.05:  # below it there is nothing left to lose
        kept = {i: (t - 1) / gain for i, t in ablated.items()}
        collapsed = [i for i, share in kept.items() if share < COLLAPSE]
        if len(collapsed) == 1 and len(kept) > 1 and all(kept[i] >= 2 * COLLAPSE for i in kept if i not in collapsed):
            (i,) = collapsed
            found.append({"kind": "collapses without one layer", "message": (
                f"without target layer {i} tau falls from {tau:.2f} to {ablated[i]:.2f}, while without any other "
                f"it keeps at least {min(t for j, t in ablated.items() if j != i):.2f}: the drafter leans on that "
                "one layer; an fc input holding a layer that nearly gives the answer (such as the target's last) "
                "does this")})
        if noise_tau is not None and (noise_tau - 1) >= UNCHANGED * gain:
            found.append({"kind": "hardly changed under noise", "message": (
                f"with noise in place of every target feature tau is still {noise_tau:.2f} of {tau:.2f}, "
                f"{(noise_tau - 1) / gain:.0%} of its gain over 1 (a drafter that reads the features keeps little "
                "of it): the drafter hardly reads the target's features; trained on noisy or missing features?")})
    rates = {name: agreed / compared for name, (agreed, compared) in (agreement or {}).items() if compared}
    shifted = {name: rates[name] for name in LABEL_OFFSETS if name in rates}
    off = max(shifted, key=shifted.__getitem__) if len(shifted) == len(LABEL_OFFSETS) else "offset 0"
    if off != "offset 0" and shifted[off] > shifted["offset 0"] + OFFSET_MARGIN:
        found.append({"kind": "labels one position off", "message": (
            f"the drafted tokens match the reference's one position {'later' if off == 'offset +1' else 'earlier'} "
            f"({shifted[off]:.0%}) more often than at their own position ({shifted['offset 0']:.0%}): the drafter "
            "was trained with labels one position off its features (a one-position offset between labels and "
            "features)")})
    if "context" in rates and "references" in rates and max(rates["context"], rates["references"]) < AGREEMENT:
        found.append({"kind": "agrees with the target on neither", "message": (
            f"the drafter's first token is the target's own next token at {rates['references']:.0%} of the "
            f"references' positions and {rates['context']:.0%} of the context's: it agrees with neither, so it "
            "learned something other than the target's next token; trained on noisy target logits, or on labels "
            "that are not the target's?")})
    return found


def first_divergences(
    drafter: DFlashDrafter,
    embed_weight: torch.Tensor,
    head_weight: torch.Tensor,
    references: Sequence[Reference],
    features: Sequence[torch.Tensor],
    results: Sequence[ReplayResult],
    decode: Callable[[list[int]], str],
    context_tokens: int = 24,
    block_size: int | None = None,
) -> list[dict | None]:
    """Per reference, its first decode step that rejected a draft (None when every step accepted all it could):
    the decode step's index, the position in the completion, its acceptance length (the drafts accepted plus the
    target's own token, as the histogram counts), and as text: the `context_tokens` tokens
    before the block (ending with the bonus token R[start]; the prompt's tail for an early step), the
    drafted block and the reference's tokens there. block_size: the blocks the steps were drafted with
    (default the drafter's own)."""
    found: dict[int, tuple[int, int, int]] = {}  # reference -> (step, start, acceptance length) of its first rejection
    for s, (_, result) in enumerate(zip(references, results)):
        step = next((i for i, r in enumerate(result.rejected_drafts) if r >= 0), None)
        if step is not None:
            found[s] = (step, result.starts[step], result.acceptance_lengths[step])
    wanted = [(s, start) for s, (_, start, _) in found.items()]
    if not wanted:
        return [None] * len(references)
    # only the references with a divergence need their context in the scorer
    scorer = BlockScorer(drafter, embed_weight, head_weight, [references[s] for s, _ in wanted],
                         [features[s] for s, _ in wanted], block_size)
    drafted = scorer.draft_tokens([(n, start) for n, (_, start) in enumerate(wanted)])
    out: list[dict | None] = [None] * len(references)
    for (s, start), block in zip(wanted, drafted):
        step, _, length = found[s]
        tokens = list(references[s].token_ids)
        truth = tokens[start + 1:start + scorer.B]
        out[s] = {
            "decode_step": step,
            "position": start - references[s].prompt_len,  # of the bonus token, in the completion
            "acceptance_length": length,
            "context": decode(tokens[max(0, start + 1 - context_tokens):start + 1]),
            "drafted": decode(block[:len(truth)]),
            "reference": decode(truth),
            "drafted_tokens": block[:len(truth)],
            "reference_tokens": truth,
        }
    return out
