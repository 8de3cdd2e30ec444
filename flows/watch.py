"""Watch a relay: start an evaluation for every checkpoint not scored yet, oldest step first.

Each evaluation is a run of the evaluate-checkpoint deployment, created with an idempotency key made
of the checkpoint's content key and the evaluation's settings: Prefect returns the existing run for a
key it has seen, so two watchers that overlap (or a watcher that runs again before the first
evaluation finished) never start the same evaluation twice. An evaluation that failed is started
again by the next look (a new attempt, with its own key), up to MAX_ATTEMPTS times.

The evaluations take evaluate-checkpoint's own settings (its deployment's parameters), with the watcher's
`settings` in their place setting by setting: the watch-relay deployment needs only its relay.
"""

from typing import cast

from prefect import flow, get_client, get_run_logger
from prefect.client.schemas.objects import FlowRun
from prefect.deployments import run_deployment
from prefect.exceptions import ObjectNotFound

from dflash_eval.reporting.history import history
from dflash_eval.services.relay.client import RelayClient
from dflash_eval.storage import Store, key_of
from dflash_eval.tasks.fetch import CheckpointError, await_checkpoint, fetched_files, relay_token

from .evaluate import run_name
from .settings import GROUPS, SETTINGS, Settings, SettingsError

EVALUATE_DEPLOYMENT = "evaluate-checkpoint/evaluate-checkpoint"
MAX_ATTEMPTS = 3  # evaluations of one checkpoint that failed before the watcher gives up on it


class WatchError(RuntimeError):
    """The watcher cannot start evaluations: no deployment to start, or settings that do not check."""


def scored_checkpoints(store: Store) -> set[str]:
    """Content keys of every checkpoint the store has scores for."""
    return {row.checkpoint for group in history(store) for row in group.rows}


def evaluation_settings(deployment: str, settings: dict | None) -> Settings:
    """The settings the evaluations the watcher starts take: `deployment`'s parameters, with `settings` (by group)
    in their place setting by setting (a group given replaces only the settings it names, unlike Prefect's own
    merge of a run's parameters, which replaces whole groups)."""
    try:
        with get_client(sync_client=True) as client:
            base = client.read_deployment_by_name(deployment).parameters
    except ObjectNotFound:
        raise WatchError(f"no deployment {deployment} on this Prefect server: start `dflash-eval serve` (or deploy "
                         "prefect.yaml's) first; the watcher starts its runs") from None
    if flat := sorted(set(base) & set(SETTINGS)):
        raise WatchError(f"deployment {deployment} has the parameters of dflash-eval 0.1 (one per setting: "
                         f"{', '.join(flat[:4])}, ...), not by group: re-create it (`dflash-eval serve` does as it "
                         "starts; `prefect --no-prompt deploy --all` with this prefect.yaml)")
    given = settings or {}
    merged = {group: {**(base.get(group) or {}), **(given.get(group) or {})} for group in GROUPS
              if group in base or group in given}
    try:
        return Settings.checked(merged)
    except SettingsError as e:
        raise WatchError(f"the evaluations' settings: {e}") from None


@flow(name="watch-relay", persist_result=False)
def watch_relay(relay: str, settings: dict | None = None, deployment: str = EVALUATE_DEPLOYMENT) -> list[dict]:
    """Start evaluate-checkpoint for each checkpoint on `relay` that the store has not scored, oldest
    step first (checkpoints without a step last, by path).

    Args:
        relay: The relay to look at (http://HOST:PORT).
        settings: The evaluations' settings by group, in place of evaluate-checkpoint's own, setting by setting
            (e.g. {"inputs": {"max_new_tokens": 64}}); empty: the deployment's.
        deployment: The deployment that evaluates a checkpoint.

    Returns what it started: path, step, checkpoint key, flow run id."""
    logger = get_run_logger()
    base_url = relay.rstrip("/")
    evaluation = evaluation_settings(deployment, settings)
    checkpoints_settings = evaluation.checkpoints
    store = Store(evaluation.output.store)
    client = RelayClient(base_url, token=relay_token(checkpoints_settings.relay_token_file))
    done = scored_checkpoints(store)
    checkpoints = sorted(client.list_checkpoints(), key=lambda c: (c["step"] is None, c["step"] or 0, c["path"]))
    parameters = evaluation.model_dump(mode="json")
    started = []
    for checkpoint in checkpoints:
        # the key the evaluation's fetch will have: its files, and the config it will be given
        try:
            ready = await_checkpoint(f"{base_url}/{checkpoint['path']}", checkpoints_settings.relay_token_file,
                                     checkpoints_settings.include, wait_seconds=0)
            key = key_of({"files": fetched_files(ready, checkpoints_settings.drafter_config, store)[0]})
        except CheckpointError as e:  # gone since the listing (a trainer's rewind), or no config for it
            logger.warning(f"{checkpoint['path']}: not evaluated: {e}")
            continue
        if key in done:
            continue
        run_parameters = {**parameters, "drafter": f"{base_url}/{checkpoint['path']}"}
        identity = key_of({"settings": parameters, "checkpoint": key})
        for attempt in range(1, MAX_ATTEMPTS + 1):
            # (called from a sync flow, run_deployment returns the run; its types also allow a coroutine)
            run = cast(FlowRun, run_deployment(deployment, parameters=run_parameters, timeout=0,
                                               idempotency_key=f"dflash-eval-{identity}-{attempt}",
                                               flow_run_name=run_name(run_parameters["drafter"])))
            if not (run.state and run.state.is_final() and not run.state.is_completed()):
                break  # new, scheduled, running or completed: this attempt stands
        else:
            logger.warning(f"{checkpoint['path']}: the last {MAX_ATTEMPTS} evaluations failed ({run.name}: "
                           f"{run.state.message if run.state else 'no state'}); not retried: fix it and run "
                           "`dflash-eval run` by hand")
            continue
        logger.info(f"{checkpoint['path']} (step {checkpoint['step']}): evaluation {run.name} ({run.state_name})")
        started.append({"path": checkpoint["path"], "step": checkpoint["step"], "checkpoint": key,
                        "flow_run_id": str(run.id), "attempt": attempt})
    if not started:
        logger.info(f"every checkpoint on {base_url} is scored or being scored")
    return started
