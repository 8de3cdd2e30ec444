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

import torch

from .target import Target


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
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    layer_ids = target.check_layer_ids(layer_ids)
    if not layer_ids:
        raise ValueError("layer_ids is empty: nothing to extract")
    sequences = [_as_id_tensor(s, i) for i, s in enumerate(sequences)]
    for ids in sequences:
        target.check_length(len(ids))

    results: dict[int, torch.Tensor] = {}  # by index in `sequences`
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
            layer_ids=layer_ids,
            logits=False,
        )
        for row, i in enumerate(batch):
            # stack copies, so no view keeps the padded batch alive
            features = torch.stack([out.features[k][row, : lengths[row]] for k in layer_ids])
            results[i] = features if device is None else features.to(device)
        del out
        done += len(batch)
        if progress is not None:
            progress(done)
    return [results[i] for i in range(len(sequences))]
