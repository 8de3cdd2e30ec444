"""A drafter checkpoint's weights, checked before they are trusted, and taken out of a training
framework's pickled save into the published format.

`check_drafter_weights` loads a checkpoint as `load_drafter` does (every weight present, with the
shape its config implies, nothing more) and refuses non-finite values: a diverged or corrupt save
would otherwise score tau 1.0 without a word.

SpecForge's CheckpointManager (`specforge/training/checkpoint.py`, `controller.save_checkpoint`)
writes `{run_id}-stepN/training_state.pt`: a torch.save'd dict whose `draft_state_dict` holds the
drafter's weights under the published names (fc.weight, layers.N.self_attn.q_proj.weight, ...),
beside the step, epoch, run id and, with replicated (DDP) optimizers, the optimizer state. Other
trainers nest them elsewhere (`model` with a `draft_model.` prefix, `state_dict`, ...), so the
weights are found by structure: the one dict that holds every weight the drafter's config implies,
under one common key prefix.

A pickle from a training box is never executed: it is read with `torch.load(weights_only=True)`,
whose allow-list admits tensors and plain containers only; anything else is refused with a message
that says how to export the drafter instead.
"""

import pickle
from pathlib import Path

import torch
from safetensors.torch import save_file

from .drafter import DFlashDrafter, load_drafter, published_names
from .drafter_config import DrafterConfig, DrafterError, read_drafter_config

MAX_DEPTH = 4  # how deep in nested dicts the weights may sit
EXPORT_HINT = (
    "export the drafter to a Hugging Face folder where it was trained (SpecForge: `python -m "
    "specforge.export.to_hf --checkpoint CHECKPOINT_DIR --draft-config CONFIG --output-dir OUT`) and evaluate OUT"
)


def expected_weights(cfg: DrafterConfig) -> dict[str, torch.Size]:
    """Name -> shape of every weight a drafter with this config has (nothing is allocated)."""
    with torch.device("meta"):
        model = DFlashDrafter(cfg)
    return {name: p.shape for name, p in model.named_parameters()}


def read_payload(path: str | Path):
    """The object in a torch.save file, read without executing anything (weights_only).

    Memory-mapped when the file allows it, so tensors nobody asks for (optimizer state) are
    never read from disk."""
    path = Path(path)
    try:
        try:
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            return torch.load(path, map_location="cpu", weights_only=True)  # a legacy (non-zip) save
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DrafterError(
            f"{path} holds Python objects other than tensors and plain containers ({first}); it is not "
            f"loaded, since unpickling it would run code from the training box: {EXPORT_HINT}"
        ) from None
    except (RuntimeError, OSError, EOFError) as e:
        raise DrafterError(f"{path}: not a readable torch.save file ({e}); fetch the checkpoint again") from None


def find_drafter_weights(payload, names: set[str]) -> tuple[str, dict[str, torch.Tensor]]:
    """(where, weights): the one place in `payload` holding every name of `names` under a common
    prefix, e.g. ("draft_state_dict", {...}) or ("model[draft_model.*]", {...}).

    Raises DrafterError when no place or several hold them, or when the place also holds tensors
    under that prefix that the drafter does not have (another architecture under the same name)."""
    anchor = next(iter(sorted(names)))
    found = []

    def visit(obj, where: str, depth: int) -> None:
        if not isinstance(obj, dict) or depth > MAX_DEPTH:
            return
        tensors = published_names({k: v for k, v in obj.items() if isinstance(k, str) and isinstance(v, torch.Tensor)})
        for key in tensors:
            if not key.endswith(anchor):
                continue
            prefix = key[: len(key) - len(anchor)]
            if all(prefix + n in tensors for n in names):
                extra = sorted(k[len(prefix):] for k in tensors
                               if k.startswith(prefix) and k[len(prefix):] not in names)
                label = where + (f"[{prefix}*]" if prefix else "")
                found.append((label or "<top level>", {n: tensors[prefix + n] for n in names}, extra))
        for k, v in obj.items():
            if isinstance(v, dict):
                visit(v, f"{where}.{k}" if where else str(k), depth + 1)

    visit(payload, "", 0)
    if not found:
        top = sorted(map(str, payload))[:12] if isinstance(payload, dict) else type(payload).__name__
        raise DrafterError(f"no drafter weights found: no dict holds {len(names)} weights such as {anchor} under one "
                           f"prefix (top-level keys: {top}); does the drafter config match this checkpoint?")
    if len(found) > 1:
        raise DrafterError(f"drafter weights found in several places {[f[0] for f in found]}; "
                           f"cannot tell which one was trained: {EXPORT_HINT}")
    where, weights, extra = found[0]
    if extra:
        raise DrafterError(f"{where} holds weights a drafter of this config does not have: {extra[:8]}"
                           f"{'...' if len(extra) > 8 else ''} (another architecture?)")
    return where, weights


def export_drafter_weights(payload_path: str | Path, cfg: DrafterConfig, out_file: str | Path) -> str:
    """Write the drafter weights held in a training payload as safetensors (`out_file`), each
    checked against the shape `cfg` implies; returns where in the payload they were found."""
    expected = expected_weights(cfg)
    where, weights = find_drafter_weights(read_payload(payload_path), set(expected))
    for name, shape in expected.items():
        if weights[name].shape != shape:
            raise DrafterError(f"{payload_path} ({where}): weight {name} has shape {list(weights[name].shape)}, "
                               f"the drafter config implies {list(shape)}")
    # clone: memory-mapped tensors may share storage, which safetensors refuses to write
    save_file({name: weights[name].detach().clone().contiguous() for name in sorted(weights)}, str(out_file))
    return where


def check_drafter_weights(path: str | Path, config: DrafterConfig | None = None) -> None:
    """Refuse a drafter checkpoint whose weights are unreadable, missing, of the wrong shape for its
    config, unexpected, or not finite (DrafterError naming the tensor). Values are checked as stored.
    config: the checkpoint's, when the caller has read it already."""
    # the mask token shapes no weight: without a config, a placeholder id spares resolving a string one
    drafter = load_drafter(path, dtype=torch.float32, config=config or read_drafter_config(path, mask_token_id=0))
    for name, weight in drafter.named_parameters():
        bad = int((~torch.isfinite(weight)).sum())
        if bad:
            raise DrafterError(f"{path}: weight {name} has {bad} of {weight.numel()} values NaN or infinite: the "
                               "training diverged or the save is corrupt; no store entry was written")
