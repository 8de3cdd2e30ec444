"""The training side of a run (dflash_eval.reporting.training_log) and the alarm beside it (reporting.training_side).

Logs are written by the code trainers run: SpecForge's own tracker (TensorboardTracker behind its
TrackerLogger, which names metrics as the trainer does), its CheckpointManager (best_meta.json), its
Evaluator (simulated_acc_len), and transformers' TrainerState (trainer_state.json). Nothing here copies
their formats by hand.
"""

import argparse
import json
import logging
import random
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from dflash_eval.reporting.history import Group, HistoryRow
from dflash_eval.reporting.training_log import TRACKER_SUFFIX, implied_acceptance, read_training_log
from dflash_eval.reporting.training_side import (
    BEST_MISMATCH,
    DIVERGING,
    TRAIN_EVAL_GAP,
    training_side,
)

specforge = pytest.importorskip("specforge")


def specforge_logger(run_dir):
    """SpecForge's tracker logger writing TensorBoard scalars to <run_dir>/runs, as its trainer does."""
    from specforge.tracker import TensorboardTracker
    from specforge.training.tracking import TrackerLogger

    return TrackerLogger(TensorboardTracker(argparse.Namespace(report_to="tensorboard"), str(run_dir)))


def eval_metrics(per_position: list[float]) -> dict:
    """What SpecForge's Evaluator returns for per-position accuracies (its own simulated_acc_len)."""
    from specforge.eval.evaluator import Evaluator

    return {"eval/avg_loss": 1.0, "eval/avg_acc": per_position[0], "eval/per_position_acc": per_position,
            "eval/simulated_acc_len": Evaluator._simulated_acc_len(per_position)}


def write_run(run_dir, steps=(100, 200, 300, 400), best=None, accuracy=lambda step: 0.5 + step / 1000):
    """A SpecForge run folder: training scalars every 50 steps, eval metrics at each save, best_meta.json."""
    from specforge.training.checkpoint import CheckpointManager

    with specforge_logger(run_dir) as log:
        for step in range(50, max(steps) + 1, 50):
            a = accuracy(step)
            log({"loss": 2 - a, "acc": a, **{f"acc_{k}": a ** (k + 1) for k in range(3)}}, step)
            if step in steps:
                log(eval_metrics([a, a * 0.9, a * 0.8]), step)
    if best is not None:
        CheckpointManager(str(run_dir), "run").update_best(best, eval_metrics([accuracy(best)] * 3))


def test_reads_what_specforge_logs(tmp_path):
    write_run(tmp_path, best=300)
    log = read_training_log(tmp_path)
    assert log.problems == []
    assert [s for s, _ in log.scalars["train/acc"]] == list(range(50, 401, 50))
    assert log.best.step == 300 and log.best.metric == "eval/simulated_acc_len"
    point = log.at(250)  # between saves: what the trainer had logged last
    assert point.accuracy == pytest.approx(0.75) and point.logged_at == 250
    assert point.eval_accuracy == pytest.approx(0.7)  # the eval at step 200
    assert point.per_position_metric == "eval/per_position_acc"
    assert point.per_position_accuracy == pytest.approx([0.7, 0.63, 0.56])
    # SpecForge's simulated_acc_len counts accepted drafts; the acceptance length adds the bonus token
    assert point.implied_acceptance == pytest.approx(1 + point.trainer_acceptance)


def test_implied_acceptance_is_one_plus_the_sum_of_running_products():
    assert implied_acceptance([]) == 1
    assert implied_acceptance([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    assert implied_acceptance([1.0] * 15) == 16  # every position accepted: the whole block


def test_reads_transformers_trainer_state(tmp_path):
    from transformers import TrainerState

    state = TrainerState(global_step=300, best_model_checkpoint=str(tmp_path / "checkpoint-200"), best_metric=0.71,
                         log_history=[{"loss": 1.5, "step": 100}, {"eval_loss": 1.2, "eval_accuracy": 0.71, "step": 200},
                                      {"loss": 1.1, "step": 300}])
    state.save_to_json(str(tmp_path / "trainer_state.json"))
    log = read_training_log(tmp_path)
    assert log.problems == [] and log.best.step == 200
    assert log.at(300).loss == 1.1 and log.at(300).eval_accuracy == 0.71


def test_damaged_logs_are_named_and_what_was_read_is_kept(tmp_path):
    write_run(tmp_path)
    (events,) = (tmp_path / "runs").glob("events.out.tfevents.*")
    data = events.read_bytes()
    events.write_bytes(data[:len(data) * 2 // 3])  # cut short, as a trainer killed mid-write leaves it
    (tmp_path / "run.best_meta.json").write_text('{"step": 3')
    log = read_training_log(tmp_path)
    assert any(str(events) in p and "cut short" in p for p in log.problems), log.problems
    assert any("best_meta.json" in p and "best-mismatch check is skipped" in p for p in log.problems), log.problems
    assert log.scalars["train/acc"][0] == (50, pytest.approx(0.55))  # the points before the cut
    assert log.best is None
    events.write_bytes(data[:200] + bytes(50) + data[250:])  # a damaged record
    assert any(str(events) in p and "checksum" in p for p in read_training_log(tmp_path).problems)

    assert "does not exist" in read_training_log(tmp_path / "missing").problems[0]
    (tmp_path / "a_file").write_text("x")
    assert "not a folder" in read_training_log(tmp_path / "a_file").problems[0]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert "no TensorBoard event files" in read_training_log(empty).problems[0]


def test_our_own_tensorboard_run_is_never_read_as_the_trainers(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    write_run(tmp_path)
    with SummaryWriter(str(tmp_path / "runs" / "dflash-eval"), filename_suffix=TRACKER_SUFFIX) as writer:
        writer.add_scalar("dflash_eval/tau_macro", 3.0, 100)
    assert not any(name.startswith("dflash_eval") for name in read_training_log(tmp_path).scalars)


# ------------------------------------------------------------------ TensorBoard's reader says nothing to us

SPECULATORS_LOGS = Path(__file__).parent / "golden" / "speculators" / "dflash" / "logs"  # its real event files


def readers_lines(records) -> list[str]:
    return [f"{r.name}: {r.getMessage()}" for r in records if r.name.split(".")[0] in ("tensorboard", "absl")]


def test_reading_a_log_logs_nothing_of_tensorboards_reader_and_only_while_reading(tmp_path, caplog):
    """TensorBoard's reader logs a dozen DEBUG and INFO lines per event file ("Loading events from", "No path
    found after", "Directory watcher advancing from"): none reaches a handler, even with everything at DEBUG;
    damage is still reported as a problem; the reader's logger is as it was once the read is over."""
    write_run(tmp_path)  # SpecForge's tracker: one event file in runs/
    shutil.copytree(SPECULATORS_LOGS, tmp_path / "logs")  # speculators': two files in one folder
    reader = logging.getLogger("tensorboard")
    before = (reader.level, list(reader.filters), list(reader.handlers), reader.propagate)
    caplog.set_level(logging.DEBUG)
    caplog.clear()
    log = read_training_log(tmp_path)
    assert log.problems == [] and "train/acc" in log.scalars and "val/eal_epoch" in log.scalars
    assert readers_lines(caplog.records) == []

    (events,) = (tmp_path / "runs").glob("events.out.tfevents.*")
    events.write_bytes(events.read_bytes()[:-40])  # cut short: the reader says so at DEBUG only
    assert any("cut short" in p for p in read_training_log(tmp_path).problems)
    assert readers_lines(caplog.records) == []

    assert (reader.level, reader.filters, reader.handlers, reader.propagate) == before
    reader.debug("after the read")  # the user's logging config holds for the rest of the process
    assert readers_lines(caplog.records) == ["tensorboard: after the read"]


def test_logs_read_at_once_by_several_threads_each_report_their_damage(tmp_path):
    """Prefect may run flows in threads: each read still catches what the reader says about its own files,
    and the reader's logger is left as it was."""
    import threading

    folders = []
    for i in range(6):
        shutil.copytree(SPECULATORS_LOGS, tmp_path / f"run{i}" / "logs")
        first = sorted((tmp_path / f"run{i}" / "logs" / "dflash").glob("events.out.tfevents.*"))[0]
        first.write_bytes(first.read_bytes()[:-40])
        folders.append(tmp_path / f"run{i}")
    problems: dict = {}
    threads = [threading.Thread(target=lambda f=f: problems.__setitem__(f, read_training_log(f).problems))
               for f in folders]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert all(any("cut short" in p for p in problems[f]) for f in folders), problems
    reader = logging.getLogger("tensorboard")
    assert reader.level == logging.NOTSET and reader.filters == []


def test_reading_a_log_prints_nothing_to_a_console_on_the_root_logger(tmp_path, capsys):
    """As Prefect configures logging (a console handler on the root logger, which stays at WARNING): nothing
    of the reader's on the console."""
    write_run(tmp_path)
    root, console = logging.getLogger(), logging.StreamHandler(sys.stderr)
    level = root.level
    root.addHandler(console)
    root.setLevel(logging.WARNING)
    try:
        capsys.readouterr()
        read_training_log(tmp_path)
    finally:
        root.removeHandler(console)
        root.setLevel(level)
    assert capsys.readouterr().err == ""


@pytest.mark.slow
def test_reading_a_log_under_prefects_logging_prints_nothing(tmp_path):
    """Prefect's own logging setup, in a process of its own: its console shows none of the reader's lines."""
    shutil.copytree(SPECULATORS_LOGS, tmp_path / "logs")
    script = ("import sys\nfrom prefect.logging.configuration import setup_logging\nsetup_logging()\n"
              "from dflash_eval.reporting.training_log import read_training_log\n"
              "log = read_training_log(sys.argv[1])\nprint(len(log.scalars), log.problems)")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "34 []"
    assert "tensorboard" not in done.stderr and "events" not in done.stderr, done.stderr


# ------------------------------------------------------------------ the alarm, on rows built here


def row(step: int, taus: list[float], run: str = "/runs/r") -> HistoryRow:
    mean = sum(taus) / len(taus)
    return HistoryRow(step=step, source=f"{run}/step_{step}", label=f"r/step_{step}", checkpoint=f"c{step}",
                      drafts=f"d{step}", scores=f"s{step}", scores_path="", scored_at=None, tau_macro=mean,
                      tau_macro_ci95=(mean - 0.1, mean + 0.1), tau_pooled=mean, all_positions_tau=None,
                      baseline=False, per_reference=tuple((f"p{i}", f"p{i}", t) for i, t in enumerate(taus)))


def group_of(rows: list[HistoryRow]) -> Group:
    return Group("f", "causal", None, None, "t", "t", "greedy", "t-series", rows)


def taus_around(mean: float, n: int = 40, seed: int = 0) -> list[float]:
    rng = random.Random(seed)
    return [mean + rng.uniform(-0.5, 0.5) for _ in range(n)]


def kinds(side) -> list[tuple[str, int]]:
    return [(f.kind, f.step) for f in side.flags]


def test_best_mismatch_names_both_steps_and_only_when_the_paired_interval_excludes_zero(tmp_path):
    noise = taus_around(0, seed=1)
    rows = [row(100, [2 + x for x in noise]), row(200, [3 + x for x in noise]), row(300, [2.5 + x for x in noise])]
    write_run(tmp_path, steps=(100, 200, 300), best=100)
    side = training_side(group_of(rows), "/runs/r", tmp_path, block_size=4)
    assert (BEST_MISMATCH, 100) in kinds(side)
    message = next(f.message for f in side.flags if f.kind == BEST_MISMATCH)
    assert "step 100" in message and "step 200" in message

    write_run(tmp_path, steps=(100, 200, 300), best=200)  # the trainer agrees: no flag
    assert BEST_MISMATCH not in [k for k, _ in kinds(training_side(group_of(rows), "/runs/r", tmp_path, 4))]
    # the trainer's best within noise of ours: no flag either
    close = [row(100, [3 + x for x in noise]), row(200, [3 + x for x in taus_around(0, seed=2)])]
    write_run(tmp_path, steps=(100, 200), best=100)
    assert BEST_MISMATCH not in [k for k, _ in kinds(training_side(group_of(close), "/runs/r", tmp_path, 4))]


def test_diverging_when_training_accuracy_rises_and_tau_does_not(tmp_path):
    write_run(tmp_path, accuracy=lambda step: 0.3 + step / 1000)
    flat = [row(s, taus_around(3, seed=s)) for s in (100, 200, 300, 400)]
    side = training_side(group_of(flat), "/runs/r", tmp_path, block_size=4)
    assert (DIVERGING, 400) in kinds(side)
    assert "per 1000 steps" in next(f.message for f in side.flags if f.kind == DIVERGING)

    noise = taus_around(0, seed=3)
    rising = [row(s, [2 + s / 200 + x for x in noise]) for s in (100, 200, 300, 400)]
    assert DIVERGING not in [k for k, _ in kinds(training_side(group_of(rising), "/runs/r", tmp_path, 4))]
    # fewer saves than the window: nothing to fit
    assert DIVERGING not in [k for k, _ in kinds(training_side(group_of(flat[:3]), "/runs/r", tmp_path, 4))]


def test_train_eval_gap_when_the_trainers_accuracy_implies_far_more_than_tau(tmp_path):
    # 70% accuracy at every position implies 1 + 0.7 + 0.49 + 0.343 = 2.53 for blocks of 4 (SpecForge #455:
    # high training accuracy, acceptance about 1)
    write_run(tmp_path, steps=(100,), accuracy=lambda step: 0.7)
    side = training_side(group_of([row(100, taus_around(1.05, seed=4))]), "/runs/r", tmp_path, block_size=4)
    assert kinds(side) == [(TRAIN_EVAL_GAP, 100)]
    message = side.flags[0].message
    assert "label" in message and "context mask" in message and "lm_head" in message
    # the same log beside a drafter decoding as training says: no flag
    implied = side.implied(side.rows[0])[0]
    assert not training_side(group_of([row(100, taus_around(implied, seed=4))]), "/runs/r", tmp_path, 4).flags


def test_train_eval_gap_per_position_against_the_drafters_teacher_forced_accuracy(tmp_path):
    """Scored with --all-positions, a row knows each position's teacher-forced accuracy on our references:
    the trainer logging far more at some position is flagged, with both sequences, even where the implied
    acceptance alone would pass."""
    write_run(tmp_path, steps=(100,), accuracy=lambda step: 0.6)  # eval per-position: 60% 54% 48%
    clean = replace(row(100, taus_around(2.0, seed=6)), teacher_forced_accuracy=(0.58, 0.55, 0.47))
    assert not training_side(group_of([clean]), "/runs/r", tmp_path, block_size=4).flags
    leaked = replace(clean, teacher_forced_accuracy=(0.30, 0.55, 0.47))  # position 1 far below the trainer's
    (flag,) = training_side(group_of([leaked]), "/runs/r", tmp_path, block_size=4).flags
    assert flag.kind == TRAIN_EVAL_GAP and "draft position 1 30%" in flag.message and "60% 54% 48%" in flag.message


def test_rows_of_another_training_run_are_not_compared(tmp_path):
    write_run(tmp_path, steps=(100,), best=100)
    side = training_side(group_of([row(100, [2.0] * 4, run="/runs/other")]), "/runs/r", tmp_path, 4)
    assert side.rows == [] and side.flags == []


def test_the_best_by_the_trainers_own_metric_without_best_meta(tmp_path):
    write_run(tmp_path, steps=(100, 200), accuracy=lambda step: 0.9 - step / 1000)  # its metric falls
    noise = taus_around(0, seed=5)
    rows = [row(100, [2 + x for x in noise]), row(200, [3 + x for x in noise])]
    side = training_side(group_of(rows), "/runs/r", tmp_path, block_size=16)
    mismatch = next(f for f in side.flags if f.kind == BEST_MISMATCH)
    assert mismatch.step == 100 and "eval/simulated_acc_len" in mismatch.message


def test_each_setting_has_its_own_tensorboard_tags():
    from dflash_eval.reporting.tracker import series_prefixes

    greedy, sampled = group_of([]), replace(group_of([]), setting="T=0.6 top-k 20 x8")
    blocks = replace(group_of([]), setting="greedy, blocks of 4")
    assert series_prefixes([greedy, sampled, blocks]) == {
        0: "dflash_eval", 1: "dflash_eval/T_0.6_top-k_20_x8", 2: "dflash_eval/greedy_blocks_of_4"}
    other_prompts = replace(group_of([]), title="target on code.jsonl")  # another greedy series: both titled
    assert series_prefixes([greedy, other_prompts]) == {0: "dflash_eval/t", 1: "dflash_eval/target_on_code.jsonl"}


def test_a_log_that_cannot_be_read_leaves_only_a_named_problem(tmp_path):
    side = training_side(group_of([row(100, [2.0] * 4)]), "/runs/r", tmp_path / "nowhere", 4)
    assert side.flags == [] and "does not exist" in side.log.problems[0]
    assert json.dumps(side.as_dict())  # what results keep
