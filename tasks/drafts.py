"""Drafts stage: replay greedy speculative decoding of a drafter checkpoint over the cached features.

What it reads is verified: the checkpoint's files against the digests recorded when it was fetched
(every byte, before the weights are loaded), each feature array against its sha256 (FeatureReader:
a damaged one is extracted again). The entry records the content digests of the checkpoint, the
references and the feature arrays it read; when one of them changes, the drafts are recomputed.

The prompts are replayed in groups (`replay_group`, PROMPTS_PER_GROUP by default): replay batches blocks
across the prompts of a group, so a group's results depend (in the last bits) on which prompts share it,
and the group size is part of the key when it is not the default. With a Dask cluster (`dask_address`,
tasks/cluster.py) each group is one shard drafted on a worker and kept as its own small store entry
(draft-shards), so a shard finished before a worker died is kept; this process merges the shards in prompt
order into a drafts.json byte for byte the one a single process writes.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from prefect import task
from prefect.cache_policies import NONE

from dflash_core.choices import DEFAULT_REPLAY_GROUP
from dflash_core.drafter import check_compatible, load_drafter, read_drafter_config
from dflash_core.replay import replay
from dflash_core.token_head import load_token_head
from dflash_eval.storage import EntryMissing, Store, key_of, write_json_atomic
from dflash_eval.storage.integrity import entry_label, features_label, upstream_digests
from dflash_eval.storage.schema import DRAFTS_FILE, DraftsRecord, Stage

from .features import FeatureReader, FeatureSet
from .fetch import Checkpoint
from .heavy import heavy
from .progress import StageProgress
from .references import ReferenceSet, load_references
from .stage import cached, get_or_compute
from .target import DTYPES, target_tokenizer
from .threads import replay_threads

STAGE = Stage.DRAFTS
# Bump when replay changes what it records (part of the key).
REPLAY_VERSION = 1
PROMPTS_PER_GROUP = DEFAULT_REPLAY_GROUP  # the default replay group (a key holds the group size only when it is another)


@dataclass(frozen=True)
class Drafts:
    """Decode steps of one drafter over one reference set, held in the store (drafts.json)."""

    key: str
    path: str
    block_size: int
    sliding_semantics: str
    shards: tuple[dict[str, Any], ...] | None = None  # DraftsRecord.shards: who drafted them on a cluster


def replay_groups(n: int, group_size: int = PROMPTS_PER_GROUP) -> list[tuple[int, int]]:
    """The groups of prompts replayed together, as (start, stop) reference indices."""
    return [(start, min(start + group_size, n)) for start in range(0, n, group_size)]


def per_prompt_items(items, results) -> list[dict]:
    """drafts.json's `per_prompt` items of these references (ReferenceItem) and their ReplayResults."""
    return [{"id": i.id, "starts": r.starts, "acceptance_lengths": r.acceptance_lengths,
             "rejected_drafts": r.rejected_drafts, "all_positions": r.all_positions}
            for i, r in zip(items, results)]


@task(name="drafts", cache_policy=NONE, persist_result=False)
def draft(
    checkpoint: Checkpoint,
    features: FeatureSet,
    refs: ReferenceSet,
    target_dir: str,
    store_root: str,
    sliding_semantics: str = "causal",
    dtype: str = "float32",
    device: str = "cpu",
    all_positions: bool = False,
    refresh: bool = False,
    replay_group: int = PROMPTS_PER_GROUP,
    dask_address: str | None = None,
):
    """Acceptance lengths per prompt, in decode order (drafted against the references, no target run);
    all_positions: also the acceptance length of a block at every position (dflash_core.replay).
    replay_group: prompts replayed together (see the module docstring); dask_address: draft each group on
    a worker of that Dask cluster (tasks/cluster.py: `target_dir` must be the same path on every worker)."""
    store = Store(store_root)
    tokenizer = target_tokenizer(target_dir)  # resolves a mask token given as a string
    config = read_drafter_config(checkpoint.path, tokenizer=tokenizer)  # the key needs only the config, not the weights
    key = key_of({
        "checkpoint": checkpoint.key, "features": features.key, "layer_ids": list(config.target_layer_ids),
        "block_size": config.block_size, "sliding_semantics": sliding_semantics,
        "mode": "all_positions" if all_positions else "decode",
        "dtype": dtype, "device": torch.device(device).type, "replay": REPLAY_VERSION,
        # only when not the default: the keys of entries drafted before it was a setting stay as they were
        **({"replay_group": replay_group} if replay_group != PROMPTS_PER_GROUP else {}),
    })
    labels = [entry_label(Stage.FETCH, checkpoint.key), entry_label(Stage.REFERENCES, refs.key),
              features_label(features.key, config.target_layer_ids, features.n)]

    def compute_on_cluster(entry: Path) -> dict:
        from .cluster import draft_on_cluster

        verify_checkpoint(store, checkpoint)
        per_prompt, shards = draft_on_cluster(
            dask_address, store, key, checkpoint, features, refs, target_dir,
            replay_groups(refs.n, replay_group), labels, sliding_semantics=sliding_semantics, dtype=dtype,
            device=device, all_positions=all_positions, refresh=refresh)
        write_json_atomic(entry / DRAFTS_FILE, {"per_prompt": per_prompt})
        return DraftsRecord(checkpoint=checkpoint.key, features=features.key, block_size=config.block_size,
                            sliding_semantics=sliding_semantics, layer_ids=tuple(config.target_layer_ids),
                            shards=shards).to_record()

    def compute(entry: Path) -> dict:
        verify_checkpoint(store, checkpoint)
        drafter = load_drafter(checkpoint.path, dtype=DTYPES[dtype], device=device, sliding_semantics=sliding_semantics,
                               tokenizer=tokenizer)
        head = load_token_head(target_dir, dtype=DTYPES[dtype])
        check_compatible(drafter, head.embed_weight.shape[1], head.embed_weight.shape[0])
        embed, lm_head = head.embed_weight.to(device), head.head_weight.to(device)
        items = load_references(refs)
        feature_reader = FeatureReader(features, refs, target_dir, store_root, dtype, device)
        results = []
        # Groups of prompts: replay reads one prompt's features at a time (a large target's are
        # ~50 KB per token) and keeps only a group's context keys/values, and a group still fills
        # replay's batches of 64 blocks.
        with StageProgress(STAGE, "prompts drafted", len(items)) as progress, replay_threads(drafter, len(items)):
            for start, stop in replay_groups(len(items), replay_group):
                group = range(start, stop)
                feats = (f.to(device) for f in feature_reader.read_each(drafter.target_layer_ids, group))
                results += replay(drafter, embed, lm_head, [items[n].reference for n in group], feats,
                                  all_positions=all_positions)
                progress.update(len(results))
        write_json_atomic(entry / DRAFTS_FILE, {"per_prompt": per_prompt_items(items, results)})
        return DraftsRecord(checkpoint=checkpoint.key, features=features.key, block_size=drafter.block_size,
                            sliding_semantics=sliding_semantics,
                            layer_ids=tuple(drafter.target_layer_ids)).to_record()

    # on a cluster the workers compute: this process takes no heavy-stage slot
    outcome = get_or_compute(store, STAGE, key, compute_on_cluster if dask_address else heavy(compute),
                             refresh=refresh, upstream=lambda: upstream_digests(store, labels))
    record = DraftsRecord.from_record(outcome.record)
    if outcome.computed and dask_address:
        from .cluster import remove_draft_shards

        remove_draft_shards(store, key, replay_groups(refs.n, replay_group))  # drafts.json holds them now
    drafts = Drafts(key=key, path=str(store.entry(STAGE, key)), block_size=record.block_size,
                    sliding_semantics=record.sliding_semantics, shards=record.shards)
    return drafts if outcome.computed else cached(drafts)


class CheckpointDamaged(RuntimeError):
    """The fetched checkpoint no longer matches its digests; it was removed, the next run fetches it again."""


def verify_checkpoint(store: Store, checkpoint: Checkpoint) -> None:
    """Hash every file of the checkpoint's fetch entry against the digests recorded at its commit (~1 s
    per GB), unless this run fetched it: then they were hashed moments ago, and sizes are checked. A
    damaged entry is removed (with a warning naming it) and CheckpointDamaged raised: this run cannot
    fetch it, the next one does."""
    try:
        store.read_entry(Stage.FETCH, checkpoint.key, full=not checkpoint.fetched_by_this_run)
    except EntryMissing as e:
        raise CheckpointDamaged(f"the drafter checkpoint fetch/{checkpoint.key} ({checkpoint.source}) cannot be "
                                f"used: {e.reason}; run again to fetch it again") from None
