"""Features stage: the target's hidden states for every reference, per (layer, sequence) in zarr.

One entry per (target, references, dtype) holds every layer extracted so far: a checkpoint that
needs other layer ids extracts only the (layer, sequence) arrays not yet held. Each array has its own
completion marker (storage.feature_store), which is the truth about what is held: a killed run, a
deleted sequence or a lost chunk is resumed by extracting exactly the missing arrays.

With a Dask cluster (`dask_address`, tasks/cluster.py) the arrays are extracted by its workers, one shard per
batch of the batch plan a single process follows (so bit for bit the same arrays), each written straight into
the entry; this process holds the entry's lock meanwhile and commits once every shard is done.

The stages that replay from the features read them through `FeatureReader`: every array is checked
against the sha256 in its marker as it is read (VERIFY_READS; benchmarks/bench_verify.py measures the
cost), and a damaged one is reported and extracted again, so changed bytes never change a tau. The
entry records the content digest of the references it was extracted from; references recomputed
with another content make it stale, and it is extracted again.
"""

import contextvars
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from prefect import task
from prefect.cache_policies import NONE

from dflash_core.choices import DEFAULT_ATTENTION
from dflash_core.features import extract, length_sorted_batches
from dflash_eval.storage import Store, key_of
from dflash_eval.storage.feature_store import FEATURES_DIRNAME, TARGET_PROBS, FeatureMissing, FeatureStore, array_name
from dflash_eval.storage.integrity import entry_label, upstream_digests
from dflash_eval.storage.schema import FeaturesRecord, Stage
from dflash_eval.storage.store import Entry

from .cluster import run_shards, use_worker_threads, worker_identity
from .heavy import heavy_stage
from .progress import StageProgress, stage_logger
from .references import ReferenceSet, load_references, references_here
from .stage import cached, get_or_compute
from .target import attention_identity, loaded_target, target_key
from .threads import compute_threads, parameter_count

STAGE = Stage.FEATURES
# Bump when extraction changes what it stores (part of the key).
EXTRACTOR_VERSION = 1
BATCH_SIZE = 8
# Hash every array the drafts and diagnostics stages read (about 1% of the drafts stage on CPU, weights
# hashing aside: benchmarks/bench_verify.py); a mismatch is extracted again instead of drafted from.
VERIFY_READS = True


@dataclass(frozen=True)
class FeatureSet:
    """Hidden states of `layer_ids` for every reference, held in the store."""

    key: str
    path: str  # the entry folder (features.zarr inside)
    layer_ids: tuple[int, ...]
    n: int
    shards: tuple[dict[str, Any], ...] | None = None  # FeaturesRecord.shards: who extracted them on a cluster
    attention: str = DEFAULT_ATTENTION  # the target's attention implementation they were extracted with


@task(name="features", cache_policy=NONE, persist_result=False)
def extract_target_features(
    target_dir: str,
    refs: ReferenceSet,
    layer_ids: tuple[int, ...],
    store_location: str,
    dtype: str = "float32",
    device: str = "cpu",
    refresh: bool = False,
    dask_address: str | None = None,
    attention: str = DEFAULT_ATTENTION,
):
    """Extract the hidden states of `layer_ids` that the store does not hold yet (absent, incomplete,
    or with a lost or short chunk: each such array is named in the log); with `dask_address`, on the
    workers of that Dask cluster (tasks/cluster.py: `target_dir` must be the same path on every worker).
    TARGET_PROBS among `layer_ids`: also the target's probability of each reference token, processed as the
    references were sampled, from the same pass (what sampled drafts' acceptance needs)."""
    store = Store(store_location)
    key = key_of({
        "target": target_key(target_dir, store), "references": refs.key, "dtype": dtype,
        "device": torch.device(device).type, "extractor": EXTRACTOR_VERSION, **attention_identity(attention),
    })
    feature_store = store.feature_store(key)
    labels = [entry_label(Stage.REFERENCES, refs.key)]

    def extract(directory: Path, kept: Entry | None = None) -> dict:
        # kept: the committed entry, extended with the arrays it lacks; else a new (or resumed) one
        held = FeaturesRecord.from_record(kept.record).layer_ids if kept is not None else ()
        missing = feature_store.missing(layer_ids, refs.n)
        lost = [(layer, n) for layer, n in missing if layer in held]  # the committed entry said it held them
        if lost:
            reasons = [f"{array_name(layer, n)}: {feature_store.why_missing(layer, n) or 'absent'}"
                       for layer, n in lost[:5]]
            stage_logger().warning(f"{STAGE}/{key} is damaged: {len(lost)} arrays missing or damaged "
                                   f"({'; '.join(reasons)}{'; ...' if len(lost) > 5 else ''}): extracting them again")
        shards = None
        if missing and dask_address:  # the workers compute: this process takes no heavy-stage slot
            shards = extract_on_cluster(dask_address, store, key, refs, target_dir, missing, dtype, device, attention)
            if still_missing := feature_store.missing(layer_ids, refs.n):
                raise RuntimeError(f"{STAGE}/{key}: the cluster's shards left {len(still_missing)} arrays unwritten "
                                   f"(first: {array_name(*still_missing[0])})")
        elif missing:
            with heavy_stage():
                extract_arrays(target_dir, refs, missing, feature_store, dtype, device, attention)
        return FeaturesRecord(layer_ids=tuple(sorted(set(held) | set(layer_ids))), n=refs.n, references=refs.key,
                              dtype=dtype, shards=shards, attention=attention_identity(attention).get("attention")
                              ).to_record()

    def layers_digest(replaced: Entry) -> str | None:
        # what a refresh must reproduce: the asked layers that the replaced entry held, not the whole entry
        compared = [i for i in layer_ids if i in FeaturesRecord.from_record(replaced.record).layer_ids]
        return _digest(feature_store, compared, refs.n) if compared else None

    outcome = get_or_compute(store, STAGE, key, extract, refresh=refresh,
                             upstream=lambda: upstream_digests(store, labels),
                             holds=lambda _: not feature_store.missing(layer_ids, refs.n), extend=extract,
                             skip=(FEATURES_DIRNAME,), compared=layers_digest)
    features = FeatureSet(key=key, path=str(store.entry(STAGE, key)), layer_ids=tuple(layer_ids), n=refs.n,
                          shards=FeaturesRecord.from_record(outcome.record).shards, attention=attention)
    return features if outcome.computed else cached(features)


def _digest(feature_store: FeatureStore, layer_ids, n: int) -> str | None:
    try:
        return feature_store.digest(layer_ids, n)
    except FeatureMissing:
        return None


class FeatureReader:
    """Reads of a features entry for a stage that replays from it (drafts, diagnostics).

    Every array is verified against the sha256 in its marker (VERIFY_READS). One that is damaged
    (changed bytes, a lost or short chunk, no marker) is named in the log and extracted again from the
    target, under the entry's lock, in the batch it was first extracted in (so bit for bit as before),
    then read again: the replay never sees damaged features and never fails for good on them.
    """

    def __init__(self, features: FeatureSet, refs: ReferenceSet, target_dir: str, store: Store,
                 dtype: str, device: str):
        self.features, self.refs, self.target_dir = features, refs, target_dir
        self.store, self.dtype, self.device = store, dtype, device
        self.feature_store = self.store.feature_store(features.key)
        self.repaired: list[tuple[int, int]] = []

    def read_probabilities(self, seq_index: int) -> torch.Tensor:
        """The target's probability of each token of one sequence [T] (TARGET_PROBS), verified."""
        return self.read([TARGET_PROBS], seq_index)[0, :, 0]

    def read(self, layer_ids, seq_index: int) -> torch.Tensor:
        """The [K, T, H] hidden states of one sequence (FeatureStore.read), verified."""
        try:
            return self.feature_store.read(layer_ids, seq_index, verify=VERIFY_READS)
        except FeatureMissing:
            pass
        damaged = {}
        for layer_id in layer_ids:
            try:
                self.feature_store.read_layer(layer_id, seq_index, verify=True)
            except FeatureMissing as e:
                damaged[(layer_id, seq_index)] = e.reason
        self.repair(damaged)
        return self.feature_store.read(layer_ids, seq_index, verify=VERIFY_READS)

    def read_each(self, layer_ids, indices) -> Iterator[torch.Tensor]:
        """`read` of each sequence of `indices` in turn, the next one read while the caller works on this
        one (a replay computes on a prompt's features meanwhile; on object storage a read waits on round
        trips). Holds at most two sequences' features."""
        indices = list(indices)

        def read(n):
            return contextvars.copy_context().run(self.read, layer_ids, n)  # the run's logger, in the thread

        if not indices:
            return
        with ThreadPoolExecutor(1) as pool:
            ahead = pool.submit(read, indices[0])
            for following in indices[1:]:
                current, ahead = ahead.result(), pool.submit(read, following)
                yield current
            yield ahead.result()

    def repair(self, damaged: dict[tuple[int, int], str]) -> None:
        """Extract the arrays `damaged` names ({(layer, sequence): reason}) again."""
        if not damaged:
            return
        names = "; ".join(f"{array_name(layer, n)}: {reason}" for (layer, n), reason in damaged.items())
        stage_logger().warning(f"{STAGE}/{self.features.key} is damaged ({names}): extracting these again")
        with self.store.lock(STAGE, self.features.key):
            todo = []
            for layer_id, n in damaged:
                try:  # another run may have repaired it while this one waited for the lock
                    self.feature_store.read_layer(layer_id, n, verify=True)
                except FeatureMissing:
                    self.feature_store.discard(layer_id, n)
                    todo.append((layer_id, n))
            if todo:
                extract_arrays(self.target_dir, self.refs, todo, self.feature_store, self.dtype, self.device,
                               self.features.attention)
                self.repaired += todo


def extraction_batches(sequences: Sequence[Sequence[int]], missing) -> list[list[int]]:
    """The batches (sequence indices) that extract the `missing` (layer, sequence) arrays: those of the fixed
    plan over ALL sequences that hold a missing one. Batched results depend (in the last bits) on which
    sequences share a batch, so a resumed run, a repair or a cluster's shard recomputes a missing sequence
    in the batch it had the first time, and gets bit for bit the same arrays."""
    wanted = {n for _, n in missing}
    return [b for b in length_sorted_batches([len(s) for s in sequences], BATCH_SIZE) if any(n in wanted for n in b)]


def extract_arrays(target_dir: str, refs: ReferenceSet, missing, feature_store: FeatureStore, dtype: str,
                   device: str, attention: str = DEFAULT_ATTENTION, progress: bool = True) -> None:
    """Extract the `missing` (layer, sequence) arrays with the target into `feature_store`, batch by batch of
    the fixed plan (`extraction_batches`). progress: the stage's own bar and artifact (a cluster's shard leaves
    those to the stage that submitted it)."""
    sequences = [item.reference.token_ids for item in load_references(refs)]
    missing_by_seq: dict[int, set[int]] = {}
    for layer_id, n in missing:
        missing_by_seq.setdefault(n, set()).add(layer_id)
    batches = extraction_batches(sequences, missing)
    target = loaded_target(target_dir, dtype, device, attention)
    # a forward processes a batch's tokens: a small target on short sequences computes faster on fewer threads
    tokens_per_forward = max(len(b) * max(len(sequences[n]) for n in b) for b in batches)
    done = 0
    shown = StageProgress(STAGE, "target hidden states", sum(len(b) for b in batches)) if progress else nullcontext()
    with shown as bar, compute_threads(work_per_op=parameter_count(target.model) * tokens_per_forward):
        for batch in batches:
            wanted = set().union(*(missing_by_seq.get(n, set()) for n in batch))
            layers = sorted(wanted - {TARGET_PROBS})
            out = extract(target, [sequences[n] for n in batch], layers, batch_size=len(batch),
                          probabilities=refs.sampling if TARGET_PROBS in wanted else None)
            for n, extracted in zip(batch, out):  # features [K, T, H], probabilities [T]
                for k, layer_id in enumerate(layers):
                    if layer_id in missing_by_seq.get(n, ()) and extracted.features is not None:
                        feature_store.write(layer_id, n, extracted.features[k])
                if TARGET_PROBS in missing_by_seq.get(n, ()) and extracted.probabilities is not None:
                    feature_store.write(TARGET_PROBS, n, extracted.probabilities[:, None])
            done += len(batch)
            if bar is not None:
                bar.update(done)


# ---------------------------------------------------------------- on a Dask cluster (tasks/cluster.py)

@task(name="features shard", task_run_name="features shard {label}", cache_policy=NONE, persist_result=False)
def extract_features_shard(store_location: str, features_key: str, refs: ReferenceSet, target_dir: str,
                           arrays: list[tuple[int, int]], dtype: str, device: str,
                           attention: str = DEFAULT_ATTENTION, label: str = "") -> dict:
    """On a worker: extract the (layer, sequence) `arrays` of one batch into features entry `features_key`,
    those the entry does not hold yet (a shard run again after its worker died does only the rest); returns
    the shard's record: its sequences, the arrays it extracted, who extracted them and how long it took."""
    started = time.monotonic()
    use_worker_threads()
    store = Store(store_location)
    feature_store = store.feature_store(features_key)
    todo = [(layer, n) for layer, n in arrays if not feature_store.has(layer, n)]
    if todo:
        extract_arrays(target_dir, references_here(store, refs), todo, feature_store, dtype, device, attention,
                       progress=False)
    return {"sequences": sorted({n for _, n in arrays}), "arrays": len(todo), **worker_identity(),
            "seconds": round(time.monotonic() - started, 3)}


def extract_on_cluster(address: str, store: Store, features_key: str, refs: ReferenceSet, target_dir: str, missing,
                       dtype: str, device: str, attention: str = DEFAULT_ATTENTION) -> tuple[dict, ...]:
    """Extract the `missing` (layer, sequence) arrays of features entry `features_key` on the cluster at
    `address`, one shard per batch of the single-process plan; returns the shards' records."""
    sequences = [item.reference.token_ids for item in load_references(refs)]
    batches = extraction_batches(sequences, missing)
    parameters = []
    for i, batch in enumerate(batches, 1):
        members = set(batch)
        parameters.append(dict(store_location=store.location, features_key=features_key, refs=refs,
                               target_dir=target_dir, arrays=[(layer, n) for layer, n in missing if n in members],
                               dtype=dtype, device=device, attention=attention, label=f"{i}/{len(batches)}"))
    return tuple(run_shards(address, extract_features_shard, parameters, STAGE, "feature batches extracted"))
