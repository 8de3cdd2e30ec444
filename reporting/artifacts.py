"""What a flow run shows in the Prefect UI once a checkpoint is scored.

Artifacts are keyed per series (reporting.history: series_key, what makes taus comparable), so the UI's artifact
page keeps one versioned history per series across flow runs:

  <series>-scores    table: this checkpoint's metrics
  <series>-history   table: every scored checkpoint of the series by step, with intervals, the best
                     one, baselines and regressions (reporting.history); with a training log, the
                     trainer's own number as logged (a column named by its tag), what the trainer's
                     numbers imply and the train/eval alarm's flags (reporting.training_side)
  <series>-summary   markdown: this checkpoint's tau (on published benchmarks, per benchmark in
                     z-lab's layout, with its notes) against the previous step, the best one and the
                     baselines (the paired differences: reporting.history.comparisons), with the
                     regression flag, the training run beside it (its logged numbers, the flags or
                     what the checks found, the TensorBoard run), the tau-over-steps plot where the report
                     is served, and the commands that rerun a stage of this checkpoint
  <series>-report    link: the store's report (reporting.report), rewritten by this run: its HTTP address
                     when one serves it ($DFLASH_REPORT_URL, set by `dflash-eval serve`), else the file

Progress artifacts of long stages (tasks/progress.py) have no key: they show on their flow run's page only.
"""

import hashlib
import shlex
from pathlib import Path

from prefect import get_run_logger
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact

from dflash_core.sections import AROUND
from dflash_eval.services.report_server import report_url
from dflash_eval.storage import Store
from dflash_eval.storage.records import write_bytes_atomic
from dflash_eval.storage.schema import Stage

from .history import (
    BASELINE,
    BEST,
    PREVIOUS_STEP,
    Comparison,
    Group,
    HistoryRow,
    comparisons,
    find_group,
    history,
    shown_beside_tau,
)
from .results import Results
from .sections import Comparisons, Training
from .training_side import TrainingSide, logged_column, side_of

# the stages a summary offers to rerun (fetch and references are shared by every checkpoint of a series)
RERUN_STAGES = (Stage.FEATURES, Stage.DRAFTS, Stage.SCORES, Stage.DIAGNOSTICS)


def publish(results: Results, store: Store, report_dir: Path, groups: list[Group] | None = None,
            training: dict[int, list[TrainingSide]] | None = None,
            step_costs: dict[int, float] | None = None) -> dict[str, str]:
    """Rewrite the report (step_costs: --step-cost, for its projected speedups) and publish the scores, history,
    summary and report-link artifacts of `results` (with what add_history added); returns their keys. groups: history(store), when the caller has it;
    training: {group index: each training run with a log beside it} (reporting.tracker.track), when the caller read
    them."""
    logger = get_run_logger()
    assert results.series is not None and results.scores is not None, "published once scored"
    keys = {name: f"{results.series['key']}-{name}" for name in ("scores", "history", "summary", "report")}
    groups = history(store) if groups is None else groups
    found = find_group(groups, results.stage_keys["scores"])
    side = side_of((training or {}).get(groups.index(found[0]), ()), found[1]) if found is not None else None
    create_table_artifact(key=keys["scores"], table=score_table(results),
                          description=f"Scores of {results.drafter['source']}")
    if found is not None:
        group = found[0]
        described = f"{group.title}: tau by step {sparkline(group)}; this run {results.scores.tau_macro:.3f}"
        if group.best:
            described += f", best {group.best.label} {group.best.tau_macro:.3f}"
        create_table_artifact(key=keys["history"], table=history_table(group, side), description=described)
    report = plot = None
    try:
        from .report import tau_plot_path, write_report  # matplotlib: imported only when a run has scores to show

        report = write_report(store, report_dir, groups=groups, step_costs=step_costs,  # the store's scores, read once
                              training=training or None)
        if found is not None and any(r.step is not None for r in found[0].rows):
            plot = kept_copy(report.parent, tau_plot_path(groups.index(found[0]) + 1))
    except Exception as e:  # noqa: BLE001 - the scores are stored; a report failure must not hide them
        logger.error(f"the report could not be written to {report_dir} ({type(e).__name__}: {e}); "
                     "the scores are in the store: rerun `dflash-eval report --out DIR` once fixed")
    # $DFLASH_REPORT_URL serves the store's own report folder, not one given elsewhere
    default_dir = (store.root / "report").resolve()
    served = report_url() if report is not None and report.parent.resolve() == default_dir else None
    create_markdown_artifact(key=keys["summary"], markdown=summary_markdown(results, found, report, served, plot,
                                                                           reruns=rerun_deployments_exist()),
                             description="This checkpoint against the previous step, the best one and the baselines")
    if report is not None:
        link = f"{served}{report.name}" if served else report.resolve().as_uri()
        create_link_artifact(key=keys["report"], link=link, link_text=link,
                             description="Report of every checkpoint scored in this store")
        logger.info(f"report: {link}")
    return keys


def add_history(results: Results, found: tuple[Group, HistoryRow] | None, side: TrainingSide | None) -> None:
    """Add to a run's results (what the flow returns and `run --out` writes) what the series' history says of
    its checkpoint: `comparisons` (reporting.history.comparisons: against the previous step, the best other
    checkpoint and the baselines, --baseline's first; [] when its row is gone) and, beside a training log, in
    `training`: the trainer's own number at this step (`trainer_logged`: {"tag", "value"}), what each check of
    the alarm found (`checks`) and, where no flag was raised, the line that says what was checked (`no_flag`)."""
    baseline = (results.get("baseline") or {}).get("key")
    results.add(Comparisons([c.as_dict() for c in comparisons(*found, baseline)] if found is not None else []))
    training = results.section(Training)
    if isinstance(training, Training) and side is not None and found is not None:
        logged = side.logged(found[1])
        training.training["trainer_logged"] = {"tag": logged[0], "value": logged[1]} if logged else None
        training.training["checks"] = [c.as_dict() for c in side.checks]
        training.training["no_flag"] = None if training.training["flags"] else side.no_flag_line()


def kept_copy(folder: Path, name: str) -> str:
    """A copy of the file `folder/name` named by its content (img/tau-by-step-<sha>.png), never overwritten: a
    summary that links it shows what it showed when it was written, whatever later runs redraw."""
    data = (folder / name).read_bytes()
    path = Path(name)
    kept = path.with_name(f"{path.stem.split('-', 1)[-1]}-{hashlib.sha256(data).hexdigest()[:12]}{path.suffix}")
    if not (folder / kept).exists():
        write_bytes_atomic(folder / kept, data)
    return kept.as_posix()


EIGHTHS = " ▏▎▍▌▋▊▉"
SPARKS = "▁▂▃▄▅▆▇█"


def bar(tau: float, top: float, width: int = 24) -> str:
    """A horizontal bar of `tau` on a scale from 1 (nothing accepted) to `top`, in eighths of a character."""
    eighths = round(8 * width * max(0.0, tau - 1) / max(top - 1, 1e-9))
    return "█" * (eighths // 8) + EIGHTHS[eighths % 8].strip()


def sparkline(group: Group) -> str:
    """Tau of the group's checkpoints in history order as one line of block characters (lowest to highest),
    the best one followed by `*`: a picture of tau by step that any text field shows."""
    rows = group.candidates
    if not rows:
        return ""
    low, high = min(r.tau_macro for r in rows), max(r.tau_macro for r in rows)
    marks = [SPARKS[round((len(SPARKS) - 1) * (r.tau_macro - low) / (high - low)) if high > low else -1]
             + ("*" if r.best else "") for r in rows]
    return "".join(marks)


def tau_chart(group: Group, this: HistoryRow | None) -> list[str]:
    """The summary's tau by step: one line per checkpoint of the series (then its baselines) with a bar, the best
    one and this run marked; plain text, so the UI shows it with no server running."""
    top = max(r.tau_macro for r in group.rows)
    width = max(len(r.label) for r in group.rows)
    lines = []
    for row in group.rows:
        marks = [m for m, holds in (("best", row.best), ("baseline", row.baseline), ("<- this run", row is this))
                 if holds]
        lines.append(f"{row.label:<{width}}  {row.tau_macro:6.3f}  {bar(row.tau_macro, top):<24}  {' '.join(marks)}"
                     .rstrip())
    return lines


def history_table(group: Group, side: TrainingSide | None = None) -> list[dict]:
    """One row per scored checkpoint of a series, in history order (by step), then its baselines; the values its
    sections set beside tau (a DFlash2 drafter's: its unary head's tau and the selector's lift); with its training
    run's side, the trainer's own number at each step as logged (a column named by its tag), what the trainer's
    numbers imply and the alarm's flags."""
    rows = []
    mine = {id(r) for r in side.rows} if side else set()
    top = max(r.tau_macro for r in group.rows)
    beside = [column for _, column in shown_beside_tau(group.rows)]
    logged_header, logged_cells = logged_column([side] if side else [], group.rows)  # the trainer's own number
    for index, row in enumerate(group.rows):
        ci = row.tau_macro_ci95
        table = {"checkpoint": row.label, "step": "-" if row.step is None else str(row.step),
                 "tau macro": f"{row.tau_macro:.3f}", "tau (bar from 1)": bar(row.tau_macro, top),
                 "95% CI": f"{ci[0]:.2f}-{ci[1]:.2f}" if ci else "-",
                 "tau pooled": f"{row.tau_pooled:.3f}"}
        table.update({column.heading: column.cell(row.values.get(column.name)) for column in beside})
        table["verdict"] = row.mark
        if side is not None:
            implied = side.implied(row) if id(row) in mine else None
            table[logged_header] = logged_cells[index]
            table["trainer implies"] = f"{implied[0]:.2f}" if implied else "-"
            table["flags"] = ", ".join(f.kind for f in side.flags_at(row.step)) if id(row) in mine else ""
        rows.append(table)
    return rows


def rerun_commands(results: Results) -> list[str]:
    """The commands that recompute one stage of this checkpoint through the served deployments, each broken
    after the deployment's name so that it fits a card."""
    drafter = results.drafter["source"]
    return [f"prefect deployment run 'evaluate-checkpoint/rerun-{stage}' \\\n    -p drafter={shlex.quote(drafter)}"
            for stage in RERUN_STAGES]


def rerun_deployments_exist() -> bool:
    """Whether this Prefect server has the rerun deployments (`dflash-eval serve` or prefect.yaml made them)."""
    from prefect import get_client
    from prefect.exceptions import ObjectNotFound

    try:
        with get_client(sync_client=True) as client:
            client.read_deployment_by_name(f"evaluate-checkpoint/rerun-{RERUN_STAGES[0]}")
    except ObjectNotFound:
        return False
    except Exception as e:  # noqa: BLE001 - the summary goes out without the commands rather than not at all
        get_run_logger().warning(f"could not ask the server for the rerun deployments ({e}): the summary leaves "
                                 "their commands out")
        return False
    return True


def score_table(results: Results) -> list[dict]:
    """One row per metric of a results record: tau, its interval and what it was scored on, per draft position;
    then each section's about the checkpoint's own numbers (on published benchmarks, each benchmark's tau and
    interval, and each group's Average, in place of the taus by prompt category), the taus by category and the
    speedups, and each section's about the evaluation around it (the baseline, the block sweep)."""
    scores, context = results.scores, results.context()
    assert scores is not None, "a scores table is made once scored"
    low, high = scores.tau_macro_ci95
    rows: list[tuple[str, object]] = [
        ("tau macro", f"{scores.tau_macro:.3f}"),
        ("tau macro 95% CI", f"{low:.3f} - {high:.3f}"),
        ("tau pooled", f"{scores.tau_pooled:.3f}"),
        ("block size", scores.block_size),
        ("prompts scored", f"{scores.n_scored_prompts} of {scores.n_prompts}"),
        ("decode steps", scores.n_steps),
        ("clipped last steps", scores.clipped_last_steps),
        ("sliding semantics", scores.sliding_semantics),
        ("served", results.served["label"]),
    ]
    intervals = scores.position_acceptance_ci95 or [None] * len(scores.position_acceptance)
    counts = scores.position_counts or {}
    for k, (p, ci) in enumerate(zip(scores.position_acceptance, intervals), start=1):
        value = "-" if p is None else f"{p:.3f}"
        if p is not None and ci is not None:
            value += f" (95% CI {ci[0]:.2f}-{ci[1]:.2f}"
            value += f"; {counts['accepted'][k - 1]} of {counts['reached'][k - 1]} blocks)" if counts else ")"
        rows.append((f"P(position {k} accepted | earlier accepted)", value))
    sections = results.sections()
    rows += [row for s in sections if s.ORDER < AROUND for row in s.metrics(context)]
    if not any(s.SHOWS_CATEGORIES for s in sections):
        rows += [(f"tau on {category}", f"{tau:.3f}") for category, tau in scores.tau_by_category.items()]
    rows += [(f"speedup upper bound, drafter costs {c} target forwards (verifying a block as cheap as a decode step)",
              f"{x:.2f}x") for c, x in scores.projected_speedup.items()]
    rows += [row for s in sections if s.ORDER >= AROUND for row in s.metrics(context)]
    return [{"metric": name, "value": str(value)} for name, value in rows]


def summary_markdown(results: Results, found, report: Path | None, served: str | None = None,
                     plot: str | None = None, reruns: bool = False) -> str:
    """This checkpoint's tau and what its sections say of its own numbers (published benchmarks, a DFlash2
    drafter's selector); against the previous step, the best other checkpoint and the baselines, and tau by
    checkpoint as text; then what its sections say of the evaluation around it (the training run). A checkpoint
    without a training step has no previous step and is never called a regression (reporting.history). served: the
    report's HTTP address; plot: the path under it of this series' tau-by-step plot (a copy named by its content),
    which the summary then shows; reruns: the rerun deployments exist, so the summary gives the commands that rerun
    a stage."""
    drafter, scores, context = results.drafter, results.scores, results.context()
    assert scores is not None, "a summary is made once scored"
    low, high = scores.tau_macro_ci95
    lines = [f"## {drafter['source']}" + (f" (step {drafter['step']})" if drafter["step"] is not None else ""),
             "", f"**tau {scores.tau_macro:.3f}** (95% CI {low:.2f}-{high:.2f}), pooled {scores.tau_pooled:.3f}, "
             f"block {scores.block_size}, {scores.n_scored_prompts} prompts"
             + ("" if results.served["label"] == "greedy" else f", {results.served['label']}"), ""]
    sections = results.sections()
    lines += [line for s in sections if s.ORDER < AROUND for line in s.markdown(context)]
    lines += series_markdown(found, (results.get("baseline") or {}).get("key"))
    lines += [line for s in sections if s.ORDER >= AROUND for line in s.markdown(context)]
    ran = [s for s, status in results.stages.items() if status == "ran"]
    lines += ["", f"Stages that ran: {', '.join(ran) or 'none (all cached)'}."]
    if report is not None:
        if served:
            if plot:
                lines += ["", f"![tau by training step]({served}{plot})"]
            lines += ["", f"Report: [{served}{report.name}]({served}{report.name})"]
        else:
            lines.append(f"Report: `{report}`")
    if reruns:
        lines += ["", "Rerun one stage of this checkpoint:", "", "```", *rerun_commands(results), "```"]
    return "\n".join(lines)


def series_markdown(found: tuple[Group, HistoryRow] | None, baseline: str | None) -> list[str]:
    """The summary's lines on the checkpoint in its series: against the previous step, the best other checkpoint
    and the baselines (`baseline`: the run's --baseline, a checkpoint key), with the regression flag, and tau by
    checkpoint as text."""
    if found is None:
        return ["No history for this checkpoint (its store entries were removed)."]
    lines = []
    group, row = found
    compared = comparisons(group, row, baseline)
    if compared:
        lines += ["| | checkpoint | step | tau macro | 95% CI | this run's tau minus it (paired 95% CI) |",
                  "|---|---|---|---|---|---|"]
        lines.append(f"| this | {row.label} | {row.step if row.step is not None else '-'} | {row.tau_macro:.3f} | "
                     f"{_interval(row.tau_macro_ci95)} | - |")
        for names, c in merged(compared):
            other = c.other
            difference = f"{c.difference:+.3f}" + (
                f" ({c.difference_ci95[0]:+.2f} to {c.difference_ci95[1]:+.2f})" if c.difference_ci95 else "")
            lines.append(f"| {names} | {other.label} | {other.step if other.step is not None else '-'} | "
                         f"{other.tau_macro:.3f} | {_interval(other.tau_macro_ci95)} | {difference} |")
        lines.append("")
    if row.regression:
        lines.append("**REGRESSION**: worse than the best earlier step on the same references (the paired 95% "
                     "interval of the difference lies below 0).")
    elif row.best:
        lines.append("Best step of this run so far." if row.step is not None else
                     "Best checkpoint so far (it has no training step).")
    elif row.step is None:
        lines.append("No training step: its place among the steps is unknown, so it is not judged a regression.")
    elif not any(c.against == PREVIOUS_STEP for c in compared):
        lines.append("No earlier step to compare with.")
    else:
        lines.append("No regression: not worse than the best earlier step on the same references (the paired "
                     "95% interval of the difference reaches 0 or above).")
    return lines + ["", "Tau by checkpoint in this series (bars from 1, nothing accepted):", "", "```",
                    *tau_chart(group, row), "```"]


# how the summary names what a comparison is against (reporting.history.Comparison.against)
AGAINST = {PREVIOUS_STEP: "previous step", BEST: "best other checkpoint", BASELINE: "baseline"}


def merged(compared: list[Comparison]) -> list[tuple[str, Comparison]]:
    """One line per other checkpoint, in the order of their first comparison, named by every role it holds
    ("previous step, best other": the previous step is the best other checkpoint)."""
    lines: list[tuple[list[str], Comparison]] = []
    for c in compared:
        same = next((names for names, first in lines if first.other is c.other), None)
        if same is None:
            lines.append(([AGAINST[c.against]], c))
        else:
            same.append(AGAINST[c.against])
    return [(", ".join(n.removesuffix(" checkpoint") if len(names) > 1 else n for n in names), c)
            for names, c in lines]


def _interval(ci: tuple[float, float] | None) -> str:
    return f"{ci[0]:.2f}-{ci[1]:.2f}" if ci else "-"
