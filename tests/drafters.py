"""Tiny DFlash drafters for tests: random weights, published checkpoint format."""

import torch

from dflash_core.drafter import DFlashDrafter, save_drafter
from dflash_core.drafter_config import DrafterConfig


def drafter_config(hidden_size=32, num_layers=2, block_size=4, layer_ids=(0, 1), mask_token_id=1,
                   layer_types=None, sliding_window=None, num_target_layers=4, **extra) -> dict:
    """A DFlash config.json as published (Qwen3 config + block_size + dflash_config)."""
    raw = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": hidden_size, "num_hidden_layers": num_layers, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 2 * hidden_size,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 4096,
        "block_size": block_size, "num_target_layers": num_target_layers,
        "dflash_config": {"target_layer_ids": list(layer_ids), "mask_token_id": mask_token_id},
    }
    if layer_types is not None:
        raw["layer_types"] = list(layer_types)
        raw["sliding_window"] = sliding_window
    raw.update(extra)
    return raw


def random_drafter(raw: dict, seed: int = 0, sliding_semantics: str = "causal", scale: float = 1.0) -> DFlashDrafter:
    """A drafter with random weights (float32). `scale` multiplies the projection weights: larger
    values make outputs depend more on the block and context."""
    torch.manual_seed(seed)
    model = DFlashDrafter(DrafterConfig.from_dict(raw), sliding_semantics)
    with torch.no_grad():
        for p in model.parameters():
            if p.ndim == 2:
                p.mul_(scale)
            else:  # norms: not all ones, so that a wrong norm shows
                p.uniform_(0.5, 1.5)
    return model.eval()


def write_random_drafter(path, raw: dict, seed: int = 0, scale: float = 1.0) -> None:
    save_drafter(random_drafter(raw, seed, scale=scale), path)
