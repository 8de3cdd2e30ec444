"""Watch a relay: start an evaluation for every checkpoint not scored yet, oldest step first.

Each evaluation is a run of the evaluate-checkpoint deployment, created with an idempotency key made
of the checkpoint's content key and the evaluation's settings: Prefect returns the existing run for a
key it has seen, so two watchers that overlap (or a watcher that runs again before the first
evaluation finished) never start the same evaluation twice. An evaluation that failed is started
again by the next look (a new attempt, with its own key), up to MAX_ATTEMPTS times.
"""

from prefect import flow, get_run_logger
from prefect.deployments import run_deployment

from dflash_eval.services.relay.client import RelayClient
from dflash_eval.storage import Store, key_of
from dflash_eval.tasks.fetch import CheckpointError, await_checkpoint, fetched_files, relay_token

from .evaluate import run_name
from dflash_eval.reporting.history import history

EVALUATE_DEPLOYMENT = "evaluate-checkpoint/evaluate-checkpoint"
MAX_ATTEMPTS = 3  # evaluations of one checkpoint that failed before the watcher gives up on it


def scored_checkpoints(store: Store) -> set[str]:
    """Content keys of every checkpoint the store has scores for."""
    return {row.checkpoint for group in history(store) for row in group.rows}


@flow(name="watch-relay", persist_result=False)
def watch_relay(
    relay: str,
    target: str,
    prompts: str,
    store: str | None = None,
    max_new_tokens: int = 256,
    parameters: dict | None = None,
    deployment: str = EVALUATE_DEPLOYMENT,
    relay_token_file: str | None = None,
) -> list[dict]:
    """Start evaluate-checkpoint for each checkpoint on `relay` that the store has not scored, oldest
    step first (checkpoints without a step last, by path). parameters: more evaluate-checkpoint
    parameters (dtype, device, ...). Returns what it started: path, step, checkpoint key, flow run id."""
    logger = get_run_logger()
    base_url = relay.rstrip("/")
    client = RelayClient(base_url, token=relay_token(relay_token_file))
    done = scored_checkpoints(Store(store))
    checkpoints = sorted(client.list_checkpoints(), key=lambda c: (c["step"] is None, c["step"] or 0, c["path"]))
    settings = {"target": target, "prompts": prompts, "store": store, "max_new_tokens": max_new_tokens,
                **(parameters or {})}
    started = []
    options = parameters or {}
    for checkpoint in checkpoints:
        # the key the evaluation's fetch will have: its files, and the config it will be given
        try:
            ready = await_checkpoint(f"{base_url}/{checkpoint['path']}", relay_token_file, options.get("include"),
                                     wait_seconds=0)
            key = key_of({"files": fetched_files(ready, options.get("drafter_config"), Store(store))[0]})
        except CheckpointError as e:  # gone since the listing (a trainer's rewind), or no config for it
            logger.warning(f"{checkpoint['path']}: not evaluated: {e}")
            continue
        if key in done:
            continue
        run_parameters = {**settings, "drafter": f"{base_url}/{checkpoint['path']}"}
        if relay_token_file:
            run_parameters["relay_token_file"] = relay_token_file
        identity = key_of({**settings, "checkpoint": key})
        for attempt in range(1, MAX_ATTEMPTS + 1):
            run = run_deployment(deployment, parameters=run_parameters, timeout=0,
                                 idempotency_key=f"dflash-eval-{identity}-{attempt}",
                                 flow_run_name=run_name(run_parameters["drafter"]))
            if not (run.state and run.state.is_final() and not run.state.is_completed()):
                break  # new, scheduled, running or completed: this attempt stands
        else:
            logger.warning(f"{checkpoint['path']}: the last {MAX_ATTEMPTS} evaluations failed ({run.name}: "
                           f"{run.state.message}); not retried: fix it and run `dflash-eval run` by hand")
            continue
        logger.info(f"{checkpoint['path']} (step {checkpoint['step']}): evaluation {run.name} ({run.state_name})")
        started.append({"path": checkpoint["path"], "step": checkpoint["step"], "checkpoint": key,
                        "flow_run_id": str(run.id), "attempt": attempt})
    if not started:
        logger.info(f"every checkpoint on {base_url} is scored or being scored")
    return started
