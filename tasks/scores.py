"""Scores stage: tau (macro and pooled), the histogram and per-prompt acceptance lengths."""

from dataclasses import dataclass
from pathlib import Path

from prefect import task
from prefect.cache_policies import NONE

from dflash_core.generations import Replayed
from dflash_core.metrics import (
    ImpossibleTau,
    PromptScore,
    all_positions_tau,
    benchmark_summary,
    summarize,
    teacher_forced_accuracy,
)
from dflash_core.sampled_drafts import ExpectedSteps
from dflash_eval.storage import Store, key_of, read_json, write_json_atomic
from dflash_eval.storage.integrity import entry_label, upstream_digests
from dflash_eval.storage.schema import DRAFTS_FILE, SCORES_FILE, ScoresRecord, Stage

from .drafts import Drafts
from .references import ReferenceSet, load_references
from .stage import cached, get_or_compute, refusals_fail_cleanly

STAGE = Stage.SCORES
# Bump when the metrics change (part of the key).
SCORES_VERSION = 3  # 3: position acceptance with counts and intervals


@dataclass(frozen=True)
class Scores:
    """A checkpoint's scores, held in the store (scores.json)."""

    key: str
    path: str  # scores.json
    tau_macro: float
    tau_pooled: float


def prompt_score(item, steps: dict) -> PromptScore:
    """A reference's decode steps as drafts.json holds them (a per_prompt item, or its base walk's), to score."""
    return PromptScore(item.id, item.category, steps["acceptance_lengths"], steps["starts"],
                       len(item.reference.token_ids), item.prompt,
                       ExpectedSteps(**steps["expected"]) if "expected" in steps else None)


def verification(prompts: list[PromptScore], per_prompt: list[dict], verified_tokens: int) -> dict:
    """Under a confidence threshold, what the target verified: the tokens per step (the drafts a step verified, and
    the anchor), and the tokens emitted per token verified (DeepSpec's verify_rate: the acceptance lengths' sum over
    the tokens verified), pooled over the references; with sampled drafts, expectations over the coins."""
    emitted = verified = steps = 0.0
    for p, d in zip(prompts, per_prompt):
        if p.expected is not None:  # sampled drafts: in expectation over the coins
            emitted, steps = emitted + p.expected.tokens, steps + p.expected.steps
            verified += p.expected.verified if p.expected.verified is not None else p.expected.steps * verified_tokens
        else:
            emitted, steps = emitted + sum(p.acceptance_lengths), steps + len(p.acceptance_lengths)
            verified += (sum(n + 1 for n in d["verified_drafts"]) if "verified_drafts" in d
                         else len(p.acceptance_lengths) * verified_tokens)
    return {"verified_per_step": verified / steps if steps else None,
            "tokens_per_verified_token": emitted / verified if verified else None}


@task(name="scores", cache_policy=NONE, persist_result=False)
@refusals_fail_cleanly(ImpossibleTau)  # (summarize refuses a tau no decoding gives: nothing is committed)
def score(drafts: Drafts, refs: ReferenceSet, store_location: str, refresh: bool = False):
    """Summarize the drafts stage's acceptance lengths (see dflash_core.metrics)."""
    store = Store(store_location)
    key = key_of({"drafts": drafts.key, "scores": SCORES_VERSION})

    def compute(entry: Path) -> dict:
        per_prompt = read_json(Path(drafts.path) / DRAFTS_FILE)["per_prompt"]
        items = load_references(refs)
        prompts = [prompt_score(item, d) for item, d in zip(items, per_prompt)]
        summary = summarize(prompts, drafts.verified_tokens, lookahead=refs.lookahead > 0)
        if refs.benchmarks:  # published benchmarks: tau per benchmark and per group, as z-lab's tables give them
            summary["by_benchmark"] = benchmark_summary(
                prompts, {use["name"]: use["group"] for use in refs.benchmarks["benchmarks"]})
        generation = drafts.generation
        base, counts = generation.BASE_WALK, generation.COUNTS_NAME
        replayed = [Replayed(p, prompt_score(item, d[base]) if base and base in d else None,
                             d.get(counts) if counts else None, d.get("calibration"))
                    for p, item, d in zip(prompts, items, per_prompt) if p.acceptance_lengths]
        for found in generation.summaries(replayed):  # what the generation adds (DFlash2's selector, DSpark's heads)
            summary[found.KEY] = found.to_json()
        if any("verified_drafts" in d for d in per_prompt) or drafts.confidence_threshold:
            summary["verification"] = verification(prompts, per_prompt, drafts.verified_tokens)
        if all(d.get("all_positions") is not None for d in per_prompt):
            summary["all_positions_tau"] = all_positions_tau([d["all_positions"] for d in per_prompt])
        if all(d.get("position_hits") is not None for d in per_prompt):  # all-positions drafts since they kept it
            summary["teacher_forced_accuracy"] = teacher_forced_accuracy([d["position_hits"] for d in per_prompt])
        summary["sliding_semantics"] = drafts.sliding_semantics
        if drafts.draft_sampling is not None:  # (only then: greedy scores stay as they were)
            summary["draft_sampling"] = drafts.draft_sampling
        # references a server gave only as text whose re-tokenisation did not round-trip
        summary["unverified_references"] = [item.id for item in items if not item.verified]
        write_json_atomic(entry / SCORES_FILE, summary, indent=1)
        return ScoresRecord(tau_macro=summary["tau_macro"], tau_pooled=summary["tau_pooled"],
                            drafts=drafts.key).to_record()

    # recomputed when the drafts (or references) it summarizes were recomputed with another content
    labels = [entry_label(Stage.DRAFTS, drafts.key), entry_label(Stage.REFERENCES, refs.key)]
    outcome = get_or_compute(store, STAGE, key, compute, refresh=refresh,
                             upstream=lambda: upstream_digests(store, labels))
    record = ScoresRecord.from_record(outcome.record)
    scores = Scores(key=key, path=str(store.entry(STAGE, key) / SCORES_FILE), tau_macro=record.tau_macro,
                    tau_pooled=record.tau_pooled)
    return scores if outcome.computed else cached(scores)
