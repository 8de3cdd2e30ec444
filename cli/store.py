"""What the store holds: `history` (tau by step), `report` (plots, served on demand) and `verify` (every byte
checked, optionally repaired)."""

import json
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer

from dflash_eval.services.report_server import DEFAULT_HOST, DEFAULT_PORT

from .common import bind_report_server, fail, open_existing_store
from .options import StepCost, StoreRoot, example

app = typer.Typer()


TrainingLogForRelay = Annotated[str | None, typer.Option(
    "--training-log", metavar="DIR", help="The training log of checkpoints fetched from a relay (their run folder "
    "is not on this machine); local checkpoints' run folders are found by themselves.")]


JsonOutput = Annotated[bool, typer.Option("--json", help="Print JSON for scripts instead of tables (warnings still go "
                                          "to stderr).")]


@app.command("history", epilog=example("dflash-eval history --store .dflash-store"))
def history_command(store: StoreRoot = None, training_log: TrainingLogForRelay = None, as_json: JsonOutput = False):
    """Tau of every scored checkpoint in the store, by training step (checkpoints without one by when they
    were first scored, never by path), with the best one and regressions (a 95% interval entirely below the
    best earlier step's; a checkpoint without a step is never flagged: its place among the steps is unknown).
    Where the training run's log is found, the trainer's own number as logged (a column named by its tag, e.g.
    `trainer eval/simulated_acc_len`) and what the trainer's numbers imply beside tau, and the alarm's flags (the
    trainer's best is not the best by tau, training accuracy rising while tau does not, a train/eval gap), or,
    where none is raised, what each check found. Beside tau, what the checkpoints' sections add (a DFlash2 drafter's:
    the tau of its unary head alone and what its candidate selector adds to it). Baselines (--baseline) are rows of
    their own, except a save of a training run of the series, which stays a step of the curve."""
    from rich.console import Console
    from rich.table import Table

    from dflash_eval.reporting.history import shown_beside_tau
    from dflash_eval.reporting.training_side import logged_column, side_of, training_sides

    opened = open_existing_store(store)
    groups = history_telling_what_is_left_out(opened)
    if as_json:
        typer.echo(json.dumps(history_json(opened, groups, training_log), indent=2))
        return
    if not groups:
        typer.echo(f"no scored checkpoint in {opened.location}")
        return
    console = Console(width=160)
    for group in groups:
        sides = training_sides(group, relay_logs(group, training_log))
        beside = [column for _, column in shown_beside_tau(group.rows)]  # the sections' values (DFlash2's selector)
        table = Table(title=group.title)
        logged_header, logged_cells = logged_column(sides, group.rows)  # the trainer's own number, as logged
        for column in ("step", "checkpoint", "tau macro", "95% CI", "tau pooled",
                       *(c.short for c in beside), "first scored (UTC)", "",
                       *((logged_header, "trainer implies", "flags") if sides else ())):
            table.add_column(column)
        for index, row in enumerate(group.rows):
            ci = row.tau_macro_ci95
            step = "-" if row.step is None else str(row.step)
            scored = f"{row.scored_at:%Y-%m-%d %H:%M:%S}" if row.scored_at else "-"
            cells = ["baseline" if row.baseline else step, row.label, f"{row.tau_macro:.3f}",
                     f"{ci[0]:.2f}-{ci[1]:.2f}" if ci else "-", f"{row.tau_pooled:.3f}"]
            cells += [c.cell(row.values.get(c.name)) for c in beside]
            cells += [scored, row.mark]
            if sides:
                side = side_of(sides, row)
                implied = side.implied(row) if side else None
                cells += [logged_cells[index], f"{implied[0]:.2f}" if implied else "-",
                          ", ".join(f.kind for f in side.flags_at(row.step)) if side else ""]
            table.add_row(*cells)
        console.print(table)
        for side in sides:
            for flag in side.flags:
                console.print(f"{flag.kind.upper()} (step {flag.step}): {flag.message}", markup=False)
            if not side.flags:
                console.print(side.no_flag_line(), markup=False)
            for problem in side.log.problems:
                console.print(f"warning: {problem}", markup=False)


def history_json(store, groups: list, training_log: str | None) -> dict:
    """What `history` shows, for scripts: {"store", "series": [{"key", "title", "setting", "rows": [...], "flags",
    "checks"}]}, each row with its step, checkpoint, tau and interval, its verdict, the values its sections set beside
    tau (a DFlash2 drafter's: its unary head's tau and the selector's lift), its paired difference to the previous step and to the best other checkpoint
    (`vs_previous_step`, `vs_best`: reporting.history.comparisons, or null) and, where the training log is found,
    the trainer's own number as logged (`trainer_logged`: {"tag", "value"}), what the trainer's numbers imply and
    the alarm's flags at that step; the series' `checks`: what each check of the alarm found, per training run."""
    from dflash_eval.reporting.history import BASELINE, BEST, PREVIOUS_STEP, comparisons
    from dflash_eval.reporting.training_side import side_of, training_sides

    series = []
    for group in groups:
        sides = training_sides(group, relay_logs(group, training_log))
        rows = []
        for row in group.rows:
            side = side_of(sides, row)
            implied = side.implied(row) if side else None
            logged = side.logged(row) if side else None
            against = {c.against: c.as_dict() for c in comparisons(group, row) if c.against != BASELINE}
            rows.append({
                "series": group.series, "step": row.step, "checkpoint": row.label, "source": row.source,
                "checkpoint_key": row.checkpoint, "scores_key": row.scores, "tau_macro": row.tau_macro,
                "tau_macro_ci95": list(row.tau_macro_ci95) if row.tau_macro_ci95 else None,
                "tau_pooled": row.tau_pooled, "all_positions_tau": row.all_positions_tau,
                "first_scored": row.scored_at.isoformat() if row.scored_at else None, "baseline": row.baseline,
                "best": row.best, "regression": row.regression,
                "vs_previous_step": against.get(PREVIOUS_STEP), "vs_best": against.get(BEST),
                "trainer_logged": {"tag": logged[0], "value": logged[1]} if logged else None,
                "trainer_implies": implied[0] if implied else None,
                "flags": [f.kind for f in side.flags_at(row.step)] if side else [],
                # those of its sections only (a DFlash2 drafter's selector): other rows stay as they were
                **row.values,
            })
        series.append({"key": group.series, "title": group.title, "setting": group.setting,
                       "sliding_semantics": group.sliding_semantics, "chosen_block_size": group.chosen_block_size,
                       "features_key": group.features, "rows": rows,
                       "flags": [{"kind": f.kind, "step": f.step, "message": f.message}
                                 for side in sides for f in side.flags],
                       "checks": [{"log": side.log.folder, **c.as_dict()} for side in sides for c in side.checks]})
    return {"store": store.location, "series": series}


def history_telling_what_is_left_out(store) -> list:
    """The store's history; each damaged or stale row it leaves out is one warning line on stderr."""
    from dflash_eval.reporting.history import history

    problems: list[str] = []
    groups = history(store, problems)
    for problem in problems:
        typer.echo(f"warning: {problem}", err=True)
    return groups


def relay_logs(group, training_log: str | None) -> dict[str, str]:
    """--training-log for the group's training runs that are not folders on this machine (relay URLs)."""
    from dflash_eval.reporting.training_side import training_run_of

    if not training_log:
        return {}
    return {run: training_log for run in {training_run_of(r.source) for r in group.candidates} if "://" in run}


@app.command("report", epilog=example("dflash-eval report --store .dflash-store --out report/"))
def report_command(
    store: StoreRoot = None,
    out: Annotated[Path | None, typer.Option("--out", help="Folder to write report.html, report.md and img/*.png "
                                             "into (with --serve, default <store>/report).")] = None,
    last: Annotated[int, typer.Option("--last", min=1, help="How many of the newest checkpoints of each group the "
                                      "acceptance curves, histograms and category table show (besides the "
                                      "baselines).")] = 3,
    serve: Annotated[bool, typer.Option("--serve", help="Then serve the folder over HTTP until Ctrl+C.")] = False,
    host: Annotated[str, typer.Option("--host", help="With --serve: address to listen on (0.0.0.0: every "
                                      "interface).")] = DEFAULT_HOST,
    port: Annotated[int, typer.Option("--port", min=0, max=65535, help="With --serve: port to listen on (0: any free "
                                      "one).")] = DEFAULT_PORT,
    step_cost: StepCost = None,
    training_log: TrainingLogForRelay = None,
):
    """Write a report of every scored checkpoint in the store: tau by training step, acceptance by draft
    position, acceptance-length histograms, tau per category, diagnostics. report.html is self-contained
    (plots embedded); report.md shows the same with the plots in img/.

    With --serve and no --out it writes <store>/report and serves it:
    `dflash-eval report --serve --host 0.0.0.0 --port 8765`.
    """
    from dflash_eval.flows.checks import InputError, read_step_costs, writable_problem
    from dflash_eval.reporting.report import NothingToReport, write_report

    try:
        step_costs = read_step_costs(step_cost, block_sizes=[])  # any block sizes: the report shows those it has
    except InputError as e:
        raise typer.BadParameter(str(e).removeprefix(f"--step-cost {step_cost}: "), param_hint="--step-cost") from None
    if out is None and not serve:
        raise typer.BadParameter("give the folder to write the report into (or --serve: <store>/report)",
                                 param_hint="--out")
    opened = open_existing_store(store)
    out = opened.root / "report" if out is None else out
    if problem := writable_problem(out, folder=True):
        fail(f"--out: {problem}")
    server = bind_report_server(out, host, port, "--port") if serve else None  # a taken port fails before any work
    try:
        groups = history_telling_what_is_left_out(opened)
        logs = {run: folder for group in groups for run, folder in relay_logs(group, training_log).items()}
        html_path = write_report(opened, out, last=last, groups=groups, step_costs=step_costs, training_logs=logs)
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


@app.command("verify", epilog=example("dflash-eval verify --store .dflash-store --repair"))
def verify_command(
    store: StoreRoot = None,
    repair: Annotated[bool, typer.Option("--repair", help="Remove what is damaged or stale (entry markers, damaged "
                                         "files, damaged feature arrays), so that the next run recomputes exactly "
                                         "that.")] = False,
    as_json: JsonOutput = False,
):
    """Check every entry of the store: its entry.json, the sha256 of every file and of every feature array,
    chunk files, JSON that parses, and whether it was built on content that has changed since (stale).
    Prints each problem as `stage/key: what: why`; exits 1 if there is any, 0 if the store is clean. Without
    --repair it changes nothing. Reads every byte of the store (features included)."""
    from dflash_eval.storage.integrity import verify_store

    opened = open_existing_store(store)
    report = verify_store(opened, repair=repair)
    if as_json:
        typer.echo(json.dumps({"store": opened.location, "entries": report.entries, "arrays": report.arrays,
                               "problems": [asdict(p, dict_factory=_problem_fields) for p in report.problems],
                               "incomplete": report.incomplete, "busy": report.busy,
                               "repaired": [asdict(p, dict_factory=_problem_fields) for p in report.repaired]},
                              indent=2))
        if report.problems:
            raise typer.Exit(1)
        return
    for problem in report.problems:
        typer.echo(str(problem))
    for name in report.incomplete:
        typer.echo(f"incomplete {name}: no entry.json (a run was interrupted, or removed a damaged entry's marker "
                   "to recompute it; the next run that needs it resumes it)")
    typer.echo(f"checked {report.entries} entries and {report.arrays} feature arrays in {opened.location}: "
               f"{len(report.problems)} problem{'' if len(report.problems) == 1 else 's'}")
    if repair and report.repaired:
        typer.echo(f"repaired: removed {len(report.repaired)} damaged or stale items; the next run recomputes "
                   "exactly these")
    for name in report.busy:
        typer.echo(f"not repaired {name}: another run is writing it; verify again when it is done")
    if report.problems and not repair:
        typer.echo("nothing was changed; `dflash-eval verify --repair` removes what is damaged or stale, so that the "
                   "next run recomputes exactly that")
    if report.problems:
        raise typer.Exit(1)


def _problem_fields(items: list[tuple]) -> dict:
    """A verify problem as --json prints it: stage, key, kind, what, reason (not the repair's own records)."""
    return {name: value for name, value in items if name in ("stage", "key", "kind", "what", "reason")}
