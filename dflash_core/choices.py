"""The names a setting of the DFlash code may take, in a module that imports nothing, so that the command line
builds its choices from them without importing torch (seconds, for every command and every `--help`)."""

# How sliding-window drafter layers attend within the block (dflash_core.drafter).
SLIDING_SEMANTICS = ("causal", "non_causal")

# The dtypes a target loads in, by the names config files and command lines give them (dflash_core.target.DTYPES).
DTYPE_NAMES = ("float32", "bfloat16", "float16")

# What the evaluation's stages compute in. float16 is not one of them: hidden states of large targets overflow in
# fp16 (DESIGN.md). "auto" is the target checkpoint's own dtype.
AUTO_DTYPE = "auto"
STAGE_DTYPE_NAMES = ("float32", "bfloat16")

# Prompts the drafts stage replays together (one replay group; on a Dask cluster, one shard).
DEFAULT_REPLAY_GROUP = 64
