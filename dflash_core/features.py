"""Teacher-forced target hidden states for DFlash drafters.

For a greedy reference sequence R, the target's hidden states computed in one
causal forward pass equal what the target computes while decoding R, so a
drafter can be replayed against them without the target.

Batching: sequences are sorted by length and right-padded. Right padding
keeps every real token at its own position 0..T_i-1, with the padding after
it, where causal attention, causal convolutions and the recurrent state of
linear-attention layers (Qwen3.5 Gated DeltaNet) never look, so the real
tokens' states do not depend on the mask at all. Left padding would shift
positions and feed pad tokens into the recurrence before the real ones; it
is only harmless where the model zeroes padded inputs (transformers 5.24's
Gated DeltaNet does, other kernels need not). The attention mask is still
passed so padded keys are masked the usual way.

Batched results are not bitwise equal to one-by-one results: CPU (and GPU)
matmul and SDPA kernels pick their blocking from the problem shape, so the same
row summed inside a longer or larger batch rounds differently. Measured on the
tiny test models in float32 the difference stays below 3e-6 of the row's RMS
(a few ulps, tests allow 1e-5); in bfloat16 it is the usual bf16 rounding
(about 1/16 of the row RMS at worst, a one-ulp flip of a large element,
propagated). With batch_size=1 (no padding, no mask) the result is bitwise
equal to Hugging Face's `output_hidden_states=True`.
"""

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .sampling import Sampling
from .target import Target

# Positions whose logits are formed at once when the target's probabilities are computed: [rows, V] in float32
# (a 248k vocabulary: 256 rows are 254 MB).
LOGIT_ROWS = 256


def _as_id_tensor(sequence, index: int) -> torch.Tensor:
    ids = torch.as_tensor(sequence)
    if ids.ndim != 1:
        raise ValueError(f"sequence {index} must be a flat list of token ids, got shape {tuple(ids.shape)}")
    if ids.numel() == 0:
        raise ValueError(f"sequence {index} is empty")
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise ValueError(f"sequence {index} must hold integer token ids, got {ids.dtype}")
    return ids.long()


def length_sorted_batches(lengths: Sequence[int], batch_size: int) -> list[list[int]]:
    """Group sequence indices into batches of similar length (longest first) to cut padding."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return [order[start : start + batch_size] for start in range(0, len(order), batch_size)]


@dataclass(frozen=True)
class Extracted:
    """What one teacher-forced pass gives of one sequence."""

    features: torch.Tensor | None  # [K, T, H] of the layer ids asked for; None when none was
    probabilities: torch.Tensor | None  # [T] float32: p[t] of token t after tokens < t (p[0] = 1); None unless asked


def reference_probabilities(target: Target, final_hidden: torch.Tensor, token_ids: torch.Tensor,
                            sampling: Sampling) -> torch.Tensor:
    """p[t]: the target's probability of token_ids[t] after token_ids[:t], processed as served (`sampling`), from
    its final-norm hidden states [T, H] through its head; p[0] = 1 (the first token is given). [T] float32, on the
    CPU. The logits are formed LOGIT_ROWS positions at a time."""
    p = torch.ones(len(token_ids), dtype=torch.float32)
    for first in range(0, len(token_ids) - 1, LOGIT_ROWS):
        last = min(first + LOGIT_ROWS, len(token_ids) - 1)
        logits = target.apply_head(final_hidden[first:last])  # predicts tokens first+1 .. last
        p[first + 1:last + 1] = sampling.probability_of(logits, token_ids[first + 1:last + 1].to(logits.device)).cpu()
    return p


def extract(
    target: Target,
    sequences: Sequence[Sequence[int]] | Sequence[torch.Tensor],
    layer_ids: Sequence[int],
    probabilities: Sampling | None = None,
    batch_size: int = 8,
    progress: Callable[[int], None] | None = None,
    device: str | torch.device | None = "cpu",
) -> list[Extracted]:
    """One teacher-forced pass per batch: the hidden states of `layer_ids` (extract_features) and, with
    `probabilities`, the target's probability of each token at those sampling settings (reference_probabilities:
    the same pass then runs to the last layer)."""
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    layer_ids = target.check_layer_ids(layer_ids)
    if not layer_ids and probabilities is None:
        raise ValueError("layer_ids is empty: nothing to extract")
    sequences = [_as_id_tensor(s, i) for i, s in enumerate(sequences)]
    for ids in sequences:
        target.check_length(len(ids))
    last = target.num_layers - 1
    run_ids = sorted(set(layer_ids) | ({last} if probabilities is not None else set()))

    results: dict[int, Extracted] = {}  # by index in `sequences`
    done = 0
    for batch in length_sorted_batches([len(s) for s in sequences], batch_size):
        lengths = [len(sequences[i]) for i in batch]
        max_len = max(lengths)
        input_ids = torch.zeros(len(batch), max_len, dtype=torch.long)  # pad id 0: any valid id works
        attention_mask = torch.zeros(len(batch), max_len, dtype=torch.long)
        for row, i in enumerate(batch):
            input_ids[row, : lengths[row]] = sequences[i]
            attention_mask[row, : lengths[row]] = 1
        # Without padding, skip the mask so the call is exactly an unbatched HF forward.
        padded = min(lengths) < max_len
        out = target.forward(
            input_ids,
            attention_mask=attention_mask if padded else None,
            layer_ids=run_ids,
            logits=False,
        )
        for row, i in enumerate(batch):
            # stack copies, so no view keeps the padded batch alive
            features = torch.stack([out.features[k][row, : lengths[row]] for k in layer_ids]) if layer_ids else None
            probs = None if probabilities is None else reference_probabilities(
                target, out.features[last][row, : lengths[row]], sequences[i], probabilities)
            results[i] = Extracted(features if features is None or device is None else features.to(device), probs)
        del out
        done += len(batch)
        if progress is not None:
            progress(done)
    return [results[i] for i in range(len(sequences))]


def extract_features(
    target: Target,
    sequences: Sequence[Sequence[int]] | Sequence[torch.Tensor],
    layer_ids: Sequence[int],
    batch_size: int = 8,
    progress: Callable[[int], None] | None = None,
    device: str | torch.device | None = "cpu",
) -> list[torch.Tensor]:
    """Hidden states of `layer_ids` for every sequence, teacher-forced.

    Args:
        target: the loaded target.
        sequences: token ids per sequence (lists or 1-D tensors), any lengths.
        layer_ids: decoder layer ids; output rows follow this order.
        batch_size: sequences per forward pass.
        progress: optional callback, called with the number of sequences done so far.
        device: where the results go (they are bound for storage); None keeps the target's device.

    Returns:
        One tensor [K, T_i, H] per sequence (K = len(layer_ids)), in the input order,
        in the target's dtype. Row k equals Hugging Face
        `hidden_states[layer_ids[k] + 1]` (so the last layer is the final-norm output).
        Layers after max(layer_ids) are not run.
    """
    if not layer_ids:
        raise ValueError("layer_ids is empty: nothing to extract")
    extracted = extract(target, sequences, layer_ids, batch_size=batch_size, progress=progress, device=device)
    return [e.features for e in extracted if e.features is not None]  # (every one: layer ids were given)
