"""The deployments of one eval machine, served from one process (`dflash-eval serve`): no work pool.

  evaluate-checkpoint   runs on each `dflash.checkpoint.saved` event (flows/notify.py), whose
                        payload's `checkpoint` becomes the `drafter` parameter
  watch-relay           (with a relay) every `watch_interval` seconds: starts evaluate-checkpoint for
                        checkpoints not scored yet, oldest step first (flows/watch.py)
  rerun-<stage>         by hand, for one checkpoint: recompute that stage, then score it (what it needs
                        comes from the store), e.g. `prefect deployment run evaluate-checkpoint/rerun-drafts -p drafter=...`

prefect.yaml declares the same deployments for the work-pool route (several machines, docs/relay.md).
"""

import asyncio
from typing import Any

from prefect import Flow
from prefect.events.schemas.deployment_triggers import DeploymentEventTrigger
from prefect.exceptions import TerminationSignal
from prefect.runner import Runner

from .evaluate import RERUN_FLOWS, evaluate_checkpoint
from .notify import EVENT, RESOURCE_PREFIX
from .settings import Settings
from .warm_runs import start_flow_runs_from_forkserver
from .watch import watch_relay


def checkpoint_saved_trigger() -> DeploymentEventTrigger:
    """Run once per `dflash.checkpoint.saved` event, drafting the checkpoint its payload names."""
    return DeploymentEventTrigger(
        name="checkpoint saved",
        expect={EVENT},
        match={"prefect.resource.id": f"{RESOURCE_PREFIX}*"},
        parameters={"drafter": "{{ event.payload.checkpoint }}"},
    )


def build_deployments(settings: Settings, relay: str | None = None,
                      watch_interval: float = 300) -> list[tuple[Flow, dict[str, Any]]]:
    """The deployments `dflash-eval serve` serves: (flow, Runner.add_flow's keyword arguments) each. Their
    parameters are the settings by group (the deployment form shows each group as a section); the watcher's
    evaluations take evaluate-checkpoint's."""
    parameters = settings.model_dump(mode="json")
    deployments: list[tuple[Flow, dict[str, Any]]] = [(evaluate_checkpoint, dict(
        name="evaluate-checkpoint", parameters=parameters, triggers=[checkpoint_saved_trigger()],
        description="Score a drafter checkpoint; started by each dflash.checkpoint.saved event.",
    ))]
    if relay:
        deployments.append((watch_relay, dict(
            name="watch-relay", interval=watch_interval, parameters={"relay": relay},
            description=f"Start evaluations of the checkpoints on {relay} not scored yet, oldest step first, with "
                        "evaluate-checkpoint's settings.",
        )))
    for stage, rerun in RERUN_FLOWS.items():
        deployments.append((rerun, dict(
            name=f"rerun-{stage}", parameters=parameters,
            description=f"Recompute the {stage} stage of one checkpoint (give `drafter`), then score it; what it "
                        "needs comes from the store.",
        )))
    return deployments


ORPHANED = ("the process serving this run stopped before it finished (killed, or its machine went down); what it "
            "completed is in the store: run it again to resume")


def crash_orphaned_runs(deployment_ids) -> list[str]:
    """Mark Crashed the runs of these deployments still Running or Pending, saying why; one line for each. Called
    as `serve` starts, before it runs anything: only a serve of these deployments runs them, so such a run belongs
    to a serve that is gone (killed: it could not end its runs), and would otherwise show Running for ever."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        FlowRunFilter,
        FlowRunFilterDeploymentId,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType
    from prefect.states import Crashed

    lines = []
    with get_client(sync_client=True) as client:
        running = client.read_flow_runs(flow_run_filter=FlowRunFilter(
            deployment_id=FlowRunFilterDeploymentId(any_=list(deployment_ids)),
            state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.RUNNING, StateType.PENDING]))))
        for run in running:
            client.set_flow_run_state(run.id, Crashed(message=ORPHANED), force=True)
            left = run.state.name if run.state else "unfinished"
            lines.append(f"flow run {run.name} ({run.id}) was left {left} by a serve that stopped: marked Crashed")
    return lines


def serve_deployments(settings: Settings, poll_seconds: float = 0.25, relay: str | None = None,
                      watch_interval: float = 300) -> None:
    """Register the deployments and run their flow runs from this process until interrupted.

    Each flow run is a fork of a forkserver that has imported the flows (flows/warm_runs.py). That needs
    the flow objects given to the runner (`add_flow`): a deployment given alone (`prefect.serve`) has its
    runs started as `python -m prefect.engine`, which imports everything again (4 s per run).
    poll_seconds: how often the runner asks the server for runs to start (Prefect's default: 10 s; one small
    query each, so a run starts within a fraction of a second of its creation).
    """
    start_flow_runs_from_forkserver()
    runner = Runner(pause_on_shutdown=True, query_seconds=poll_seconds)
    deployments = build_deployments(settings, relay, watch_interval)
    ids = [runner.add_flow(flow, **options) for flow, options in deployments]
    for line in crash_orphaned_runs(ids):
        print(line, flush=True)
    print(f"serving {', '.join(options['name'] for _, options in deployments)} (looking for runs every "
          f"{poll_seconds} s); Ctrl+C stops", flush=True)
    try:
        asyncio.run(runner.start())
    except (KeyboardInterrupt, TerminationSignal):
        pass
