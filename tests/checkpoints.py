"""Checkpoint folders as trainers leave them, for storage and relay tests: valid weight files of any
size (the relay and fetch check that weights are whole), optimizer files, timestamps in the past."""

import json
import os
import time
from pathlib import Path


def write_weights(path: Path, size: int) -> None:
    """A valid safetensors file of exactly `size` bytes (>= 64): one uint8 tensor of random bytes."""
    for width in range(1, 256):  # the header's length depends on the data length's digits
        n = size - 8 - width
        header = json.dumps({"w": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}})
        if len(header) <= width:
            path.write_bytes(width.to_bytes(8, "little") + header.ljust(width).encode() + os.urandom(n))
            return
    raise ValueError(f"no safetensors file of {size} bytes")


def settle(directory: Path, age: float = 120) -> None:
    """Make every file in `directory` look last written `age` seconds ago."""
    old = time.time() - age
    for p in directory.iterdir():
        os.utime(p, (old, old), follow_symlinks=False)


def write_checkpoint(directory: Path, sizes: dict[str, int], config: dict | None = None, age: float = 120) -> Path:
    """config.json plus files of the given sizes (valid safetensors for *.safetensors, random bytes else)."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config or {"architectures": ["DFlashDraftModel"]}))
    for name, size in sizes.items():
        if name.endswith(".safetensors"):
            write_weights(directory / name, size)
        else:
            (directory / name).write_bytes(os.urandom(size))
    settle(directory, age)
    return directory
