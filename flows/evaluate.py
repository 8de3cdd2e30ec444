"""The main job: evaluate one drafter checkpoint against a target on a prompt set.

    fetch ─────────────────────────┐
    references ─> features ────────┴─> drafts ─> scores ─> diagnostics (on demand)

Every stage keeps its output in the store under a content key (tasks/stage.py): for a new
checkpoint of the same drafter run only fetch, drafts and scores do any work; references and
features show as `Cached`. Inputs are checked once, before any stage runs (flows/checks.py), so bad
input leaves the store untouched; the flow only wires the stage tasks with the checked inputs, and
flows/results.py assembles what they returned.

With `baseline` (e.g. the published drafter for the same target) that drafter is scored alongside
(cached after its first run) and shows as its own row in `dflash-eval history` and the report.
After scoring the flow rewrites the store's report and publishes Prefect artifacts under keys
stable per target and prompt set (reporting/artifacts.py).

A checkpoint from a training run whose log is found (its run folder, or `training_log`) is set beside
what the trainer logged, with the train/eval alarm's flags, and its tau written into the run's
TensorBoard (reporting/training_side.py, reporting/tracker.py); a missing or damaged log is a warning only.

With `dask_address` the features and drafts stages compute on the workers of that Dask cluster, shard by
shard (tasks/cluster.py); the scheduler is asked before any stage runs, and the results say which worker
computed each shard.
"""

import inspect
from pathlib import Path
from typing import Literal

from prefect import Flow, flow, get_client, get_run_logger
from prefect.runtime import flow_run
from prefect.states import Completed

from dflash_core.checkpoint_files import step_from_name
from dflash_core.choices import DEFAULT_REPLAY_GROUP, SLIDING_SEMANTICS
from dflash_eval.flows.checks import EvaluationInputs, InputError, check_evaluation
from dflash_eval.flows.choices import STAGES, DeviceName, StageName
from dflash_eval.flows.results import StageRuns, evaluation_results, outcome
from dflash_eval.reporting.artifacts import publish
from dflash_eval.reporting.history import find_group, history, series_key, source_name
from dflash_eval.reporting.tracker import track
from dflash_eval.reporting.training_side import DEFAULT_WINDOW
from dflash_eval.storage import Store
from dflash_eval.tasks.baselines import mark_baseline
from dflash_eval.tasks.diagnostics import diagnose, layers_needed
from dflash_eval.tasks.drafts import draft
from dflash_eval.tasks.features import extract_target_features
from dflash_eval.tasks.fetch import (
    DEFAULT_WAIT_SECONDS,
    CheckpointError,
    fetch_checkpoint,
    source_step,
)
from dflash_eval.tasks.heavy import heavy_stages_at_once
from dflash_eval.tasks.references import generate_references
from dflash_eval.tasks.scores import score
from dflash_eval.tasks.stage import refusals_fail_cleanly
from dflash_eval.tasks.target import AUTO, DTYPE_CHOICES
from dflash_eval.tasks.threads import leases_threads

# The parameter types the deployment forms show as dropdowns (Prefect turns Literal into a JSON-schema enum);
# StageName and DeviceName: flows/choices.py.
DtypeName = Literal[DTYPE_CHOICES]  # type: ignore[valid-type]
SlidingSemantics = Literal[SLIDING_SEMANTICS]  # type: ignore[valid-type]


def evaluate(inputs: EvaluationInputs):
    """Run the stages of one checked evaluation in order, each a Prefect task that computes only what the
    store lacks; once scored, publish the results and return them in a Completed state whose message is tau."""
    _add_tags(run_tags(inputs.target_name, inputs.prompts, source_step(inputs.drafter), inputs.stages[-1], inputs.refresh)
              + served_tags(inputs))
    _log_dtype(inputs)
    store, target, refresh, runs = inputs.store_location, inputs.target, inputs.refresh, StageRuns()
    on_device = {"dtype": inputs.dtype.name, "device": inputs.device}
    waits = {"relay_token_file": inputs.relay_token_file, "wait_seconds": inputs.checkpoint_wait,
             "settle_seconds": inputs.settle_seconds}
    replays = {"sliding_semantics": inputs.sliding_semantics, "all_positions": inputs.all_positions,
               "replay_group": inputs.replay_group, "dask_address": inputs.dask_address,
               "block_size": inputs.block_size, **on_device}
    checkpoint = baseline = refs = features = drafts = scores = None
    if inputs.runs("fetch"):
        checkpoint = runs.add("fetch", fetch_checkpoint(
            inputs.drafter, store, target, drafter_config=inputs.drafter_config, include=inputs.include,
            refresh="fetch" in refresh, return_state=True, **waits))
    if inputs.baseline is not None and inputs.runs("scores"):
        baseline = runs.add("baseline fetch", fetch_checkpoint(
            inputs.baseline, store, target, refresh="fetch" in refresh, return_state=True, **waits))
        mark_baseline(baseline, store)
    if inputs.runs("references"):
        refs = runs.add("references", generate_references(
            target, inputs.prompts, inputs.max_new_tokens, store, reference=inputs.reference,
            lookahead=inputs.checked.drafter.block_size - 1 if inputs.lookahead else 0, thinking=inputs.thinking,
            concurrency=inputs.concurrency, reference_api_key_file=inputs.reference_api_key_file,
            sampling=inputs.checked.sampling, samples=inputs.samples, seed=inputs.seed, given=inputs.references,
            target_name=inputs.target_name, refresh="references" in refresh, return_state=True, **on_device))
    if inputs.runs("features"):
        features = runs.add("features", extract_target_features(
            target, refs, feature_layers(inputs, checkpoint, baseline), store, dask_address=inputs.dask_address,
            refresh="features" in refresh, return_state=True, **on_device))
    if inputs.runs("drafts"):
        drafts = runs.add("drafts", draft(checkpoint, features, refs, target, store, refresh="drafts" in refresh,
                                          return_state=True, **replays))
    if inputs.runs("scores"):
        scores = runs.add("scores", score(drafts, refs, store, refresh="scores" in refresh, return_state=True))
    for b in inputs.block_sizes if inputs.runs("scores") else ():
        swept = runs.add(f"drafts b{b}", draft(checkpoint, features, refs, target, store, refresh="drafts" in refresh,
                                               return_state=True, **{**replays, "block_size": b}))
        runs.add(f"scores b{b}", score(swept, refs, store, refresh="scores" in refresh, return_state=True))
    if baseline is not None:
        baseline_drafts = runs.add("baseline drafts", draft(baseline, features, refs, target, store,
                                                            refresh="drafts" in refresh, return_state=True, **replays))
        runs.add("baseline scores", score(baseline_drafts, refs, store, refresh="scores" in refresh,
                                          return_state=True))
    if inputs.runs("diagnostics"):
        runs.add("diagnostics", diagnose(checkpoint, features, refs, drafts, scores, target, store,
                                         refresh="diagnostics" in refresh, return_state=True, **on_device))
    results = evaluation_results(inputs, runs)
    if not inputs.runs("scores"):
        return results
    opened = Store(store)
    groups = history(opened)
    found_row = find_group(groups, results["keys"]["scores"])
    results["series"] = ({"key": found_row[0].series, "title": found_row[0].title} if found_row is not None else
                         {"key": series_key(opened, results["keys"]["features"], results["sliding_semantics"],
                                            inputs.block_size, inputs.target_name, inputs.prompts), "title": None})
    training = {}
    if found_row is not None and found_row[1].step is not None:
        results["training"], training = track(groups, found_row[1].source, inputs.training_log, inputs.tensorboard,
                                           inputs.divergence_window, inputs.mlflow)
        for problem in results["training"]["problems"]:
            get_run_logger().warning(problem)
    publish(results, opened, Path(inputs.report_dir) if inputs.report_dir else opened.root / "report",
            groups=groups, training=training, step_costs=inputs.checked.step_costs)
    # the runs list shows tags, not state messages; filtered by `series:` it lists only taus that compare
    _add_tags([f"series:{results['series']['key']}", f"tau:{results['tau_macro']:.3f}"])
    found = outcome(results)
    get_run_logger().info(found)
    return Completed(message=found, data=results)


def feature_layers(inputs: EvaluationInputs, checkpoint, baseline) -> tuple[int, ...]:
    """The target layers one pass of the features stage extracts: every layer this evaluation reads (the
    fetched drafter's, the baseline's, and the diagnostics' shifted layers)."""
    own = checkpoint.config.target_layer_ids if checkpoint else inputs.checked.drafter.target_layer_ids
    wanted = set(own)
    if inputs.runs("diagnostics"):
        wanted |= set(layers_needed(own, inputs.checked.num_target_layers))
    if baseline is not None:
        wanted |= set(baseline.config.target_layer_ids)
    return tuple(sorted(wanted))


def _log_dtype(inputs: EvaluationInputs) -> None:
    if inputs.dtype.note:
        get_run_logger().warning(f"--dtype {inputs.dtype.requested}: {inputs.dtype.note}")
    elif inputs.dtype.requested == AUTO:
        get_run_logger().info(f"--dtype auto: {inputs.dtype.name}, the target checkpoint's own")


def evaluation_flow(checked: EvaluationInputs | None = None, until: str | None = None,
                    refresh: str | None = None) -> Flow:
    """The evaluate-checkpoint flow. `checked`: the inputs the command line checked before Prefect started,
    which a run of this flow takes instead of checking its parameters again (they must be those parameters).
    `until`, `refresh`: the flow of deployment `rerun-<refresh>`, which recomputes that stage of one checkpoint
    and then scores it (`until`); its parameters are evaluate_checkpoint's without `until` and `refresh`, so
    the deployment's form cannot turn a stage rerun into something else."""

    def evaluate_checkpoint(
        target: str,
        drafter: str,
        prompts: str,
        max_new_tokens: int = 256,
        store: str | None = None,
        dtype: DtypeName = AUTO,
        device: DeviceName = "cpu",
        sliding_semantics: SlidingSemantics = "causal",
        thinking: bool = False,
        reference: str = "local",
        lookahead: bool = False,
        concurrency: int = 8,
        relay_token_file: str | None = None,
        until: StageName = "scores",
        refresh: list[StageName] | None = None,
        baseline: str | None = None,
        report_dir: str | None = None,
        all_positions: bool = False,
        reference_api_key_file: str | None = None,
        drafter_config: str | None = None,
        include: list[str] | None = None,
        checkpoint_wait: float = DEFAULT_WAIT_SECONDS,
        settle_seconds: float | None = None,
        threads: int | None = None,
        replay_group: int = DEFAULT_REPLAY_GROUP,
        dask_address: str | None = None,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        min_p: float = 0.0,
        samples: int = 1,
        seed: int = 0,
        block_size: int | None = None,
        references: str | None = None,
        block_sizes: list[int] | None = None,
        step_cost: str | None = None,
        training_log: str | None = None,
        tensorboard: str | None = None,
        mlflow: str | None = None,
        divergence_window: int = DEFAULT_WINDOW,
        target_name: str | None = None,
    ) -> dict:
        """Score a drafter checkpoint: tau (macro and pooled), histogram, per-prompt acceptance lengths.

        Returns the results record (also what `dflash-eval run --out` writes); the flow run's state message
        holds tau, its interval, pooled tau and the step.

        Args:
            target: The target model's folder (a Hugging Face checkpoint) on this machine.
            drafter: The checkpoint to score: a folder (HF export or SpecForge save) or a relay URL
                (http://relay:8700/run1/step_1000).
            prompts: A JSONL file of prompts on this machine, or a shipped suite (math, code, chat, multiturn).
            max_new_tokens: Tokens generated per prompt (and sample) for the references.
            store: The store's folder or s3://BUCKET/PREFIX (default $DFLASH_STORE, else ./.dflash-store).
            dtype: auto (the target checkpoint's own; float16 ones compute in float32), float32 or bfloat16;
                resolved once before any stage (the results record the resolved name).
            device: cpu or cuda (choose a GPU with CUDA_VISIBLE_DEVICES).
            sliding_semantics: Sliding drafter layers: causal (training, serving) or non_causal (earlier z-lab
                reference); a drafter config's is_causal overrides it.
            thinking: enable_thinking in the target's chat template.
            reference: Where references come from: local (the target here), sglang+http://HOST:PORT or
                openai+http://HOST:PORT/v1.
            lookahead: Keep B-1 greedy tokens past each completion, so its last step is scored against a whole
                block.
            concurrency: Requests in flight to a reference server.
            relay_token_file: A file holding the relay's token.
            until: Run only this stage and what it depends on (diagnostics adds them to a full run).
            refresh: Stages to recompute even if they are in the store.
            baseline: Another drafter (e.g. the published one) scored alongside, as its own row.
            report_dir: Where the report is rewritten (default <store>/report).
            all_positions: Also score a block at every position (all_positions_tau in the results).
            reference_api_key_file: A file holding the reference server's API key (else
                $DFLASH_REFERENCE_API_KEY; the key itself is never a parameter).
            drafter_config: The drafter's config.json, for checkpoints saved without one (SpecForge's run-stepN
                folders) whose run folder holds none either.
            include: More checkpoint files to fetch (fnmatch patterns); the drafter's own files always travel.
            checkpoint_wait: Seconds to wait for a checkpoint that is absent or still being written.
            settle_seconds: How long a folder must be untouched to count as finished (default
                $DFLASH_SETTLE_SECONDS, else 30).
            threads: CPU threads this run computes with (empty: the process's budget, else this machine's
                cores / the heavy stages allowed at once on it).
            replay_group: Prompts the drafts stage replays together (part of the drafts key unless 64); on a
                Dask cluster, one shard each.
            dask_address: A Dask scheduler (tcp://HOST:PORT) whose workers compute the features and drafts
                stages, shard by shard (empty: this process). The workers need this package, the store and the
                target at the same path.
            temperature: The temperature the target is served at: 0 (greedy references), or above 0 (`samples`
                sampled references per prompt; the replay over each gives the acceptance of the online loop
                that emitted it, so tau is their mean).
            top_k: Keep the top_k most likely tokens (0: off); SGLang's order: temperature, top-k, top-p, min-p.
            top_p: Keep the most likely tokens holding this much mass, in (0, 1] (1: off).
            min_p: Drop tokens below this fraction of the most likely one's probability (0: off).
            samples: Sampled completions per prompt (1 when greedy).
            seed: Seed of the sampled completions (each request's follows from it, the prompt and the sample).
            block_size: Tokens verified per step, 2 .. the drafter's block size (SGLang's
                --speculative-num-draft-tokens); the drafter drafts blocks of this size (empty: its own).
            references: A completions file on this machine (e.g. a server's logged outputs; see
                dflash_core.prompts.read_completions) stored as the references instead of generating them;
                `prompts` then only names the series.
            block_sizes: Also draft and score at each of these block sizes (one drafts entry each, sharing the
                features): tau(b), tau(b)/b and, with `step_cost`, the projected speedup per b.
            step_cost: A JSON file {"<b>": cost of one speculative step verifying b tokens relative to one plain
                decode step}, measured on the serving box: the projected speedup tau(b) / cost(b).
            training_log: The training run's folder on this machine, for checkpoints from a relay (a local
                checkpoint's run folder is found by itself): the trainer's logged numbers beside tau, and the
                alarm when training and evaluation disagree (reporting/training_side.py).
            tensorboard: The TensorBoard run tau by training step is written into (default
                <training run>/runs/dflash-eval when that folder is on this machine and writable).
            mlflow: An MLflow tracking URI (http://HOST:PORT, file:DIR) to write the same into, an MLflow run of
                ours per training run in experiment dflash-eval (empty: none).
            divergence_window: Saves the diverging alarm fits its slopes over (at least 3).
            target_name: How series titles and tags call the target (default: the Hub id in its config or cache path,
                else its folder's name); recorded with its references the first time they are made.
        """
        return evaluate(checked or check_evaluation(locals()))

    # the entrypoint Prefect records for deployments (module:qualname) names this module's flow objects
    evaluate_checkpoint.__qualname__ = evaluate_checkpoint.__name__
    fn, name_runs = evaluate_checkpoint, _run_name
    if refresh is not None:
        def rerun(**parameters):
            return evaluate_checkpoint(**parameters, until=until, refresh=[refresh])

        signature = inspect.signature(evaluate_checkpoint)
        rerun.__signature__ = signature.replace(parameters=[  # type: ignore[attr-defined]
            p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in signature.parameters.values()
            if p.name not in ("until", "refresh")])
        docstring = evaluate_checkpoint.__doc__ or ""
        rerun.__doc__ = (f"Recompute the {refresh} stage of one checkpoint (give `drafter`), then score it."
                         + docstring[docstring.index("\n"):])
        rerun.__name__ = rerun.__qualname__ = f"rerun_{refresh}"
        fn, name_runs = rerun, lambda: run_name(flow_run.parameters.get("drafter", ""), until, [refresh])
    # the same flow name for stage reruns: their deployments are evaluate-checkpoint/rerun-<stage>
    return flow(refusals_fail_cleanly(InputError, CheckpointError)(leases_threads(heavy_stages_at_once,
                                                                                  invalid=InputError)(fn)),
                name="evaluate-checkpoint", flow_run_name=name_runs, persist_result=False)


def run_name(drafter: str, until: str = "scores", refresh=None) -> str:
    """A flow run's name: the checkpoint's run folder and name (`run1/step_400`), with ` step <N>` when its name
    does not end in its step already (`run1/epoch_2`), then `rerun <stage>` for refreshed stages, `with
    diagnostics` for a full evaluation that adds them, or `stage <stage>` for one stage asked for, so a full
    evaluation, a stage rerun by hand and one from the UI read differently in the runs list."""
    name = source_name(str(drafter)) or str(drafter)
    step = source_step(drafter)
    if step is not None and step_from_name(name) != step:
        name += f" step {step}"
    if refresh:
        return f"{name} rerun {', '.join(s for s in STAGES if s in set(refresh))}"
    if until == "diagnostics":
        return f"{name} with diagnostics"
    return name if until == "scores" else f"{name} stage {until}"


def run_tags(target_name: str, prompts: str, step: int | None, until: str = "scores", refresh=None) -> list[str]:
    """The tags a flow run gets when it starts: its target's name, prompt set and step, and `stage-rerun` unless it
    is a full evaluation (`series:<key>` and `tau:<tau macro>` are added once it is scored: reporting.history's
    series_key, which only the store's entries decide)."""
    tags = [f"target:{target_name}", f"prompts:{Path(str(prompts)).stem}"]
    if step is not None:
        tags.append(f"step:{step}")
    if refresh or until != "scores":
        tags.append("stage-rerun")
    return tags


def served_tags(inputs: EvaluationInputs) -> list[str]:
    """Tags naming how the run is served, when not greedy at the drafter's own block size (the run name says it
    too): `sampling:<settings>`, `samples:<N>`, `block-size:<b>`."""
    tags = []
    if not inputs.checked.sampling.greedy:
        tags += [f"sampling:{inputs.checked.sampling.describe()}", f"samples:{inputs.samples}"]
    if inputs.block_size is not None:
        tags.append(f"block-size:{inputs.block_size}")
    return tags


def served_as(parameters: dict) -> str:
    """What a run name adds for how it is served: "" (greedy, the drafter's block size), else e.g.
    " T=0.6 x8" (8 samples per prompt) and " b4" (blocks of 4)."""
    name = ""
    if parameters.get("temperature"):
        name += f" T={parameters['temperature']:g} x{parameters.get('samples', 1)}"
    if parameters.get("block_size"):
        name += f" b{parameters['block_size']}"
    return name


def _run_name() -> str:
    parameters = flow_run.parameters
    return (run_name(parameters.get("drafter", ""), parameters.get("until", "scores"), parameters.get("refresh"))
            + served_as(parameters))


def _add_tags(tags: list[str]) -> None:
    """Add tags to this flow run (Prefect fixes a run's tags at its creation; the API can add more)."""
    if flow_run.id is None:
        return
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(flow_run.id)
        client.update_flow_run(flow_run.id, tags=[*run.tags, *(t for t in tags if t not in run.tags)])


evaluate_checkpoint = evaluation_flow()
RERUN_FLOWS = {stage: evaluation_flow(until="diagnostics" if stage == "diagnostics" else "scores", refresh=stage)
               for stage in STAGES}
# entrypoints of prefect.yaml's rerun-<stage> deployments
rerun_fetch, rerun_references, rerun_features, rerun_drafts, rerun_scores, rerun_diagnostics = RERUN_FLOWS.values()
