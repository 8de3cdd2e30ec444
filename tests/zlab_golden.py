"""The drafter-forward case pinned against the z-lab DFlash reference (tests/golden/zlab_drafter_forward.json).

Weights and inputs come from seeded generators, tensor by tensor, so they do not depend on how any model
initialises itself; the case is written as a published checkpoint folder that both the z-lab model
(`DFlashDraftModel.from_pretrained`) and ours (`load_drafter`) load. Full attention, not causal within the
block: the z-lab forward with no attention mask.
"""

from pathlib import Path

import torch

from dflash_core.drafter import DFlashDrafter, save_drafter
from dflash_core.drafter_config import DrafterConfig
from tests.drafters import drafter_config

GOLDEN = Path(__file__).parent / "golden" / "zlab_drafter_forward.json"
RAW = drafter_config(hidden_size=32, num_layers=2, block_size=4, layer_ids=(0, 2), num_target_layers=4)
CONTEXT = 5  # tokens of target context before the block


def _values(seed: int, shape, scale: float) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float32) * scale


def write_case_drafter(folder: Path) -> Path:
    """The case's drafter, saved as a published checkpoint (config.json + model.safetensors) in `folder`."""
    model = DFlashDrafter(DrafterConfig.from_dict(RAW))
    with torch.no_grad():
        for seed, (_, p) in enumerate(sorted(model.named_parameters())):
            # norms near 1 (not all ones, so that a wrong norm shows), projections of unit-ish gain
            p.copy_(1 + _values(seed, p.shape, 0.1) if p.ndim == 1 else _values(seed, p.shape, p.shape[1] ** -0.5))
    save_drafter(model, folder)
    return folder


def case_inputs() -> tuple[torch.Tensor, torch.Tensor]:
    """features [K, CONTEXT, H] (the target layers' hidden states of the context) and the block's
    embeddings [B, H]."""
    k, h, b = len(RAW["dflash_config"]["target_layer_ids"]), RAW["hidden_size"], RAW["block_size"]
    return _values(1000, (k, CONTEXT, h), 1.0), _values(1001, (b, h), 1.0)
