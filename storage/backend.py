"""Where a `Store` keeps its entries: the interface of its two backends, a local folder
(storage.local_backend) and object storage (storage.object_storage_backend).

The Store (storage/store.py) owns the layout, the markers' content, integrity (damage, staleness) and
get-or-compute, written once; a backend does the few things that differ between the two kinds of store:
read, write and delete an entry's marker, list the entries, lock one, publish, fetch and delete its files.

Both keep the entries' files in a folder on this machine, `root`: the stages write there, and the Store
digests them there at commit and checks them there on reads. For a local store that folder is the store
itself; for one on object storage it is this machine's copy of the bucket's entries, and the bucket is the
truth. A backend names an entry by its path relative to `root`, `<stage>/<key[:2]>/<key>`, which is also
its prefix on object storage.
"""

from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Protocol

from .object_storage import Lease, ObjectStorage

# Which marker was read (its inode here, its e_tag on object storage): a newer marker has another, so a
# remover that found the old one damaged leaves a newer one alone.
Identity = int | str

# What `Backend.fetch` found where the store keeps a file: (size, sha256); size None when it is not there,
# sha256 None when it was only sized.
Fetched = tuple[int | None, str | None]


class LockTimeout(TimeoutError):
    """`Store.lock` waited longer than its timeout."""


class Backend(Protocol):
    """The operations a `Store` needs of where it keeps its entries (module docstring). `entry` is always an
    entry's path relative to `root`."""

    root: Path  # this machine's folder of the entries' files: the store itself, or this machine's copy
    concurrent_files: int  # how many of an entry's files to check (and fetch) at once

    @property
    def location(self) -> str:
        """What `Store(location)` opens again on any machine: the folder (absolute), or the object store's URL."""
        ...

    def read_marker(self, entry: str) -> tuple[bytes, Identity]:
        """(content, identity) of the entry's marker; FileNotFoundError when it has none."""
        ...

    def marker_identity(self, entry: str) -> Identity | None:
        """The identity of the entry's marker, None when it has none (nothing is read but its metadata)."""
        ...

    def has_files(self, entry: str) -> bool:
        """Whether an entry without a marker has files anywhere (incomplete: a killed writer's) or is absent."""
        ...

    def folders(self, stage: str | None) -> Iterable[tuple[str, str, str, bool]]:
        """(stage, fan-out, name, holds the marker) of every folder at the depth of entries, under `stage` or
        everywhere; the Store keeps those that name an entry."""
        ...

    def fetch(self, entry: str, name: str, *, download: bool) -> Fetched | None:
        """Copy file `name` of the entry from where the store keeps it into this machine's folder, hashed as it
        streams, or with `download` False only size it there. None when this machine's folder is the store
        itself (there is no other copy to fetch)."""
        ...

    def unmark(self, entry: str) -> None:
        """Remove the entry's marker (if any): it reads as incomplete from now on."""
        ...

    def publish(self, entry: str, names: Sequence[str], marker: bytes) -> None:
        """Make the entry complete: its files `names` (written in this machine's folder) where the store keeps
        them, then `marker` as its marker, atomically and last."""
        ...

    def discard(self, entry: str, identity: Identity, names: Sequence[str]) -> bool:
        """Remove the entry's marker if it is still the one with `identity`, then its files `names` where the
        store keeps them beyond this machine's folder (the Store removes its own copies). False, removing
        nothing, when the marker is gone or another one."""
        ...

    def delete(self, entry: str) -> None:
        """Delete the entry, its marker first, where the store keeps it beyond this machine's folder (the Store
        removes that folder after)."""
        ...

    def lock(self, entry: str, timeout: float | None) -> AbstractContextManager[Lease | None]:
        """Hold an exclusive lock on the entry, across processes (and machines), for the `with` block; it
        yields the object-storage `Lease`, else None. `timeout` None waits forever, else `LockTimeout`."""
        ...

    def in_place(self, entry: str, folder: str) -> Path | ObjectStorage:
        """Where the entry's top-level `folder` is read and written in place, never copied to this machine
        (the feature arrays: `FeatureStore` opens either kind)."""
        ...
