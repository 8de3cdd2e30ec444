"""What the trainer logged: the training side of a run, beside which the offline tau is read.

A run folder holds what trainers write (the sources are SpecForge's specforge/tracker.py,
specforge/training/checkpoint.py, specforge/eval/evaluator.py and transformers' Trainer):

- TensorBoard event files: SpecForge's tracker writes `<output_dir>/runs`, transformers' Trainer
  `<output_dir>/runs/<date_host>`. Read with TensorBoard's own reader (EventAccumulator), every folder
  under the run folder except ours (event files ending in TRACKER_SUFFIX: reporting.tracker writes them).
  What the reader logs while we read (a dozen DEBUG and INFO lines per file) never reaches the console: its
  logger is quieted for the read only (_quiet_reader), and what it says about damage becomes a problem.
- `{run_id}.best_meta.json` (SpecForge's CheckpointManager): {run_id, step, score, metric, metrics}, the
  step the trainer calls its best by its own metric (`eval/simulated_acc_len` by default).
- `trainer_state.json` (transformers' Trainer, in the run folder or in each `checkpoint-N/`): `log_history`,
  one dict of metrics per logged step, and `best_model_checkpoint`.

What a trainer calls accuracy is teacher-forced: the drafter's argmax at block position k equals the data
token, whatever the positions before it did. SpecForge's DFlash `eval/simulated_acc_len` is that
accuracy (`"eval/simulated_acc_len": avg_acc`), not an acceptance length; where per-position accuracies
a_k are logged, `implied_acceptance` turns them into the acceptance length they imply if positions were
independent, 1 + sum_k prod_{j<=k} a_j, the number comparable to tau.

Nothing here raises on a damaged or missing log: each problem becomes a warning naming the file
(TrainingLog.problems), and what could be read is kept.
"""

import json
import logging
import math
import re
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

TRACKER_SUFFIX = ".dflash-eval"  # our own event files (reporting.tracker): never read as the trainer's

# canonical name -> the names trainers log it under, preferred first
# (speculators: its validation values once per epoch, `val/<name>_epoch`, then its training ones)
ACCURACY = ("train/acc", "train/accuracy", "accuracy", "train_accuracy", "train/full_acc")
EVAL_ACCURACY = ("eval/avg_acc", "eval/accuracy", "eval_accuracy", "val/full_acc_epoch")
LOSS = ("train/loss", "loss")
EVAL_LOSS = ("eval/avg_loss", "eval_loss", "val/loss_epoch")
# speculators' eal: the accepted length, bonus included, of its teacher-forced drafts (on DFlash2, the selector's)
TRAINER_ACCEPTANCE = ("eval/simulated_acc_len", "train/dflash/expected_acc_len", "val/eal_epoch", "train/eal")
# per-position accuracies: <base>_<k> or <base>/<k>, k from 0 (the first drafted position)
PER_POSITION = ("eval/per_position_acc", "eval/acceptance_rate", "train/dflash/acc", "train/acc", "eval_acc", "acc")
# ... or named with the position inside (speculators), from 1 (from 0 when its anchor slot drafts too)
PER_POSITION_NAMED = ("val/position_{k}_acc_epoch", "train/position_{k}_acc")
# DFlash2 (speculators): its selector's teacher-forced accuracy, the unary head's top-K recall and the accepted
# length of an oracle choosing among those K (names with K in them)
SELECTOR_ACCURACY = ("val/teacher_forced_selector_acc_epoch", "train/teacher_forced_selector_acc")
CANDIDATE_RECALL = (r"val/unary_candidate_recall_at_\d+_epoch", r"train/unary_candidate_recall_at_\d+")
ORACLE_ACCEPTANCE = (r"val/unary_top_\d+_oracle_accepted_length_epoch", r"train/unary_top_\d+_oracle_accepted_length")


@dataclass(frozen=True)
class BestCheckpoint:
    """The step a trainer calls its best, by its own metric."""

    step: int
    metric: str  # e.g. "eval/simulated_acc_len"
    score: float | None
    source: str  # the file that says so


@dataclass(frozen=True)
class TrainingPoint:
    """What the trainer logged last at or before one training step (None: not logged)."""

    step: int  # the step asked for
    logged_at: int | None  # the step of the latest value used
    accuracy: float | None
    eval_accuracy: float | None
    loss: float | None
    eval_loss: float | None
    trainer_acceptance: float | None  # the trainer's own "acceptance" metric (see the module docstring)
    trainer_acceptance_metric: str | None
    per_position_accuracy: list[float] | None  # position 1, 2, ... of the block
    per_position_metric: str | None
    # DFlash2 trainers that log them (speculators): SELECTOR_ACCURACY, CANDIDATE_RECALL, ORACLE_ACCEPTANCE
    selector_accuracy: float | None = None
    candidate_recall: float | None = None
    oracle_acceptance: float | None = None

    @property
    def implied_acceptance(self) -> float | None:
        """The acceptance length the per-position accuracies imply (module docstring); None without them."""
        return implied_acceptance(self.per_position_accuracy) if self.per_position_accuracy else None

    def as_dict(self) -> dict:
        return {"step": self.step, "logged_at": self.logged_at, "accuracy": self.accuracy,
                "eval_accuracy": self.eval_accuracy, "loss": self.loss, "eval_loss": self.eval_loss,
                "trainer_acceptance": self.trainer_acceptance,
                "trainer_acceptance_metric": self.trainer_acceptance_metric,
                "per_position_accuracy": self.per_position_accuracy, "per_position_metric": self.per_position_metric,
                "implied_acceptance": self.implied_acceptance,
                **{name: value for name, value in (("selector_accuracy", self.selector_accuracy),
                                                   ("candidate_recall", self.candidate_recall),
                                                   ("oracle_acceptance", self.oracle_acceptance)) if value is not None}}


@dataclass
class TrainingLog:
    """Every scalar a run's trainer logged, {name: [(step, value), ...] by step}, its best checkpoint, and
    what could not be read."""

    folder: str
    scalars: dict[str, list[tuple[int, float]]] = field(default_factory=dict)
    best: BestCheckpoint | None = None
    problems: list[str] = field(default_factory=list)  # one line each, naming the file

    def series(self, names: Sequence[str]) -> tuple[str, list[tuple[int, float]]] | None:
        """The first of `names` that was logged, with its points."""
        return next(((n, self.scalars[n]) for n in names if self.scalars.get(n)), None)

    def at(self, step: int) -> TrainingPoint:
        """The values logged last at or before `step`: what the trainer knew when it saved that step."""
        found: dict[str, tuple[str, int, float] | None] = {}
        for name, names in (("accuracy", ACCURACY), ("eval_accuracy", EVAL_ACCURACY), ("loss", LOSS),
                            ("eval_loss", EVAL_LOSS), ("trainer_acceptance", TRAINER_ACCEPTANCE),
                            ("selector_accuracy", SELECTOR_ACCURACY), ("candidate_recall", self._named(CANDIDATE_RECALL)),
                            ("oracle_acceptance", self._named(ORACLE_ACCEPTANCE))):
            found[name] = self._latest(names, step)
        positions = self._per_position(step)
        logged = [f[1] for f in found.values() if f] + ([positions[2]] if positions else [])
        value = {name: (f[2] if f else None) for name, f in found.items()}
        acceptance = found["trainer_acceptance"]
        return TrainingPoint(step=step, logged_at=max(logged, default=None), **value,
                             trainer_acceptance_metric=acceptance[0] if acceptance else None,
                             per_position_accuracy=positions[1] if positions else None,
                             per_position_metric=positions[0] if positions else None)

    def _latest(self, names: Sequence[str], step: int) -> tuple[str, int, float] | None:
        for name in names:
            before = [(s, v) for s, v in self.scalars.get(name, ()) if s <= step]
            if before:
                return (name, *before[-1])
        return None

    def _named(self, patterns: Sequence[str]) -> list[str]:
        """The logged names matching each pattern (a regular expression), in the patterns' order."""
        return [name for pattern in patterns for name in sorted(self.scalars) if re.fullmatch(pattern, name)]

    def _per_position(self, step: int) -> tuple[str, list[float], int] | None:
        """(base name, accuracies by position, the step they were logged at) of the first per-position base
        logged at or before step, positions from the first drafted one, without gaps."""
        # (base, its names with the position as {k}, the first position)
        bases: list[tuple[str, tuple[str, ...], int]] = [(base, (base + "_{k}", base + "/{k}"), 0)
                                                         for base in PER_POSITION]
        bases += [(template, (template,), 0 if template.format(k=0) in self.scalars else 1)
                  for template in PER_POSITION_NAMED]
        for base, templates, first in bases:
            values = []
            for k in range(first, first + 64):
                latest = self._latest([t.format(k=k) for t in templates], step)
                if latest is None:
                    break
                values.append(latest)
            if values:
                return base, [v for _, _, v in values], max(s for _, s, _ in values)
        return None


def implied_acceptance(per_position_accuracy: Sequence[float]) -> float:
    """1 + sum over k of prod_{j<=k} a_j: the acceptance length per-position accuracies a_1, a_2, ... imply
    when each position is accepted independently of the others (the bonus token counts 1)."""
    total, running = 1.0, 1.0
    for accuracy in per_position_accuracy:
        running *= accuracy
        total += running
    return total


def read_training_log(folder: str | Path) -> TrainingLog:
    """Read what the trainer wrote under `folder` (a run folder, or its `runs/` folder): event files,
    `*.best_meta.json` and `trainer_state.json`. Problems are kept as TrainingLog.problems, never raised."""
    folder = Path(folder)
    log = TrainingLog(str(folder))
    if not folder.is_dir():
        log.problems.append(f"training log {folder}: {'not a folder' if folder.exists() else 'does not exist'}")
        return log
    event_folders = sorted({p.parent for p in folder.rglob("events.out.tfevents.*")
                            if not p.name.endswith(TRACKER_SUFFIX)})
    for events in event_folders:
        _read_events(events, log)
    for meta in sorted(folder.glob("*.best_meta.json")):
        _read_best_meta(meta, log)
    for state in sorted(folder.rglob("trainer_state.json"), key=_trainer_state_order):
        _read_trainer_state(state, log)
    for name in log.scalars:
        log.scalars[name] = sorted(dict(log.scalars[name]).items())  # one value per step: the last read wins
    if not log.scalars and not log.best and not log.problems:
        log.problems.append(f"training log {folder}: no TensorBoard event files, *.best_meta.json or "
                            "trainer_state.json in it")
    return log


def _read_events(folder: Path, log: TrainingLog) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0, "tensors": 0})
    with _quiet_reader() as caught:
        try:
            accumulator.Reload()
        except Exception as e:  # noqa: BLE001 - a damaged event file: what was read before it is kept
            log.problems.append(f"training log {folder}: event files unreadable past some point "
                                f"({type(e).__name__}: {e})")
    log.problems += [f"training log {message}" for message in caught.messages]
    for tag in accumulator.Tags().get("scalars", []):
        points = log.scalars.setdefault(tag, [])
        points += [(int(e.step), float(e.value)) for e in accumulator.Scalars(tag) if math.isfinite(e.value)]


READER_LOGGER = "tensorboard"  # every logger of TensorBoard's event reader (tensorboard.util.tb_logging)
_READING = threading.Lock()  # one read at a time quiets the logger: each restores what it found


@contextmanager
def _quiet_reader() -> Iterator["_Caught"]:
    """While TensorBoard's reader runs in this thread: what it logs (a dozen DEBUG and INFO lines per event
    file: "Loading events from", "No path found after", ...) reaches no handler, neither the console's nor
    Prefect's, whatever the user's logging config; what it says about damage is caught instead (_Caught).
    Only the reader's logger is touched, and only for the read: its level and filters are restored after, and
    what other threads log through it meanwhile is passed or dropped as the logger's level before would."""
    logger = logging.getLogger(READER_LOGGER)
    with _READING:
        level = logger.level
        caught = _Caught(logger.getEffectiveLevel())
        logger.addFilter(caught)
        logger.setLevel(logging.DEBUG)  # the reader reports a cut-short record at debug level only
        try:
            yield caught
        finally:
            logger.setLevel(level)
            logger.removeFilter(caught)


class _Caught(logging.Filter):
    """What TensorBoard's reader says about damage instead of raising: a record cut short or failing its
    checksum (it stops reading that file there), anything it warns about. A filter on the reader's logger:
    the records of the thread reading are kept here and go no further."""

    def __init__(self, level_before: int) -> None:
        super().__init__()
        self.thread, self.level_before = threading.get_ident(), level_before
        self.messages: list[str] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.thread is not None and record.thread != self.thread:  # another thread's: as before the read
            return record.levelno >= self.level_before
        if str(record.msg).startswith("Truncated record in"):
            path, error = record.args  # type: ignore[misc]
            what = "cut short" if "truncated" in str(error) else "damaged (a record fails its checksum)"
            self.messages.append(f"{path}: {what}; the points after that place are not read (a trainer still "
                                 "writing the file may be why)")
        elif record.levelno >= logging.WARNING:
            self.messages.append(record.getMessage())
        return False


def _read_best_meta(path: Path, log: TrainingLog) -> None:
    try:
        meta = json.loads(path.read_text())
        step, metric, score = meta["step"], meta.get("metric", "?"), meta.get("score")
        if not isinstance(step, int) or isinstance(step, bool):
            raise ValueError(f"step {step!r} is not an integer")
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.problems.append(f"training log {path}: cannot read the trainer's best checkpoint ({e!r}); "
                            "the best-mismatch check is skipped")
        return
    log.best = BestCheckpoint(step, str(metric), float(score) if isinstance(score, (int, float)) else None, str(path))
    for name, value in (meta.get("metrics") or {}).items():  # the eval metrics at the best step
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            log.scalars.setdefault(name, []).append((step, float(value)))
        elif isinstance(value, list):
            log.scalars.update({f"{name}/{k}": log.scalars.get(f"{name}/{k}", []) + [(step, float(v))]
                                for k, v in enumerate(value) if isinstance(v, (int, float))})


def _trainer_state_order(path: Path) -> tuple:
    # checkpoint-N/trainer_state.json by N, the run folder's own (the final one) last
    match = re.fullmatch(r"checkpoint-(\d+)", path.parent.name)
    return (0, int(match.group(1))) if match else (1, 0)


def _read_trainer_state(path: Path, log: TrainingLog) -> None:
    try:
        state = json.loads(path.read_text())
        history = state["log_history"]
        if not isinstance(history, list):
            raise ValueError("log_history is not a list")
    except (OSError, ValueError, KeyError, TypeError) as e:
        log.problems.append(f"training log {path}: cannot read it ({e!r})")
        return
    for entry in history:
        step = entry.get("step") if isinstance(entry, dict) else None
        if not isinstance(step, int):
            continue
        for name, value in entry.items():
            if name != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                log.scalars.setdefault(name, []).append((step, float(value)))
    best = state.get("best_model_checkpoint")
    match = re.search(r"checkpoint-(\d+)/?$", best) if isinstance(best, str) else None
    if match and log.best is None:
        metric = state.get("best_metric")
        log.best = BestCheckpoint(int(match.group(1)), "best_metric (Trainer's metric_for_best_model)",
                                  float(metric) if isinstance(metric, (int, float)) else None, str(path))
