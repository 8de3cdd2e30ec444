"""The training run beside the evaluation: what the trainer logged at each evaluated step, and the alarm
that goes off when training and evaluation disagree.

A training run is found from a checkpoint's source: the folder (or relay URL) its checkpoint folders sit
in, SpecForge's `output_dir` (`{run_id}-step{N}/` beside `runs/` and `{run_id}.best_meta.json`), or given
with --training-log DIR (a relay's checkpoints: the run folder is on the training machine). Only a group's
checkpoints from that run are compared with its log (dflash_eval.reporting.training_log reads it).

Flags, each with its reason:
- best mismatch: the step the trainer calls its best (`best_meta.json`, or its own metric) is worse by
  tau than another step of the run: the paired 95% interval of the difference lies above 0.
- diverging: over the last `window` saves, the trainer's accuracy rises (the bootstrap interval of its
  fitted slope lies above 0) while tau does not (the paired interval of tau's slope reaches 0 or below).
- train/eval gap: the acceptance the trainer's per-position accuracy implies (1 + sum_k prod_{j<=k} a_j;
  with only a mean accuracy a, every position at a) lies above the replayed tau's interval by more than
  GAP_MARGIN of tau; or, where the checkpoint was scored with --all-positions (a block at every position,
  as training anchors them), the trainer's accuracy at some draft position exceeds the drafter's
  teacher-forced accuracy on our references by more than POSITION_MARGIN. The message names the known
  causes.

Each check also says what it found when it raises no flag, or why it could not run (TrainingSide.checks), so
that "no flag" is never read as more than was checked: no_flag_line puts them in one line, the one the command
line, the Prefect summary, `history` and the report show where no flag is raised.

Beside tau every view shows the trainer's own number at each step as logged (`logged`: its acceptance metric,
e.g. SpecForge's `eval/simulated_acc_len`, else its eval accuracy, else its training accuracy, named by its tag)
and what the trainer's numbers imply as an acceptance length (`implied`), which is what the gap check compares.
"""

from dataclasses import dataclass, field
from pathlib import Path

from dflash_core.metrics import paired_slope_interval, slope_interval
from dflash_eval.reporting.training_log import (
    ACCURACY,
    EVAL_ACCURACY,
    TRAINER_ACCEPTANCE,
    TrainingLog,
    TrainingPoint,
    implied_acceptance,
    read_training_log,
)
from dflash_eval.storage import read_json

from .history import Group, HistoryRow, paired_interval, training_run_of

DEFAULT_WINDOW = 4  # saves the diverging check fits slopes over
GAP_MARGIN = 0.25  # train/eval gap: implied acceptance above tau's interval by more than this share of tau
POSITION_MARGIN = 0.15  # ... or the trainer's accuracy at a draft position above ours (teacher-forced) by more
LEAK_ACCURACY = 0.9  # a trainer's accuracy this high at every draft position: the block saw its answers

BEST_MISMATCH, DIVERGING, TRAIN_EVAL_GAP = "best mismatch", "diverging", "train/eval gap"

KNOWN_CAUSES = (
    "attention leaking across blocks or into the block's future at training time",
    "a one-position offset between labels and features",
    "a context mask that includes the anchor (<= where < belongs)",
    "an lm_head that was never loaded",
    "noise on the target's features or logits at training time",
    "an fc input that includes a layer the evaluation does not feed",
    "a loss whose positions do not match decoding",
)


@dataclass(frozen=True)
class Flag:
    """One alarm about one checkpoint of a training run."""

    kind: str  # BEST_MISMATCH, DIVERGING or TRAIN_EVAL_GAP
    step: int  # the checkpoint it is about
    message: str  # what disagrees, with the numbers, and what it may mean


@dataclass(frozen=True)
class Check:
    """What one check of the alarm found: its flags aside, what it compared and with which numbers, or why it
    could not run."""

    kind: str  # BEST_MISMATCH, DIVERGING or TRAIN_EVAL_GAP
    ran: bool  # False: it could not run (`message` says why)
    message: str  # a clause, lowercase: what was checked, with the numbers and the thresholds

    def as_dict(self) -> dict:
        return {"kind": self.kind, "ran": self.ran, "message": self.message}


@dataclass
class TrainingSide:
    """A group's checkpoints from one training run beside that run's log."""

    log: TrainingLog
    rows: list[HistoryRow]  # the run's stepped candidates, by step
    block_size: int  # the block verified: the implied acceptance counts its b-1 drafted positions
    flags: list[Flag] = field(default_factory=list)
    checks: list[Check] = field(default_factory=list)  # what each check found where it raised no flag

    def point(self, row: HistoryRow) -> TrainingPoint:
        """What the trainer had logged when it saved row's step."""
        assert row.step is not None
        return self.log.at(row.step)

    def implied(self, row: HistoryRow) -> tuple[float, str] | None:
        """The acceptance the trainer's numbers at row's step imply, and from what; None without them."""
        point = self.point(row)
        if point.per_position_accuracy:  # the positions a block of this size drafts
            return (implied_acceptance(point.per_position_accuracy[:self.block_size - 1]),
                    f"per-position {point.per_position_metric}")
        mean = point.eval_accuracy if point.eval_accuracy is not None else point.accuracy
        if mean is None:
            return None
        source = "eval accuracy" if point.eval_accuracy is not None else "training accuracy"
        return implied_acceptance([mean] * (self.block_size - 1)), f"{source} {mean:.3f} at every position"

    def logged(self, row: HistoryRow) -> tuple[str, float] | None:
        """The trainer's own number at row's step, as logged, with its tag: its acceptance metric
        (TRAINER_ACCEPTANCE, e.g. SpecForge's `eval/simulated_acc_len`), else its eval accuracy, else its
        training accuracy, whichever it logged last at or before that step; None: none of them."""
        assert row.step is not None
        step = row.step
        for names in (TRAINER_ACCEPTANCE, EVAL_ACCURACY, ACCURACY):
            for name in names:
                before = [v for s, v in self.log.scalars.get(name, ()) if s <= step]
                if before:
                    return name, before[-1]
        return None

    def flags_at(self, step: int | None) -> list[Flag]:
        return [f for f in self.flags if f.step == step]

    def no_flag_line(self) -> str:
        """What the checks found, in one line, for where they raised no flag: "No flag: the trainer's best ...;
        ...; the gap ... is within the alarm's margin of 25% ...", each check's own clause (one that could not
        run says why)."""
        if not self.checks:
            return "No flag, and nothing checked: no checkpoint of this run was evaluated."
        return "No flag: " + "; ".join(c.message for c in self.checks) + "."

    def as_dict(self) -> dict:
        """JSON-able, for results and the summary."""
        return {"log": self.log.folder, "problems": self.log.problems,
                "best": {"step": self.log.best.step, "metric": self.log.best.metric, "source": self.log.best.source}
                if self.log.best else None,
                "steps": [{**self.point(r).as_dict(), "tau_macro": r.tau_macro,
                           "implied": (self.implied(r) or (None,))[0]} for r in self.rows],
                "flags": [{"kind": f.kind, "step": f.step, "message": f.message} for f in self.flags],
                "checks": [c.as_dict() for c in self.checks]}


def logged_column(sides: list["TrainingSide"], rows: list[HistoryRow]) -> tuple[str, list[str]]:
    """The header and cells of a column of the trainer's own number (TrainingSide.logged) beside `rows`: named by
    its tag ("trainer eval/simulated_acc_len") when every row that has one has the same; else "trainer logged",
    each cell naming its tag. "-" where a row's run has no log or logged none of them."""
    found = []
    for row in rows:
        side = side_of(sides, row)
        found.append(side.logged(row) if side is not None else None)
    tags = {f[0] for f in found if f}
    if len(tags) == 1:
        return f"trainer {tags.pop()}", [f"{f[1]:.3f}" if f else "-" for f in found]
    return "trainer logged", [f"{f[0]} {f[1]:.3f}" if f else "-" for f in found]


def side_of(sides, row: HistoryRow) -> TrainingSide | None:
    """The training run's side among `sides` that holds `row` (None: the row's run has no log found)."""
    return next((s for s in sides if any(r is row for r in s.rows)), None)


def training_side(group: Group, run: str, log_folder: str | Path | None, block_size: int,
                  window: int = DEFAULT_WINDOW) -> TrainingSide | None:
    """The group's checkpoints from training run `run` (training_run_of) beside its log, read from
    log_folder (default: `run` itself when it is a local folder), with the flags raised; None when there is
    no log folder to read."""
    folder = Path(log_folder) if log_folder else Path(run) if "://" not in run else None
    if folder is None:
        return None
    rows = sorted((r for r in group.candidates if r.step is not None and training_run_of(r.source) == run),
                  key=lambda r: r.step or 0)
    side = TrainingSide(read_training_log(folder), rows, block_size)
    if rows:
        found = [_best_mismatch(side), _diverging(side, window), _gaps(side)]
        side.flags = [flag for flags, _ in found for flag in flags]
        side.checks = [check for _, check in found]
    return side


def _not_run(kind: str, why: str) -> tuple[list[Flag], Check]:
    return [], Check(kind, False, why)


def _best_mismatch(side: TrainingSide) -> tuple[list[Flag], Check]:
    by_step = {r.step: r for r in side.rows}
    if side.log.best is not None:
        step, by_what = side.log.best.step, f"{side.log.best.metric}, in {side.log.best.source}"
    else:  # the trainer's own metric, as logged last at or before each evaluated step
        found = side.log.series(TRAINER_ACCEPTANCE) or side.log.series(EVAL_ACCURACY)
        if found is None:
            return _not_run(BEST_MISMATCH, "the best-mismatch check could not run: the log names no best step and "
                                           "holds no eval metric to rank the steps by")
        name, points = found
        known = {r.step: before[-1] for r in side.rows
                 if r.step is not None and (before := [v for s, v in points if s <= r.step])}
        if not known:
            return _not_run(BEST_MISMATCH, f"the best-mismatch check could not run: the trainer's {name} was not "
                                           "logged at or before any evaluated step")
        step, by_what = max(known, key=lambda s: known[s]), f"its own {name}"
    theirs = by_step.get(step)
    ours = max(side.rows, key=lambda r: r.tau_macro)
    if theirs is None:
        return _not_run(BEST_MISMATCH, f"the best-mismatch check could not run: the trainer's best, step {step} "
                                       f"(by {by_what}), was not evaluated")
    if ours is theirs:
        return [], Check(BEST_MISMATCH, True, f"the trainer's best, step {step} (by {by_what}), is the best by tau "
                                              f"({ours.tau_macro:.3f})")
    interval = paired_interval(ours, theirs)
    if interval is None:
        return _not_run(BEST_MISMATCH, f"the best-mismatch check could not run: the trainer's best, step {step}, and "
                                       f"the best by tau, step {ours.step}, have no per-reference taus to pair")
    if interval[0] <= 0:
        return [], Check(BEST_MISMATCH, True,
                         f"the trainer's best, step {step} (by {by_what}; tau {theirs.tau_macro:.3f}), is within "
                         f"noise of the best by tau, step {ours.step} ({ours.tau_macro:.3f}): the paired 95% "
                         f"interval of the difference, {interval[0]:+.3f} to {interval[1]:+.3f}, reaches 0")
    flag = Flag(BEST_MISMATCH, step,
                f"the trainer's best is step {step} (by {by_what}), tau {theirs.tau_macro:.3f}; step {ours.step} "
                f"is better by tau: {ours.tau_macro:.3f}, paired 95% interval of the difference "
                f"{interval[0]:+.3f} to {interval[1]:+.3f}. The trainer's metric does not rank checkpoints as "
                f"decoding does: step {ours.step} is the one to serve.")
    return [flag], Check(BEST_MISMATCH, True, flag.message)


def _diverging(side: TrainingSide, window: int) -> tuple[list[Flag], Check]:
    rows = [r for r in side.rows if r.per_reference][-window:]
    found = side.log.series(ACCURACY) or side.log.series(EVAL_ACCURACY)
    needed = max(3, window)
    if len(rows) < needed:
        return _not_run(DIVERGING, f"the divergence check could not run: it fits slopes over the last {needed} "
                                   f"saves with per-reference taus, and {len(rows)} of this run "
                                   f"{'was' if len(rows) == 1 else 'were'} evaluated")
    if found is None:
        return _not_run(DIVERGING, "the divergence check could not run: the log holds no training or eval accuracy")
    name, points = found
    first, last = rows[0].step or 0, rows[-1].step or 0
    logged = [(s, v) for s, v in points if first <= s <= last]
    if len({s for s, _ in logged}) < 3:
        return _not_run(DIVERGING, f"the divergence check could not run: the trainer's {name} was logged at fewer "
                                   f"than 3 steps between steps {first} and {last}")
    per_k = 1000.0  # slopes per 1000 steps read better than per step
    train_low, train_high = slope_interval([s / per_k for s, _ in logged], [v for _, v in logged])
    taus = [{ref: (prompt, tau) for ref, prompt, tau in r.per_reference} for r in rows]
    try:
        tau_low, tau_high = paired_slope_interval([(r.step or 0) / per_k for r in rows], taus)
    except ValueError:  # no shared reference
        return _not_run(DIVERGING, f"the divergence check could not run: the saves of steps {first}-{last} share no "
                                   "reference")
    slopes = (f"the trainer's {name} {train_low:+.3f} to {train_high:+.3f}, tau {tau_low:+.3f} to {tau_high:+.3f} "
              "per 1000 steps, 95% intervals")
    if train_low <= 0:
        return [], Check(DIVERGING, True, f"the trainer's {name} does not rise beyond noise over steps {first}-{last}, "
                                          f"so tau cannot lag it ({slopes})")
    if tau_low > 0:
        return [], Check(DIVERGING, True, f"the trainer's {name} and tau rise together over steps {first}-{last} "
                                          f"({slopes})")
    flag = Flag(DIVERGING, last,
                f"over the last {len(rows)} saves (steps {first}-{last}) the trainer's {name} rises "
                f"({train_low:+.3f} to {train_high:+.3f} per 1000 steps, 95% interval) while tau does not "
                f"({tau_low:+.3f} to {tau_high:+.3f} per 1000 steps, paired over the references): training "
                "improves something decoding does not use; compare the train/eval gap.")
    return [flag], Check(DIVERGING, True, flag.message)


def _gaps(side: TrainingSide) -> tuple[list[Flag], Check]:
    flags = []
    closest: tuple[float, str] | None = None  # (implied minus the threshold, what was compared) nearest the alarm
    shortfall: tuple[float, str] | None = None  # per position: (the trainer's minus ours, where) nearest the alarm
    logs_positions = False
    implied_rows = sum(side.implied(row) is not None for row in side.rows)
    for row in side.rows:
        implied = side.implied(row)
        if implied is None:
            continue
        value, source = implied
        high = row.tau_macro_ci95[1] if row.tau_macro_ci95 else row.tau_macro
        threshold = high + GAP_MARGIN * row.tau_macro
        reasons = []
        if value > threshold:
            reasons.append(f"the trainer's numbers imply an acceptance length of {value:.2f} (from {source}), the "
                           f"replay measures tau {row.tau_macro:.2f} (95% interval up to {high:.2f})")
        elif closest is None or value - threshold > closest[0]:
            gap = value - row.tau_macro
            at = f"step {row.step}" + (", the nearest the alarm" if implied_rows > 1 else "")
            compared = (f"the gap between tau and what the trainer implies ({gap:.2f} tokens at {at}: {value:.2f} "
                        f"implied from {source}, tau {row.tau_macro:.2f}) is" if gap >= 0 else
                        f"what the trainer implies lies below tau ({value:.2f} implied from {source}, tau "
                        f"{row.tau_macro:.2f} at {at}),")
            closest = (value - threshold,
                       f"{compared} within the alarm's margin of {GAP_MARGIN:.0%}: it flags an implied acceptance "
                       f"above tau's 95% interval by more than {GAP_MARGIN:.0%} of tau ({threshold:.2f} there)")
        theirs = side.point(row).per_position_accuracy
        logs_positions = logs_positions or bool(theirs)
        ours = [a for a in row.teacher_forced_accuracy or () if a is not None][:side.block_size - 1]
        if theirs and ours:
            worst = max(range(min(len(theirs), len(ours))), key=lambda k: theirs[k] - ours[k])
            if theirs[worst] - ours[worst] > POSITION_MARGIN:
                reasons.append(f"teacher-forced on our references the drafter is right at draft position {worst + 1} "
                               f"{ours[worst]:.0%} of the time, the trainer logged {theirs[worst]:.0%} "
                               f"(positions 1-{len(ours)}: ours {_percentages(ours)}, the trainer's "
                               f"{_percentages(theirs[:len(ours)])})")
            elif shortfall is None or theirs[worst] - ours[worst] > shortfall[0]:
                shortfall = (theirs[worst] - ours[worst],
                             f"teacher-forced on our references the drafter is within {POSITION_MARGIN:.0%} of the "
                             f"trainer's accuracy at every draft position (nearest: position {worst + 1} at step "
                             f"{row.step}, ours {ours[worst]:.0%}, the trainer's {theirs[worst]:.0%})")
        if reasons:
            leak = ""
            if theirs and len(theirs) >= 3 and min(theirs) >= LEAK_ACCURACY:
                leak = (f" Most likely a leak: the trainer's accuracy is {min(theirs):.0%} or higher at every draft "
                        "position up to the block's last, where a drafter that cannot see the block's answers falls; "
                        "attention leaking into the block's future does this.")
            flags.append(Flag(TRAIN_EVAL_GAP, row.step or 0,
                              "; ".join(reasons) + "." + leak + " Training and decoding disagree about this drafter; "
                              "known causes: " + "; ".join(KNOWN_CAUSES) + "."))
    if flags:
        return flags, Check(TRAIN_EVAL_GAP, True, "; ".join(f.message for f in flags))
    if closest is None:
        return _not_run(TRAIN_EVAL_GAP, "the train/eval gap check could not run: the log holds no accuracy to imply "
                                        "an acceptance length from")
    found = [closest[1]]
    if shortfall is not None:
        found.append(shortfall[1])
    elif logs_positions:
        found.append("the per-position check could not run: no checkpoint of this run was scored with "
                     "--all-positions, which measures the drafter's teacher-forced accuracy")
    return [], Check(TRAIN_EVAL_GAP, True, "; ".join(found))


def _percentages(values) -> str:
    return " ".join(f"{v:.0%}" for v in values)


def holds_training_log(folder: Path) -> bool:
    """Whether a local folder holds anything a trainer writes (dflash_eval.reporting.training_log)."""
    return folder.is_dir() and ((folder / "runs").is_dir() or (folder / "logs").is_dir()  # (logs: speculators')
                                or any(folder.glob("*.best_meta.json"))
                                or (folder / "trainer_state.json").is_file()
                                or any(folder.glob("checkpoint-*/trainer_state.json")))


def training_sides(group: Group, logs: dict[str, str] | None = None,
                   window: int = DEFAULT_WINDOW) -> list[TrainingSide]:
    """One TrainingSide per training run the group's stepped checkpoints come from that has a log: the one
    `logs` gives for it ({training run: log folder}: --training-log), else the run's own folder when it is
    local and holds a training log."""
    logs = logs or {}
    sides = []
    for run in dict.fromkeys(training_run_of(r.source) for r in group.candidates if r.step is not None):
        folder = logs.get(run) or (run if "://" not in run and holds_training_log(Path(run)) else None)
        if folder is None:
            continue
        block_size = read_json(Path(group.rows[0].scores_path))["block_size"]
        side = training_side(group, run, folder, block_size, window)
        if side is not None:
            sides.append(side)
    return sides
