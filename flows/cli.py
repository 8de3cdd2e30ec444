"""The `dflash-eval` command line."""

import json
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import NoReturn

import typer

from dflash_eval.flows.report_server import DEFAULT_HOST, DEFAULT_PORT, REPORT_URL_ENV, PortInUse, ReportServer, report_url
from dflash_eval.flows.store_paths import (is_storage_full, storage_full_message, store_problem, store_root, store_write_problem,
                               writable_problem)

# This tool runs offline: Prefect's temporary server must not try to send telemetry.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

app = typer.Typer(help="Evaluate DFlash speculative-decoding drafters offline.", no_args_is_help=True,
                  pretty_exceptions_enable=False)
tiny_app = typer.Typer(help="The tiny trained target and drafter run (demo, tests, smoke tests).", no_args_is_help=True)
app.add_typer(tiny_app, name="tiny")
relay_app = typer.Typer(help="Move checkpoints from a training box to this one over HTTP.", no_args_is_help=True)
app.add_typer(relay_app, name="relay")

TARGET = typer.Option(..., "--target", help="Target model folder (Hugging Face format).")
DRAFTER = typer.Option(..., "--drafter", help="Drafter checkpoint folder (config.json + model.safetensors).")
PROMPTS = typer.Option(..., "--prompts", help="A suite (math, code, chat, multiturn) or a JSONL file: id + one of "
                       "text/messages/turns/input_ids, optional category.")
MAX_NEW = typer.Option(256, "--max-new-tokens", help="Greedy reference length limit per prompt.")
STORE = typer.Option(None, "--store", help="Store root (default $DFLASH_STORE, else ./.dflash-store).")
DTYPE = typer.Option("auto", "--dtype", help="auto (the target checkpoint's own dtype; a float16 one computes in "
                     "float32), float32 or bfloat16: target and drafter compute dtype.")
DEVICE = typer.Option("cpu", "--device", help="cpu or cuda.")
SEMANTICS = typer.Option("causal", "--sliding-semantics",
                         help="Sliding drafter layers: causal (training, serving, current z-lab reference) or non_causal (earlier z-lab reference); a config's is_causal overrides it.")
THINKING = typer.Option(False, "--thinking/--no-thinking", help="enable_thinking in the chat template.")
REFERENCE = typer.Option("local", "--reference", help="Greedy references from: local (the target here), "
                         "sglang+http://HOST:PORT or openai+http://HOST:PORT/v1.")
LOOKAHEAD = typer.Option(False, "--lookahead/--no-lookahead", help="Keep B-1 greedy tokens past each completion so "
                         "the last step is scored against a whole block (default: clipped, as online decoding).")
CONCURRENCY = typer.Option(8, "--concurrency", help="Requests in flight to a reference server.")
TEMPERATURE = typer.Option(0.0, "--temperature", help="Only 0 (greedy): anything else is refused.")
BASELINE = typer.Option(None, "--baseline", help="Another drafter (e.g. the published one for this target) scored "
                        "alongside: its own row in history and the report.")
REPORT_DIR = typer.Option(None, "--report-dir", help="Where the report is rewritten after scoring (default <store>/report).")
RELAY_TOKEN_FILE = typer.Option(None, "--relay-token-file", help="File holding a relay's bearer token "
                                "(else $DFLASH_RELAY_TOKEN), for --drafter http://RELAY/<path>.")
REFERENCE_API_KEY_FILE = typer.Option(None, "--reference-api-key-file", help="File holding the reference server's "
                                      "API key (else $DFLASH_REFERENCE_API_KEY), sent as Authorization: Bearer.")
DRAFTER_CONFIG = typer.Option(None, "--drafter-config", help="The drafter's config.json, for checkpoints saved "
                              "without one (SpecForge's run-stepN folders) whose run folder holds none either.")
INCLUDE = typer.Option(None, "--include", help="Also fetch checkpoint files matching this pattern (repeatable); "
                       "config, weights and trainer_state.json always travel, optimizer state never unless named.")
CHECKPOINT_WAIT = typer.Option(300.0, "--checkpoint-wait", help="Seconds to wait for a checkpoint that is not there "
                               "yet or still being written, before failing.")
THREADS = typer.Option(None, "--threads", min=1, help="CPU threads torch computes with in this process (default: "
                       "$OMP_NUM_THREADS, else this machine's cores shared by the runs by hand computing on it at "
                       "the time; ops of small models take fewer, where that is faster; see tasks/threads.py).")
SETTLE_SECONDS = typer.Option(30.0, "--settle-seconds", envvar="DFLASH_SETTLE_SECONDS", help="A checkpoint folder "
                              "counts as finished once none of its files changed for this long.")


def _configure_threads(threads: int | None) -> None:
    """This process's thread budget, set before anything computes (tasks/threads.py)."""
    from dflash_eval.tasks.threads import configure_threads

    configure_threads(threads)


def _decoding_threads(target: str) -> int:
    """Threads for greedy decoding of `target` (one token per forward) on this machine by default."""
    from dflash_eval.tasks.threads import checkpoint_parameters, default_threads, threads_for

    return threads_for(checkpoint_parameters(target), default_threads())


def _evaluate(**kwargs) -> dict:
    """Check the inputs (one clear error, nothing written), then run the flow."""
    _configure_threads(kwargs.get("threads"))
    from dflash_eval.flows.evaluate import InputError, check_arguments, check_inputs, evaluate_checkpoint, inputs_checked_by_caller
    from dflash_core.drafter import DrafterError
    from dflash_core.reference.backends import BackendError
    from dflash_eval.tasks.fetch import CheckpointError

    if problem := store_problem(kwargs.get("store")):
        _fail(problem)
    try:
        arguments = check_arguments(kwargs)
        inputs = check_inputs(**arguments, temperature=kwargs.pop("temperature", 0.0))
        if problem := store_write_problem(store_root(kwargs.get("store"))):
            _fail(problem)
        if _local_server_needed():  # after the checks: bad input costs no server start-up
            from dflash_eval.flows.local_server import tie_local_server  # imports Prefect's server (~1 s): only to start one

            tie_local_server()
        # errors handled below get one line, so Prefect's console tracebacks of them are left out
        explained = (InputError, DrafterError, CheckpointError, BackendError)
        with _console_tracebacks_hidden(lambda e: isinstance(e, explained) or is_storage_full(e)), \
                inputs_checked_by_caller(inputs, arguments), _heartbeats_unless_asked():
            return evaluate_checkpoint(**kwargs)
    # CheckpointError: fetch refused what it got; BackendError: a reference server failed, refused or changed
    except (InputError, DrafterError, CheckpointError, BackendError) as e:
        typer.secho(f"error: {e}", err=True, fg="red")
        raise typer.Exit(2) from None
    except OSError as e:
        if not is_storage_full(e):
            raise
        _fail(storage_full_message(e, store_root(kwargs.get("store"))))


@contextmanager
def _heartbeats_unless_asked() -> Iterator[None]:
    """Flow runs started here send no heartbeats unless $PREFECT_FLOWS_HEARTBEAT_FREQUENCY asks for them. They
    only serve a server-side automation that marks runs whose process died as crashed (none by default), and
    stopping the heartbeat thread, which sleeps in 1 s steps, cost each run 0.75 s after its end. Deployment
    runs are started by a runner, which sets their heartbeats itself."""
    if "PREFECT_FLOWS_HEARTBEAT_FREQUENCY" in os.environ:
        yield
        return
    from prefect.settings import PREFECT_FLOWS_HEARTBEAT_FREQUENCY, temporary_settings

    with temporary_settings(updates={PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None}):
        yield


def _local_server_needed() -> bool:
    """Whether flows in this process run against Prefect's temporary local server (no PREFECT_API_URL)."""
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    return not PREFECT_API_URL.value() and PREFECT_SERVER_EPHEMERAL_ENABLED.value()


def _print_results(results: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"drafter {Path(results['drafter']['source']).name}", show_header=True)
    for column in ("stage", "status", "key"):
        table.add_column(column)
    for stage, status in results["stages"].items():
        table.add_row(stage, status, results["keys"][stage][:12])
    console = Console()
    console.print(table)
    if "tau_macro" in results:
        low, high = results["tau_macro_ci95"]
        console.print(
            f"tau macro {results['tau_macro']:.3f} (95% CI {low:.2f}-{high:.2f}), pooled {results['tau_pooled']:.3f} "
            f"(block {results['block_size']}, {results['n_scored_prompts']} prompts, {results['n_steps']} steps, "
            f"{results['clipped_last_steps']} clipped last steps; {results['sliding_semantics']} sliding layers)"
        )
    if "all_positions_tau" in results:
        console.print(f"all positions: mean acceptance length {results['all_positions_tau']:.3f}")
    if "baseline" in results:
        b = results["baseline"]
        console.print(f"baseline {b['source']}: tau macro {b['tau_macro']:.3f} "
                      f"(95% CI {b['tau_macro_ci95'][0]:.2f}-{b['tau_macro_ci95'][1]:.2f})")
    if "diagnostics" in results:
        _print_diagnostics(console, results["diagnostics"])


def _print_diagnostics(console, d: dict) -> None:
    ablation = ", ".join(f"layer {a['layer_id']}: {a['tau_macro']:.2f}" for a in d["layer_ablation"])
    console.print(f"ablation (one layer's features zeroed): {ablation}; all layers: {d['all_layers_ablated']:.2f}")
    probe = ", ".join(f"{p['offset']:+d}: {p['tau_macro']:.2f}" for p in d["layer_offset_probe"] if p["tau_macro"] is not None)
    peak = max((p for p in d["layer_offset_probe"] if p["tau_macro"] is not None), key=lambda p: p["tau_macro"])
    console.print(f"layer-offset probe (tau with layers id+offset): {probe}"
                  + ("" if peak["offset"] == 0 else f"  <- peaks at {peak['offset']:+d}: were the training features "
                     f"taken from layers {peak['layer_ids']}?"))
    if d["sliding_switch"]:
        sw = d["sliding_switch"]
        console.print(f"sliding semantics {sw['to']} instead of {sw['from']}: tau {sw['tau_macro']:.2f}")
    for example in d["first_divergence"][:3]:
        console.print(f"first divergence in {example['id']} at completion token {example['position']}: "
                      f"after {example['context']!r} drafted {example['drafted']!r}, reference {example['reference']!r}",
                      markup=False)


def _absolute(path: str) -> str:
    """An existing file or folder as an absolute path (flow runs start in other processes); else as given
    (a suite name, a URL)."""
    return str(Path(path).resolve()) if Path(path).exists() else path


def _checkpoint_options(drafter_config: str | None, include: list[str] | None, checkpoint_wait: float,
                        settle_seconds: float) -> dict:
    """The fetch options of `run` and `stage` as flow parameters (paths absolute: flow runs start elsewhere)."""
    return {"drafter_config": _absolute(drafter_config) if drafter_config else None, "include": include or None,
            "checkpoint_wait": checkpoint_wait, "settle_seconds": settle_seconds}


def _write(results: dict | list, out: Path | None) -> None:
    if out is None:
        return
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results, indent=1))
    except OSError as e:  # checked up front; what is left: the disk filled, or someone changed the folder meanwhile
        stored = ("; the results are in the store: the same command with another --out writes them without "
                  "recomputing anything") if isinstance(results, dict) and "store" in results else ""
        _fail(f"cannot write {out}: {e.strerror}{stored}")
    typer.echo(f"results: {out}")


@contextmanager
def _console_tracebacks_hidden(explained: Callable[[BaseException], bool]) -> Iterator[None]:
    """Prefect logs a failed task's and flow's traceback on the console; for an error this command explains in
    one line, the console shows Prefect's one-line summaries only. The run logs keep the tracebacks: Prefect's
    API handler (prefect.flow_runs, prefect.task_runs) formats a record before the root logger's console
    handler, where this filter sits, sees it."""
    import logging

    from prefect.logging.handlers import PrefectConsoleHandler

    def drop_traceback(record: logging.LogRecord) -> bool:
        if record.exc_info and record.exc_info[1] is not None and explained(record.exc_info[1]):
            record.exc_info, record.exc_text = None, None
        return True

    consoles = [h for h in logging.getLogger().handlers if isinstance(h, PrefectConsoleHandler)]
    for handler in consoles:
        handler.addFilter(drop_traceback)
    try:
        yield
    finally:
        for handler in consoles:
            handler.removeFilter(drop_traceback)


def _fail(message: str, code: int = 2) -> NoReturn:
    """One line on stderr, and the exit code (2: bad input or a condition the user must fix; nothing half done)."""
    typer.secho(f"error: {message}", err=True, fg="red")
    raise typer.Exit(code)


def _check_out(out: Path | None, folder: bool = False) -> None:
    """Refuse an --out that could not be written, before any work (else the results are lost at the end)."""
    if out is not None and (problem := writable_problem(out, folder)):
        _fail(f"--out: {problem}")


@app.command()
def run(
    target: str = TARGET, drafter: str = DRAFTER, prompts: str = PROMPTS, max_new_tokens: int = MAX_NEW,
    store: str = STORE, out: Path = typer.Option(None, "--out", help="Write the results JSON here."),
    dtype: str = DTYPE, device: str = DEVICE, sliding_semantics: str = SEMANTICS, thinking: bool = THINKING,
    reference: str = REFERENCE, lookahead: bool = LOOKAHEAD, concurrency: int = CONCURRENCY,
    temperature: float = TEMPERATURE, relay_token_file: str = RELAY_TOKEN_FILE, baseline: str = BASELINE,
    report_dir: str = REPORT_DIR, reference_api_key_file: str = REFERENCE_API_KEY_FILE,
    drafter_config: str = DRAFTER_CONFIG, include: list[str] = INCLUDE, checkpoint_wait: float = CHECKPOINT_WAIT,
    settle_seconds: float = SETTLE_SECONDS, threads: int = THREADS,
    diagnostics: bool = typer.Option(False, "--diagnostics", help="Also run the diagnostics: layer ablation, "
                                     "layer-offset probe, sliding switch, first divergences (drafter replays only)."),
    all_positions: bool = typer.Option(False, "--all-positions", help="Also score a block drafted at every position "
                                       "(all_positions_tau: every position weighed once, as training losses do)."),
):
    """Evaluate a drafter checkpoint: tau on the prompts, computing only what the store lacks.

    Example: dflash-eval run --target runs/tiny/target --drafter runs/tiny/drafter/step_400
    --prompts runs/tiny/prompts.jsonl --out results.json
    """
    _check_out(out)
    results = _evaluate(target=target, drafter=drafter, prompts=prompts, max_new_tokens=max_new_tokens, store=store,
                        dtype=dtype, device=device, sliding_semantics=sliding_semantics, thinking=thinking,
                        reference=reference, lookahead=lookahead, concurrency=concurrency, temperature=temperature,
                        relay_token_file=relay_token_file, baseline=baseline, report_dir=report_dir,
                        reference_api_key_file=reference_api_key_file,
                        until="diagnostics" if diagnostics else "scores", all_positions=all_positions,
                        threads=threads, **_checkpoint_options(drafter_config, include, checkpoint_wait, settle_seconds))
    _print_results(results)
    _write(results, out)


@app.command()
def stage(
    name: str = typer.Argument(..., help="fetch, references, features, drafts, scores or diagnostics."),
    target: str = TARGET, drafter: str = DRAFTER, prompts: str = PROMPTS, max_new_tokens: int = MAX_NEW,
    store: str = STORE, refresh: bool = typer.Option(False, "--refresh", help="Recompute it even if the store has it."),
    out: Path = typer.Option(None, "--out", help="Write the results JSON here."),
    dtype: str = DTYPE, device: str = DEVICE, sliding_semantics: str = SEMANTICS, thinking: bool = THINKING,
    reference: str = REFERENCE, lookahead: bool = LOOKAHEAD, concurrency: int = CONCURRENCY,
    temperature: float = TEMPERATURE, relay_token_file: str = RELAY_TOKEN_FILE,
    reference_api_key_file: str = REFERENCE_API_KEY_FILE,
    drafter_config: str = DRAFTER_CONFIG, include: list[str] = INCLUDE, checkpoint_wait: float = CHECKPOINT_WAIT,
    settle_seconds: float = SETTLE_SECONDS, threads: int = THREADS,
):
    """Run one stage by hand (and the stages it needs, from the store when they are there)."""
    from dflash_eval.flows.evaluate import STAGES

    if name not in STAGES:
        raise typer.BadParameter(f"one of {', '.join(STAGES)}, got {name!r}", param_hint="NAME")
    _check_out(out)
    results = _evaluate(target=target, drafter=drafter, prompts=prompts, max_new_tokens=max_new_tokens, store=store,
                        dtype=dtype, device=device, sliding_semantics=sliding_semantics, thinking=thinking,
                        reference=reference, lookahead=lookahead, concurrency=concurrency, temperature=temperature,
                        relay_token_file=relay_token_file, until=name, refresh=[name] if refresh else [],
                        reference_api_key_file=reference_api_key_file, threads=threads,
                        **_checkpoint_options(drafter_config, include, checkpoint_wait, settle_seconds))
    _print_results(results)
    _write(results, out)


@app.command()
def demo(
    store: str = STORE,
    out: Path = typer.Option(None, "--out", help="Write each step's results JSON into this folder."),
    threads: int = THREADS,
):
    """The embedded default: build (or reuse) the tiny target and drafter run, evaluate every saved
    step through the full flow, print tau per step. No server, no GPU, no downloads."""
    from dflash_core.tiny.build import default_cache_root, tiny_run

    _check_out(out, folder=True)
    _configure_threads(threads)  # before a first demo trains the tiny models
    tiny = tiny_run(default_cache_root(), log=typer.echo)
    typer.echo(f"tiny run: {tiny.root}")
    rows = []
    for checkpoint in tiny.drafter_steps:
        results = _evaluate(target=str(tiny.target_dir), drafter=str(checkpoint), prompts=str(tiny.prompts_file),
                            max_new_tokens=tiny.record["settings"]["max_new_tokens"], store=store,
                            dtype="float32", device="cpu", sliding_semantics="causal", thinking=False,
                            threads=threads)
        _print_results(results)
        _write(results, out / f"{checkpoint.name}.json" if out else None)
        rows.append((checkpoint.name, results))
    typer.echo("\nstep        tau macro  tau pooled  ran")
    for name, results in rows:
        ran = ", ".join(s for s, status in results["stages"].items() if status == "ran") or "nothing (all cached)"
        typer.echo(f"{name:<10}  {results['tau_macro']:9.3f}  {results['tau_pooled']:10.3f}  {ran}")


@app.command("serve-reference")
def serve_reference(
    target: str = TARGET,
    host: str = typer.Option("127.0.0.1", "--host", help="Address to listen on."),
    port: int = typer.Option(30000, "--port", help="Port to listen on (0: any free port)."),
    dtype: str = typer.Option("auto", "--dtype", help="auto (the checkpoint's own; float16 serves in float32, as "
                              "evaluations compute), float32, bfloat16 or float16: the target's compute dtype."),
    device: str = DEVICE,
    served_model_name: str = typer.Option(None, "--served-model-name",
                                          help="Model name in /v1/models and responses (default: the target folder name)."),
    api_key_file: str = typer.Option(None, "--api-key-file", help="File holding the API key clients must send "
                                     "(Authorization: Bearer), as SGLang's --api-key; /health needs none."),
    threads: int = typer.Option(None, "--threads", min=1, help="CPU threads each generation computes with "
                                "(default: $OMP_NUM_THREADS, else every core, fewer for a target this small that "
                                "decodes faster so; see tasks/threads.py)."),
):
    """Serve the target's greedy completions over HTTP (SGLang /generate, OpenAI /v1/completions)
    until killed: a reference server for tests and for machines without SGLang or vLLM.

    Example: dflash-eval serve-reference --target runs/tiny/target --port 30000
    """
    from dflash_core.reference.server import DTYPES, serve_reference as serve

    if dtype != "auto" and dtype not in DTYPES:
        raise typer.BadParameter(f"one of auto, {', '.join(DTYPES)}, got {dtype!r}", param_hint="--dtype")
    api_key = None
    if api_key_file is not None:
        try:
            api_key = Path(api_key_file).read_text().strip()
        except OSError as e:
            raise typer.BadParameter(f"cannot read {api_key_file} ({e.strerror})", param_hint="--api-key-file") from None
        if not api_key:
            raise typer.BadParameter(f"{api_key_file} is empty", param_hint="--api-key-file")
    try:
        if dtype == "auto":
            from dflash_eval.tasks.target import resolve_dtype

            choice = resolve_dtype(dtype, target)
            dtype = choice.name
            typer.echo(f"--dtype auto: {dtype} ({choice.note})" if choice.note else f"--dtype auto: {dtype}")
        _configure_threads(threads if threads is not None else _decoding_threads(target))
        serve(target, host=host, port=port, dtype=dtype, served_model_name=served_model_name, device=device,
              log=typer.echo, api_key=api_key)
    except (ValueError, OSError) as e:  # no such target, port in use
        typer.secho(f"error: {e}", err=True, fg="red")
        raise typer.Exit(2) from None


@app.command()
def notify(
    checkpoint: str = typer.Option(..., "--checkpoint", help="The saved checkpoint, as the evaluation fetches it: "
                                   "a relay URL (http://relay:8700/run1/step_1000) or a folder."),
    step: int = typer.Option(None, "--step", help="Its training step (shown with the event)."),
    api_url: str = typer.Option(None, "--api-url", help="Prefect API URL (default $PREFECT_API_URL)."),
):
    """For training scripts: announce a saved checkpoint (event dflash.checkpoint.saved), which starts
    its evaluation. Always exits 0 and within seconds: an unreachable server is only reported."""
    from dflash_eval.flows.notify import EVENT
    from dflash_eval.flows.notify import notify as send

    if send(checkpoint, step, api_url):
        typer.echo(f"sent {EVENT} for {checkpoint}")


@app.command()
def watch(
    relay: str = typer.Option(..., "--relay", help="The relay to look at (http://HOST:PORT)."),
    target: str = TARGET, prompts: str = PROMPTS, store: str = STORE, max_new_tokens: int = MAX_NEW,
    relay_token_file: str = RELAY_TOKEN_FILE,
    out: Path = typer.Option(None, "--out", help="Write what was started (JSON) here."),
):
    """Look at a relay once: start the evaluate-checkpoint deployment for each checkpoint not scored
    yet, oldest step first (what the watch-relay deployment does on its schedule). Needs a Prefect
    server with the deployment (`dflash-eval serve`)."""
    from dflash_eval.flows.watch import watch_relay

    started = watch_relay(relay=relay, target=_absolute(target), prompts=_absolute(prompts),
                          store=str(Path(store).resolve()) if store else None, max_new_tokens=max_new_tokens,
                          relay_token_file=relay_token_file)
    for run in started:
        typer.echo(f"{run['path']} (step {run['step']}): flow run {run['flow_run_id']}, attempt {run['attempt']}")
    if not started:
        typer.echo("nothing to start: every checkpoint is scored or being scored")
    _write(started, out)


@app.command()
def serve(
    target: str = TARGET, prompts: str = PROMPTS, store: str = STORE, max_new_tokens: int = MAX_NEW,
    relay: str = typer.Option(None, "--relay", help="Also watch this relay (http://HOST:PORT) and evaluate "
                              "checkpoints not scored yet, oldest step first."),
    watch_interval: float = typer.Option(300, "--watch-interval", help="Seconds between two looks at the relay."),
    dtype: str = DTYPE, device: str = DEVICE, sliding_semantics: str = SEMANTICS,
    baseline: str = BASELINE, drafter_config: str = DRAFTER_CONFIG, include: list[str] = INCLUDE,
    checkpoint_wait: float = CHECKPOINT_WAIT, settle_seconds: float = SETTLE_SECONDS,
    reference: str = REFERENCE, reference_api_key_file: str = REFERENCE_API_KEY_FILE, concurrency: int = CONCURRENCY,
    threads: int = typer.Option(None, "--threads", min=1, help="CPU threads each evaluation computes with (the "
                                "flow parameter `threads`; default: the cores / the machine's heavy-stage slots, "
                                "see tasks/threads.py)."),
    poll_seconds: float = typer.Option(0.25, "--poll-seconds", min=0.05, help="How often to ask the server for flow runs "
                                     "to start (Prefect's own default is 10 s; each ask is one small query)."),
    report_server: bool = typer.Option(True, "--report-server/--no-report-server", help="Serve <store>/report "
                                       "over HTTP from this process, for the report links of the Prefect UI."),
    report_host: str = typer.Option(DEFAULT_HOST, "--report-host", help="Address the report server listens on "
                                    "(0.0.0.0: every interface; the links then name this machine)."),
    report_port: int = typer.Option(DEFAULT_PORT, "--report-port", min=0, help="Port of the report server "
                                    "(0: any free one)."),
):
    """Serve the deployments on this machine without a work pool (Prefect's runner), until interrupted:
    evaluate-checkpoint (started by `dflash-eval notify` events), watch-relay (with --relay) and
    rerun-<stage>. Each flow run is a fork of a process that has imported torch and the flows already
    (flows/warm_runs.py). Needs a Prefect server: PREFECT_API_URL=http://HOST:4200/api. The report
    every run rewrites, <store>/report, is served at http://<report host>:<report port>/ ($DFLASH_REPORT_URL,
    if set, is the address the runs link to instead: a reverse proxy's)."""
    import os

    from dflash_eval.flows.deployments import serve_deployments

    if not os.environ.get("PREFECT_API_URL"):
        typer.secho("error: set PREFECT_API_URL to a Prefect server (`prefect server start`): deployments, "
                    "event triggers and schedules live there", err=True, fg="red")
        raise typer.Exit(2)
    parameters = {"dtype": dtype, "device": device, "sliding_semantics": sliding_semantics,
                  "reference": reference, "concurrency": concurrency,
                  "reference_api_key_file": _absolute(reference_api_key_file) if reference_api_key_file else None,
                  **_checkpoint_options(drafter_config, include, checkpoint_wait, settle_seconds)}
    if baseline:
        parameters["baseline"] = _absolute(baseline)
    if threads is not None:
        parameters["threads"] = threads
    # before the runner: the flow runs' processes copy this one's environment when they start
    server = _serve_report_to_runs(store_root(store) / "report", report_host, report_port) if report_server else None
    try:
        serve_deployments(poll_seconds=poll_seconds, target=_absolute(target), prompts=_absolute(prompts),
                          relay=relay, store=str(Path(store).resolve()) if store else None,
                          watch_interval=watch_interval, max_new_tokens=max_new_tokens, parameters=parameters)
    finally:
        if server is not None:
            server.stop()


@app.command("history")
def history_command(store: str = STORE):
    """Tau of every scored checkpoint in the store, by training step (checkpoints without one by when they
    were first scored, never by path), with the best one and regressions (a 95% interval entirely below the
    best earlier step's; a checkpoint without a step is never flagged: its place among the steps is unknown)."""
    from rich.console import Console
    from rich.table import Table

    from dflash_eval.flows.history import history
    from dflash_eval.storage import Store

    groups = history(Store(store))
    if not groups:
        typer.echo(f"no scored checkpoint in {Store(store).root}")
        return
    console = Console(width=160)
    for group in groups:
        table = Table(title=group.title)
        for column in ("step", "checkpoint", "tau macro", "95% CI", "tau pooled", "first scored (UTC)", ""):
            table.add_column(column)
        for row in group.rows:
            ci = row["tau_macro_ci95"]
            mark = "best" if row["best"] else "REGRESSION" if row["regression"] else "baseline" if row["baseline"] else ""
            step = "-" if row["step"] is None else str(row["step"])
            scored = f"{row['scored_at']:%Y-%m-%d %H:%M:%S}" if row["scored_at"] else "-"
            table.add_row("baseline" if row["baseline"] else step, row["label"], f"{row['tau_macro']:.3f}",
                          f"{ci[0]:.2f}-{ci[1]:.2f}" if ci else "-", f"{row['tau_pooled']:.3f}", scored, mark)
        console.print(table)


@app.command("report")
def report_command(
    store: str = STORE,
    out: Path = typer.Option(None, "--out", help="Folder to write report.html, report.md and img/*.png into "
                             "(with --serve, default <store>/report)."),
    last: int = typer.Option(3, "--last", min=1, help="How many of the newest checkpoints of each group the "
                             "acceptance curves, histograms and category table show (besides the baselines)."),
    serve: bool = typer.Option(False, "--serve", help="Then serve the folder over HTTP until Ctrl+C."),
    host: str = typer.Option(DEFAULT_HOST, "--host", help="With --serve: address to listen on (0.0.0.0: every "
                             "interface)."),
    port: int = typer.Option(DEFAULT_PORT, "--port", min=0, help="With --serve: port to listen on (0: any free one)."),
):
    """Write a report of every scored checkpoint in the store: tau by training step, acceptance by draft
    position, acceptance-length histograms, tau per category, diagnostics. report.html is self-contained
    (plots embedded); report.md shows the same with the plots in img/.

    Example: dflash-eval report --out report/
    Example: dflash-eval report --serve --host 0.0.0.0 --port 8765
    """
    from dflash_eval.flows.report import NothingToReport, write_report
    from dflash_eval.storage import Store

    if out is None and not serve:
        raise typer.BadParameter("give the folder to write the report into (or --serve: <store>/report)",
                                 param_hint="--out")
    out = store_root(store) / "report" if out is None else out
    server = _report_server(out, host, port, "--port") if serve else None  # a taken port fails before any work
    try:
        html_path = write_report(Store(store), out, last=last)
    except NothingToReport as e:
        if server is not None:
            server.stop()
        typer.echo(str(e), err=True)
        raise typer.Exit(1) from None
    typer.echo(f"report: {html_path}")
    typer.echo(f"markdown: {html_path.with_name('report.md')}")
    if server is not None:
        typer.echo(f"serving {out} at {server.url}report.html; Ctrl+C stops")
        server.serve_forever()


def _report_server(folder: Path, host: str, port: int, port_option: str) -> ReportServer:
    """A ReportServer of `folder` bound to host:port, or one line saying why not (and exit 2)."""
    try:
        return ReportServer(folder, host=host, port=port)
    except PortInUse as e:
        _fail(f"cannot serve the report: {e.strerror}; choose another port with {port_option} (0: any free one)")
    except OSError as e:  # an address this machine does not have, a port below 1024, ...
        _fail(f"cannot serve the report on {host}:{port}: {e.strerror or e}")


def _serve_report_to_runs(folder: Path, host: str, port: int) -> ReportServer:
    """Serve `folder` (the report every flow run rewrites) from this process and point the flow runs, which
    inherit this process's environment, at it with $DFLASH_REPORT_URL; keep a URL the user set (a proxy's)."""
    try:
        folder.mkdir(parents=True, exist_ok=True)  # the server starts before the first run writes the report
    except OSError as e:
        _fail(f"cannot create the report folder {folder}: {e.strerror}")
    server = _report_server(folder, host, port, "--report-port").start()
    if report_url() is not None:
        typer.echo(f"report server at {server.url}report.html; ${REPORT_URL_ENV} is set, so flow runs link to "
                   f"{report_url()}report.html")
    else:
        os.environ[REPORT_URL_ENV] = server.url
        typer.echo(f"report server at {server.url}report.html (flow runs link to it)")
    return server


@app.command("verify")
def verify_command(
    store: str = STORE,
    repair: bool = typer.Option(False, "--repair", help="Remove what is damaged or stale (entry markers, damaged "
                                "files, damaged feature arrays), so that the next run recomputes exactly that."),
):
    """Check every entry of the store: its entry.json, the sha256 of every file and of every feature array,
    chunk files, JSON that parses, and whether it was built on content that has changed since (stale).
    Prints each problem as `stage/key: what: why`; exits 1 if there is any, 0 if the store is clean.
    Reads every byte of the store (features included).

    Example: dflash-eval verify --store .dflash-store --repair
    """
    from dflash_eval.storage import Store
    from dflash_eval.storage.integrity import verify_store

    report = verify_store(Store(store), repair=repair)
    for problem in report.problems:
        typer.echo(str(problem))
    for name in report.incomplete:
        typer.echo(f"incomplete {name}: no entry.json (an interrupted run; the next run resumes it)")
    typer.echo(f"checked {report.entries} entries and {report.arrays} feature arrays in {Store(store).root}: "
               f"{len(report.problems)} problems")
    if repair and report.repaired:
        typer.echo(f"repaired: removed {len(report.repaired)} damaged or stale items; the next run recomputes "
                   "exactly these")
    for name in report.busy:
        typer.echo(f"not repaired {name}: another run is writing it; verify again when it is done")
    if report.problems:
        raise typer.Exit(1)


def _token(token_file: str | None) -> str | None:
    if token_file is None:
        return None
    token = Path(token_file).read_text().strip()
    if not token:
        raise typer.BadParameter(f"{token_file} is empty", param_hint="--token-file")
    return token


@relay_app.command("serve")
def relay_serve(
    root: Path = typer.Argument(None, help="Folder to serve checkpoints from (any depth); optional with --upstream."),
    upstream: str = typer.Option(None, "--upstream", help="Pull checkpoints through from this relay (http://HOST:PORT)."),
    upstream_token_file: str = typer.Option(None, "--upstream-token-file", help="File holding the upstream's token."),
    token_file: str = typer.Option(None, "--token-file", help="File holding the bearer token clients must send."),
    host: str = typer.Option("127.0.0.1", "--host"),
    port: int = typer.Option(8700, "--port"),
    state_dir: Path = typer.Option(None, "--state-dir", help="Digest cache and pulled-through files "
                                   "(default ~/.cache/dflash-eval/relay)."),
    settle_seconds: float = typer.Option(30, "--settle-seconds", help="A checkpoint is listed once none of its files "
                                         "changed for this long (trainers write no completion marker)."),
    max_rate_mb: float = typer.Option(None, "--max-rate-mb", help="Cap on MB/s sent over all downloads together "
                                      "(leave bandwidth to a trainer on the same link); default no cap."),
    max_connections: int = typer.Option(128, "--max-connections", help="Connections served at once; more get "
                                        "503 + Retry-After (one thread each, so this bounds the threads)."),
    max_connections_per_client: int = typer.Option(32, "--max-connections-per-client",
                                                   help="Connections served at once from one address (IPv6: one /64)."),
    request_timeout: float = typer.Option(30, "--request-timeout", help="Seconds a request may take to arrive whole, "
                                          "and an idle keep-alive connection stays open."),
):
    """Serve the checkpoints under ROOT over HTTP: Hugging Face folders (config.json + safetensors) and
    SpecForge saves, at any depth; only the files evaluation needs are hashed and sent.

    A checkpoint's URL is the relay's URL + its folder relative to ROOT, e.g.
    `dflash-eval run --drafter http://relay:8700/run1/step_1000 ...`.
    """
    import logging

    from dflash_eval.storage.relay.server import DEFAULT_STATE_DIR, RelayServer

    if root is None and upstream is None:
        raise typer.BadParameter("give a folder to serve, or --upstream", param_hint="ROOT")
    if root is not None and not root.is_dir():
        raise typer.BadParameter(f"{root} is not a directory", param_hint="ROOT")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    relay = RelayServer(root, host=host, port=port, token=_token(token_file), upstream=upstream,
                        upstream_token=_token(upstream_token_file), state_dir=state_dir or DEFAULT_STATE_DIR,
                        settle_seconds=settle_seconds, max_rate=max_rate_mb * 1e6 if max_rate_mb else None,
                        max_connections=max_connections, max_connections_per_client=max_connections_per_client,
                        request_timeout=request_timeout)
    typer.echo(f"relay listening on {relay.url}")
    try:
        relay.serve_forever()
    except KeyboardInterrupt:
        pass


@relay_app.command("ls")
def relay_ls(
    url: str = typer.Argument(..., help="The relay, http://HOST:PORT."),
    store: str = STORE,
    token_file: str = typer.Option(None, "--token-file", help="File holding the relay's bearer token."),
):
    """List a relay's checkpoints: path, step, size, and whether this store already holds them."""
    from rich.console import Console
    from rich.table import Table

    from dflash_eval.storage import Store
    from dflash_eval.storage.relay.client import RelayClient, RelayError

    try:
        client = RelayClient(url, token=_token(token_file))
        checkpoints = client.list_checkpoints()
        held = [Store(store).is_complete("fetch", client.manifest(c["path"])["key"]) for c in checkpoints]
    except RelayError as e:
        typer.secho(f"error: {e}", err=True, fg="red")
        raise typer.Exit(2) from None
    table = Table(title=f"{url}: {len(checkpoints)} checkpoints")
    for column in ("checkpoint", "step", "layout", "size (what evaluation fetches)", "in store"):
        table.add_column(column)
    for checkpoint, in_store in zip(checkpoints, held):
        table.add_row(f"{url.rstrip('/')}/{checkpoint['path']}", str(checkpoint["step"] if checkpoint["step"] is not None else "-"),
                      checkpoint.get("layout", "hf"), f"{checkpoint['total_bytes'] / 1e6:.1f} MB", "yes" if in_store else "no")
    Console(width=200).print(table)


@tiny_app.command("build")
def tiny_build(
    out: Path = typer.Option(..., "--out", help="Folder to write the target and drafter run into."),
    arch: str = typer.Option("qwen3", help="Target architecture: qwen3, or qwen3_5 (hybrid; also saved as a VLM)."),
    target_steps: int = typer.Option(None, help="Target training steps (default: the architecture's)."),
    drafter_steps: int = typer.Option(None, help="Drafter training steps (default 400)."),
    save_every: int = typer.Option(None, help="Save a drafter checkpoint every N steps (default 100)."),
    threads: int = THREADS,
):
    """Train a tiny target and a DFlash drafter run into OUT, and print tau per saved step.

    Example: dflash-eval tiny build --out runs/tiny
    """
    from dflash_core.tiny.build import TinyBuildSettings, build_tiny

    if arch not in ("qwen3", "qwen3_5"):
        raise typer.BadParameter(f"arch must be qwen3 or qwen3_5, got {arch!r}", param_hint="--arch")
    _configure_threads(threads)
    settings = TinyBuildSettings(arch=arch, target_steps=target_steps)
    training = settings.drafter_training
    if drafter_steps is not None:
        training = replace(training, steps=drafter_steps)
    if save_every is not None:
        training = replace(training, save_every=save_every)
    run = build_tiny(out, replace(settings, drafter_training=training), log=typer.echo)
    typer.echo(f"\nbuilt in {run.record['timings_s']['total']:.0f} s: target {run.target_dir}, "
               f"drafter run {run.root / 'drafter'}, prompts {run.prompts_file}")
    typer.echo("step      tau")
    for step, tau in zip(run.record["steps"], run.record["tau"].values()):
        typer.echo(f"{step:>6}  {tau:5.2f}")


def main():
    try:
        app()
    finally:
        # The command is done. The interpreter's last garbage collection would walk the millions of objects
        # torch, transformers and Prefect leave (1.5 s on 2 cores, after every other exit hook) to free memory
        # the process is about to return anyway; frozen objects are left out of it. atexit hooks (Prefect's
        # server shutdown, log flushing) still run, and so do destructors of objects freed by reference count.
        import gc

        gc.freeze()


if __name__ == "__main__":
    main()
