"""Diagnostics stage: layer ablation, noise, layer-offset probe, sliding switch, first divergences, first-token
agreement and the findings (dflash_core.diagnostics), from the cached features: drafter replays only, no target
run."""

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from prefect import task
from prefect.cache_policies import NONE
from transformers import AutoTokenizer

from dflash_core.choices import SLIDING_SEMANTICS
from dflash_core.diagnostics import (
    DEFAULT_OFFSETS,
    NOISE,
    Variant,
    agreement_counts,
    diagnostic_variants,
    findings,
    first_divergences,
    next_tokens,
    variant_features,
)
from dflash_core.drafter import load_drafter
from dflash_core.metrics import PromptScore, tau_macro
from dflash_core.replay import ReplayResult, replay
from dflash_core.target import read_target_config
from dflash_core.token_head import load_token_head
from dflash_eval.storage import Store, key_of, read_json, write_json_atomic
from dflash_eval.storage.integrity import entry_label, features_label, upstream_digests
from dflash_eval.storage.schema import DIAGNOSTICS_FILE, DRAFTS_FILE, DiagnosticsRecord, Stage

from .drafts import PROMPTS_PER_GROUP, Drafts, verify_checkpoint
from .features import FeatureReader, FeatureSet
from .fetch import Checkpoint
from .heavy import heavy
from .progress import StageProgress
from .references import ReferenceSet, load_references
from .scores import Scores
from .stage import cached, get_or_compute
from .target import DTYPES
from .threads import replay_threads

STAGE = Stage.DIAGNOSTICS
# Bump when what the diagnostics compute changes (part of the key).
DIAGNOSTICS_VERSION = 3  # 2: the noise variant, first-token agreement and the findings; 3: first divergences
# name their decode step and acceptance length (decode_step, acceptance_length)
EXAMPLES = 8  # first-divergence examples kept


@dataclass(frozen=True)
class Diagnostics:
    """A checkpoint's diagnostics, held in the store (diagnostics.json)."""

    key: str
    path: str


def layers_needed(layer_ids, num_target_layers: int, offsets=DEFAULT_OFFSETS) -> list[int]:
    """Every target layer the diagnostics read: the drafter's, those of the offsets in range, and the last
    (the target's next tokens, for the first-token agreement)."""
    variants, _ = diagnostic_variants(layer_ids, num_target_layers, offsets)
    return sorted({i for v in variants for i in v.layer_ids} | set(layer_ids) | {num_target_layers - 1})


@task(name="diagnostics", cache_policy=NONE, persist_result=False)
def diagnose(
    checkpoint: Checkpoint,
    features: FeatureSet,
    refs: ReferenceSet,
    drafts: Drafts,
    scores: Scores,
    target_dir: str,
    store_location: str,
    dtype: str = "float32",
    device: str = "cpu",
    refresh: bool = False,
):
    """Tau with each layer's features zeroed, with all of them, with noise instead, with shifted layers, with
    the other sliding semantics, each at the block size the drafts were verified with; the first rejected draft
    of each prompt, as text; how often the first drafted token is the target's own next token; and the findings.
    `features` must hold layers_needed(...) (the flow extracts them with the drafter's)."""
    store = Store(store_location)
    key = key_of({"drafts": drafts.key, "offsets": list(DEFAULT_OFFSETS), "examples": EXAMPLES,
                  "diagnostics": DIAGNOSTICS_VERSION})

    def compute(entry: Path) -> dict:
        verify_checkpoint(store, checkpoint)
        semantics = drafts.sliding_semantics
        drafter = load_drafter(checkpoint.path, config=checkpoint.config, dtype=DTYPES[dtype], device=device,
                               sliding_semantics=semantics)
        ids = tuple(drafter.target_layer_ids)
        num_layers = read_target_config(target_dir).num_layers
        variants, out_of_range = diagnostic_variants(ids, num_layers)
        switched = None
        if "sliding_attention" in drafter.cfg.layer_types:
            other = next(s for s in SLIDING_SEMANTICS if s != semantics)
            switched = load_drafter(checkpoint.path, config=checkpoint.config, dtype=DTYPES[dtype], device=device,
                                    sliding_semantics=other)
        head = load_token_head(target_dir, dtype=DTYPES[dtype])
        embed, lm_head = head.embed_weight.to(device), head.head_weight.to(device)
        tokenizer = AutoTokenizer.from_pretrained(target_dir)
        items = load_references(refs)
        # the unmodified decode steps are the drafts stage's: not replayed again
        unmodified = [ReplayResult(d["starts"], d["acceptance_lengths"], d["rejected_drafts"])
                      for d in read_json(Path(drafts.path) / DRAFTS_FILE)["per_prompt"]]
        feature_reader = FeatureReader(features, refs, target_dir, store, dtype, device)
        needed = layers_needed(ids, num_layers)
        results: dict[str, list[ReplayResult]] = {v.name: [] for v in variants}
        switched_results: list[ReplayResult] = []
        examples: list[dict] = []
        agreement: dict[str, list[int]] = {}
        with StageProgress(STAGE, "prompts diagnosed", len(items)) as progress, replay_threads(drafter, len(items)):
            for start in range(0, len(items), PROMPTS_PER_GROUP):
                group = range(start, min(start + PROMPTS_PER_GROUP, len(items)))
                by_layer = []
                for n in group:
                    held = feature_reader.read(needed, n).to(device)  # [L, T, H]
                    by_layer.append({layer: held[k] for k, layer in enumerate(needed)})
                references = [items[n].reference for n in group]
                drafter_inputs = [variant_features(Variant("unmodified", ids), f) for f in by_layer]
                for variant in variants:
                    inputs = [variant_features(variant, f, seed=n) for n, f in zip(group, by_layer)]
                    results[variant.name] += replay(drafter, embed, lm_head, references, inputs,
                                                    block_size=drafts.block_size)
                if switched is not None:
                    switched_results += replay(switched, embed, lm_head, references, drafter_inputs,
                                               block_size=drafts.block_size)
                target_next = [next_tokens(f[num_layers - 1], lm_head) for f in by_layer]
                counted = agreement_counts(drafter, embed, lm_head, references, drafter_inputs, target_next,
                                           block_size=drafts.block_size)
                for name, (agreed, compared) in counted.items():
                    total = agreement.setdefault(name, [0, 0])
                    total[0] += agreed
                    total[1] += compared
                if len(examples) < EXAMPLES:
                    found = first_divergences(drafter, embed, lm_head, references, drafter_inputs,
                                              unmodified[start:start + len(group)],
                                              # transformers types decode for any ids: one sequence gives one string
                                              cast(Callable[[list[int]], str], tokenizer.decode),
                                              block_size=drafts.block_size)
                    examples += [{"id": items[n].id, "category": items[n].category, **example}
                                 for n, example in zip(group, found) if example is not None]
                progress.update(group.stop)

        def tau(replayed: list[ReplayResult]) -> float:
            return tau_macro([PromptScore(i.id, i.category, r.acceptance_lengths, r.starts, len(i.reference.token_ids))
                              for i, r in zip(items, replayed) if r.acceptance_lengths])

        offsets: dict[int, tuple[list[int], float | None]] = {0: (list(ids), scores.tau_macro)}
        offsets.update({v.offset: (list(v.layer_ids), tau(results[v.name])) for v in variants if v.offset})
        offsets.update({o: ([i + o for i in ids], None) for o in out_of_range})  # not probed: no tau
        ablated = {i: tau(results[f"ablate layer {i}"]) for i in ids}
        noise_tau = tau(results[NOISE])
        report = {
            "tau_macro": scores.tau_macro,
            "layer_ids": list(ids),
            "num_target_layers": num_layers,
            "layer_ablation": [{"layer_id": i, "tau_macro": t} for i, t in ablated.items()],
            "all_layers_ablated": tau(results["all layers ablated"]),
            "noise_instead_of_features": noise_tau,
            "agreement": {name: {"agreed": agreed, "compared": compared,
                                 "rate": agreed / compared if compared else None}
                          for name, (agreed, compared) in agreement.items()},
            "findings": findings(scores.tau_macro, ablated, noise_tau, agreement),
            "layer_offset_probe": [{"offset": o, "layer_ids": offsets[o][0], "tau_macro": offsets[o][1]}
                                   for o in sorted(offsets)],
            "sliding_switch": None if switched is None else {
                "from": semantics, "to": switched.sliding_semantics, "tau_macro": tau(switched_results)},
            "first_divergence": examples[:EXAMPLES],
        }
        write_json_atomic(entry / DIAGNOSTICS_FILE, report, indent=1)
        return DiagnosticsRecord(drafts=drafts.key, scores=scores.key).to_record()

    # what it is built from; the layers it reads are layers_needed of the drafter's ids, as in compute
    ids = checkpoint.config.target_layer_ids
    needed = layers_needed(ids, read_target_config(target_dir).num_layers)
    labels = [entry_label(Stage.DRAFTS, drafts.key), entry_label(Stage.SCORES, scores.key),
              entry_label(Stage.FETCH, checkpoint.key), entry_label(Stage.REFERENCES, refs.key),
              features_label(features.key, needed, features.n)]
    outcome = get_or_compute(store, STAGE, key, heavy(compute), refresh=refresh,
                             upstream=lambda: upstream_digests(store, labels))
    diagnostics = Diagnostics(key=key, path=str(store.entry(STAGE, key) / DIAGNOSTICS_FILE))
    return diagnostics if outcome.computed else cached(diagnostics)
