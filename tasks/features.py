"""Features stage: the target's hidden states for every reference, per (layer, sequence) in zarr.

One entry per (target, references, dtype) holds every layer extracted so far: a checkpoint that
needs other layer ids extracts only the (layer, sequence) arrays not yet held. Each array has its own
completion marker (storage.feature_store), which is the truth about what is held: a killed run, or
a deleted sequence, is resumed by extracting exactly the missing arrays.
"""

from dataclasses import dataclass

import torch
from prefect import task
from prefect.cache_policies import NONE

from dflash_core.features import extract_features, length_sorted_batches
from storage import Store, key_of
from storage.feature_store import FeatureStore

from .heavy import heavy_stage
from .progress import StageProgress
from .references import ReferenceSet, load_references
from .stage import cached
from .target import loaded_target, target_key

STAGE = "features"
# Bump when extraction changes what it stores (part of the key).
EXTRACTOR_VERSION = 1
BATCH_SIZE = 8


@dataclass(frozen=True)
class FeatureSet:
    """Hidden states of `layer_ids` for every reference, held in the store."""

    key: str
    path: str  # the entry folder (features.zarr inside)
    layer_ids: tuple[int, ...]
    n: int


@task(name="features", cache_policy=NONE, persist_result=False)
def extract_target_features(
    target_dir: str,
    refs: ReferenceSet,
    layer_ids: tuple[int, ...],
    store_root: str,
    dtype: str = "float32",
    device: str = "cpu",
    refresh: bool = False,
):
    """Extract the hidden states of `layer_ids` that the store does not hold yet."""
    store = Store(store_root)
    key = key_of({
        "target": target_key(target_dir, store), "references": refs.key, "dtype": dtype,
        "device": torch.device(device).type, "extractor": EXTRACTOR_VERSION,
    })
    entry = store.entry(STAGE, key)
    features = FeatureSet(key=key, path=str(entry), layer_ids=tuple(layer_ids), n=refs.n)
    if not refresh and store.is_complete(STAGE, key) and not FeatureStore.in_entry(entry).missing(layer_ids, refs.n):
        return cached(features)

    with store.lock(STAGE, key):
        if refresh:
            store.remove(STAGE, key)
        held = store.read_record(STAGE, key)["layer_ids"] if store.is_complete(STAGE, key) else []
        store.begin(STAGE, key)
        feature_store = FeatureStore.in_entry(entry)
        missing = feature_store.missing(layer_ids, refs.n)
        if missing:
            with heavy_stage():
                _extract(target_dir, refs, missing, feature_store, dtype, device)
        store.commit(STAGE, key, {
            "layer_ids": sorted(set(held) | set(layer_ids)), "n": refs.n, "references": refs.key, "dtype": dtype,
        })
    return features if missing else cached(features)


def _extract(target_dir, refs, missing, feature_store, dtype, device) -> None:
    sequences = [item.reference.token_ids for item in load_references(refs)]
    missing_by_seq: dict[int, set[int]] = {}
    for layer_id, n in missing:
        missing_by_seq.setdefault(n, set()).add(layer_id)
    # Fixed batches over ALL sequences: batched results depend (in the last bits) on which sequences
    # share a batch, so a resumed run recomputes a missing sequence in the batch it had the first time.
    batches = [b for b in length_sorted_batches([len(s) for s in sequences], BATCH_SIZE)
               if any(n in missing_by_seq for n in b)]
    target = loaded_target(target_dir, dtype, device)
    done = 0
    with StageProgress(STAGE, "target hidden states", sum(len(b) for b in batches)) as progress:
        for batch in batches:
            layers = sorted(set().union(*(missing_by_seq.get(n, set()) for n in batch)))
            out = extract_features(target, [sequences[n] for n in batch], layers, batch_size=len(batch))
            for n, hidden in zip(batch, out):  # hidden [K, T, H]
                for k, layer_id in enumerate(layers):
                    if layer_id in missing_by_seq.get(n, ()):
                        feature_store.write(layer_id, n, hidden[k])
            done += len(batch)
            progress.update(done)
