"""Content hashing, the content-addressed store, and zarr feature arrays.

Imports neither Prefect nor dflash_core: it stores arrays, tensors and JSON, and the
callers (tasks/) convert. `dflash_eval.storage.feature_store` imports torch and zarr, so it is not
imported here; `from storage.feature_store import FeatureStore`.
"""

from .hashing import (
    CHECKPOINT_PATTERNS,
    DigestCache,
    DirectoryDigest,
    canonical_json,
    directory_digest,
    file_sha256,
    key_of,
)
from .records import read_json, write_json_atomic
from .store import CorruptEntryWarning, EntryMissing, LockTimeout, Store, default_root

__all__ = [
    "CHECKPOINT_PATTERNS",
    "CorruptEntryWarning",
    "DigestCache",
    "DirectoryDigest",
    "EntryMissing",
    "LockTimeout",
    "Store",
    "canonical_json",
    "default_root",
    "directory_digest",
    "file_sha256",
    "key_of",
    "read_json",
    "write_json_atomic",
]
