"""What lands on disk: the content-addressed store, its records, zarr feature arrays, S3.

Imports no Prefect and nothing of dflash_core. `dflash_eval.storage.feature_store` imports torch and zarr, so it
is not imported here: `from dflash_eval.storage.feature_store import FeatureStore`.
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
from .store import CorruptEntryWarning, EntryMissing, LockTimeout, Miss, Outcome, Store, default_root

__all__ = [
    "CHECKPOINT_PATTERNS",
    "CorruptEntryWarning",
    "DigestCache",
    "DirectoryDigest",
    "EntryMissing",
    "LockTimeout",
    "Miss",
    "Outcome",
    "Store",
    "canonical_json",
    "default_root",
    "directory_digest",
    "file_sha256",
    "key_of",
    "read_json",
    "write_json_atomic",
]
