"""Why a drafter's tau is what it is: replays of the same references with its inputs changed.

All of these reuse the target features already cached for scoring (plus, for the offset probe, the
neighbouring layers), so each costs one drafter replay, never a target run:

  layer ablation   tau with one target layer's features zeroed, for each layer, and with all of them
                   (a drafter that uses its context falls to ~1 with all of them gone)
  offset probe     tau with the features of layers id+o instead of id: a drafter trained on the wrong
                   layers (an off-by-one in the training features) peaks at o != 0
  sliding switch   tau with the other sliding-window semantics (choices.SLIDING_SEMANTICS)
  first divergence per prompt, the first step that rejected a draft: where, and the drafted block
                   next to the reference's tokens, as text
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .drafter import DFlashDrafter
from .replay import BlockScorer, Reference, ReplayResult

DEFAULT_OFFSETS = (-2, -1, 0, 1, 2)


@dataclass(frozen=True)
class Variant:
    """One way of feeding the drafter: which target layers, and which of them zeroed."""

    name: str  # "ablate layer 2", "all layers ablated", "offset -1"
    layer_ids: tuple[int, ...]  # target layers whose features feed the drafter, in its order
    zeroed: tuple[int, ...] = ()  # layer ids whose features are replaced by zeros
    offset: int = 0  # layer_ids are the drafter's shifted by this many layers


def diagnostic_variants(layer_ids: Sequence[int], num_target_layers: int,
                        offsets: Sequence[int] = DEFAULT_OFFSETS) -> tuple[list[Variant], list[int]]:
    """The ablation and offset variants of a drafter trained on `layer_ids`, and the offsets left out
    because they fall outside the target's layers 0..num_target_layers-1."""
    ids = tuple(layer_ids)
    variants = [Variant(f"ablate layer {i}", ids, (i,)) for i in ids]
    variants.append(Variant("all layers ablated", ids, ids))
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


def variant_features(variant: Variant, features: dict[int, torch.Tensor]) -> torch.Tensor:
    """The drafter's input for one sequence: [K, T, H] from per-layer features {layer id: [T, H]}."""
    return torch.stack([
        torch.zeros_like(features[i]) if i in variant.zeroed else features[i] for i in variant.layer_ids
    ])


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
    """Per reference, its first step that rejected a draft (None when every step accepted all it could):
    step index, position in the completion, drafts accepted, and as text: the `context_tokens` tokens
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
            "step": step,
            "position": start - references[s].prompt_len,  # of the bonus token, in the completion
            "accepted": length - 1,
            "context": decode(tokens[max(0, start + 1 - context_tokens):start + 1]),
            "drafted": decode(block[:len(truth)]),
            "reference": decode(truth),
            "drafted_tokens": block[:len(truth)],
            "reference_tokens": truth,
        }
    return out
