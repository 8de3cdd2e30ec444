"""Drafts stage: replay greedy speculative decoding of a drafter checkpoint over the cached features.

What it reads is verified: the checkpoint's files against the digests recorded when it was fetched
(every byte, before the weights are loaded), each feature array against its sha256 (FeatureReader:
a damaged one is extracted again). The entry records the content digests of the checkpoint, the
references and the feature arrays it read; when one of them changes, the drafts are recomputed.
"""

from dataclasses import dataclass
from pathlib import Path

import torch
from prefect import task
from prefect.cache_policies import NONE

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
PROMPTS_PER_GROUP = 64


@dataclass(frozen=True)
class Drafts:
    """Decode steps of one drafter over one reference set, held in the store (drafts.json)."""

    key: str
    path: str
    block_size: int
    sliding_semantics: str


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
):
    """Acceptance lengths per prompt, in decode order (drafted against the references, no target run);
    all_positions: also the acceptance length of a block at every position (dflash_core.replay)."""
    store = Store(store_root)
    tokenizer = target_tokenizer(target_dir)  # resolves a mask token given as a string
    config = read_drafter_config(checkpoint.path, tokenizer=tokenizer)  # the key needs only the config, not the weights
    key = key_of({
        "checkpoint": checkpoint.key, "features": features.key, "layer_ids": list(config.target_layer_ids),
        "block_size": config.block_size, "sliding_semantics": sliding_semantics,
        "mode": "all_positions" if all_positions else "decode",
        "dtype": dtype, "device": torch.device(device).type, "replay": REPLAY_VERSION,
    })

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
            for start in range(0, len(items), PROMPTS_PER_GROUP):
                group = range(start, min(start + PROMPTS_PER_GROUP, len(items)))
                feats = (feature_reader.read(drafter.target_layer_ids, n).to(device) for n in group)
                results += replay(drafter, embed, lm_head, [items[n].reference for n in group], feats,
                                  all_positions=all_positions)
                progress.update(len(results))
        write_json_atomic(entry / DRAFTS_FILE, {"per_prompt": [
            {"id": i.id, "starts": r.starts, "acceptance_lengths": r.acceptance_lengths,
             "rejected_drafts": r.rejected_drafts, "all_positions": r.all_positions}
            for i, r in zip(items, results)
        ]})
        return DraftsRecord(checkpoint=checkpoint.key, features=features.key, block_size=drafter.block_size,
                            sliding_semantics=sliding_semantics,
                            layer_ids=tuple(drafter.target_layer_ids)).to_record()

    labels = [entry_label(Stage.FETCH, checkpoint.key), entry_label(Stage.REFERENCES, refs.key),
              features_label(features.key, config.target_layer_ids, features.n)]
    outcome = get_or_compute(store, STAGE, key, heavy(compute), refresh=refresh,
                             upstream=lambda: upstream_digests(store, labels))
    record = DraftsRecord.from_record(outcome.record)
    drafts = Drafts(key=key, path=str(store.entry(STAGE, key)), block_size=record.block_size,
                    sliding_semantics=record.sliding_semantics)
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
