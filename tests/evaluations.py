"""Evaluations as a script runs them: the evaluate-checkpoint flow (or a rerun-<stage> flow) with its settings given
by name, flat, as on the command line (flows.settings.by_group puts each in its group); a setting's place in a
deployment's form; and a training run's first and last saves evaluated into a store of their own."""

from dataclasses import dataclass
from pathlib import Path

from dflash_eval.flows.settings import by_group


def run_evaluation(flow=None, *, return_state: bool = False, **settings):
    """Run `flow` (default evaluate-checkpoint) with these settings (`drafter`, `target`, `max_new_tokens`, ...)."""
    from dflash_eval.flows.evaluate import evaluate_checkpoint

    return (flow or evaluate_checkpoint)(**by_group(settings), return_state=return_state)


def setting_schema(schema: dict, group: str, name: str) -> dict:
    """The form's schema of setting `name` in section `group` of a deployment's parameters (its schema)."""
    definition = schema["properties"][group]["$ref"].rsplit("/", 1)[1]
    return schema["definitions"][definition]["properties"][name]


@dataclass(frozen=True)
class Evaluated:
    """Saves of a training run evaluated through the flow into a store of their own."""

    store: Path
    tensorboard: Path  # the TensorBoard run they wrote
    results: list[dict]  # each save's results, in step order
    flow_runs: list[str]  # each save's flow run id, alike


def evaluate_saves(run, prompts: Path, root: Path, max_new_tokens: int) -> Evaluated:
    """The first and last saves of `run` (a TinyRun) on `prompts`, into `root`/store, writing `root`/tensorboard."""
    evaluated = Evaluated(root / "store", root / "tensorboard", [], [])
    for drafter in (run.drafter_steps[0], run.drafter_steps[-1]):
        state = run_evaluation(target=str(run.target_dir), drafter=str(drafter), prompts=str(prompts),
                               max_new_tokens=max_new_tokens, store=str(evaluated.store),
                               tensorboard=str(evaluated.tensorboard), return_state=True)
        evaluated.results.append(state.result())
        evaluated.flow_runs.append(str(state.state_details.flow_run_id))
    return evaluated


def stored_scores(store: Path, results: dict) -> dict:
    """The scores.json of an evaluation's results, as the store holds it."""
    from dflash_eval.storage import Store, read_json
    from dflash_eval.storage.schema import SCORES_FILE, Stage

    return read_json(Store(store).entry(Stage.SCORES, results["keys"]["scores"]) / SCORES_FILE)


# a greedy evaluation's results whose values nothing reads (results_of fills what a test leaves out with them):
# scores.json's part (its keys sorted, as it holds them), then what was evaluated
UNREAD_SCORES = {
    "block_size": 8, "clipped_last_steps": 0, "clipping_note": "", "histogram": {}, "lookahead": False, "n_prompts": 3,
    "n_scored_prompts": 3, "n_steps": 10, "n_tokens": 20, "per_prompt": [], "position_acceptance": [],
    "position_acceptance_ci95": [], "position_counts": {"reached": [], "accepted": []}, "projected_speedup": {},
    "sliding_semantics": "causal", "speedup_note": "", "tau_by_category": {}, "tau_macro": 2.0,
    "tau_macro_ci95": [1.9, 2.1], "tau_pooled": 2.0, "tau_pooled_ci95": [1.9, 2.1], "unverified_references": [],
}
UNREAD_EVALUATION = {
    "drafter": {"source": "runs/x/step_100", "key": None, "step": 100}, "target": "target", "prompts": "prompts.jsonl",
    "reference": "local", "lookahead": False, "thinking": False, "max_new_tokens": 16,
    "served": {"label": "greedy", "references": "greedy", "temperature": 0.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0,
               "samples": 1, "seed": 0, "block_size": None, "draft_sample_method": "greedy", "draft_truncation": True},
    "layer_ids": [1], "dtype": "float32", "dtype_requested": "float32", "dtype_note": None,
    "attn_implementation": "sdpa", "device": "cpu", "store": "store", "stages": {}, "keys": {},
}
UNREAD_RESULTS = {**UNREAD_SCORES, **UNREAD_EVALUATION}


def results_of(**given):
    """A results record (reporting.results.Results) holding `given` (its JSON's keys; `drafter` and `served` in part),
    the rest a greedy evaluation's values that nothing reads (UNREAD_RESULTS)."""
    from dflash_eval.reporting.results import Results

    merged = {**UNREAD_RESULTS, **given}
    for name in ("drafter", "served"):
        merged[name] = {**UNREAD_RESULTS[name], **given.get(name, {})}
    return Results.from_json(merged)
