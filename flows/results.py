"""What an evaluation returns: the results record (`dflash-eval run --out` writes it), assembled from the
evaluation's checked inputs and what its stages returned, and the one line that says what it found."""

from dataclasses import dataclass, field
from typing import Any

from prefect.states import State

from dflash_core.choices import DEFAULT_REPLAY_GROUP
from dflash_core.sampling import Sampling
from dflash_eval.storage import read_json
from dflash_eval.tasks.fetch import source_step

from .checks import EvaluationInputs

SHARDED_STAGES = ("features", "drafts", "baseline drafts")  # what a Dask cluster computes shard by shard


@dataclass
class StageRuns:
    """What the stage tasks of one evaluation returned, by name ("fetch", "baseline drafts", ...), and whether
    each ran or came from the store."""

    outputs: dict[str, Any] = field(default_factory=dict)
    statuses: dict[str, str] = field(default_factory=dict)  # "ran" or "cached"

    def add(self, name: str, state: State) -> Any:
        """Keep a stage task's final state under `name`; returns its result (the stage's record)."""
        self.statuses[name] = "cached" if state.name == "Cached" else "ran"
        self.outputs[name] = state.result()
        return self.outputs[name]


def evaluation_results(inputs: EvaluationInputs, runs: StageRuns) -> dict:
    """The results record: the scores (when scored), what was evaluated and how, and each stage's status and
    key; the baseline's tau, the diagnostics and the cluster's shards when there are any."""
    out = runs.outputs
    checkpoint = out.get("fetch")
    results = read_json(out["scores"].path) if "scores" in out else {}
    config = checkpoint.config if checkpoint else inputs.checked.drafter
    results.update({
        "drafter": {"source": inputs.drafter, "key": checkpoint.key if checkpoint else None,
                    "step": checkpoint.step if checkpoint else source_step(inputs.drafter),
                    **({"layout": checkpoint.layout, "config_source": checkpoint.config_source} if checkpoint else {})},
        "target": str(inputs.target),
        "prompts": str(inputs.prompts),
        "reference": inputs.reference,
        "lookahead": inputs.lookahead,
        "thinking": inputs.thinking,
        "max_new_tokens": inputs.max_new_tokens,
        "layer_ids": list(config.target_layer_ids),
        "dtype": inputs.dtype.name,
        "dtype_requested": inputs.dtype.requested,
        "dtype_note": inputs.dtype.note,
        "device": inputs.device,
        "store": inputs.store_location,
        "stages": dict(runs.statuses),
        "keys": {name: record.key for name, record in out.items()},
    })
    if not inputs.checked.sampling.greedy:  # (only then: greedy results stay as they were)
        results["sampling"] = {**inputs.checked.sampling.identity(), "samples": inputs.samples, "seed": inputs.seed}
    if inputs.block_size is not None:
        results["chosen_block_size"] = inputs.block_size
    if inputs.references is not None:
        results["references_file"] = inputs.references
    if inputs.block_sizes:
        results["block_sweep"] = block_sweep(inputs, runs)
    if inputs.replay_group != DEFAULT_REPLAY_GROUP:  # (only then: results of other runs stay as they were)
        results["replay_group"] = inputs.replay_group
    if inputs.dask_address:
        # per stage, the workers that computed its shards (when this run or an earlier one computed it on a cluster)
        results["cluster"] = {"dask_address": inputs.dask_address, "shards": {
            name: list(out[name].shards) if out[name].shards else None for name in SHARDED_STAGES if name in out}}
    if "baseline scores" in out:
        baseline, scores = out["baseline fetch"], read_json(out["baseline scores"].path)
        results["baseline"] = {
            "source": inputs.baseline, "key": baseline.key, "step": baseline.step,
            **{k: scores[k] for k in ("tau_macro", "tau_macro_ci95", "tau_pooled", "tau_by_category")},
        }
    if "diagnostics" in out:
        results["diagnostics"] = read_json(out["diagnostics"].path)
    return results


def block_sweep(inputs: EvaluationInputs, runs: StageRuns) -> list[dict]:
    """Per block size swept: tau macro (interval) and pooled, tau per verified token and, given step costs,
    the projected speedup tau(b) / cost(b) (projected: the costs are the user's measurements)."""
    rows = []
    for b in inputs.block_sizes:
        scores = read_json(runs.outputs[f"scores b{b}"].path)
        row = {"block_size": b, **{k: scores[k] for k in ("tau_macro", "tau_macro_ci95", "tau_pooled")},
               "tau_per_token": scores["tau_macro"] / b}
        if inputs.checked.step_costs:
            row["projected_speedup"] = scores["tau_macro"] / inputs.checked.step_costs[b]
        rows.append(row)
    return rows


def outcome(results: dict) -> str:
    """One line with what an evaluation found: the final log line and the flow run's state message."""
    low, high = results["tau_macro_ci95"]
    step = results["drafter"]["step"]
    served = ""
    if sampling := results.get("sampling"):
        served += f" at {Sampling.from_identity(sampling).describe()} ({sampling['samples']} samples per prompt)"
    if "chosen_block_size" in results:
        served += f", blocks of {results['chosen_block_size']}"
    return (f"tau {results['tau_macro']:.3f} (95% CI {low:.2f}-{high:.2f}){served}, pooled "
            f"{results['tau_pooled']:.3f}, " + (f"step {step}" if step is not None else "no step"))
