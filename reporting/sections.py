"""The results' sections that are not a drafter generation's (dflash_core.sections says what a section is; a
generation's own, DFlash2's candidate selector, is in its module), each with how it is shown:

- of the checkpoint's own scores (scores.json): one draw of the acceptance coins of sampled drafts (`tau_drawn`), the
  all-positions tau (`all_positions_tau`), teacher-forced accuracy by draft position (`teacher_forced_accuracy`) and,
  under a confidence threshold, what the target verified (`verification`); the published benchmarks are
  reporting.benchmarks';
- of the evaluation around it (flows/results.py, the flow): the block-size sweep (`block_sweep`), the confidence
  threshold sweep (`threshold_sweep`), the baseline's tau
  (`baseline`), the diagnostics (`diagnostics`), the paired comparisons with the series' other checkpoints
  (`comparisons`: reporting.artifacts.add_history) and the training run beside it (`training`:
  reporting.tracker.track).

Importing it registers every section the renderers show: these, and each drafter generation's.
"""

from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, NotRequired, Self

from typing_extensions import TypedDict  # (pydantic reads it for the schema on Python 3.11)

import dflash_core.generations  # noqa: F401 - registers each generation's section
from dflash_core.sections import AROUND, Chart, Column, Context, Section, Table, section


class DrawnTau(TypedDict):
    """One draw of the acceptance coins of sampled drafts (scores.json's `tau_drawn`)."""

    tau_macro: float
    tau_pooled: float


@section
@dataclass(frozen=True)
class SampledDraws(Section):
    """Sampled drafts: tau is the expectation over the acceptance coins; what one seeded draw of them gave."""

    KEY: ClassVar[str] = "tau_drawn"
    TITLE: ClassVar[str] = "One draw of the acceptance coins"
    ORDER: ClassVar[int] = 20
    JSON: ClassVar[Any] = DrawnTau
    IN_SUMMARY: ClassVar[bool] = False  # the summary's tau line says what tau is; one draw is for the console

    drawn: DrawnTau

    def lines(self, context: Context) -> list[str]:
        return [f"sampled drafts: tau is the expectation over the acceptance coins; one draw of them: tau macro "
                f"{self.drawn['tau_macro']:.3f}, pooled {self.drawn['tau_pooled']:.3f}"]


@section
@dataclass(frozen=True)
class AllPositions(Section):
    """--all-positions: the mean acceptance length of a block anchored at every position of the references."""

    KEY: ClassVar[str] = "all_positions_tau"
    TITLE: ClassVar[str] = "All positions"
    ORDER: ClassVar[int] = 40
    JSON: ClassVar[Any] = float
    IN_SUMMARY: ClassVar[bool] = False

    tau: float

    def lines(self, context: Context) -> list[str]:
        return [f"all positions: mean acceptance length {self.tau:.3f}"]

    def scalars(self) -> dict[str, float]:
        return {"all_positions_tau": self.tau}


@section
@dataclass(frozen=True)
class TeacherForced(Section):
    """--all-positions: each draft position's accuracy whatever came before it (as training measures it)."""

    KEY: ClassVar[str] = "teacher_forced_accuracy"
    TITLE: ClassVar[str] = "Teacher-forced accuracy"
    ORDER: ClassVar[int] = 45
    JSON: ClassVar[Any] = list[float | None]
    IN_SUMMARY: ClassVar[bool] = False

    accuracy: list[float | None]

    @classmethod
    def from_json(cls, data: Any) -> Self:
        return cls(list(data))

    def scalars(self) -> dict[str, float]:
        return {f"teacher_forced_accuracy/{k}": a for k, a in enumerate(self.accuracy, start=1) if a is not None}

    def charts(self) -> list[Chart]:
        return [Chart("dflash-eval: by draft position", "teacher-forced accuracy at draft position k",
                      (r"teacher_forced_accuracy/\d+",))]


class BlockSizeRow(TypedDict):
    """One block size of a sweep: tau macro (interval) and pooled, tau per verified token and, given step costs,
    the projected speedup tau(b) / cost(b)."""

    block_size: int
    tau_macro: float
    tau_macro_ci95: list[float]
    tau_pooled: float
    tau_per_token: float
    projected_speedup: NotRequired[float]


@section
@dataclass(frozen=True)
class BlockSweep(Section):
    """--block-sizes: the checkpoint verified on blocks of each size (flows.results.block_sweep)."""

    KEY: ClassVar[str] = "block_sweep"
    TITLE: ClassVar[str] = "By block size"
    ORDER: ClassVar[int] = AROUND
    JSON: ClassVar[Any] = list[BlockSizeRow]
    IN_SUMMARY: ClassVar[bool] = False  # the report shows every checkpoint's sweep

    rows: list[BlockSizeRow]

    @classmethod
    def from_json(cls, data: Any) -> Self:
        return cls(list(data))

    def tables(self, context: Context) -> list[Table]:
        cells = []
        for row in self.rows:
            low, high = row["tau_macro_ci95"]
            speedup = f"{row['projected_speedup']:.2f}x" if "projected_speedup" in row else "-"
            cells.append((str(row["block_size"]), f"{row['tau_macro']:.3f}", f"{low:.2f}-{high:.2f}",
                          f"{row['tau_pooled']:.3f}", f"{row['tau_per_token']:.3f}", speedup))
        return [Table(("block size", "tau macro", "95% CI", "tau pooled", "tau / b", "projected speedup"),
                      tuple(cells), title="by block size (projected speedup: tau(b) / your step cost(b))", framed=True)]

    def metrics(self, context: Context) -> list[tuple[str, str]]:
        rows = []
        for row in self.rows:
            rows.append((f"tau macro at block size {row['block_size']}", f"{row['tau_macro']:.3f}"))
            if "projected_speedup" in row:
                rows.append((f"projected speedup at block size {row['block_size']} (your step costs)",
                             f"{row['projected_speedup']:.2f}x"))
        return rows


class VerificationJson(TypedDict):
    """Under a confidence threshold (scores.json's `verification`, tasks/scores.py): the tokens a step verified (its
    drafts verified and the anchor) and the tokens emitted per token verified (DeepSpec's verify_rate); None where no
    step was taken."""

    verified_per_step: float | None
    tokens_per_verified_token: float | None


@section
@dataclass(frozen=True)
class Verification(Section):
    """--confidence-threshold: a drafter with a confidence head (DSpark) verified only the drafts before the first it
    was less confident of than the threshold; what the target verified, per step and per token emitted."""

    KEY: ClassVar[str] = "verification"
    TITLE: ClassVar[str] = "Verification"
    ORDER: ClassVar[int] = 35
    JSON: ClassVar[Any] = VerificationJson
    HISTORY: ClassVar[tuple[Column, ...]] = (Column("verified_per_step", "tokens verified per step", "verified"),
                                             Column("tokens_per_verified_token", "tokens per verified token",
                                                    "tok/verified"))
    REPORT_COLUMNS: ClassVar[tuple[str, ...]] = ("tokens verified per step", "tokens per verified token")
    REPORT_TEXT: ClassVar[str] = (
        "Served with a confidence threshold, a step verifies only the drafts before the first its drafter's "
        "confidence head is less sure of than the threshold: the tokens verified per step (those drafts and the "
        "anchor), and the tokens emitted per token verified (DeepSpec's verify_rate: tau over the tokens a step "
        "verified).")

    verification: VerificationJson

    def lines(self, context: Context) -> list[str]:
        v = self.verification
        expected = " (expected)" if context.sampled else ""
        return [f"verified{expected}: {_decimals(v['verified_per_step'])} tokens per step, "
                f"{_decimals(v['tokens_per_verified_token'])} tokens emitted per token verified"]

    def metrics(self, context: Context) -> list[tuple[str, str]]:
        v = self.verification
        return [("tokens verified per step", _decimals(v["verified_per_step"])),
                ("tokens per verified token", _decimals(v["tokens_per_verified_token"]))]

    def scalars(self) -> dict[str, float]:
        return {f"verification/{name}": value for name, value in self.history().items() if value is not None}

    def charts(self) -> list[Chart]:
        group = "dflash-eval: confidence threshold"
        return [Chart(group, "tokens verified per step", ("verification/verified_per_step",)),
                Chart(group, "tokens per verified token", ("verification/tokens_per_verified_token",))]

    def history(self) -> dict[str, float | None]:
        v = self.verification
        return {"verified_per_step": v["verified_per_step"], "tokens_per_verified_token": v["tokens_per_verified_token"]}

    @classmethod
    def history_text(cls, context: Context) -> str:
        return ("Tokens verified per step: the drafts a step verified under the confidence threshold and the anchor; "
                "tokens per verified token: tau over them (DeepSpec's verify_rate).")

    def report_row(self) -> tuple[str, ...]:
        v = self.verification
        return _decimals(v["verified_per_step"]), _decimals(v["tokens_per_verified_token"])


class ThresholdRow(TypedDict):
    """One confidence threshold of a sweep: tau macro (interval) and pooled, the tokens a step verified and the
    tokens emitted per token verified (DeepSpec's verify_rate)."""

    threshold: float
    tau_macro: float
    tau_macro_ci95: list[float]
    tau_pooled: float
    verified_per_step: float | None
    tokens_per_verified_token: float | None


@section
@dataclass(frozen=True)
class ThresholdSweep(Section):
    """--confidence-thresholds: the checkpoint served at each confidence threshold (flows.results.threshold_sweep)."""

    KEY: ClassVar[str] = "threshold_sweep"
    TITLE: ClassVar[str] = "By confidence threshold"
    ORDER: ClassVar[int] = AROUND + 1  # after the block sweep
    JSON: ClassVar[Any] = list[ThresholdRow]

    rows: list[ThresholdRow]

    @classmethod
    def from_json(cls, data: Any) -> Self:
        return cls(list(data))

    def tables(self, context: Context) -> list[Table]:
        cells = []
        for row in self.rows:
            low, high = row["tau_macro_ci95"]
            cells.append((f"{row['threshold']:g}", f"{row['tau_macro']:.3f}", f"{low:.2f}-{high:.2f}",
                          f"{row['tau_pooled']:.3f}", _decimals(row["verified_per_step"]),
                          _decimals(row["tokens_per_verified_token"])))
        return [Table(("threshold", "tau macro", "95% CI", "tau pooled", "verified / step", "tokens / verified"),
                      tuple(cells), framed=True,
                      title="by confidence threshold (verified / step: tokens a step verified; tokens / verified: "
                            "DeepSpec's verify_rate)")]

    def metrics(self, context: Context) -> list[tuple[str, str]]:
        rows = []
        for row in self.rows:
            t = f"{row['threshold']:g}"
            rows += [(f"tau macro at confidence threshold {t}", f"{row['tau_macro']:.3f}"),
                     (f"tokens per verified token at confidence threshold {t}",
                      _decimals(row["tokens_per_verified_token"]))]
        return rows


def _decimals(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


class BaselineJson(TypedDict):
    """The baseline (--baseline) scored on the same references."""

    source: str
    key: str
    step: int | None
    tau_macro: float
    tau_macro_ci95: list[float]
    tau_pooled: float
    tau_by_category: dict[str, float]


@section
@dataclass(frozen=True)
class Baseline(Section):
    """--baseline: the other drafter's tau on the same references (the comparisons hold the paired difference)."""

    KEY: ClassVar[str] = "baseline"
    TITLE: ClassVar[str] = "Baseline"
    ORDER: ClassVar[int] = 60
    JSON: ClassVar[Any] = BaselineJson
    IN_SUMMARY: ClassVar[bool] = False  # the summary's comparisons table has the baseline's row

    baseline: BaselineJson

    def lines(self, context: Context) -> list[str]:
        b = self.baseline
        low, high = b["tau_macro_ci95"]
        return [f"baseline {b['source']}: tau macro {b['tau_macro']:.3f} (95% CI {low:.2f}-{high:.2f})"]

    def metrics(self, context: Context) -> list[tuple[str, str]]:
        return [(f"baseline {self.baseline['source']} tau macro", f"{self.baseline['tau_macro']:.3f}")]


class ComparisonJson(TypedDict):
    """This checkpoint's tau macro minus another's of its series (reporting.history.Comparison.as_dict)."""

    against: str  # "previous step", "best" or "baseline"
    checkpoint: str
    source: str
    checkpoint_key: str
    step: int | None
    tau_macro: float
    difference: float
    difference_ci95: list[float] | None


# how the command line names what a comparison is against (reporting.history: PREVIOUS_STEP, BEST, BASELINE)
AGAINST = {"baseline": "baseline", "previous step": "previous step", "best": "best other"}


@section
@dataclass(frozen=True)
class Comparisons(Section):
    """The paired differences against the previous step, the best other checkpoint and the baselines
    (reporting.artifacts.add_history; [] when the checkpoint's row is gone from the history)."""

    KEY: ClassVar[str] = "comparisons"
    TITLE: ClassVar[str] = "Paired differences"
    ORDER: ClassVar[int] = 70
    JSON: ClassVar[Any] = list[ComparisonJson]
    WRAPS: ClassVar[bool] = False
    IN_SUMMARY: ClassVar[bool] = False  # the summary's history of the series shows them, with the other rows' intervals

    compared: list[ComparisonJson]

    @classmethod
    def from_json(cls, data: Any) -> Self:
        return cls(list(data))

    def lines(self, context: Context) -> list[str]:
        """This checkpoint's tau minus the baseline's, the previous step's and the best other checkpoint's, each with
        the 95% interval of the per-reference difference: two checkpoints' own intervals overlap where the paired one
        may lie wholly on one side of 0. One line per other checkpoint, named by every role it holds."""
        if not self.compared:
            return []
        lines: list[tuple[list[str], ComparisonJson]] = []
        for c in self.compared:
            same = next((names for names, first in lines if first["checkpoint_key"] == c["checkpoint_key"]), None)
            if same is None:
                lines.append(([AGAINST.get(c["against"], c["against"])], c))
            else:
                same.append(AGAINST.get(c["against"], c["against"]))
        said = ["paired differences: this checkpoint's tau macro minus another's, with the 95% CI of the "
                "per-reference difference"]
        for names, c in lines:
            ci = c["difference_ci95"]
            step = "" if c["step"] is None else f"step {c['step']}, "
            verdict = ("" if ci is None else "; better" if ci[0] > 0 else "; worse" if ci[1] < 0 else
                       "; no difference shown")
            said.append(f"  {', '.join(names)}: {c['checkpoint']} ({step}tau macro {c['tau_macro']:.3f}): "
                        f"{c['difference']:+.3f}" + ("" if ci is None else f" (paired 95% CI {ci[0]:+.3f} to "
                                                     f"{ci[1]:+.3f})") + verdict)
        return said


class TrainingJson(TypedDict):
    """The training run beside the checkpoint (reporting.tracker.track, completed by reporting.artifacts.add_history)."""

    run: str
    log: str | None
    problems: list[str]
    flags: list[dict[str, Any]]  # {"kind", "step", "message"}
    tensorboard: str | None
    at_step: NotRequired[dict[str, Any]]  # what the trainer logged at this step, and what its numbers imply
    tracker_tags: NotRequired[list[str]]
    mlflow_run: NotRequired[str]
    trainer_logged: NotRequired[dict[str, Any] | None]  # {"tag", "value"}
    checks: NotRequired[list[dict[str, Any]]]
    no_flag: NotRequired[str | None]


@section
@dataclass(frozen=True)
class Training(Section):
    """The training run beside this step: the trainer's own number as logged and what its numbers imply, beside tau;
    the alarm's flags, or what its checks found; where its TensorBoard run is."""

    KEY: ClassVar[str] = "training"
    TITLE: ClassVar[str] = "Training beside evaluation"
    ORDER: ClassVar[int] = 80
    JSON: ClassVar[Any] = TrainingJson
    WRAPS: ClassVar[bool] = False

    training: TrainingJson

    def lines(self, context: Context) -> list[str]:
        training = self.training
        if not training.get("log"):
            return []
        lines = [f"training log {training['log']}"]
        point, logged = training.get("at_step"), training.get("trainer_logged")
        said = [f"tau macro {context.tau_macro:.3f}"]
        if logged:
            said.append(f"the trainer logged {logged['tag']} {logged['value']:.3f}")
        if point and point.get("implied") is not None:
            said.append(f"its numbers imply an acceptance length of {point['implied']:.2f} (from "
                        f"{point['implied_from']})")
        if point and len(said) > 1:
            lines.append(f"at step {point['step']}: " + "; ".join(said))
        lines += [f"{flag['kind'].upper()} (step {flag['step']}): {flag['message']}" for flag in training["flags"]]
        if training.get("no_flag"):
            lines.append(str(training["no_flag"]))
        return lines

    def markdown(self, context: Context) -> list[str]:
        """What the trainer logged at this step beside tau, the alarm's flags, where the TensorBoard run is, what
        could not be read."""
        training = self.training
        if not (training["log"] or training["tensorboard"] or training["problems"]):
            return []
        lines = ["", "### Training beside evaluation", ""]
        if training["log"]:
            lines.append(f"Training log: `{training['log']}`.")
        if point := training.get("at_step"):
            logged = [(name, point[key]) for name, key in (
                ("training accuracy", "accuracy"), ("eval accuracy", "eval_accuracy"), ("loss", "loss"),
                (point["trainer_acceptance_metric"] or "", "trainer_acceptance")) if point[key] is not None]
            if logged:
                lines.append("At this step the trainer logged " + ", ".join(f"{n} {v:.3f}" for n, v in logged) + ".")
            if point["implied"] is not None:
                lines.append(f"They imply an acceptance length of {point['implied']:.2f} (from "
                             f"{point['implied_from']}).")
        for flag in training["flags"]:
            lines += ["", f"**{flag['kind'].upper()}** (step {flag['step']}): {flag['message']}"]
        if training["log"] and not training["flags"] and training.get("no_flag"):
            lines += ["", str(training["no_flag"])]  # what was checked, with the numbers (add_history)
        if training["tensorboard"]:
            lines += ["", f"TensorBoard run: `{training['tensorboard']}` (`tensorboard --logdir "
                      f"{Path(training['tensorboard']).parent}`)."]
        lines += [f"- {problem}" for problem in training["problems"]]
        return lines


@section
@dataclass(frozen=True)
class Diagnostics(Section):
    """--diagnostics: the checkpoint's diagnostics.json (tasks/diagnostics.py): layer ablation, layer-offset probe,
    sliding switch, agreement, findings, first divergences. The report shows them from the store."""

    KEY: ClassVar[str] = "diagnostics"
    TITLE: ClassVar[str] = "Diagnostics"
    ORDER: ClassVar[int] = 90
    JSON: ClassVar[Any] = dict[str, Any]  # diagnostics.json (storage.schema.DIAGNOSTICS_FILE)
    IN_SUMMARY: ClassVar[bool] = False

    report: dict[str, Any]

    def lines(self, context: Context) -> list[str]:
        d = self.report
        ablation = ", ".join(f"layer {a['layer_id']}: {a['tau_macro']:.2f}" for a in d["layer_ablation"])
        lines = [f"ablation (one layer's features zeroed): {ablation}; all layers: {d['all_layers_ablated']:.2f}"]
        probed = [p for p in d["layer_offset_probe"] if p["tau_macro"] is not None]
        probe = ", ".join(f"{p['offset']:+d}: {p['tau_macro']:.2f}" for p in probed)
        peak = max(probed, key=lambda p: p["tau_macro"])
        lines.append(f"layer-offset probe (tau with layers id+offset): {probe}"
                     + ("" if peak["offset"] == 0 else f"  <- peaks at {peak['offset']:+d}: were the training "
                        f"features taken from layers {peak['layer_ids']}?"))
        if d["sliding_switch"]:
            sw = d["sliding_switch"]
            lines.append(f"sliding semantics {sw['to']} instead of {sw['from']}: tau {sw['tau_macro']:.2f}")
        if d.get("noise_instead_of_features") is not None:
            lines.append(f"noise instead of every feature: tau {d['noise_instead_of_features']:.2f}")
        rates = {name: counts["rate"] for name, counts in (d.get("agreement") or {}).items()
                 if counts["rate"] is not None}
        if "references" in rates and "context" in rates:
            lines.append(f"first drafted token = the target's own next token: {rates['references']:.0%} of the "
                         f"references' positions, {rates['context']:.0%} of the context's")
        if {"offset -1", "offset 0", "offset +1"} <= rates.keys():
            lines.append(f"drafted tokens = the reference's one position earlier {rates['offset -1']:.0%}, at their "
                         f"own {rates['offset 0']:.0%}, one later {rates['offset +1']:.0%}")
        lines += [f"FINDING ({finding['kind']}): {finding['message']}" for finding in d.get("findings", ())]
        lines += [f"first divergence in {divergence['id']} at completion token {divergence['position']}: after "
                  f"{divergence['context']!r} drafted {divergence['drafted']!r}, reference {divergence['reference']!r}"
                  for divergence in d["first_divergence"][:3]]
        return lines
