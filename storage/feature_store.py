"""Target hidden states in zarr v3: one array per (layer id, sequence), each with its own completion marker.

Layout inside a features entry (`<entry>/features.zarr`)::

    features.zarr/
      zarr.json                     root group
      layer_<i>/                    i = decoder layer id (feature of layer i = HF hidden_states[i + 1])
        zarr.json                   group
        seq_<n>/                    n = index of the sequence in the references
          zarr.json                 array [T_n, H]; attributes hold the completion marker
          c/<r>/0                   chunks of rows, uncompressed
      target_probs/seq_<n>/         the target's probability of each token of sequence n after the ones before
                                    it, processed as the references were sampled: [T_n, 1] float32 (layer id
                                    TARGET_PROBS; kept as one more layer, so every rule of the layers holds for it)

Why this shape (measured: docs/design.md, "Feature storage"): one array per sequence was the fastest
layout and the only one safe with several writers, since each writer touches
only its own keys. One array per layer (not per sequence holding all layers)
lets a checkpoint that needs other layer ids extract only the layers not yet
held: completeness is tracked per (layer, sequence), never in a shared file.

dtypes: bfloat16 is stored as its raw bits in `uint16` (zarr 3.1 has no bf16) and
viewed back, zero-copy and bit-exact (NaN payloads, inf, -0, subnormals); float32
is stored as float32. torch is used only for that bf16 <-> uint16 view, and
`read` returns torch tensors because the drafter consumes them. float16 is
refused: hidden states of large targets overflow it.

Completion marker: the array's attributes, rewritten LAST (one atomic rename of its
`zarr.json`) as `{"complete": true, "dtype": "bfloat16"|"float32", "shape": [T, H],
"sha256": <digest of the stored bytes>}`. A killed writer leaves chunks without the
marker; zarr would read missing chunks back as zeros, so nothing here reads an
array without its marker. Rewriting an array clears the marker first.

On object storage (`FeatureStore(ObjectStorage)`, what `Store.feature_store` gives for an s3:// store) the
same keys are objects: zarr writes them through `zarr.storage.ObjectStore`, every `zarr.json` is one PUT
(so the marker is still atomic), and the reads below fetch whole objects (the e_tag of `zarr.json` takes
the place of its inode as the identity that a rewrite changes).
"""

import hashlib
import json
import os
import re
import shutil
import sys
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch
import zarr
import zarr.abc.store
import zarr.errors
import zarr.storage

from .hashing import key_of
from .object_storage import ObjectStorage, store_url

FEATURES_DIRNAME = "features.zarr"
MARKER_FORMAT = 1
# Big chunks read fastest (docs/design.md: one chunk per sequence and layer); the cap only keeps
# a single chunk of a very long sequence of a very wide model (32k x 8192 bf16 = 512 MiB) bounded.
DEFAULT_MAX_CHUNK_BYTES = 64 << 20

# The metadata `write` produces for its chunks: read directly by `_read_chunks`.
_PLAIN_CODECS = [{"name": "bytes", "configuration": {"endian": "little"}}]
_DEFAULT_CHUNK_KEYS = {"name": "default", "configuration": {"separator": "/"}}

_STORED_DTYPE: dict[str, np.dtype[Any]] = {"bfloat16": np.dtype(np.uint16), "float32": np.dtype(np.float32)}

# The "layer id" of the target's probabilities of the reference tokens (sampled drafts' acceptance needs them).
TARGET_PROBS = -1


class FeatureMissing(LookupError):
    """The hidden states of one (layer id, sequence) are absent, incomplete or corrupt: extract them."""

    def __init__(self, layer_id: int, seq_index: int, reason: str):
        super().__init__(f"features of layer {layer_id}, sequence {seq_index}: {reason}")
        self.layer_id = layer_id
        self.seq_index = seq_index
        self.reason = reason


def _check_index(name: str, value: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
        raise ValueError(f"{name} must be a non-negative int, got {value!r}")
    return int(value)


def array_name(layer_id: int, seq_index: int) -> str:
    """The array's path in features.zarr, how messages name it: `layer_3/seq_0`, `target_probs/seq_0`."""
    folder = "target_probs" if layer_id == TARGET_PROBS else f"layer_{_check_index('layer_id', layer_id)}"
    return f"{folder}/seq_{_check_index('seq_index', seq_index)}"



def _to_stored(hidden: torch.Tensor | np.ndarray) -> tuple[np.ndarray, str]:
    """(C-contiguous numpy array as stored, dtype tag) for a [T, H] tensor or array."""
    if isinstance(hidden, torch.Tensor):
        tensor = hidden.detach().cpu().contiguous()
        if tensor.dtype == torch.bfloat16:
            # Reinterpret the 16 bits, no rounding: numpy has no bf16, int16 -> uint16 is a view.
            stored, tag = tensor.view(torch.int16).numpy().view(np.uint16), "bfloat16"
        elif tensor.dtype == torch.float32:
            stored, tag = tensor.numpy(), "float32"
        else:
            raise TypeError(f"hidden states must be bfloat16 or float32, got torch {tensor.dtype} (float16 overflows)")
    elif isinstance(hidden, np.ndarray):
        if hidden.dtype != np.float32:
            raise TypeError(
                f"numpy hidden states must be float32, got {hidden.dtype}; pass bfloat16 as a torch tensor"
            )
        stored, tag = np.ascontiguousarray(hidden), "float32"
    else:
        raise TypeError(f"hidden states must be a torch.Tensor or numpy.ndarray, got {type(hidden).__name__}")
    if stored.ndim != 2 or stored.shape[0] == 0 or stored.shape[1] == 0:
        raise ValueError(f"hidden states of one layer and sequence must be [T, H] with T, H > 0, got {stored.shape}")
    return stored, tag


def _from_stored(stored: np.ndarray, tag: str) -> torch.Tensor:
    if tag == "bfloat16":
        return torch.from_numpy(np.ascontiguousarray(stored).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(stored)


def _sha256_of(stored: np.ndarray) -> str:
    # the C-contiguous array's own buffer (`.data`, a memoryview): hashes the stored little-endian bytes without a copy
    return hashlib.sha256(stored.data.cast("B")).hexdigest()


def _chunk_rows(n_rows: int, row_bytes: int, max_chunk_bytes: int) -> int:
    """Rows per chunk: as few chunks as the cap allows, evenly sized.

    Uncompressed, the last chunk is stored at full size, so T rows in chunks of
    ceil(T / n) rows waste less than n rows; a fixed chunk height could waste almost a chunk.
    """
    n_chunks = max(1, -(-n_rows * row_bytes // max_chunk_bytes))
    return -(-n_rows // n_chunks)


class _LocalFiles:
    """The group's keys as files under a folder."""

    def __init__(self, path: Path):
        self.path = path

    def read(self, key: str) -> tuple[bytes, tuple[int, int]]:
        # (content, identity): inode and mtime change whenever the file is replaced
        with open(self.path / key, "rb") as f:
            stat = os.fstat(f.fileno())
            return f.read(), (stat.st_ino, stat.st_mtime_ns)

    def read_into(self, key: str, view: memoryview) -> int:
        with open(self.path / key, "rb") as f:
            return f.readinto(view)

    def size(self, key: str) -> int | None:
        try:
            return os.stat(self.path / key).st_size
        except (FileNotFoundError, NotADirectoryError):
            return None

    def delete(self, key: str) -> None:
        try:
            os.unlink(self.path / key)
        except FileNotFoundError:
            pass

    def delete_tree(self, prefix: str) -> None:
        shutil.rmtree(self.path / prefix, ignore_errors=True)

    def array_folders(self) -> list[str]:
        return [p.relative_to(self.path).as_posix() for p in self.path.glob("layer_*/seq_*") if p.is_dir()]


class _ObjectFiles:
    """The group's keys as objects under a prefix of object storage."""

    def __init__(self, storage: ObjectStorage):
        self.storage = storage

    def read(self, key: str) -> tuple[bytes, str]:
        return self.storage.get(key)  # (content, e_tag)

    def read_into(self, key: str, view: memoryview) -> int:
        data, _ = self.storage.get(key)
        n = min(len(data), len(view))  # as readinto: the last chunk is stored at full chunk size
        view[:n] = data[:n]
        return n

    def size(self, key: str) -> int | None:
        meta = self.storage.head(key)
        return None if meta is None else meta["size"]

    def delete(self, key: str) -> None:
        self.storage.delete([key])

    def delete_tree(self, prefix: str) -> None:
        self.storage.delete_prefix(prefix)

    def array_folders(self) -> list[str]:
        # (object storage lists by whole path segments: no listing of "layer_*" by prefix)
        return sorted({"/".join(meta["path"].split("/")[:2]) for meta in self.storage.objects()
                       if meta["path"].startswith("layer_") and meta["path"].count("/") >= 2})


class FeatureStore:
    """Per-(layer id, sequence) hidden states in one zarr v3 group (layout in the module docstring), in a
    local folder or under a prefix of object storage.

    Several processes (or machines) may write different sequences (or layers) at once; two
    writers of the same (layer, sequence) are not supported (zarr chunk and
    metadata writes of one key race: docs/design.md, "Feature storage").
    """

    def __init__(self, location: str | os.PathLike | ObjectStorage, *, max_chunk_bytes: int = DEFAULT_MAX_CHUNK_BYTES):
        """location: the group's folder, or its place on object storage (an `ObjectStorage` or s3:// URL)."""
        if max_chunk_bytes < 1:
            raise ValueError(f"max_chunk_bytes must be positive, got {max_chunk_bytes}")
        self.max_chunk_bytes = max_chunk_bytes
        self.path: Path | None  # the group's folder (None on object storage)
        self._files: _LocalFiles | _ObjectFiles
        self._zarr_store: zarr.abc.store.Store
        if isinstance(location, str) and store_url(location):
            location = ObjectStorage(location)
        if isinstance(location, ObjectStorage):
            self.path, self.location = None, location.url
            self._files = _ObjectFiles(location)
            self._zarr_store = location.zarr_store()
        else:
            self.path = Path(location)
            self.location = str(self.path)
            self._files = _LocalFiles(self.path)
            self._zarr_store = zarr.storage.LocalStore(self.path)

    @classmethod
    def in_entry(cls, entry_dir: str | os.PathLike, **kwargs: Any) -> "FeatureStore":
        """The feature store of a local store entry: `<entry_dir>/features.zarr` (Store.feature_store gives
        any store's)."""
        return cls(Path(entry_dir) / FEATURES_DIRNAME, **kwargs)

    def __repr__(self) -> str:
        return f"FeatureStore({self.location!r})"

    # ------------------------------------------------------------ writing

    def write(self, layer_id: int, seq_index: int, hidden: torch.Tensor | np.ndarray) -> None:
        """Store the [T, H] hidden states of one layer and one sequence, replacing any earlier ones.

        bfloat16 (torch) is stored bit-exact as uint16; float32 (torch or numpy) as float32.
        The completion marker is written last, after every chunk.
        """
        path = array_name(layer_id, seq_index)
        stored, tag = _to_stored(hidden)
        layer_group = self._require_group(path.split("/")[0])
        self._clear_marker(path)
        n_rows, width = stored.shape
        array = layer_group.create_array(
            f"seq_{int(seq_index)}",
            shape=stored.shape,
            chunks=(_chunk_rows(n_rows, width * stored.itemsize, self.max_chunk_bytes), width),
            dtype=stored.dtype,
            compressors=None,  # ~1.4x at best on bf16 states: not worth it on local disks (docs/design.md)
            fill_value=0,
            overwrite=True,
            attributes={"complete": False, "dtype": tag},
            # Per array rather than zarr.config.set: same effect (2.2x faster writes, no
            # comparing every chunk with the fill value), no global state to restore.
            config={"write_empty_chunks": True},
        )
        array[...] = stored
        marker: dict[str, Any] = {"complete": True, "format": MARKER_FORMAT, "dtype": tag, "shape": list(stored.shape)}
        array.update_attributes({**marker, "sha256": _sha256_of(stored)})

    def write_layers(self, layer_ids: Sequence[int], seq_index: int, hidden: torch.Tensor | np.ndarray) -> None:
        """Store [K, T, H] hidden states of one sequence, row k as layer `layer_ids[k]`."""
        if hidden.ndim != 3 or hidden.shape[0] != len(layer_ids):
            raise ValueError(
                f"expected [K={len(layer_ids)}, T, H] for layer ids {list(layer_ids)}, got {tuple(hidden.shape)}"
            )
        for k, layer_id in enumerate(layer_ids):
            self.write(layer_id, seq_index, hidden[k])

    def _require_group(self, name: str) -> zarr.Group:
        # Open-or-create that tolerates another writer creating the same group at the same moment
        # (both write identical metadata; zarr raises ContainsGroupError to the slower one).
        for path in ("", name):
            try:
                group = zarr.open_group(self._zarr_store, path=path, mode="r+")
            except zarr.errors.GroupNotFoundError:
                try:
                    group = zarr.create_group(self._zarr_store, path=path)
                except zarr.errors.ContainsGroupError:
                    group = zarr.open_group(self._zarr_store, path=path, mode="r+")
        return group

    def _clear_marker(self, path: str) -> None:
        # create_array(overwrite=True) deletes the old node with shutil.rmtree, in no particular
        # order: killed midway it could leave the old marker beside deleted chunks. Clearing the
        # marker first (one atomic metadata rewrite) rules that out.
        try:
            old = zarr.open_array(self._zarr_store, path=path, mode="r+")
        except (zarr.errors.NodeNotFoundError, zarr.errors.ContainsGroupError):
            return
        except (ValueError, TypeError, KeyError):  # damaged metadata: without it nothing reads as complete
            self._files.delete(f"{path}/zarr.json")
            return
        if old.attrs.get("complete") is not False:
            old.update_attributes({"complete": False})

    # ------------------------------------------------------------ reading

    def _read_marker(self, layer_id: int, seq_index: int) -> tuple[dict[str, Any], dict[str, Any], tuple[int, int] | str]:
        """(array metadata, marker, identity of its zarr.json); FeatureMissing unless complete.

        Reads the array's zarr.json directly (a tenth of the time zarr.open_array takes): `missing`
        checks every (layer, sequence) of an entry on every run. The identity (inode and mtime, or
        e_tag) changes whenever the metadata is rewritten, which every writer does before touching chunks.
        """
        path = array_name(layer_id, seq_index)
        try:
            raw, identity = self._files.read(f"{path}/zarr.json")
            metadata = json.loads(raw)
        except (FileNotFoundError, NotADirectoryError):
            raise FeatureMissing(layer_id, seq_index, f"absent (no array {path} in {self.location})") from None
        except ValueError as e:
            raise FeatureMissing(layer_id, seq_index, f"unreadable metadata ({e})") from None
        if not isinstance(metadata, dict):
            raise FeatureMissing(layer_id, seq_index, "unreadable metadata (not a JSON object)")
        marker = metadata.get("attributes") or {}
        if metadata.get("node_type") != "array" or marker.get("complete") is not True:
            raise FeatureMissing(
                layer_id,
                seq_index,
                "incomplete: no completion marker (its writer stopped before finishing, or is still writing)",
            )
        tag = marker.get("dtype")
        if (
            tag not in _STORED_DTYPE
            or metadata.get("data_type") != _STORED_DTYPE[tag].name
            or marker.get("shape") != metadata.get("shape")
        ):
            raise FeatureMissing(
                layer_id, seq_index, f"inconsistent marker {marker} for a {metadata.get('data_type')} array "
                f"of shape {metadata.get('shape')}"
            )
        return metadata, marker, identity

    def _read_chunks(self, layer_id: int, seq_index: int, metadata: dict[str, Any]) -> np.ndarray:
        """The array's values, read from its chunk files straight into the result when the layout
        is the one `write` produces (uncompressed little-endian row chunks): 4-5x faster than zarr's
        codec pipeline. Any other layout is read through zarr."""
        path = array_name(layer_id, seq_index)
        shape, dtype = metadata["shape"], np.dtype(metadata["data_type"])
        chunk_rows, chunk_width = metadata["chunk_grid"]["configuration"]["chunk_shape"]
        if not (
            sys.byteorder == "little"
            and metadata.get("codecs") == _PLAIN_CODECS
            and metadata.get("chunk_key_encoding") == _DEFAULT_CHUNK_KEYS
            and chunk_width == shape[1]
        ):
            try:  # not the layout `write` produces: an older store, or damaged metadata
                return np.asarray(zarr.open_array(self._zarr_store, path=path, mode="r")[...])
            except Exception as e:  # zarr's errors for unreadable metadata have no common base
                raise FeatureMissing(layer_id, seq_index, f"unreadable metadata: zarr cannot read it "
                                     f"({type(e).__name__}: {e})") from None
        out = np.empty(shape, dtype=dtype)
        for i, first in enumerate(range(0, shape[0], chunk_rows)):
            rows = out[first : first + chunk_rows].data.cast("B")
            try:
                n_read = self._files.read_into(f"{path}/c/{i}/0", rows)
            except (FileNotFoundError, NotADirectoryError):
                n_read = 0
            if n_read != len(rows):  # never hand out zeros for missing data
                raise FeatureMissing(layer_id, seq_index, f"chunk {i} is missing or short ({n_read} of {len(rows)} bytes)")
        return out

    def _check_chunk_files(self, layer_id: int, seq_index: int, metadata: dict[str, Any]) -> None:
        """FeatureMissing unless every chunk file of the layout `write` produces is there at full size:
        a stat per chunk, so `missing` finds a lost or truncated chunk without reading any data."""
        shape = metadata["shape"]
        chunk_rows, chunk_width = metadata["chunk_grid"]["configuration"]["chunk_shape"]
        if not (metadata.get("codecs") == _PLAIN_CODECS and metadata.get("chunk_key_encoding") == _DEFAULT_CHUNK_KEYS
                and chunk_width == shape[1]):
            return  # another layout: its chunks are checked when read
        row_bytes = shape[1] * np.dtype(metadata["data_type"]).itemsize
        chunks = f"{array_name(layer_id, seq_index)}/c"
        for i, first in enumerate(range(0, shape[0], chunk_rows)):
            expected = min(chunk_rows, shape[0] - first) * row_bytes
            size = self._files.size(f"{chunks}/{i}/0")
            # the last chunk is stored at full chunk size (uncompressed), so at least `expected` bytes
            if size is None or size < expected:
                raise FeatureMissing(layer_id, seq_index, f"chunk {i} is missing or short "
                                     f"({size or 0} of {expected} bytes)")

    def why_missing(self, layer_id: int, seq_index: int) -> str | None:
        """None when (layer, sequence) is stored completely (see `has`), else why not."""
        try:
            metadata, _, _ = self._read_marker(layer_id, seq_index)
            self._check_chunk_files(layer_id, seq_index, metadata)
        except FeatureMissing as e:
            return e.reason
        return None

    def has(self, layer_id: int, seq_index: int) -> bool:
        """Whether (layer, sequence) is stored completely: marker present and every chunk file there at
        full size (bytes not re-hashed: `read_layer(verify=True)` does that)."""
        return self.why_missing(layer_id, seq_index) is None

    def digest(self, layer_ids: Sequence[int], n_sequences: int) -> str:
        """The content digest of layers `layer_ids` for sequences 0..n_sequences-1: a key of the sha256
        each array's marker holds (markers only, no data read). What a drafts entry records as the
        features it was built from. Raises `FeatureMissing` for an array not stored completely."""
        digests = {}
        for layer_id in layer_ids:
            for seq_index in range(n_sequences):
                _, marker, _ = self._read_marker(layer_id, seq_index)
                digests[array_name(layer_id, seq_index)] = marker.get("sha256")
        return key_of(digests)

    def arrays(self) -> list[tuple[int, int]]:
        """(layer id, sequence index) of every array folder present, complete or not (sorted)."""
        found = []
        for folder in self._files.array_folders():
            match = re.fullmatch(r"(?:layer_(\d+)|target_probs)/seq_(\d+)", folder)
            if match:
                found.append((TARGET_PROBS if match.group(1) is None else int(match.group(1)), int(match.group(2))))
        return sorted(found)

    def discard(self, layer_id: int, seq_index: int) -> None:
        """Delete the array of (layer, sequence), marker first, so that `missing` lists it again and the
        features stage extracts it again."""
        path = array_name(layer_id, seq_index)
        self._clear_marker(path)
        self._files.delete_tree(path)

    def missing(self, layer_ids: Sequence[int], n_sequences: int) -> list[tuple[int, int]]:
        """(layer id, sequence index) pairs not stored completely, for sequences 0..n_sequences-1.

        Ordered by `layer_ids` as given, then by sequence. An empty list means everything
        a drafter with these layer ids needs is here.
        """
        pairs = [(layer, seq) for layer in layer_ids for seq in range(n_sequences)]
        if isinstance(self._files, _LocalFiles):
            return [pair for pair in pairs if not self.has(*pair)]
        with ThreadPoolExecutor(16) as pool:  # object storage: one round trip per marker and chunk, overlapped
            held = list(pool.map(lambda pair: self.has(*pair), pairs))
        return [pair for pair, ok in zip(pairs, held) if not ok]

    def read_layer(self, layer_id: int, seq_index: int, *, verify: bool = False) -> torch.Tensor:
        """The [T, H] hidden states of one layer and sequence, in the stored dtype (bfloat16 or float32).

        Raises `FeatureMissing` naming the layer and sequence when the array is absent,
        incomplete, changed while being read, or (with `verify`) its bytes do not match
        the marker's sha256. Never returns fill values for missing data.
        """
        metadata, marker, identity = self._read_marker(layer_id, seq_index)
        stored = self._read_chunks(layer_id, seq_index, metadata)
        if verify and _sha256_of(np.ascontiguousarray(stored)) != marker.get("sha256"):
            raise FeatureMissing(layer_id, seq_index, "corrupt: stored bytes do not match the marker's sha256"
                                 if "sha256" in marker else "unverifiable: the marker holds no sha256")
        # A concurrent rewrite replaces the metadata (clearing the marker) before touching chunks;
        # if it is not the file we started with, what we read may mix two versions.
        if self._read_marker(layer_id, seq_index)[2] != identity:
            raise FeatureMissing(layer_id, seq_index, "rewritten by another process while being read")
        return _from_stored(stored, marker["dtype"])

    def read(self, layer_ids: Sequence[int], seq_index: int, *, verify: bool = False) -> torch.Tensor:
        """The [K, T, H] hidden states of one sequence, row k = layer `layer_ids[k]` (the drafter's order).

        All layers must share T, H and dtype. Raises `FeatureMissing` for the first layer
        that is not stored completely (see `read_layer`).
        """
        if len(layer_ids) == 0:
            raise ValueError("layer_ids is empty")
        if isinstance(self._files, _LocalFiles):
            layers = [self.read_layer(layer_id, seq_index, verify=verify) for layer_id in layer_ids]
        else:  # object storage: each layer is a few round trips; overlap them
            with ThreadPoolExecutor(len(layer_ids)) as pool:
                layers = list(pool.map(lambda layer_id: self.read_layer(layer_id, seq_index, verify=verify),
                                       layer_ids))
        first = layers[0]
        for layer_id, layer in zip(layer_ids, layers):
            if layer.shape != first.shape or layer.dtype != first.dtype:
                raise ValueError(
                    f"sequence {seq_index}: layer {layer_id} is {layer.dtype} {tuple(layer.shape)}, "
                    f"layer {layer_ids[0]} is {first.dtype} {tuple(first.shape)}"
                )
        return torch.stack(layers)
