"""The names a setting of the DFlash code may take, in a module that imports nothing (but typing), so that the
command line builds its choices from them without importing torch (seconds, for every command and every `--help`)."""

from typing import Literal

# How sliding-window drafter layers treat the block when the drafter's config does not say (no is_causal;
# dflash_core.drafter). "causal": block position k sees block positions <= k and a window over context + block,
# as SGLang, vLLM, the SpecForge training mask and z-lab's current reference do (the default). "non_causal": the
# whole block (within the window) is visible, as z-lab's transformers reference did before it read is_causal.
SLIDING_SEMANTICS = ("causal", "non_causal")

# The dtypes a target loads in, by the names config files and command lines give them (dflash_core.target.DTYPES).
DTYPE_NAMES = ("float32", "bfloat16", "float16")

# What the evaluation's stages compute in. float16 is not one of them: the hidden states of large targets overflow
# its range (largest value 65504), so a float16 checkpoint computes in float32. "auto" is the target checkpoint's
# own dtype.
AUTO_DTYPE = "auto"
STAGE_DTYPE_NAMES = ("float32", "bfloat16")

# The attention implementation of the target's text model (--attn-implementation; dflash_core.target.choose_attention):
# "auto" is SDPA where its class takes it, else eager (gpt-oss: attention sinks have no SDPA path).
ATTENTION_CHOICES = ("auto", "sdpa", "eager")
DEFAULT_ATTENTION = "sdpa"  # what every target ran with before the choice existed: keys leave it out (tasks/target.py)

# Prompts the drafts stage replays together (one replay group; on a Dask cluster, one shard).
DEFAULT_REPLAY_GROUP = 64

# How drafts are drawn, as vLLM names it (draft_sample_method): "greedy", the drafter's argmax, accepted iff emitted
# (SGLang, vLLM's default); "probabilistic", sampled from the drafter's q and accepted by rejection sampling (dflash
# 0.1.0, vLLM's "probabilistic"). The setting (flows/settings.py) and dflash_core.sampling.Served share this type.
DraftSampleMethod = Literal["greedy", "probabilistic"]
