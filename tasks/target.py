"""The target model as the stages see it: its content key, and one loaded copy per process."""

from functools import lru_cache

import torch

from dflash_core.target import Target, load_target
from storage import Store, directory_digest

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def target_key(target_dir: str, store: Store) -> str:
    """Content key of a target checkpoint: its files' digests (cached by path, size and mtime)."""
    return directory_digest(target_dir, cache=store.digest_cache()).key


@lru_cache(maxsize=1)
def loaded_target(target_dir: str, dtype: str, device: str) -> Target:
    """The target, loaded once per process: the references and features stages share it
    (a 27B target is ~54 GB; it is never loaded when both stages are cached)."""
    return load_target(target_dir, dtype=DTYPES[dtype], device=device)
