"""DFlash (z-lab's `DFlashDraftModel`): the backbone alone (dflash_core.drafter). Its greedy draft at a block position
is the head's argmax there, and a sampled one is drawn from the head's processed logits (temperature, and top-k,
top-p and min-p as served: dflash_core.sampling); no draft depends on another."""

from .base import Generation


class DFlash(Generation):
    NAME = "DFlash"
    ARCHITECTURES = ("DFlashDraftModel",)
    SPECULATORS_MODEL_TYPE = "dflash"
    WHAT = "the block diffusion backbone alone"
