"""Drafter generations, one module each on the shared DFlash backbone (base.py says what a generation declares), and
the registry that finds a config's: by its `architectures`, or by a speculators save's `speculators_model_type`.

Adding a generation is its module (a Generation subclass, with its results section) and one `register` call below;
the checkpoint readers, the replay, the stages and every renderer then take it without another edit.
"""

from .base import ConfigFields, Generation, HeadChoice, Replayed, SublayerWrapper
from .dflash import DFlash
from .dflash2 import DFlash2
from .dspark import DSpark

__all__ = ["ConfigFields", "Generation", "HeadChoice", "Replayed", "SublayerWrapper", "by_architecture", "generations",
           "by_speculators_model_type", "register", "GENERATIONS", "NOT_READ"]

# every registered generation, by each architecture it is read for
GENERATIONS: dict[str, Generation] = {}

# Drafters of other generations, refused with what they add (docs/drafter-config.md)
NOT_READ = ("SpecForge's Domino and DSpark-style logits heads on top of the drafter (projector_type), MiMo-style "
            "drafters (attention-sink biases, sliding layers of their own shapes), XPress (speculators: a causal "
            "refiner resolved by Jacobi passes; no serving stack has merged it) and DeepSeek-V4's built-in DSpark (an "
            "MTP chain inside the V4 checkpoint, not a drafter of its own)")


def register(generation: Generation) -> Generation:
    """Make `generation` the one read for its architectures (and its speculators model type)."""
    for architecture in generation.ARCHITECTURES:
        GENERATIONS[architecture] = generation
    return generation


def by_architecture(architecture: str) -> Generation | None:
    """The generation a config's `architectures` entry names, None when none is registered for it."""
    return GENERATIONS.get(architecture)


def by_speculators_model_type(model_type: str) -> Generation | None:
    """The generation a speculators save's `speculators_model_type` names, None when none is registered for it."""
    return next((g for g in GENERATIONS.values() if g.SPECULATORS_MODEL_TYPE == model_type), None)


def generations() -> list[Generation]:
    """The registered generations, each once, in the order they were registered."""
    return list(dict.fromkeys(GENERATIONS.values()))


register(DFlash())
register(DFlash2())
register(DSpark())
