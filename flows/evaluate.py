"""The main job: evaluate one drafter checkpoint against a target on a prompt set.

    fetch ─────────────────────────┐
    references ─> features ────────┴─> drafts ─> scores ─> diagnostics (on demand)

Every stage keeps its output in the store under a content key (tasks/stage.py): for a new
checkpoint of the same drafter run only fetch, drafts and scores do any work; references and
features show as `Cached`. Inputs are checked once, before any stage runs (flows/checks.py), so bad
input leaves the store untouched.

With `baseline` (e.g. the published drafter for the same target) that drafter is scored alongside
(cached after its first run) and shows as its own row in `dflash-eval history` and the report.
After scoring the flow rewrites the store's report and publishes Prefect artifacts under keys
stable per target and prompt set (flows/artifacts.py).

With `dask_address` the features and drafts stages compute on the workers of that Dask cluster, shard by
shard (tasks/cluster.py); the scheduler is asked before any stage runs, and the results say which worker
computed each shard.
"""

import inspect
from pathlib import Path
from typing import Literal

from prefect import flow, get_client, get_run_logger
from prefect.runtime import flow_run
from prefect.states import Completed

from dflash_core.choices import DEFAULT_REPLAY_GROUP
from dflash_core.drafter import SLIDING_SEMANTICS, read_drafter_config
from dflash_eval.flows.artifacts import publish
from dflash_eval.flows.checks import InputError, inputs_of_run
from dflash_eval.flows.choices import STAGES, DeviceName, StageName
from dflash_eval.storage import Store, read_json
from dflash_eval.tasks.baselines import mark_baseline
from dflash_eval.tasks.cluster import ClusterUnreachable, check_cluster
from dflash_eval.tasks.diagnostics import diagnose, layers_needed
from dflash_eval.tasks.drafts import draft
from dflash_eval.tasks.features import extract_target_features
from dflash_eval.tasks.fetch import DEFAULT_WAIT_SECONDS, CheckpointError, fetch_checkpoint, source_step
from dflash_eval.tasks.heavy import heavy_stages_at_once
from dflash_eval.tasks.references import generate_references
from dflash_eval.tasks.scores import score
from dflash_eval.tasks.stage import refusals_fail_cleanly
from dflash_eval.tasks.progress import series_key, stage_logger
from dflash_eval.tasks.target import AUTO, DTYPE_CHOICES, resolve_dtype, target_tokenizer
from dflash_eval.tasks.threads import leases_threads

# The parameter types the deployment forms show as dropdowns (Prefect turns Literal into a JSON-schema enum);
# StageName and DeviceName: flows/choices.py.
DtypeName = Literal[DTYPE_CHOICES]
SlidingSemantics = Literal[SLIDING_SEMANTICS]
# What each stage needs done first (a hand-run stage runs these too; they are usually cached).
DEPENDS_ON = {
    "fetch": (), "references": (), "features": ("references",),
    "drafts": ("fetch", "features"), "scores": ("drafts", "references"), "diagnostics": ("scores",),
}


def stages_to_run(until: str) -> list[str]:
    """`until` and every stage it depends on, in pipeline order."""
    needed, todo = set(), [until]
    while todo:
        stage = todo.pop()
        if stage not in needed:
            needed.add(stage)
            todo.extend(DEPENDS_ON[stage])
    return [s for s in STAGES if s in needed]


def run_name(drafter: str, until: str = "scores", refresh=None) -> str:
    """A flow run's name: `<checkpoint> step <N>` (the step when the checkpoint's name holds one), then
    `rerun <stage>` for refreshed stages or `stage <stage>` for one stage asked for, so a full evaluation, a
    stage rerun by hand and one from the UI read differently in the runs list."""
    name = Path(str(drafter).rstrip("/")).name or str(drafter)
    if (step := source_step(drafter)) is not None:
        name += f" step {step}"
    if refresh:
        return f"{name} rerun {', '.join(s for s in STAGES if s in set(refresh))}"
    return name if until == "scores" else f"{name} stage {until}"


def run_tags(target: str, prompts: str, step: int | None, until: str = "scores", refresh=None) -> list[str]:
    """The tags a flow run gets when it starts: its target, prompt set and step, and `stage-rerun` unless it is
    a full evaluation (`tau:<tau macro>` is added once it is scored)."""
    tags = [f"target:{Path(str(target).rstrip('/')).name}", f"prompts:{Path(str(prompts)).stem}",
            f"series:{series_key(target, prompts)}"]
    if step is not None:
        tags.append(f"step:{step}")
    if refresh or until != "scores":
        tags.append("stage-rerun")
    return tags


def _run_name() -> str:
    parameters = flow_run.parameters
    return run_name(parameters.get("drafter", ""), parameters.get("until", "scores"), parameters.get("refresh"))


def _add_tags(tags: list[str]) -> None:
    """Add tags to this flow run (Prefect fixes a run's tags at its creation; the API can add more)."""
    if flow_run.id is None:
        return
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(flow_run.id)
        client.update_flow_run(flow_run.id, tags=[*run.tags, *(t for t in tags if t not in run.tags)])


def check_dask_address(address: str | None) -> int | None:
    """Ask the Dask scheduler at `address` (None: no cluster) who it is, before any work: its workers now,
    or InputError naming the address and what to do when none answers (tasks/cluster.py: check_cluster)."""
    if not address:
        return None
    try:
        workers = check_cluster(address)
    except ClusterUnreachable as e:
        raise InputError(str(e)) from None
    if workers == 0:  # not an error: workers may join later, and the shards wait for them
        stage_logger().warning(f"--dask {address}: the scheduler has no workers yet; the features and drafts "
                               "stages wait for one to join")
    return workers


def outcome(results: dict) -> str:
    """One line with what an evaluation found: the final log line and the flow run's state message."""
    low, high = results["tau_macro_ci95"]
    step = results["drafter"]["step"]
    return (f"tau {results['tau_macro']:.3f} (95% CI {low:.2f}-{high:.2f}), pooled {results['tau_pooled']:.3f}, "
            + (f"step {step}" if step is not None else "no step"))


@flow(name="evaluate-checkpoint", flow_run_name=_run_name, persist_result=False)
@refusals_fail_cleanly(InputError, CheckpointError)
@leases_threads(heavy_stages_at_once, invalid=InputError)
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
) -> dict:
    """Score a drafter checkpoint: tau (macro and pooled), histogram, per-prompt acceptance lengths.

    Returns the results record (also what `dflash-eval run --out` writes); the flow run's state message
    holds tau, its interval, pooled tau and the step.

    Args:
        target: The target model's folder (a Hugging Face checkpoint) on this machine.
        drafter: The checkpoint to score: a folder (HF export or SpecForge save) or a relay URL
            (http://relay:8700/run1/step_1000).
        prompts: A JSONL file of prompts on this machine, or a shipped suite (math, code, chat, multiturn).
        max_new_tokens: Greedy tokens generated per prompt for the references.
        store: The store's folder (default $DFLASH_STORE, else ./.dflash-store).
        dtype: auto (the target checkpoint's own; float16 ones compute in float32), float32 or bfloat16;
            resolved once before any stage (the results record the resolved name).
        device: cpu or cuda (choose a GPU with CUDA_VISIBLE_DEVICES).
        sliding_semantics: Sliding drafter layers: causal (training, serving) or non_causal (earlier z-lab
            reference); a drafter config's is_causal overrides it.
        thinking: enable_thinking in the target's chat template.
        reference: Where greedy references come from: local (the target here), sglang+http://HOST:PORT or
            openai+http://HOST:PORT/v1.
        lookahead: Keep B-1 greedy tokens past each completion, so its last step is scored against a whole block.
        concurrency: Requests in flight to a reference server.
        relay_token_file: A file holding the relay's token.
        until: Run only this stage and what it depends on (diagnostics adds them to a full run).
        refresh: Stages to recompute even if they are in the store.
        baseline: Another drafter (e.g. the published one) scored alongside, as its own row.
        report_dir: Where the report is rewritten (default <store>/report).
        all_positions: Also score a block at every position (all_positions_tau in the results).
        reference_api_key_file: A file holding the reference server's API key (else $DFLASH_REFERENCE_API_KEY;
            the key itself is never a parameter).
        drafter_config: The drafter's config.json, for checkpoints saved without one (SpecForge's run-stepN
            folders) whose run folder holds none either.
        include: More checkpoint files to fetch (fnmatch patterns); the drafter's own files always travel.
        checkpoint_wait: Seconds to wait for a checkpoint that is absent or still being written.
        settle_seconds: How long a folder must be untouched to count as finished (default
            $DFLASH_SETTLE_SECONDS, else 30).
        threads: CPU threads this run computes with (empty: the process's budget, else this machine's cores /
            the heavy stages allowed at once on it).
        replay_group: Prompts the drafts stage replays together (part of the drafts key unless 64); on a
            Dask cluster, one shard each.
        dask_address: A Dask scheduler (tcp://HOST:PORT) whose workers compute the features and drafts
            stages, shard by shard (empty: this process). The workers need this package, the store and the
            target at the same path.
    """
    # a deployment's templated parameters arrive as "" when their variable is unset
    reference = reference or "local"
    drafter_config, reference_api_key_file = drafter_config or None, reference_api_key_file or None
    dask_address = dask_address or None
    if isinstance(replay_group, bool) or not isinstance(replay_group, int) or replay_group < 1:
        raise InputError(f"replay_group must be a whole number of at least 1, got {replay_group!r}")
    inputs = inputs_of_run(locals())  # the parameters, as normalised just above
    check_dask_address(dask_address)  # before any stage: a dead scheduler gets one message, nothing computed
    refresh = set(refresh or ())
    run = stages_to_run(until)
    _add_tags(run_tags(target, prompts, source_step(drafter), until, refresh))
    # once, before any stage computes a key: `auto` and the name it resolves to share the store's entries
    dtype_choice = resolve_dtype(dtype, target)
    dtype = dtype_choice.name
    if dtype_choice.note:
        get_run_logger().warning(f"--dtype {dtype_choice.requested}: {dtype_choice.note}")
    elif dtype_choice.requested == AUTO:
        get_run_logger().info(f"--dtype auto: {dtype}, the target checkpoint's own")
    opened = Store(store)
    root = opened.location  # what every task reopens the store from (a folder, or s3://...)
    states, outputs = {}, {}

    def step(stage, task_fn, *args, name=None, **kwargs):
        state = task_fn(*args, store_root=root, refresh=stage in refresh, return_state=True, **kwargs)
        states[name or stage] = state
        outputs[name or stage] = state.result()
        return outputs[name or stage]

    layer_ids = tuple(inputs.drafter.target_layer_ids)
    if "fetch" in run:
        checkpoint = step("fetch", fetch_checkpoint, drafter, relay_token_file=relay_token_file,
                          drafter_config=drafter_config, include=include, wait_seconds=checkpoint_wait,
                          settle_seconds=settle_seconds)
        # the fetched copy is what gets drafted: take its layer ids (the source may have changed since)
        layer_ids = tuple(read_drafter_config(checkpoint.path, tokenizer=target_tokenizer(target)).target_layer_ids)
    with_baseline = baseline is not None and "scores" in run
    if with_baseline:
        baseline_checkpoint = step("fetch", fetch_checkpoint, baseline, relay_token_file=relay_token_file,
                                   wait_seconds=checkpoint_wait, settle_seconds=settle_seconds, name="baseline fetch")
        mark_baseline(baseline_checkpoint, store_root=root)
        baseline_layer_ids = tuple(read_drafter_config(baseline_checkpoint.path,
                                                       tokenizer=target_tokenizer(target)).target_layer_ids)
    if "references" in run:
        refs = step("references", generate_references, target, prompts, max_new_tokens, reference=reference,
                    lookahead=inputs.drafter.block_size - 1 if lookahead else 0, dtype=dtype, device=device,
                    thinking=thinking, concurrency=concurrency, reference_api_key_file=reference_api_key_file)
    if "features" in run:
        # one target pass extracts every layer this run reads
        wanted = set(layer_ids)
        if "diagnostics" in run:
            wanted |= set(layers_needed(layer_ids, inputs.num_target_layers))
        if with_baseline:
            wanted |= set(baseline_layer_ids)
        features = step("features", extract_target_features, target, refs, tuple(sorted(wanted)), dtype=dtype,
                        device=device, dask_address=dask_address)
    if "drafts" in run:
        drafts = step("drafts", draft, checkpoint, features, refs, target,
                      sliding_semantics=sliding_semantics, dtype=dtype, device=device, all_positions=all_positions,
                      replay_group=replay_group, dask_address=dask_address)
    if "scores" in run:
        scores = step("scores", score, drafts, refs)
    if with_baseline:
        baseline_drafts = step("drafts", draft, baseline_checkpoint, features, refs, target, name="baseline drafts",
                               sliding_semantics=sliding_semantics, dtype=dtype, device=device,
                               all_positions=all_positions, replay_group=replay_group, dask_address=dask_address)
        step("scores", score, baseline_drafts, refs, name="baseline scores")
    if "diagnostics" in run:
        step("diagnostics", diagnose, checkpoint, features, refs, drafts, scores, target, dtype=dtype, device=device)

    results = read_json(outputs["scores"].path) if "scores" in run else {}
    results.update({
        "drafter": {"source": drafter, "key": outputs["fetch"].key if "fetch" in run else None,
                    "step": outputs["fetch"].step if "fetch" in run else source_step(drafter),
                    **({"layout": checkpoint.layout, "config_source": checkpoint.config_source} if "fetch" in run else {})},
        "target": str(target),
        "prompts": str(prompts),
        "reference": reference,
        "lookahead": lookahead,
        "thinking": thinking,
        "max_new_tokens": max_new_tokens,
        "layer_ids": list(layer_ids),
        "dtype": dtype,
        "dtype_requested": dtype_choice.requested,
        "dtype_note": dtype_choice.note,
        "device": device,
        "store": root,
        "stages": {s: "cached" if st.name == "Cached" else "ran" for s, st in states.items()},
        "keys": {s: out.key for s, out in outputs.items()},
    })
    if replay_group != DEFAULT_REPLAY_GROUP:  # (only then: results of other runs stay as they were)
        results["replay_group"] = replay_group
    if dask_address:
        # per stage, the workers that computed its shards (when this run or an earlier one computed it on a cluster)
        results["cluster"] = {"dask_address": dask_address, "shards": {
            stage: list(out.shards) if getattr(out, "shards", None) else None
            for stage, out in outputs.items() if stage in ("features", "drafts", "baseline drafts")}}
    if with_baseline:
        baseline_scores = read_json(outputs["baseline scores"].path)
        results["baseline"] = {
            "source": baseline, "key": baseline_checkpoint.key, "step": baseline_checkpoint.step,
            **{k: baseline_scores[k] for k in ("tau_macro", "tau_macro_ci95", "tau_pooled", "tau_by_category")},
        }
    if "diagnostics" in run:
        results["diagnostics"] = read_json(outputs["diagnostics"].path)
    if "scores" not in run:
        return results
    publish(results, opened, Path(report_dir) if report_dir else opened.root / "report")
    _add_tags([f"tau:{results['tau_macro']:.3f}"])  # the runs list shows tags, not state messages
    found = outcome(results)
    get_run_logger().info(found)
    return Completed(message=found, data=results)


def rerun_flow(stage: str):
    """The flow of deployment `rerun-<stage>`: recompute `stage` of one checkpoint, then score it (what it
    needs comes from the store, usually cached), so the run ends with the checkpoint's tau. Its parameters
    are evaluate_checkpoint's without `until` and `refresh`: the deployment's form cannot turn a stage rerun
    into something else."""
    until = "diagnostics" if stage == "diagnostics" else "scores"

    def rerun(**parameters):
        return evaluate_checkpoint.fn(**parameters, until=until, refresh=[stage])

    signature = inspect.signature(evaluate_checkpoint.fn)
    rerun.__signature__ = signature.replace(parameters=[
        p.replace(kind=inspect.Parameter.KEYWORD_ONLY) for p in signature.parameters.values()
        if p.name not in ("until", "refresh")])
    summary = f"Recompute the {stage} stage of one checkpoint (give `drafter`), then score it."
    rerun.__doc__ = summary + evaluate_checkpoint.fn.__doc__[evaluate_checkpoint.fn.__doc__.index("\n"):]
    rerun.__name__ = rerun.__qualname__ = f"rerun_{stage}"
    # the same flow name as a full evaluation: its deployments stay evaluate-checkpoint/rerun-<stage>
    return flow(rerun, name="evaluate-checkpoint", persist_result=False,
                flow_run_name=lambda: run_name(flow_run.parameters.get("drafter", ""), until, [stage]))


RERUN_FLOWS = {stage: rerun_flow(stage) for stage in STAGES}
# entrypoints of prefect.yaml's rerun-<stage> deployments
rerun_fetch, rerun_references, rerun_features, rerun_drafts, rerun_scores, rerun_diagnostics = RERUN_FLOWS.values()
