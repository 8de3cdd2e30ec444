"""Unattended evaluation: `serve` (the deployments, from this process), `watch` (one look at a relay) and
`notify` (for trainers: a checkpoint was saved)."""

import os
from pathlib import Path
from typing import Annotated

import typer

from dflash_eval.flows.settings import Settings
from dflash_eval.services.report_server import DEFAULT_HOST, DEFAULT_PORT, REPORT_URL_ENV, ReportServer, report_url

from .common import bind_report_server, fail, open_store, start_local_server, write_results
from .options import example, settings_options

app = typer.Typer()


@app.command(epilog=example("PREFECT_API_URL=http://127.0.0.1:4200/api dflash-eval serve",
                            "--target runs/tiny/target --prompts runs/tiny/prompts.jsonl",
                            "--relay http://127.0.0.1:8700"))
@settings_options(by_hand=False)
def serve(
    *, settings: Settings,
    relay: Annotated[str | None, typer.Option("--relay", help="Also watch this relay (http://HOST:PORT) and evaluate "
                                              "checkpoints not scored yet, oldest step first.")] = None,
    watch_interval: Annotated[float, typer.Option("--watch-interval", min=1, help="Seconds between two looks at the "
                                                  "relay.")] = 300,
    poll_seconds: Annotated[float, typer.Option("--poll-seconds", min=0.05, help="How often to ask the server for flow "
                                                "runs to start (Prefect's own default is 10 s; each ask is one small "
                                                "query).")] = 0.25,
    report_server: Annotated[bool, typer.Option("--report-server/--no-report-server", help="Serve <store>/report "
                                                "over HTTP from this process, for the report links of the Prefect "
                                                "UI.")] = True,
    report_host: Annotated[str, typer.Option("--report-host", help="Address the report server listens on (0.0.0.0: "
                                             "every interface; the links then name this machine).")] = DEFAULT_HOST,
    report_port: Annotated[int, typer.Option(
        "--report-port", min=0, max=65535, help="Port of the report server (0: any free "
        "one).")] = DEFAULT_PORT,
):
    """Serve the deployments on this machine without a work pool (Prefect's runner), until interrupted:
    evaluate-checkpoint (started by `dflash-eval notify` events), watch-relay (with --relay) and
    rerun-<stage>, with these settings. Each flow run is a fork of a process that has imported torch and the flows
    already, so it starts in a second, not ten. Needs a Prefect server: PREFECT_API_URL=http://HOST:4200/api. The
    report every run rewrites, <store>/report, is served at http://<report host>:<report port>/
    ($DFLASH_REPORT_URL, if set, is the address the runs link to instead: a reverse proxy's)."""
    from dflash_eval.flows.deployments import serve_deployments

    if not os.environ.get("PREFECT_API_URL"):
        fail("set PREFECT_API_URL to a Prefect server (`prefect server start`): deployments, event triggers and "
             "schedules live there")
    # before the runner: the flow runs' processes copy this one's environment when they start
    settings, store = _store_located(settings)
    server = _serve_report_to_runs(store.root / "report", report_host, report_port) if report_server else None
    try:
        serve_deployments(settings, poll_seconds=poll_seconds, relay=relay, watch_interval=watch_interval)
    finally:
        if server is not None:
            server.stop()


def _store_located(settings: Settings):
    """(The settings with a store given as its absolute location: flow runs may start in another folder; the
    store.) Without --store the flow runs find theirs ($DFLASH_STORE, else ./.dflash-store) where they run."""
    store = open_store(settings.output.store)
    if settings.output.store is None:
        return settings, store
    return settings.model_copy(update={"output": settings.output.model_copy(update={"store": store.location})}), store


def _serve_report_to_runs(folder: Path, host: str, port: int) -> ReportServer:
    """Serve `folder` (the report every flow run rewrites) from this process and point the flow runs, which
    inherit this process's environment, at it with $DFLASH_REPORT_URL; keep a URL the user set (a proxy's)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)  # the server starts before the first run writes the report
    except OSError as e:
        fail(f"cannot create the report folder {folder}: {e.strerror}")
    server = bind_report_server(folder, host, port, "--report-port").start()
    if report_url() is not None:
        typer.echo(f"report server at {server.url}report.html; ${REPORT_URL_ENV} is set, so flow runs link to "
                   f"{report_url()}report.html")
    else:
        os.environ[REPORT_URL_ENV] = server.url
        typer.echo(f"report server at {server.url}report.html (flow runs link to it)")
    return server


@app.command(epilog=example("PREFECT_API_URL=http://127.0.0.1:4200/api dflash-eval watch",
                            "--relay http://127.0.0.1:8700 --target runs/tiny/target",
                            "--prompts runs/tiny/prompts.jsonl"))
@settings_options(by_hand=False)
def watch(
    relay: Annotated[str, typer.Option("--relay", help="The relay to look at (http://HOST:PORT).")],
    settings: Settings,
    out: Annotated[Path | None, typer.Option("--out", help="Write what was started (JSON) here (its folder is "
                                             "created if need be).")] = None,
):
    """Look at a relay once: start the evaluate-checkpoint deployment for each checkpoint not scored
    yet, oldest step first (what the watch-relay deployment does on its schedule). The evaluations take the
    deployment's settings, with those given here in their place. Needs a Prefect server with the deployment
    (`dflash-eval serve`)."""
    from dflash_eval.flows.watch import WatchError, watch_relay

    settings, _ = _store_located(settings)
    start_local_server()  # no PREFECT_API_URL: Prefect's temporary server, with time for a slow first start
    try:
        started = watch_relay(relay=relay, settings=settings.model_dump(mode="json", exclude_unset=True))
    except WatchError as e:
        fail(str(e))
    for run in started:
        typer.echo(f"{run['path']} (step {run['step']}): flow run {run['flow_run_id']}, attempt {run['attempt']}")
    if not started:
        typer.echo("nothing to start: every checkpoint is scored or being scored")
    write_results(started, out)


@app.command(epilog=example("dflash-eval notify --checkpoint http://relay:8700/run1/step_1000 --step 1000"))
def notify(
    checkpoint: Annotated[str, typer.Option("--checkpoint", help="The saved checkpoint, as the evaluation fetches "
                                            "it: a relay URL (http://relay:8700/run1/step_1000) or a folder.")],
    step: Annotated[int | None, typer.Option("--step", help="Its training step (shown with the event).")] = None,
    api_url: Annotated[str | None, typer.Option("--api-url", help="Prefect API URL (default "
                                                "$PREFECT_API_URL).")] = None,
):
    """For training scripts: announce a saved checkpoint (event dflash.checkpoint.saved), which starts
    its evaluation. Always exits 0 and within seconds: an unreachable server is only reported."""
    from dflash_eval.flows.notify import EVENT
    from dflash_eval.flows.notify import notify as send

    if send(checkpoint, step, api_url):
        typer.echo(f"sent {EVENT} for {checkpoint}")
