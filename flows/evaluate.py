"""The main job: evaluate one drafter checkpoint against a target on a prompt set.

    fetch ─────────────────────────┐
    references ─> features ────────┴─> drafts ─> scores ─> diagnostics (on demand)

Every stage keeps its output in the store under a content key (tasks/stage.py): for a new
checkpoint of the same drafter run only fetch, drafts and scores do any work; references and
features show as `Cached`. The flow's parameters are the checkpoint (`drafter`), the settings by group
(`inputs`, `generation`, `serving`, ...: flows/settings.py declares each setting once) and the stages to run
(`until`, `refresh`). They are checked once, before any stage runs (flows/checks.py), so bad input leaves the
store untouched; the flow only wires the stage tasks with the checked evaluation, and flows/results.py
assembles what they returned.

With a baseline (`inputs.baseline`, e.g. the published drafter for the same target) that drafter is scored alongside
(cached after its first run) and shows as its own row in `dflash-eval history` and the report.
After scoring the flow rewrites the store's report and publishes Prefect artifacts under keys
stable per target and prompt set (reporting/artifacts.py).

A checkpoint from a training run whose log is found (its run folder, or `training.training_log`) is set beside
what the trainer logged, with the train/eval alarm's flags, and its tau written into the run's
TensorBoard (reporting/training_side.py, reporting/tracker.py); a missing or damaged log is a warning only.

With `compute.dask_address` the features and drafts stages compute on the workers of that Dask cluster, shard by
shard (tasks/cluster.py); the scheduler is asked before any stage runs, and the results say which worker
computed each shard.
"""

import inspect
from pathlib import Path

from prefect import Flow, flow, get_client, get_run_logger
from prefect.runtime import flow_run
from prefect.states import Completed

from dflash_core.checkpoint_files import step_from_name
from dflash_eval.reporting.artifacts import add_history, publish
from dflash_eval.reporting.history import find_group, history, series_key, source_name
from dflash_eval.reporting.results import Results
from dflash_eval.reporting.sections import Training
from dflash_eval.reporting.tracker import track
from dflash_eval.reporting.training_side import side_of
from dflash_eval.storage import Store
from dflash_eval.storage.feature_store import TARGET_PROBS
from dflash_eval.tasks.baselines import mark_baseline
from dflash_eval.tasks.diagnostics import diagnose, layers_needed
from dflash_eval.tasks.drafts import draft
from dflash_eval.tasks.features import extract_target_features
from dflash_eval.tasks.fetch import CheckpointError, fetch_checkpoint, source_step
from dflash_eval.tasks.heavy import heavy_stages_at_once
from dflash_eval.tasks.references import generate_references
from dflash_eval.tasks.scores import score
from dflash_eval.tasks.stage import refusals_fail_cleanly
from dflash_eval.tasks.target import AUTO
from dflash_eval.tasks.threads import leases_threads

from .checks import CheckedEvaluation, InputError, check_evaluation, prompt_choice
from .results import StageRuns, evaluation_results, outcome
from .settings import GROUPS, STAGES, Evaluation


def evaluate(checked: CheckedEvaluation):
    """Run the stages of one checked evaluation in order, each a Prefect task that computes only what the
    store lacks; once scored, publish the results and return them in a Completed state whose message is tau."""
    e = checked.evaluation
    inputs, generation, scoring = e.inputs, e.generation, e.scoring
    checkpoints, compute, training = e.checkpoints, e.compute, e.training
    _name_and_tag(run_name(e.drafter, e.until, e.refresh, checked.served.label),
                  run_tags(checked.target_name, inputs.prompt_set, source_step(e.drafter), e.until, e.refresh)
                  + checked.served.tags())
    _log_dtype(checked)
    store, target, refresh, runs = checked.store_location, inputs.target, checked.refresh, StageRuns()
    on_device = {"dtype": checked.dtype.name, "device": compute.device}
    waits = {"relay_token_file": checkpoints.relay_token_file, "wait_seconds": checkpoints.checkpoint_wait,
             "settle_seconds": checkpoints.settle_seconds}
    replays = {"sliding_semantics": scoring.sliding_semantics, "all_positions": scoring.all_positions,
               "replay_group": compute.replay_group, "dask_address": compute.dask_address,
               "draft_sampling": checked.served.draft_sampling, **on_device}
    threshold = {"confidence_threshold": checked.served.confidence_threshold}
    checkpoint = baseline = refs = features = drafts = scores = None
    if checked.runs("fetch"):
        checkpoint = runs.add("fetch", fetch_checkpoint(
            e.drafter, store, target, drafter_config=checkpoints.drafter_config, include=checkpoints.include,
            refresh="fetch" in refresh, return_state=True, **waits))
    if inputs.baseline is not None and checked.runs("scores"):
        baseline = runs.add("baseline fetch", fetch_checkpoint(  # a finished checkpoint: taken as it is (checks.py)
            inputs.baseline, store, target, refresh="fetch" in refresh, return_state=True,
            **{**waits, "wait_seconds": 0, "settle_seconds": 0}))
        mark_baseline(baseline, store)
    if checked.runs("references"):
        refs = runs.add("references", generate_references(
            target, prompt_choice(inputs), inputs.max_new_tokens, store, reference=generation.reference,
            lookahead=checked.drafter.verified_tokens(checked.drafter.block_size) - 1 if generation.lookahead else 0,
            concurrency=generation.concurrency, reference_api_key_file=generation.reference_api_key_file,
            sampling=checked.served.sampling, samples=checked.served.samples, seed=checked.served.seed,
            given=inputs.references, target_name=checked.target_name, attention=checked.attention,
            refresh="references" in refresh, return_state=True, **on_device))
    if checked.runs("features"):
        features = runs.add("features", extract_target_features(
            target, refs, feature_layers(checked, checkpoint, baseline), store, dask_address=compute.dask_address,
            attention=checked.attention, refresh="features" in refresh, return_state=True, **on_device))
    if checked.runs("drafts"):
        drafts = runs.add("drafts", draft(checkpoint, features, refs, target, store, refresh="drafts" in refresh,
                                          block=checked.block, return_state=True, **replays, **threshold))
    if checked.runs("scores"):
        scores = runs.add("scores", score(drafts, refs, store, refresh="scores" in refresh, return_state=True))
    for b, block in checked.block_sweep if checked.runs("scores") else ():
        swept = runs.add(f"drafts b{b}", draft(checkpoint, features, refs, target, store, refresh="drafts" in refresh,
                                               block=block, return_state=True, **replays, **threshold))
        runs.add(f"scores b{b}", score(swept, refs, store, refresh="scores" in refresh, return_state=True))
    for t in checked.threshold_sweep if checked.runs("scores") else ():
        swept = runs.add(f"drafts t{t:g}", draft(checkpoint, features, refs, target, store, block=checked.block,
                                                 refresh="drafts" in refresh, confidence_threshold=t,
                                                 return_state=True, **replays))
        runs.add(f"scores t{t:g}", score(swept, refs, store, refresh="scores" in refresh, return_state=True))
    if baseline is not None:
        # (a baseline without a confidence head is served verifying every draft)
        baseline_threshold = threshold if checked.baseline and checked.baseline.generation.schedules_verification(
            checked.baseline) else {}
        baseline_drafts = runs.add("baseline drafts", draft(baseline, features, refs, target, store,
                                                            refresh="drafts" in refresh,
                                                            block=checked.baseline_block,
                                                            return_state=True, **replays, **baseline_threshold))
        runs.add("baseline scores", score(baseline_drafts, refs, store, refresh="scores" in refresh,
                                          return_state=True))
    if checked.runs("diagnostics"):
        runs.add("diagnostics", diagnose(checkpoint, features, refs, drafts, scores, target, store,
                                         refresh="diagnostics" in refresh, return_state=True, **on_device))
    results = evaluation_results(checked, runs)
    if not checked.runs("scores"):
        return results
    opened = Store(store)
    groups = history(opened)
    found_row = find_group(groups, results["keys"]["scores"])
    results.series = ({"key": found_row[0].series, "title": found_row[0].title} if found_row is not None else
                      {"key": series_key(opened, results["keys"]["features"], results["sliding_semantics"],
                                         checked.served.block_size, results.get("draft_sampling"),
                                         checked.target_name, inputs.prompt_set,
                                         confidence_threshold=checked.served.confidence_threshold),
                       "title": None})
    sides: dict[int, list] = {}
    if found_row is not None and found_row[1].step is not None:
        trained, sides = track(groups, found_row[1].source, training.training_log, training.tensorboard,
                               training.divergence_window, training.mlflow)
        results.add(Training(trained))
        for problem in trained["problems"]:
            get_run_logger().warning(problem)
    # what the series' history says of this checkpoint: the paired comparisons, what the alarm checked
    side = side_of(sides.get(groups.index(found_row[0]), ()), found_row[1]) if found_row is not None else None
    add_history(results, found_row, side)
    report_dir = e.output.report_dir
    publish(results, opened, Path(report_dir) if report_dir else opened.root / "report", groups=groups,
            training=sides, step_costs=checked.step_costs)
    # the runs list shows tags, not state messages; filtered by `series:` it lists only taus that compare
    _name_and_tag(None, [f"series:{results['series']['key']}", f"tau:{results['tau_macro']:.3f}"])
    found = outcome(results)
    get_run_logger().info(found)
    return Completed(message=found, data=results)


def feature_layers(checked: CheckedEvaluation, checkpoint, baseline) -> tuple[int, ...]:
    """The target layers one pass of the features stage extracts: every layer this evaluation reads (the
    fetched drafter's, the baseline's, and the diagnostics' shifted layers)."""
    own = checkpoint.config.target_layer_ids if checkpoint else checked.drafter.target_layer_ids
    wanted = set(own)
    if checked.runs("diagnostics"):
        wanted |= set(layers_needed(own, checked.num_target_layers))
    if baseline is not None:
        wanted |= set(baseline.config.target_layer_ids)
    if checked.served.draft_sampling is not None:  # sampled drafts' acceptance needs the target's probabilities
        wanted.add(TARGET_PROBS)
    return tuple(sorted(wanted))


def _log_dtype(checked: CheckedEvaluation) -> None:
    if checked.dtype.note:
        get_run_logger().warning(f"--dtype {checked.dtype.requested}: {checked.dtype.note}")
    elif checked.dtype.requested == AUTO:
        get_run_logger().info(f"--dtype auto: {checked.dtype.name}, the target checkpoint's own")


# The evaluate-checkpoint flow's parameters, in the order its deployment form shows them: the checkpoint, the
# settings by group, the stages (flows/settings.py declares them all).
PARAMETERS = ("drafter", *GROUPS, "until", "refresh")


def _signature(leave_out: tuple[str, ...] = ()) -> inspect.Signature:
    """The flow function's signature, made from the declaration: what Prefect builds the parameters' schema (the
    deployment form) from, and binds a run's parameters to."""
    fields = Evaluation.model_fields
    return inspect.Signature([
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=fields[name].annotation,
                          default=inspect.Parameter.empty if fields[name].is_required() else fields[name].get_default())
        for name in PARAMETERS if name not in leave_out])


def _docstring(first_line: str, leave_out: tuple[str, ...] = ()) -> str:
    """The flow function's docstring: Prefect shows each parameter's line of its Args beside its section of the
    form (the settings' own help shows beside each setting)."""
    fields = Evaluation.model_fields
    lines = [f"{name}: {' '.join((GROUPS[name].__doc__ or '').split()) if name in GROUPS else fields[name].description}"
             for name in PARAMETERS if name not in leave_out]
    return first_line + "\n\nArgs:\n" + "\n".join(f"    {line}" for line in lines) + "\n"


def evaluation_flow(checked: CheckedEvaluation | None = None, until: str | None = None,
                    refresh: str | None = None) -> Flow[..., Results]:
    """The evaluate-checkpoint flow. `checked`: the evaluation the command line checked before Prefect started,
    which a run of this flow takes instead of checking its parameters again (they must be those parameters).
    `until`, `refresh`: the flow of deployment `rerun-<refresh>`, which recomputes that stage of one checkpoint
    and then scores it (`until`); its parameters are evaluate_checkpoint's without `until` and `refresh`, so
    the deployment's form cannot turn a stage rerun into something else."""
    fixed = {} if refresh is None else {"until": until, "refresh": [refresh]}

    def evaluate_checkpoint(**parameters) -> Results:
        return evaluate(checked or check_evaluation({**parameters, **fixed}))

    name = "evaluate_checkpoint" if refresh is None else f"rerun_{refresh}"
    # the entrypoint Prefect records for deployments (module:qualname) names this module's flow objects
    evaluate_checkpoint.__name__ = evaluate_checkpoint.__qualname__ = name
    evaluate_checkpoint.__signature__ = _signature(tuple(fixed))  # type: ignore[attr-defined]
    evaluate_checkpoint.__doc__ = _docstring(
        "Score a drafter checkpoint: tau (macro and pooled), histogram, per-prompt acceptance lengths; returns the "
        "results record (what `dflash-eval run --out` writes)." if refresh is None else
        f"Recompute the {refresh} stage of one checkpoint (give `drafter`), then score it.", tuple(fixed))

    def name_run() -> str:
        if checked is not None:
            e = checked.evaluation
            return run_name(e.drafter, e.until, e.refresh, checked.served.label)
        parameters = {**flow_run.parameters, **fixed}  # the served setting is added once checked (_name_and_tag)
        return run_name(str(parameters.get("drafter", "")), parameters.get("until") or "scores",
                        parameters.get("refresh"))

    # the same flow name for stage reruns: their deployments are evaluate-checkpoint/rerun-<stage>; the parameters
    # are checked by check_evaluation, which names what is wrong as the user gave it
    as_flow = flow(name="evaluate-checkpoint", flow_run_name=name_run, persist_result=False, validate_parameters=False)
    return as_flow(refusals_fail_cleanly(InputError, CheckpointError)(
        leases_threads(heavy_stages_at_once, invalid=InputError)(evaluate_checkpoint)))


def run_name(drafter: str, until: str = "scores", refresh=None, served: str = "greedy") -> str:
    """A flow run's name: the checkpoint's run folder and name (`run1/step_400`), with ` step <N>` when its name
    does not end in its step already (`run1/epoch_2`), then `rerun <stage>` for refreshed stages, `with
    diagnostics` for a full evaluation that adds them, or `stage <stage>` for one stage asked for, so a full
    evaluation, a stage rerun by hand and one from the UI read differently in the runs list; then how the target
    is served, unless greedy at the drafter's own block size (`[T=0.6 top-k 20, 8 samples per prompt, seed 0]`)."""
    name = source_name(str(drafter)) or str(drafter)
    step = source_step(drafter)
    if step is not None and step_from_name(name) != step:
        name += f" step {step}"
    if refresh:
        name += f" rerun {', '.join(s for s in STAGES if s in set(refresh))}"
    elif until == "diagnostics":
        name += " with diagnostics"
    elif until != "scores":
        name += f" stage {until}"
    return name if served == "greedy" else f"{name} [{served}]"


def run_tags(target_name: str, prompts: str, step: int | None, until: str = "scores", refresh=None) -> list[str]:
    """The tags a flow run gets when it starts: its target's name, prompt set and step, and `stage-rerun` unless it
    is a full evaluation (`series:<key>` and `tau:<tau macro>` are added once it is scored: reporting.history's
    series_key, which only the store's entries decide; how it is served: dflash_core.sampling.Served.tags)."""
    tags = [f"target:{target_name}", f"prompts:{Path(str(prompts)).stem}"]
    if step is not None:
        tags.append(f"step:{step}")
    if refresh or until != "scores":
        tags.append("stage-rerun")
    return tags


def _name_and_tag(name: str | None, tags: list[str]) -> None:
    """Rename this flow run (a run a deployment started was named before its settings were checked) and add tags
    (Prefect fixes a run's tags at its creation; the API can add more)."""
    if flow_run.id is None:
        return
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(flow_run.id)
        client.update_flow_run(flow_run.id, name=name if name and name != run.name else None,
                               tags=[*run.tags, *(t for t in tags if t not in run.tags)])


evaluate_checkpoint = evaluation_flow()
RERUN_FLOWS = {stage: evaluation_flow(until="diagnostics" if stage == "diagnostics" else "scores", refresh=stage)
               for stage in STAGES}
# entrypoints of prefect.yaml's rerun-<stage> deployments
rerun_fetch, rerun_references, rerun_features, rerun_drafts, rerun_scores, rerun_diagnostics = RERUN_FLOWS.values()
