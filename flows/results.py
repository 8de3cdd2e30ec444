"""What an evaluation returns: the results record (`dflash-eval run --out` writes it), assembled from the
evaluation's checked inputs and what its stages returned, and the one line that says what it found."""

from dataclasses import dataclass, field, replace
from typing import Any, cast

from prefect.states import State

from dflash_core.checkpoint_files import model_name
from dflash_core.choices import DEFAULT_REPLAY_GROUP
from dflash_core.published.numbers import Setting, beside_published
from dflash_eval.reporting.benchmarks import Benchmarks
from dflash_eval.reporting.results import DrafterJson, Published, Results, Scores, ServedJson
from dflash_eval.reporting.sections import (
    Baseline,
    BaselineJson,
    BlockSizeRow,
    BlockSweep,
    Diagnostics,
    ThresholdRow,
    ThresholdSweep,
    VerificationJson,
)
from dflash_eval.storage import read_json
from dflash_eval.tasks.fetch import source_step

from .checks import CheckedEvaluation

SHARDED_STAGES = ("features", "drafts", "baseline drafts")  # what a Dask cluster computes shard by shard


@dataclass
class StageRuns:
    """What the stage tasks of one evaluation returned, by name ("fetch", "baseline drafts", ...), and whether
    each ran or came from the store."""

    outputs: dict[str, Any] = field(default_factory=dict)
    statuses: dict[str, str] = field(default_factory=dict)  # "ran" or "cached"

    def add(self, name: str, state: Any) -> Any:
        """Keep a stage task's final state under `name` (a task's call with `return_state=True`: a State, which
        Prefect's types cannot tell from a coroutine); returns its result (the stage's record)."""
        state = cast(State, state)
        self.statuses[name] = "cached" if state.name == "Cached" else "ran"
        self.outputs[name] = state.result()
        return self.outputs[name]


def evaluation_results(checked: CheckedEvaluation, runs: StageRuns) -> Results:
    """The results record (reporting.results.Results): the scores (when scored), what was evaluated and how (`served`:
    how the target is served, one value with its label), and each stage's status and key; the block sweep, the
    baseline's tau, the diagnostics, the published benchmarks and the cluster's shards when there are any. Once the
    store's history is read, what it says of this checkpoint is added (reporting.artifacts.add_history: `comparisons`,
    the paired differences against the baseline, the previous step and the best other checkpoint; in `training`, the
    trainer's own number and what the alarm checked)."""
    e, out = checked.evaluation, runs.outputs
    checkpoint = out.get("fetch")
    scored = read_json(out["scores"].path) if "scores" in out else None
    # what scores.json says of the served setting: `served` says it all, in one shape
    given_per_prompt = scored.get("samples_per_prompt", 1) if scored else 1
    served = replace(checked.served, samples=given_per_prompt) if checked.served.given else checked.served
    config = checkpoint.config if checkpoint else checked.drafter
    drafter: DrafterJson = {"source": e.drafter, "key": checkpoint.key if checkpoint else None,
                            "step": checkpoint.step if checkpoint else source_step(e.drafter)}
    if checkpoint:
        drafter["layout"], drafter["config_source"] = checkpoint.layout, checkpoint.config_source
    if "drafts" in out and out["drafts"].token_head:  # a save's copies of the target's embedding and head that differ
        drafter["token_head"] = out["drafts"].token_head
    results = Results(
        drafter=drafter, target=str(e.inputs.target), prompts=e.inputs.prompt_set,
        reference=e.generation.reference, lookahead=e.generation.lookahead, thinking=e.inputs.thinking,
        max_new_tokens=e.inputs.max_new_tokens, served=cast(ServedJson, served.to_json()),
        layer_ids=list(config.target_layer_ids), dtype=checked.dtype.name, dtype_requested=checked.dtype.requested,
        dtype_note=checked.dtype.note, attn_implementation=checked.attention, device=e.compute.device,
        store=checked.store_location, stages=dict(runs.statuses),
        stage_keys={name: record.key for name, record in out.items()},
        scores=Scores.from_json(scored) if scored is not None else None,
        published=Published(e.inputs.protocol, e.inputs.reasoning) if e.inputs.benchmarks else None,
        references_file=e.inputs.references,
        # (only then: results of other runs stay as they were)
        replay_group=e.compute.replay_group if e.compute.replay_group != DEFAULT_REPLAY_GROUP else None)
    if checked.block_sweep:
        results.add(BlockSweep(block_sweep(checked, runs)))
    if checked.threshold_sweep and all(f"scores t{t:g}" in out for t in checked.threshold_sweep):
        results.add(ThresholdSweep(threshold_sweep(checked, runs)))
    if e.compute.dask_address:
        # per stage, the workers that computed its shards (when this run or an earlier one computed it on a cluster)
        results.cluster = {"dask_address": e.compute.dask_address, "shards": {
            name: list(out[name].shards) if out[name].shards else None for name in SHARDED_STAGES if name in out}}
    if "baseline scores" in out:
        baseline, scores = out["baseline fetch"], read_json(out["baseline scores"].path)
        results.add(Baseline(cast(BaselineJson, {
            "source": e.inputs.baseline, "key": baseline.key, "step": baseline.step,
            **{k: scores[k] for k in ("tau_macro", "tau_macro_ci95", "tau_pooled", "tau_by_category")}})))
    if "diagnostics" in out:
        results.add(Diagnostics(read_json(out["diagnostics"].path)))
    if results.scores and results.scores.by_benchmark and "references" in out and out["references"].benchmarks:
        inputs, sampling = e.inputs, served.sampling
        setting = Setting(checked.target_name, model_name(e.drafter), sampling.temperature, sampling.top_p,
                          sampling.top_k, results.scores.block_size, str(inputs.protocol), inputs.max_new_tokens,
                          inputs.reasoning, served.draft_sample_method)
        block = beside_published(results.scores.by_benchmark, out["references"].benchmarks, setting)
        results.scores.by_benchmark = None
        results.add(Benchmarks(block))
    return results


def block_sweep(checked: CheckedEvaluation, runs: StageRuns) -> list[BlockSizeRow]:
    """Per block size swept: tau macro (interval) and pooled, tau per verified token and, given step costs,
    the projected speedup tau(b) / cost(b) (projected: the costs are the user's measurements)."""
    rows = []
    for b, _ in checked.block_sweep:
        scores = read_json(runs.outputs[f"scores b{b}"].path)
        row: BlockSizeRow = {"block_size": b, "tau_macro": scores["tau_macro"],
                             "tau_macro_ci95": scores["tau_macro_ci95"], "tau_pooled": scores["tau_pooled"],
                             "tau_per_token": scores["tau_macro"] / b}
        if checked.step_costs:
            row["projected_speedup"] = scores["tau_macro"] / checked.step_costs[b]
        rows.append(row)
    return rows


def threshold_sweep(checked: CheckedEvaluation, runs: StageRuns) -> list[ThresholdRow]:
    """Per confidence threshold swept: tau macro (interval) and pooled, the tokens a step verified and the tokens
    emitted per token verified (DeepSpec's verify_rate)."""
    rows = []
    for t in checked.threshold_sweep:
        scores = read_json(runs.outputs[f"scores t{t:g}"].path)
        rows.append(ThresholdRow(threshold=t, tau_macro=scores["tau_macro"], tau_macro_ci95=scores["tau_macro_ci95"],
                                 tau_pooled=scores["tau_pooled"], **verified(scores)))
    return rows


def verified(scores: dict) -> VerificationJson:
    """What the target verified for these scores: scores.json's `verification` (under a confidence threshold), else
    every draft of each step (threshold 0): the tokens a step verifies, and tau pooled over them."""
    if scores.get("verification") is not None:
        return cast(VerificationJson, dict(scores["verification"]))
    tokens, steps, block = scores["n_tokens"], scores["n_steps"], scores["block_size"]
    return {"verified_per_step": float(block) if steps else None,
            "tokens_per_verified_token": tokens / (steps * block) if steps else None}


def outcome(results: Results) -> str:
    """One line with what an evaluation found: the final log line and the flow run's state message."""
    assert results.scores is not None, "an outcome is said once scored"
    scores = results.scores
    low, high = scores.tau_macro_ci95
    step = results.drafter["step"]
    served = results.served["label"]
    return (f"tau {scores.tau_macro:.3f} (95% CI {low:.2f}-{high:.2f}), pooled {scores.tau_pooled:.3f}, "
            + (f"step {step}" if step is not None else "no step") + ("" if served == "greedy" else f"; {served}"))
