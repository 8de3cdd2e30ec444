"""Tau in the team's tracker: a TensorBoard run of our own beside the trainer's.

The run (--tensorboard DIR; by default `<training run>/runs/dflash-eval`, so that `tensorboard --logdir
<training run>/runs` shows it beside SpecForge's) is a projection of the store: each write rewrites it
whole from reporting.history, so re-evaluating a step replaces its points instead of adding a second one, and
a run killed mid-write leaves the previous projection (the new event file is complete before it is put in
place, the old ones are removed after). Our event files end in TRACKER_SUFFIX, so the trainer's log reader
(dflash_eval.reporting.training_log) never takes them for the trainer's.

Scalars, at each checkpoint's training step, one number per checkpoint under PREFIX (greedy at the drafter's
block size) or PREFIX/<setting> (a sampled setting, a chosen block size: dflash_core.sampling.Served's label,
"greedy, blocks of 4"): tau_macro, tau_macro_ci95_low/high, tau_pooled, tau_pooled_ci95_low/high, each section's
of its scores.json (dflash_core.sections: all_positions_tau when scored with --all-positions; a DFlash2 drafter's
selector/unary_tau_macro, the tau of its unary head's argmax alone, and selector/lift, tau_macro minus it) and,
where the trainer's log implies one, trainer_implied_acceptance. The series by draft position are under BY_POSITION
(BY_POSITION/<setting>): acceptance_at_position/<k> (P(position k accepted | earlier ones accepted)) and the
sections' (teacher_forced_accuracy/<k> with --all-positions; for DFlash2 selector/selector_accuracy/<k>,
selector/argmax_accuracy/<k>, selector/candidate_recall/<k>, where a decode step reached k). The gap alarm's flags
are text, PREFIX/flags.

TensorBoard's default view (Time Series, Scalars) groups cards by the tag's first component, sorted, and opens
the first two groups: PREFIX's first, tau_macro its first card (only all_positions_tau, a DFlash2 drafter's
selector/lift and selector/unary_tau_macro and other settings' tau series sort before it), and the cards by position in their own group after it (they used to be
PREFIX/acceptance_at_position/<k>, ..., seven cards and more in front of tau: every write rewrites the run whole
from the store, so the next evaluation of any step of a training run renames them in its TensorBoard and MLflow
runs; nothing reads our runs back). The run also holds a Custom Scalars layout
(custom_scalars_layout; TensorBoard's "Custom Scalars" tab), first tau beside the trainer's own acceptance
metric on one chart: its tag regexes match across runs, ours and the trainer's; then the sections' charts.

With a tracking URI (--mlflow), the same points go to an MLflow run of ours (experiment "dflash-eval", one
run per training run, tagged with it), rewritten the same way: a new run, then the old one deleted.
"""

import os
import re
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from dflash_core.sections import Chart, sections_of
from dflash_eval.reporting.training_log import TRACKER_SUFFIX, TRAINER_ACCEPTANCE, read_training_log
from dflash_eval.storage import read_json

from . import sections as _sections  # noqa: F401 - registers the sections scores.json may hold
from .history import Group
from .sections import TrainingJson
from .training_side import TrainingSide, holds_training_log, training_run_of, training_sides

PREFIX = "dflash_eval"
BY_POSITION = "dflash_eval_by_position"  # the series by draft position: a tag group after PREFIX's
MLFLOW_EXPERIMENT = "dflash-eval"
MLFLOW_RUN_TAG = "dflash_eval.training_run"  # the training run an MLflow run of ours shows


def default_tracker_folder(run: str) -> Path | None:
    """<run>/runs/dflash-eval for a local training run folder (one holding a trainer's log) we may write into;
    None otherwise: a folder of checkpoints without a log is not a training run to add a TensorBoard run to."""
    if "://" in run or not holds_training_log(Path(run)):
        return None
    runs = Path(run) / "runs"
    writable = os.access(runs if runs.is_dir() else Path(run), os.W_OK)
    return runs / "dflash-eval" if writable else None


def series_prefixes(groups: list[Group]) -> dict[int, str]:
    """Group index -> its tag prefix: PREFIX for greedy at the drafter's block, PREFIX/<setting> otherwise;
    groups that would share a prefix (other prompts, another target) add their title."""
    prefixes = {i: PREFIX if g.setting == "greedy" else f"{PREFIX}/{_tag(g.setting)}" for i, g in enumerate(groups)}
    shared = {p for p in prefixes.values() if list(prefixes.values()).count(p) > 1}
    return {i: f"{p}/{_tag(groups[i].title)}" if p in shared else p for i, p in prefixes.items()}


def by_position(prefix: str) -> str:
    """The prefix of a series' tags by draft position: PREFIX/<setting> -> BY_POSITION/<setting>."""
    return BY_POSITION + prefix[len(PREFIX):]


_PER_POSITION = re.compile(r"/\d+$")  # _scalars' names by draft position end in /<k>, no other does


@dataclass(frozen=True)
class Projection:
    """What a tracker shows of one training run: scalars (tag, training step, value) and the flags' text
    (tag, training step, markdown), in step order; the charts of the sections among them (series prefix, chart), in
    the order they were first met."""

    scalars: list[tuple[str, int, float]]
    texts: list[tuple[str, int, str]]
    charts: list[tuple[str, Chart]] = field(default_factory=list)

    @property
    def tags(self) -> list[str]:
        return sorted({tag for tag, _, _ in self.scalars})


def projection(groups: list[Group], run: str, sides: dict[int, TrainingSide]) -> Projection:
    """Every stepped checkpoint of training run `run` (reporting.training_side.training_run_of) in `groups`, as
    tracker points; sides: {group index: its TrainingSide}, for what the trainer's numbers imply and the flags."""
    prefixes = series_prefixes(groups)
    scalars, texts, charts = [], [], []
    for index, group in enumerate(groups):
        rows = [r for r in group.candidates if r.step is not None and training_run_of(r.source) == run]
        side = sides.get(index)
        for row in sorted(rows, key=lambda r: r.step or 0):
            assert row.step is not None
            scores = read_json(Path(row.scores_path))
            for name, value in _scalars(row, scores, side).items():
                prefix = by_position(prefixes[index]) if _PER_POSITION.search(name) else prefixes[index]
                scalars.append((f"{prefix}/{name}", row.step, value))
            charts += [(prefixes[index], chart) for shown in sections_of(scores) for chart in shown.charts()
                       if (prefixes[index], chart) not in charts]
            if flags := side.flags_at(row.step) if side else []:
                texts.append((f"{prefixes[index]}/flags", row.step,
                              "\n\n".join(f"**{f.kind}**: {f.message}" for f in flags)))
    return Projection(scalars, texts, charts)


def write_tensorboard(folder: Path, points: Projection) -> None:
    """Rewrite the TensorBoard run in `folder` with `points` (the module docstring: never half written)."""
    from torch.utils.tensorboard import SummaryWriter

    folder.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="dflash-eval-tensorboard-"))
    try:
        writer = SummaryWriter(log_dir=str(staging), filename_suffix=TRACKER_SUFFIX)
        for tag, step, value in points.scalars:
            writer.add_scalar(tag, value, global_step=step)
        for tag, step, text in points.texts:
            writer.add_text(tag, text, global_step=step)
        writer.add_custom_scalars(custom_scalars_layout(points))
        writer.close()
        (written,) = staging.glob(f"events.out.tfevents.*{TRACKER_SUFFIX}")
        # copied under a name TensorBoard does not read, then renamed: a reader never sees half a file
        partial = folder / f".writing-{os.getpid()}"
        shutil.copyfile(written, partial)
        os.replace(partial, folder / written.name)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    for old in folder.glob(f"events.out.tfevents.*{TRACKER_SUFFIX}"):
        if old.name != written.name:
            old.unlink(missing_ok=True)


LAYOUT_TAU = "dflash-eval: tau beside the trainer"  # the Custom Scalars tab's first category
TAU_BESIDE_TRAINER = "tau (dflash-eval) beside the trainer's acceptance"  # ... and its first chart
# that chart's tag regexes (TensorBoard matches each from a tag's start, in every run): tau_macro of every
# series, what the trainer's numbers imply, and the trainer's own acceptance metric under each name
# training_log reads it by
TAU_BESIDE_TRAINER_TAGS = (rf"^{PREFIX}/(?:.+/)?tau_macro$", rf"^{PREFIX}/(?:.+/)?trainer_implied_acceptance$",
                           *(f"^{re.escape(name)}$" for name in TRAINER_ACCEPTANCE))


def custom_scalars_layout(points: Projection) -> dict[str, dict[str, list]]:
    """TensorBoard's Custom Scalars layout of our run (SummaryWriter.add_custom_scalars' form: {category: {chart:
    ["Multiline", tag regexes] or ["Margin", [value, lower, upper tags]]}}), in the order the tab shows it:
    LAYOUT_TAU first, its first chart tau beside the trainer's acceptance (TAU_BESIDE_TRAINER), then tau with its
    interval per series; then the series by draft position; then the sections' charts (a DFlash2 drafter's
    selector), each where some tag it draws was written."""
    tags = set(points.tags)
    series = sorted((tag.removesuffix("/tau_macro") for tag in tags
                     if tag.endswith("/tau_macro") and tag.startswith(f"{PREFIX}/")), key=lambda p: (p != PREFIX, p))

    def named(title: str, prefix: str) -> str:
        return title if prefix == PREFIX else f"{title} ({prefix[len(PREFIX) + 1:]})"

    tau: dict[str, list] = {TAU_BESIDE_TRAINER: ["Multiline", list(TAU_BESIDE_TRAINER_TAGS)]}
    for p in series:
        if {f"{p}/tau_macro_ci95_low", f"{p}/tau_macro_ci95_high"} <= tags:
            tau[named("tau_macro with its 95% interval", p)] = [
                "Margin", [f"{p}/tau_macro", f"{p}/tau_macro_ci95_low", f"{p}/tau_macro_ci95_high"]]
    layout: dict[str, dict[str, list]] = {LAYOUT_TAU: tau, LAYOUT_BY_POSITION: {}}
    for p in series:
        if any(tag.startswith(f"{by_position(p)}/acceptance_at_position/") for tag in tags):
            layout[LAYOUT_BY_POSITION][named("acceptance at draft position k (given the earlier ones)", p)] = [
                "Multiline", [f"^{re.escape(by_position(p))}/acceptance_at_position/" + r"\d+$"]]
        for prefix, chart in points.charts:
            regexes = [_chart_regex(p, tag) for tag in chart.tags]
            if prefix == p and any(re.match(regex, tag) for regex in regexes for tag in tags):
                layout.setdefault(chart.group, {})[named(chart.title, p)] = ["Multiline", regexes]
    return {category: charts for category, charts in layout.items() if charts}


LAYOUT_BY_POSITION = "dflash-eval: by draft position"  # the Custom Scalars tab's category of the series by position


def _chart_regex(prefix: str, tag: str) -> str:
    """A section's chart tag (dflash_core.sections.Chart) as the regex of its series' tag: a series by draft
    position (`name/\\d+`) under the series' by-position prefix, any other tag exactly."""
    if tag.endswith(r"/\d+"):
        return f"^{re.escape(by_position(prefix))}/{tag}$"
    return f"^{re.escape(f'{prefix}/{tag}')}$"


def write_mlflow(tracking_uri: str, run: str, points: Projection) -> str:
    """Rewrite training run `run`'s MLflow run, in experiment MLFLOW_EXPERIMENT, tagged with the training run:
    the same metrics at the same steps, the flags as tags; the previous one is deleted once the new one is
    complete (MLflow appends a metric logged twice at a step: a rewrite replaces). Returns the run's id."""
    from mlflow.entities import Metric, RunTag
    from mlflow.tracking import MlflowClient

    if tracking_uri.startswith(("http://", "https://")):  # MLflow's client retries a dead server for minutes
        import requests

        try:
            requests.get(f"{tracking_uri.rstrip('/')}/health", timeout=10).raise_for_status()
        except requests.RequestException as e:
            raise OSError(f"the MLflow server at {tracking_uri} does not answer ({type(e).__name__})") from None
    client = MlflowClient(tracking_uri)
    experiment = client.get_experiment_by_name(MLFLOW_EXPERIMENT)
    experiment_id = experiment.experiment_id if experiment else client.create_experiment(MLFLOW_EXPERIMENT)
    previous = client.search_runs([experiment_id], filter_string=f"tags.`{MLFLOW_RUN_TAG}` = '{run}'")
    created = client.create_run(experiment_id, run_name=f"dflash-eval {Path(run).name}",
                                tags={MLFLOW_RUN_TAG: run})
    run_id = created.info.run_id
    now = int(time.time() * 1000)
    metrics = [Metric(tag, value, now, step) for tag, step, value in points.scalars]
    for start in range(0, len(metrics), 1000):  # MLflow's batch limit
        client.log_batch(run_id, metrics=metrics[start:start + 1000])
    tags = [RunTag(f"{tag}/step_{step}", text[:5000]) for tag, step, text in points.texts]
    if tags:
        client.log_batch(run_id, tags=tags)
    client.set_terminated(run_id)
    for old in previous:
        client.delete_run(old.info.run_id)
    return run_id


def _scalars(row, scores: dict, side: TrainingSide | None) -> dict[str, float]:
    """A checkpoint's scalars, by name under its series' prefix."""
    values = {"tau_macro": row.tau_macro, "tau_pooled": row.tau_pooled}
    for name in ("tau_macro", "tau_pooled"):
        if interval := scores.get(f"{name}_ci95"):
            values[f"{name}_ci95_low"], values[f"{name}_ci95_high"] = interval
    for k, p in enumerate(scores.get("position_acceptance") or [], start=1):
        if p is not None:
            values[f"acceptance_at_position/{k}"] = p
    for shown in sections_of(scores):  # all positions, a generation's numbers (DFlash2's selector), ...
        values.update(shown.scalars())
    if side is not None and (implied := side.implied(row)) is not None:
        values["trainer_implied_acceptance"] = implied[0]
    return values


def _tag(text: str) -> str:
    # what both trackers accept in a name (MLflow: letters, digits, _ - . / and space)
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", text).strip("_")


def track(groups: list[Group], source: str, training_log: str | None, tensorboard: str | None,
          window: int, mlflow: str | None = None) -> tuple[TrainingJson, dict[int, list[TrainingSide]]]:
    """The training side of an evaluated checkpoint (`source`): its run's log read beside every group
    (reporting.training_side), the TensorBoard run (and, given a tracking URI, the MLflow run) rewritten. Returns
    (results["training"], {group index: the TrainingSide of each of its training runs with a log}), the
    latter for the artifacts and the report, so that no log is read twice. Problems (no log, a damaged one,
    a folder we cannot write) are listed, never raised: the evaluation is complete without them."""
    run = training_run_of(source)
    logs = {run: training_log} if training_log else {}
    every = {index: training_sides(group, logs, window) for index, group in enumerate(groups)}
    sides = {index: side for index, found in every.items() for side in found
             if side.rows and training_run_of(side.rows[0].source) == run}
    record: TrainingJson = {"run": run, "log": None, "problems": [], "flags": [], "tensorboard": None}
    if sides:
        first = next(iter(sides.values()))
        record["log"], record["problems"] = first.log.folder, first.log.problems
        record["flags"] = [{"kind": f.kind, "step": f.step, "message": f.message}
                           for side in sides.values() for f in side.flags]
        mine = [(side, row) for side in sides.values() for row in side.rows if row.source == source]
        if mine:
            side, row = mine[0]
            implied = side.implied(row)
            record["at_step"] = {**side.point(row).as_dict(), "implied": implied[0] if implied else None,
                                 "implied_from": implied[1] if implied else None}
    elif training_log:  # given, but nothing in it could be read
        record["problems"] = read_training_log(training_log).problems or [f"training log {training_log}: nothing read"]
    points = projection(groups, run, sides)
    folder = Path(tensorboard) if tensorboard else default_tracker_folder(run)
    if folder is not None:
        try:
            write_tensorboard(folder, points)
            record["tensorboard"], record["tracker_tags"] = str(folder), points.tags
        except OSError as e:
            record["problems"].append(f"tensorboard {folder}: cannot write the run ({e}); the scores are in the store")
    if mlflow:
        try:
            record["mlflow_run"] = write_mlflow(mlflow, run, points)
            record["tracker_tags"] = points.tags
        except Exception as e:  # noqa: BLE001 - the tracker is a view: the evaluation is complete without it
            record["problems"].append(f"mlflow {mlflow}: cannot write the run ({e}); the scores are in the store")
    return record, every
