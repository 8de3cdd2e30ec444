"""Evaluations by hand: `run`, `stage` and `demo`, each a run of the evaluate-checkpoint flow in this process."""

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, cast

import typer

from dflash_eval.flows.disk_full import is_storage_full, storage_full_message
from dflash_eval.flows.settings import Evaluation, Settings, SettingsError, by_group, flag_name

from .common import configure_threads, fail, local_server_needed, open_store, start_local_server, write_results
from .options import Drafter, Drafters, Stage, StoreRoot, Threads, example, settings_options
from .stopping import stopped_by_signals, stops

if TYPE_CHECKING:
    from dflash_eval.reporting.results import Results

app = typer.Typer()


def evaluate(evaluation: Evaluation, out: Path | None = None) -> "Results":
    """Check the evaluation and the results file `out` (one clear error, nothing written), then run the flow with
    it, handing the flow run the checked evaluation."""
    results = evaluate_each([evaluation], out)[0]
    assert results is not None  # one checkpoint: its failure exited
    return results


def evaluate_each(evaluations: list[Evaluation], out: Path | None = None) -> "list[Results | None]":
    """Evaluate several checkpoints in this process, each a flow run of its own: every one's inputs are checked
    before any runs (a bad one: one clear error naming the flag, nothing computed), then they run in turn, sharing
    Prefect's temporary server and what the process loaded (the target's head). A checkpoint that fails while it
    runs (a refused save, a relay gone) is said in one line and the next one runs; with several, its results are
    None. `out`: the results file (one checkpoint) or folder (several, checked here, written by the caller)."""
    configure_threads(evaluations[0].compute.threads)
    from prefect.states import State

    from dflash_core.drafter_config import DrafterError
    from dflash_core.metrics import ImpossibleTau
    from dflash_eval.flows.checks import InputError, check_evaluation, check_out
    from dflash_eval.flows.evaluate import evaluation_flow
    from dflash_eval.services.reference.backends import BackendError
    from dflash_eval.services.relay.client import RelayError
    from dflash_eval.storage.object_storage import ObjectStorageError
    from dflash_eval.tasks.drafts import CheckpointDamaged
    from dflash_eval.tasks.fetch import CheckpointError

    # errors of the inputs, or of a server or store that failed mid-run, each said in one line (Prefect's console
    # tracebacks of them are left out; the run logs keep them): CheckpointError: fetch refused what it got;
    # RelayError: the relay went away mid-download (a rerun resumes); CheckpointDamaged: weights changed in the
    # store (a rerun fetches them again); BackendError: a reference server failed, refused or changed;
    # ObjectStorageError: the store's server went away or refused us; ImpossibleTau: the drafts or scores stage
    # refused to store a tau no decoding gives (a bug or numbers that are not finite upstream, named in the message)
    explained = (InputError, DrafterError, CheckpointError, RelayError, CheckpointDamaged, BackendError,
                 ObjectStorageError, ImpossibleTau)
    try:
        check_out(out, folder=len(evaluations) > 1)
        checked = [check_evaluation(evaluation, flag_name) for evaluation in evaluations]
    except explained as e:
        fail(str(e))
    for note in dict.fromkeys(filter(None, (_new_series_note(c) for c in checked))):
        typer.secho(note, err=True, fg="yellow")
    start_local_server()  # after the checks: bad input costs no server start-up
    found: list[Results | None] = []
    for inputs in checked:
        evaluation = inputs.evaluation
        try:
            with stopped_by_signals(), _heartbeats_unless_asked(), \
                    _console_tracebacks_hidden(lambda e: isinstance(e, (*explained, *stops())) or is_storage_full(e)):
                # a State (with **parameters, Prefect's types take the call for one without return_state)
                state = cast(State, evaluation_flow(inputs)(**evaluation.parameters(), return_state=True))
                found.append(state.result())
            _say_where_the_run_is(state.state_details.flow_run_id)
        except explained as e:
            if len(evaluations) == 1:
                fail(str(e))
            typer.secho(f"error: {evaluation.drafter}: {e}", err=True, fg="red")
            found.append(None)
        except OSError as e:
            if not is_storage_full(e):
                raise
            fail(storage_full_message(e, open_store(evaluation.output.store)))
    return found


def _new_series_note(checked) -> str | None:
    """The line saying that this evaluation starts a new series beside one differing in one setting only
    (reporting.new_series), when its references are made here (not given, and a stage that needs them runs)."""
    from dflash_eval.reporting.new_series import new_series_note, this_run
    from dflash_eval.storage import Store

    e, served = checked.evaluation, checked.served
    if e.inputs.references is not None or not checked.runs("references"):
        return None
    sampling = None if served.sampling.greedy else {**served.sampling.identity(), "samples": served.samples,
                                                    "seed": served.seed}
    ours = this_run(e.inputs.max_new_tokens, e.generation.lookahead,
                    checked.dtype.name if e.generation.reference == "local" else None, sampling, e.inputs.protocol)
    return new_series_note(Store(checked.store_location), str(e.inputs.target), e.inputs.prompt_set, ours)


def _say_where_the_run_is(flow_run_id) -> None:
    """The flow run's page in the Prefect UI, on stdout (Prefect's own "View at" line goes to stderr), when a
    server of its own serves it: the temporary server's pages end with this command."""
    from prefect.utilities.urls import url_for

    if flow_run_id is not None and not local_server_needed() and (url := url_for("flow-run", obj_id=flow_run_id)):
        typer.echo(f"flow run: {url}")


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


@contextmanager
def _console_tracebacks_hidden(explained: Callable[[BaseException], bool]) -> Iterator[None]:
    """Prefect logs a failed task's and flow's traceback on the console; for an error this command explains in
    one line, the console shows Prefect's one-line summaries only. A refusal a task returns as its Failed state
    (tasks/stage.py: refusals_fail_cleanly, e.g. weights that are not finite) is not repeated at all: Prefect
    would log it three times before the command's own line says it. The run logs keep all of it: Prefect's
    API handler (prefect.flow_runs, prefect.task_runs) formats a record before the root logger's console
    handler, where this filter sits, sees it."""
    import logging

    from prefect.logging.handlers import PrefectConsoleHandler

    refused: set[str] = set()  # the refusals' messages

    def drop_traceback(record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if message.startswith("Task run failed with state: "):  # only a refusal ends a task as a returned state
            if (said := _failed_message(message)) is not None:
                refused.add(said)
            return False
        if message.startswith("Finished in state Failed(") and any(said in message for said in refused):
            return False
        # (an exc_info without an exception: Prefect logs a returned failed state "with its traceback", which
        # printed a stray `NoneType: None`)
        if record.exc_info and (record.exc_info[1] is None or explained(record.exc_info[1])):
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


def _failed_message(logged: str) -> str | None:
    """The message of the Failed state Prefect logs as `... Failed(message='...', type=FAILED, ...)`, or None."""
    import ast
    import re

    found = re.search(r"""Failed\(message=('(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*")""", logged)
    try:
        return ast.literal_eval(found.group(1)) if found else None
    except (ValueError, SyntaxError):
        return None


def _print_results(results: "Results") -> None:
    """What an evaluation found (reporting.results.Results): each stage's status and key, tau, then each of its
    sections as it shows itself on the command line (dflash_core.sections)."""
    from rich import box
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"drafter {Path(results.drafter['source']).name}", show_header=True)
    for column in ("stage", "status", "key"):
        table.add_column(column)
    for stage, status in results.stages.items():
        table.add_row(stage, status, results.stage_keys[stage][:12])
    console = Console()
    console.print(table)
    if (scores := results.scores) is not None:
        low, high = scores.tau_macro_ci95
        console.print(
            f"tau macro {scores.tau_macro:.3f} (95% CI {low:.2f}-{high:.2f}), pooled {scores.tau_pooled:.3f} "
            f"(block {scores.block_size}, {scores.n_scored_prompts} references"
            + ("" if results.served["label"] == "greedy" else f", {results.served['label']}")
            + (f", {scores.n_steps} steps, {scores.clipped_last_steps} clipped last steps" if not results.sampled else
               f", {scores.n_steps:.1f} steps and {scores.clipped_last_steps:.1f} clipped last steps expected")
            + f"; {scores.sliding_semantics} sliding layers)"
        )
    context = results.context()
    for section in results.sections():
        for line in section.lines(context):
            console.print(line, markup=False, soft_wrap=not section.WRAPS)
        for shown in section.tables(context):
            drawn = Table(title=shown.title, box=box.HEAVY_HEAD if shown.framed else None)
            for index, column in enumerate(shown.columns):
                drawn.add_column(column, justify="left" if index < shown.text_columns else "right")
            for index, row in enumerate(shown.rows):
                drawn.add_row(*row, style="bold" if index in shown.strong else None)
            console.print(drawn)
            for note in shown.notes:
                console.print(note, markup=False)


def _evaluate_by_hand(drafters: list[str], settings: Settings, out: Path | None, until: str = "scores",
                      refresh: list[str] | None = None) -> None:
    """`run` and `stage`: evaluate each checkpoint, print what it found, write the results JSON (several: one file
    each in the --out folder, and a table of them all at the end)."""
    checkpoints = checkpoints_named(drafters, settings.output.store, settings.checkpoints.settle_seconds)
    found = evaluate_each([settings.evaluation(checkpoint, until, refresh) for checkpoint in checkpoints], out=out)
    for results in found:
        if results is not None:
            _print_results(results)
    if len(checkpoints) == 1:
        assert found[0] is not None  # one checkpoint: its failure exited
        write_results(found[0], out)
        return
    names = results_names(checkpoints)
    for name, results in zip(names, found):
        if results is not None and out:
            write_results(results, out / f"{name}.json")
    typer.echo(f"\n{'checkpoint':<32}  {'step':>6}  {'tau macro':>9}  ran")
    for name, results in zip(names, found):
        if results is None:
            typer.echo(f"{name:<32}  {'-':>6}  {'failed':>9}  (its error is above)")
            continue
        step = results["drafter"]["step"]
        ran = ", ".join(s for s, status in results["stages"].items() if status == "ran") or "nothing (all cached)"
        typer.echo(f"{name:<32}  {'-' if step is None else step:>6}  {results['tau_macro']:9.3f}  {ran}")
    if None in found:
        fail(f"{found.count(None)} of {len(checkpoints)} checkpoints failed (each said why above); the others' results "
             "are in the store")


def checkpoints_named(drafters: list[str], store: str | None, settle_seconds: float | None) -> list[str]:
    """The checkpoints the --drafter options name, in order. A folder on this machine that is no checkpoint itself
    but holds some (a training run's) stands for its finished ones, in step order (those without a step last, by
    path); one still being written is left out. Anything else is one checkpoint, as given (fetch checks it)."""
    from dflash_core.checkpoint_files import checkpoint_files
    from dflash_eval.services.relay.local_checkpoints import LocalCheckpoints
    from dflash_eval.tasks.fetch import settle_seconds_default

    found = []
    for drafter in drafters:
        folder = Path(drafter)
        if "://" in drafter or not folder.is_dir() or checkpoint_files(folder) is not None:
            found.append(drafter)
            continue
        settled = settle_seconds_default() if settle_seconds is None else settle_seconds
        listed = LocalCheckpoints(folder.resolve(), settled, open_store(store).digest_cache()).scan()
        listed.sort(key=lambda c: (c["step"] is None, c["step"] or 0, c["path"]))
        if not listed:
            found.append(drafter)  # fetch says why it is no checkpoint
            continue
        typer.echo(f"{drafter}: {len(listed)} finished checkpoints, in step order: "
                   + ", ".join(c["path"] for c in listed))
        found += [str(folder.resolve() / c["path"]) for c in listed]
    return found


def results_names(checkpoints: list[str]) -> list[str]:
    """A file name per checkpoint for the --out folder: its folder's name, with its parent's when two share one."""
    names = [Path(c.rstrip("/")).name for c in checkpoints]
    return [name if names.count(name) == 1 else "-".join(Path(c.rstrip("/")).parts[-2:])
            for name, c in zip(names, checkpoints)]


ResultsOut = Annotated[Path | None, typer.Option(
    "--out", rich_help_panel="Store and output", help="Write the results JSON here (its folder is created if need "
    "be; checked before any work).")]


@app.command(epilog=example("dflash-eval run --target TINY/target --drafter TINY/drafter",
                            "--prompts TINY/prompts.jsonl --out results")
              + "\n\nTINY stands for the tiny run's folder: `dflash-eval demo` prints it (tiny run: ...), `dflash-eval "
                "tiny build --out TINY` makes one. --drafter TINY/drafter evaluates each of its saves; "
                "TINY/drafter/step_400 one of them.")
@settings_options()
def run(
    drafter: Drafters, settings: Settings, out: ResultsOut = None,
    diagnostics: Annotated[bool, typer.Option("--diagnostics", rich_help_panel="Scoring", help="Also run the "
                                              "diagnostics: layer ablation, layer-offset probe, sliding switch, first "
                                              "divergences (drafter replays only).")] = False,
):
    """Evaluate drafter checkpoints: tau on the prompts, computing only what the store lacks. Several --drafter
    options, or a training run's folder, evaluate each checkpoint in turn in this one process: each its own flow
    run with its own results, the target's head loaded once."""
    _evaluate_by_hand(drafter, settings, out, until="diagnostics" if diagnostics else "scores")


@app.command(epilog=example("dflash-eval stage features --refresh --target runs/tiny/target",
                            "--drafter runs/tiny/drafter/step_400 --prompts runs/tiny/prompts.jsonl"))
@settings_options()
def stage(
    name: Annotated[Stage, typer.Argument(metavar="NAME", help="fetch, references, features, drafts, scores or "
                                          "diagnostics.")],
    drafter: Drafter, settings: Settings, out: ResultsOut = None,
    refresh: Annotated[bool, typer.Option("--refresh", help="Recompute it even if the store has it.")] = False,
):
    """Run one stage by hand (and the stages it needs, from the store when they are there)."""
    _evaluate_by_hand([drafter], settings, out, until=str(name), refresh=[str(name)] if refresh else None)


@app.command(epilog=example("dflash-eval demo --store .dflash-store --out demo-results"))
def demo(
    store: StoreRoot = None,
    out: Annotated[Path | None, typer.Option("--out", help="Write each step's results JSON into this folder (created "
                                             "if need be).")] = None,
    threads: Threads = None,
):
    """The embedded default: build (or reuse) the tiny target and drafter run, evaluate every saved step through
    the full flow, print tau per step beside what the drafter's trainer logged, and where to look next. A first
    demo evaluates each save as the drafter's training writes it, as a served flow follows a training run: the
    first tau shows while the drafter still trains. No server, no GPU, no downloads."""
    import queue
    import threading
    import time

    from dflash_eval.flows.checks import InputError, check_out
    from dflash_eval.tasks.threads import thread_budget
    from dflash_eval.tiny.build import BUILD_RECORD, TinyRun, default_cache_root, tiny_run, tiny_run_folder

    from .tiny import BuildProgress

    try:
        check_out(out, folder=True)
    except InputError as e:
        fail(str(e))
    started = time.monotonic()
    configure_threads(threads)  # before a first demo trains the tiny models
    # Prefect's temporary server starts meanwhile: its first start after an install takes a while (a minute on a
    # busy machine) and would otherwise come after the training; the first evaluation waits for it.
    start_local_server(wait=False)
    settings = demo_build_settings()
    folder = tiny_run_folder(default_cache_root(), settings)
    typer.echo(f"tiny run: {folder}" + ("" if (folder / BUILD_RECORD).exists() else
                                        " (building it; each drafter save is evaluated as soon as it is written)"))
    # What the building thread hands over: each drafter save once written (a Path), then the finished run (TinyRun),
    # or what stopped it (an exception). A cached run hands over only itself.
    handed: queue.Queue[Path | TinyRun | BaseException] = queue.Queue()
    budget = thread_budget()
    rows: list[tuple[str, Results]] = []
    first_tau: float | None = None

    def build(progress: BuildProgress) -> None:
        try:
            # Threads, deliberately: the build computes on one thread leased from the command's budget, the target
            # and the drafter alike. One, because trained weights depend on the thread count (float sums taken in
            # another order: a target trained on 2 threads differs from one trained on 1, and tau at step_400 with
            # it), and the test suite's parallel builds (tests/trained_runs.py) and README's figures are made on
            # one: every machine builds the same run. It costs time on idle cores (2 threads trained the target in
            # 78 s instead of 128 s on 2 idle cores). The drafter's lease (drafter_compute) holds that one thread
            # while the evaluations of its saves lease the rest of the budget (on 2 cores: one each). The saves are
            # evaluated with no settle wait: this thread says when each is written, as a trainer's `notify` does.
            with budget.lease(1):
                handed.put(tiny_run(default_cache_root(), settings, log=typer.echo, progress=progress,
                                    on_save=handed.put, drafter_compute=lambda: budget.lease(1)))
        except BaseException as e:  # noqa: BLE001 - said by the thread that prints
            handed.put(e)

    def evaluate_save(checkpoint: Path) -> None:
        nonlocal first_tau
        root = checkpoint.parent.parent  # <tiny run>/drafter/step_N
        try:
            evaluation = Evaluation.checked(by_group({
                "target": str(root / "target"), "drafter": str(checkpoint), "prompts": str(root / "prompts.jsonl"),
                "max_new_tokens": settings.max_new_tokens, "store": store, "dtype": "float32", "threads": threads,
                "settle_seconds": 0}), flag_name)
        except SettingsError as e:
            fail(str(e))
        results = evaluate(evaluation)
        _print_results(results)
        write_results(results, out / f"{checkpoint.name}.json" if out else None)
        rows.append((checkpoint.name, results))
        elapsed = time.monotonic() - started
        first_tau = elapsed if first_tau is None else first_tau
        typer.echo(f"{checkpoint.name}: tau macro {results['tau_macro']:.3f}, {elapsed:.0f} s into the demo")

    with BuildProgress() as progress:
        threading.Thread(target=build, args=(progress,), name="tiny build", daemon=True).start()
        while not isinstance(item := handed.get(), TinyRun):
            if isinstance(item, BaseException):
                raise item
            # a save the drafter's training just wrote, evaluated while the training goes on
            last = item.name == f"step_{settings.drafter_training.steps}"
            typer.echo(f"{item.name} written {time.monotonic() - started:.0f} s into the demo: evaluating it"
                       + (" (the drafter's last save)" if last else " while the drafter trains on"))
            evaluate_save(item)
    tiny = item
    for checkpoint in tiny.drafter_steps:  # those not handed over while they were written (all, when cached)
        if checkpoint.name not in {name for name, _ in rows}:
            evaluate_save(checkpoint)
    _print_demo_table(rows)
    _print_next_steps(tiny, rows, store)
    assert first_tau is not None  # the run has saves
    typer.echo(f"demo: first tau {first_tau:.0f} s after the start, the last {time.monotonic() - started:.0f} s")


def demo_build_settings():
    """The tiny run `demo` builds or reuses: dflash_eval.tiny.build.TinyBuildSettings' defaults (tests give smaller
    ones)."""
    from dflash_eval.tiny.build import TinyBuildSettings

    return TinyBuildSettings()


def _print_demo_table(rows: "list[tuple[str, Results]]") -> None:
    """tau per step, beside what the drafter's trainer logged at that step (its held-out teacher-forced accuracy,
    the acceptance length its per-position accuracies imply), and the train/eval alarm's flags."""
    typer.echo("\nstep        tau macro     95% CI  tau pooled  trainer eval acc  trainer implies  ran")
    for name, results in rows:
        at = (results.get("training") or {}).get("at_step") or {}
        accuracy = at.get("eval_accuracy") if at.get("eval_accuracy") is not None else at.get("accuracy")
        implied = at.get("implied")
        low, high = results["tau_macro_ci95"]
        ran = ", ".join(s for s, status in results["stages"].items() if status == "ran") or "nothing (all cached)"
        typer.echo(f"{name:<10}  {results['tau_macro']:9.3f}  {f'{low:.2f}-{high:.2f}':>9}  {results['tau_pooled']:10.3f}  "
                   f"{'-' if accuracy is None else f'{accuracy:.3f}':>16}  "
                   f"{'-' if implied is None else f'{implied:.2f}':>15}  {ran}")
    training = rows[-1][1].get("training") or {}  # the last evaluation's view of the whole run
    if training.get("log"):
        for flag in training.get("flags", []):
            typer.echo(f"{flag['kind'].upper()} (step {flag['step']}): {flag['message']}")
        if not training.get("flags") and training.get("no_flag"):
            typer.echo(training["no_flag"])  # what each of the alarm's checks found, with its numbers
    for problem in training.get("problems", []):
        typer.echo(f"warning: {problem}")


def _print_next_steps(tiny, rows: "list[tuple[str, Results]]", store: str | None) -> None:
    """Where the results are and what to run next: the store's report, history, and TensorBoard over the tiny run's
    training log (the trainer's scalars and ours, tau by step)."""
    import shlex

    from dflash_eval.tiny.build import TRAINER_LOG

    opened = open_store(store)
    training = rows[-1][1].get("training") or {}
    logs = Path(training["tensorboard"]).parent if training.get("tensorboard") else tiny.drafter_run / TRAINER_LOG
    named = store if store is not None else opened.location if opened.remote else os.path.relpath(opened.location)
    store_option = shlex.quote(named)
    typer.echo("\nnext:")
    typer.echo(f"  the report (every checkpoint in the store, plots):  {(opened.root / 'report' / 'report.html').resolve()}")
    typer.echo(f"  tau by step, the best step, the alarm:              dflash-eval history --store {store_option}")
    typer.echo(f"  tau beside the trainer's own log, in TensorBoard:   tensorboard --logdir {shlex.quote(str(logs))}")
    typer.echo(f"  the run's saves, by hand:                           dflash-eval run --target "
               f"{shlex.quote(str(tiny.target_dir))} --drafter {shlex.quote(str(tiny.drafter_run))} --prompts "
               f"{shlex.quote(str(tiny.prompts_file))} --max-new-tokens {tiny.record['settings']['max_new_tokens']} "
               f"--store {store_option}")
