"""The deployments of one eval machine, served from one process (`dflash-eval serve`): no work pool.

  evaluate-checkpoint   runs on each `dflash.checkpoint.saved` event (flows/notify.py), whose
                        payload's `checkpoint` becomes the `drafter` parameter
  watch-relay           (with a relay) every `watch_interval` seconds: starts evaluate-checkpoint for
                        checkpoints not scored yet, oldest step first (flows/watch.py)
  rerun-<stage>         by hand, for one checkpoint: recompute that stage (and run what it needs, from
                        the store), e.g. `prefect deployment run evaluate-checkpoint/rerun-drafts -p drafter=...`

prefect.yaml declares the same deployments for the work-pool route (several machines, README).
"""

from prefect import serve
from prefect.events.schemas.deployment_triggers import DeploymentEventTrigger

from .evaluate import STAGES, evaluate_checkpoint
from .notify import EVENT, RESOURCE_PREFIX
from .watch import watch_relay


def checkpoint_saved_trigger() -> DeploymentEventTrigger:
    """Run once per `dflash.checkpoint.saved` event, drafting the checkpoint its payload names."""
    return DeploymentEventTrigger(
        name="checkpoint saved",
        expect={EVENT},
        match={"prefect.resource.id": f"{RESOURCE_PREFIX}*"},
        parameters={"drafter": "{{ event.payload.checkpoint }}"},
    )


def build_deployments(target: str, prompts: str, store: str | None = None, relay: str | None = None,
                      watch_interval: float = 300, max_new_tokens: int = 256, parameters: dict | None = None) -> list:
    """The deployments `dflash-eval serve` serves (RunnerDeployments, not yet registered)."""
    settings = {"target": target, "prompts": prompts, "store": store, "max_new_tokens": max_new_tokens,
                **(parameters or {})}
    deployments = [evaluate_checkpoint.to_deployment(
        name="evaluate-checkpoint", parameters=settings, triggers=[checkpoint_saved_trigger()],
        description="Score a drafter checkpoint; started by each dflash.checkpoint.saved event.",
    )]
    if relay:
        deployments.append(watch_relay.to_deployment(
            name="watch-relay", interval=watch_interval,
            parameters={"relay": relay, "target": target, "prompts": prompts, "store": store,
                        "max_new_tokens": max_new_tokens, "parameters": parameters or {}},
            description=f"Start evaluations of the checkpoints on {relay} not scored yet, oldest step first.",
        ))
    for stage in STAGES:
        deployments.append(evaluate_checkpoint.to_deployment(
            name=f"rerun-{stage}", parameters={**settings, "until": stage, "refresh": [stage]},
            description=f"Recompute the {stage} stage of one checkpoint (give `drafter`); what it needs comes from the store.",
        ))
    return deployments


def serve_deployments(**kwargs) -> None:
    """Register the deployments and run their flow runs from this process until interrupted."""
    serve(*build_deployments(**kwargs))
