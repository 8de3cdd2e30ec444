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
