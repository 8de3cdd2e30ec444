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

import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from prefect import task
from prefect.cache_policies import NONE

from dflash_core.blocks import Block
from dflash_core.choices import DEFAULT_REPLAY_GROUP
from dflash_core.drafter import DFlashDrafter, load_drafter
from dflash_core.drafter_config import check_compatible
from dflash_core.generations import Generation, by_architecture
from dflash_core.metrics import ImpossibleTau
from dflash_core.replay import replay
from dflash_core.sampled_drafts import SampledDrafts, coin_seed
from dflash_core.sampling import DraftSampling
from dflash_core.token_head import load_token_head
from dflash_eval.storage import EntryMissing, Store, key_of, read_json, write_json_atomic
from dflash_eval.storage.feature_store import TARGET_PROBS
from dflash_eval.storage.integrity import entry_label, features_label, upstream_digests
from dflash_eval.storage.schema import DRAFT_SHARD_FILE, DRAFTS_FILE, DraftShardRecord, DraftsRecord, Stage

from .cluster import load_once, run_shards, use_worker_threads, worker_identity
from .features import FeatureReader, FeatureSet
from .fetch import CHECKPOINT_DIRNAME, Checkpoint
from .heavy import heavy
from .progress import StageProgress
from .references import ReferenceItem, ReferenceSet, load_references, references_here
from .stage import cached, get_or_compute, refusals_fail_cleanly
from .target import DTYPES
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
    block_size: int  # the drafter's slots per block
    verified_tokens: int  # what a step verifies at most: block_size, or one more when the anchor's slot drafts too
    sliding_semantics: str
    shards: tuple[dict[str, Any], ...] | None = None  # DraftsRecord.shards: who drafted them on a cluster
    draft_sampling: dict[str, Any] | None = None  # DraftsRecord.draft_sampling: None, greedy drafts
    architecture: str = "DFlashDraftModel"  # the drafter's, which names its generation (dflash_core.generations)
    confidence_threshold: float = 0.0  # DraftsRecord.confidence_threshold (0: every draft verified)
    token_head: dict[str, str] | None = None  # DraftsRecord.token_head: the save's copies that differ from the target's

    @property
    def generation(self) -> Generation:
        """The drafter's generation: what its drafts.json holds beside the steps, and the numbers it adds."""
        generation = by_architecture(self.architecture)
        assert generation is not None, "the fetched drafter's config was read, so its generation is registered"
        return generation


def replay_groups(n: int, group_size: int = PROMPTS_PER_GROUP) -> list[tuple[int, int]]:
    """The groups of prompts replayed together, as (start, stop) reference indices."""
    return [(start, min(start + group_size, n)) for start in range(0, n, group_size)]


def per_prompt_items(items, results, generation: Generation) -> list[dict]:
    """drafts.json's `per_prompt` items of these references (ReferenceItem) and their ReplayResults: with sampled
    drafts, `expected` holds the steps in expectation over the acceptance coins, and the steps one draw of them; a
    drafter whose generation has a head also holds its base walk's steps (alike) and its counts per draft position,
    under the generation's names (DFlash2: `unary`, `selector_positions`); under a verify threshold, the drafts each
    step verified (`verified_drafts`); a drafter that predicts its drafts' acceptance, the predictions' calibration
    (`calibration`: ReplayResult.calibration)."""
    return [{"id": i.id, "starts": r.starts, "acceptance_lengths": r.acceptance_lengths,
             "rejected_drafts": r.rejected_drafts, "all_positions": r.all_positions,
             **({"position_hits": r.position_hits} if r.position_hits is not None else {}),
             **({"expected": asdict(r.expected)} if r.expected is not None else {}),
             **({generation.BASE_WALK: _steps(r.base), generation.COUNTS_NAME: r.position_counts}
                if r.base is not None and generation.BASE_WALK and generation.COUNTS_NAME else {}),
             **({"verified_drafts": r.verified_drafts} if r.verified_drafts is not None else {}),
             **({"calibration": r.calibration} if r.calibration is not None else {})}
            for i, r in zip(items, results)]


def _steps(result) -> dict:
    """The decode steps of a ReplayResult, as drafts.json holds them."""
    return {"starts": result.starts, "acceptance_lengths": result.acceptance_lengths,
            "rejected_drafts": result.rejected_drafts,
            **({"expected": asdict(result.expected)} if result.expected is not None else {})}


@task(name="drafts", cache_policy=NONE, persist_result=False)
@refusals_fail_cleanly(ImpossibleTau)  # (a sampled draft's q or p that is not a number: nothing is committed)
def draft(
    checkpoint: Checkpoint,
    features: FeatureSet,
    refs: ReferenceSet,
    target_dir: str,
    store_location: str,
    block: Block,
    sliding_semantics: str = "causal",
    dtype: str = "float32",
    device: str = "cpu",
    all_positions: bool = False,
    refresh: bool = False,
    replay_group: int = PROMPTS_PER_GROUP,
    dask_address: str | None = None,
    draft_sampling: DraftSampling | None = None,
    confidence_threshold: float = 0.0,
):
    """Acceptance lengths per prompt, in decode order (drafted against the references, no target run);
    block: the drafter's block as the input checks resolved it (dflash_core.blocks.resolve_block): drafts of
    block.size slots (fewer than the drafter's own when one is chosen: one history series each);
    all_positions: also the acceptance length of a block at every position (dflash_core.replay);
    replay_group: prompts replayed together (see the module docstring); dask_address: draft each group on
    a worker of that Dask cluster (`target_dir` must be the same path on every worker). draft_sampling: drafts
    sampled from the drafter's logits processed as its q and accepted by rejection sampling against the target's
    probabilities, which `features` must hold (TARGET_PROBS); the acceptance coins of each reference follow from
    its seed and the reference's id (dflash_core.sampled_drafts). None: greedy drafts. confidence_threshold: a
    drafter with a confidence head (DSpark) verifies only the drafts before the first it is less confident of (0:
    every draft)."""
    store = Store(store_location)
    config = checkpoint.config
    sliding_semantics = config.sliding_semantics or sliding_semantics  # a config that fixes them (speculators) wins
    if block.own != config.block_size:  # (the checks read the drafter's config before the fetch read it again)
        raise ValueError(f"a block resolved for a drafter of block size {block.own}, not this one's "
                         f"{config.block_size}: give resolve_block(requested, the fetched drafter's config)")
    chosen, block_size = block.chosen, block.size
    sampled = None if draft_sampling is None else draft_sampling.to_record()
    key = drafts_key(checkpoint.key, features.key, config.target_layer_ids, block_size, sliding_semantics,
                     all_positions, dtype, device, replay_group, draft_sampling, confidence_threshold)
    read_layers = (*config.target_layer_ids, *((TARGET_PROBS,) if sampled else ()))
    labels = [entry_label(Stage.FETCH, checkpoint.key), entry_label(Stage.REFERENCES, refs.key),
              features_label(features.key, read_layers, features.n)]
    groups = replay_groups(refs.n, replay_group)
    models = ReplayModels(checkpoint, target_dir, sliding_semantics, dtype, device, block_size, draft_sampling,
                          confidence_threshold)
    threshold = confidence_threshold or None

    def compute_on_cluster(entry: Path) -> dict:
        assert dask_address is not None  # chosen only with a cluster's address
        verify_checkpoint(store, checkpoint)
        per_prompt, shards = draft_on_cluster(dask_address, store, key, models, features, refs, groups, labels,
                                              all_positions=all_positions, refresh=refresh)
        write_json_atomic(entry / DRAFTS_FILE, {"per_prompt": per_prompt})
        # a save with its own copies of the target's embedding and head is compared here too (the workers drafted)
        differences = token_head_differences(*models.load()) if config.source_format == "deepspec" else None
        return DraftsRecord(checkpoint=checkpoint.key, features=features.key, block_size=block_size,
                            sliding_semantics=sliding_semantics, layer_ids=tuple(config.target_layer_ids),
                            chosen_block_size=chosen, draft_sampling=sampled, confidence_threshold=threshold,
                            token_head=differences, shards=shards).to_record()

    def compute(entry: Path) -> dict:
        verify_checkpoint(store, checkpoint)
        drafter, embed, lm_head = models.load()
        items = load_references(refs)
        reader = FeatureReader(features, refs, target_dir, store, dtype, device)
        per_prompt: list[dict] = []
        with StageProgress(STAGE, "prompts drafted", len(items)) as progress, replay_threads(drafter, len(items)):
            for start, stop in groups:
                per_prompt += draft_group(models, drafter, embed, lm_head, items, reader, start, stop, all_positions)
                progress.update(len(per_prompt))
        write_json_atomic(entry / DRAFTS_FILE, {"per_prompt": per_prompt})
        return DraftsRecord(checkpoint=checkpoint.key, features=features.key, block_size=block_size,
                            sliding_semantics=sliding_semantics, layer_ids=tuple(config.target_layer_ids),
                            chosen_block_size=chosen, draft_sampling=sampled, confidence_threshold=threshold,
                            token_head=token_head_differences(drafter, embed, lm_head)).to_record()

    # on a cluster the workers compute: this process takes no heavy-stage slot
    outcome = get_or_compute(store, STAGE, key, compute_on_cluster if dask_address else heavy(compute),
                             refresh=refresh, upstream=lambda: upstream_digests(store, labels))
    record = DraftsRecord.from_record(outcome.record)
    if outcome.computed and dask_address:
        remove_draft_shards(store, key, groups)  # drafts.json holds them now
    drafts = Drafts(key=key, path=str(store.entry(STAGE, key)), block_size=record.block_size,
                    verified_tokens=block.verified_tokens,
                    sliding_semantics=record.sliding_semantics, shards=record.shards,
                    draft_sampling=record.draft_sampling, architecture=config.architecture,
                    confidence_threshold=record.confidence_threshold or 0.0, token_head=record.token_head)
    return drafts if outcome.computed else cached(drafts)


def drafts_key(checkpoint_key: str, features_key: str, layer_ids, block_size: int, sliding_semantics: str,
               all_positions: bool, dtype: str, device: str, replay_group: int,
               draft_sampling: DraftSampling | None, confidence_threshold: float = 0.0) -> str:
    """The drafts entry's content key: what was drafted (block_size: the slots drafted, Block.size) over which
    features, how, and the sampled drafts' one stored form (DraftSampling.to_record); tests/test_settings.py
    pins it, so stores keep their entries."""
    return key_of({
        "checkpoint": checkpoint_key, "features": features_key, "layer_ids": list(layer_ids),
        "block_size": block_size, "sliding_semantics": sliding_semantics,
        "mode": "all_positions" if all_positions else "decode",
        "dtype": dtype, "device": torch.device(device).type, "replay": REPLAY_VERSION,
        # only when not the default: the keys of entries drafted before it was a setting stay as they were
        **({"replay_group": replay_group} if replay_group != PROMPTS_PER_GROUP else {}),
        # only with sampled drafts: greedy drafts' keys stay as they were
        **({"sampled_drafts": draft_sampling.to_record()} if draft_sampling is not None else {}),
        **({"confidence_threshold": confidence_threshold} if confidence_threshold else {}),
    })


@dataclass(frozen=True)
class ReplayModels:
    """What a replay computes with: the fetched drafter and the target's embedding and lm_head, the block
    size it drafts, and how drafts are sampled (None: greedy)."""

    checkpoint: Checkpoint
    target_dir: str
    sliding_semantics: str
    dtype: str
    device: str
    block_size: int
    draft_sampling: DraftSampling | None = None
    confidence_threshold: float = 0.0  # a drafter with a confidence head verifies fewer drafts (0: every one)

    def drafter(self, checkpoint_dir: Path | None = None) -> DFlashDrafter:
        """The drafter, from `checkpoint_dir` (a worker's own copy of the fetch entry), else from the
        checkpoint's path; its config is the one validated at the fetch, not read again."""
        return load_drafter(checkpoint_dir or self.checkpoint.path, config=self.checkpoint.config,
                            dtype=DTYPES[self.dtype], device=self.device, sliding_semantics=self.sliding_semantics)

    def token_head(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The target's (embedding [V, H], lm_head [V, H]) on the device."""
        head = load_token_head(self.target_dir, dtype=DTYPES[self.dtype])
        return head.embed_weight.to(self.device), head.head_weight.to(self.device)

    def load(self) -> tuple[DFlashDrafter, torch.Tensor, torch.Tensor]:
        """(drafter, embedding, lm_head), checked to fit each other. The token head is loaded once per process
        (GBs for a large target), whatever number of checkpoints it drafts for (`run` over a training run's
        folder; a Dask worker's shards)."""
        drafter = self.drafter()
        embed, lm_head = load_once(self.token_head_key, self.token_head)
        check_compatible(drafter.cfg, embed.shape[1], embed.shape[0])
        return drafter, embed, lm_head

    @property
    def token_head_key(self) -> tuple:
        return ("token head", self.target_dir, self.dtype, self.device)


def token_head_differences(drafter: DFlashDrafter, embed: torch.Tensor, lm_head: torch.Tensor) -> dict[str, str] | None:
    """How the save's own copies of the target's embedding and head differ from the target's (None: they do not, or
    it holds none; the replay warns of each as well)."""
    return drafter.token_head_differences(embed, lm_head) or None


def draft_group(models: ReplayModels, drafter: DFlashDrafter, embed: torch.Tensor, lm_head: torch.Tensor,
                items: list[ReferenceItem], reader: FeatureReader, start: int, stop: int,
                all_positions: bool) -> list[dict]:
    """Replay prompts start .. stop-1 of `items` (one replay group) together; returns their drafts.json
    `per_prompt` items. The one replay loop of the stage: this process's groups and a cluster's shards."""
    # replay reads one prompt's features at a time (a large target's are ~50 KB per token) and keeps only the
    # group's context keys/values; a group still fills replay's batches of 64 blocks
    group = range(start, stop)
    features = (f.to(embed.device) for f in reader.read_each(drafter.target_layer_ids, group))
    drawn = models.draft_sampling
    sampled = None if drawn is None else SampledDrafts(
        drawn.q, [reader.read_probabilities(n) for n in group], [coin_seed(drawn.seed, items[n].id) for n in group])
    results = replay(drafter, embed, lm_head, [items[n].reference for n in group], features,
                     all_positions=all_positions, block_size=models.block_size, sampled=sampled,
                     verify_threshold=models.confidence_threshold)
    return per_prompt_items(items[start:stop], results, drafter.generation)


# ---------------------------------------------------------------- on a Dask cluster (tasks/cluster.py)

def draft_shard_key(drafts_key: str, start: int, stop: int) -> str:
    """The store key of the shard of drafts entry `drafts_key` that drafts prompts start .. stop-1."""
    return key_of({"drafts": drafts_key, "prompts": [start, stop]})


@task(name="drafts shard", task_run_name="drafts shard {label}", cache_policy=NONE, persist_result=False)
def draft_shard(store_location: str, drafts_key: str, models: ReplayModels, features: FeatureSet, refs: ReferenceSet,
                start: int, stop: int, upstream: list[str], all_positions: bool, label: str = "") -> dict:
    """On a worker: replay prompts start .. stop-1 (one replay group of drafts entry `drafts_key`) and commit
    their per-prompt items as a draft-shards entry, unless one is committed and fresh (its `upstream` labels:
    the drafts entry's); returns what the drafts record says of the shard (DraftShardRecord.shard)."""
    store = Store(store_location)

    def compute(entry: Path) -> dict:
        started = time.monotonic()
        use_worker_threads()
        local_refs = references_here(store, refs)
        checkpoint_dir = store.local_entry(Stage.FETCH, models.checkpoint.key) / CHECKPOINT_DIRNAME
        # loaded once per worker process, whatever number of shards it drafts (the head shared by its drafters)
        drafter = load_once(("drafter", models.checkpoint.key, models.sliding_semantics, models.dtype, models.device),
                            lambda: models.drafter(checkpoint_dir))
        embed, lm_head = load_once(models.token_head_key, models.token_head)
        check_compatible(drafter.cfg, embed.shape[1], embed.shape[0])
        reader = FeatureReader(features, local_refs, models.target_dir, store, models.dtype, models.device)
        with replay_threads(drafter, stop - start):
            per_prompt = draft_group(models, drafter, embed, lm_head, load_references(local_refs), reader, start,
                                     stop, all_positions)
        write_json_atomic(entry / DRAFT_SHARD_FILE, {"per_prompt": per_prompt})
        return DraftShardRecord(drafts=drafts_key, start=start, stop=stop, **worker_identity(),
                                seconds=round(time.monotonic() - started, 3)).to_record()

    outcome = get_or_compute(store, Stage.DRAFT_SHARDS, draft_shard_key(drafts_key, start, stop), compute,
                             upstream=lambda: upstream_digests(store, upstream))
    return DraftShardRecord.from_record(outcome.record).shard()


def draft_on_cluster(address: str, store: Store, drafts_key: str, models: ReplayModels, features: FeatureSet,
                     refs: ReferenceSet, groups: list[tuple[int, int]], upstream: list[str], *, all_positions: bool,
                     refresh: bool = False) -> tuple[list[dict], tuple[dict, ...]]:
    """Draft each replay group of drafts entry `drafts_key` as a shard on the cluster at `address` (shards an
    interrupted run committed are kept, unless `refresh`); returns (drafts.json's per_prompt items, merged in
    prompt order; the shards' records)."""
    if refresh:  # recomputed whole, as the entry itself
        remove_draft_shards(store, drafts_key, groups)
    parameters = [dict(store_location=store.location, drafts_key=drafts_key, models=models, features=features,
                       refs=refs, start=start, stop=stop, upstream=list(upstream), all_positions=all_positions,
                       label=f"prompts {start}-{stop - 1}")
                  for start, stop in groups]
    shards = run_shards(address, draft_shard, parameters, STAGE, "replay groups drafted")
    per_prompt = []
    for start, stop in groups:
        directory = store.local_entry(Stage.DRAFT_SHARDS, draft_shard_key(drafts_key, start, stop))
        per_prompt += read_json(directory / DRAFT_SHARD_FILE)["per_prompt"]
    return per_prompt, tuple(shards)


def remove_draft_shards(store: Store, drafts_key: str, groups: list[tuple[int, int]]) -> None:
    """Remove the draft-shards entries of drafts entry `drafts_key` (once drafts.json holds them, or before
    a refresh drafts every group again)."""
    for start, stop in groups:
        key = draft_shard_key(drafts_key, start, stop)
        with store.lock(Stage.DRAFT_SHARDS, key):
            store.remove(Stage.DRAFT_SHARDS, key)


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
