"""The tiny run as a training run that `demo` follows, as a served flow follows a real one: the drafter's training
logs what SpecForge's trainer logs (a TensorBoard log in the run folder, read by reporting.training_log as the
trainer's), hands each save on as soon as it is written while it goes on training, and its logging changes no
weight; a build's progress off a terminal prints as plain lines while it runs; and a first `demo` evaluates each
save while the drafter still trains, ending with where to look next. Small builds: seconds of training each."""

import contextlib
import io
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from dflash_core.replay import Reference
from dflash_eval.cli import app
from dflash_eval.reporting.training_log import read_training_log
from dflash_eval.reporting.training_side import holds_training_log
from dflash_eval.tiny.build import TinyBuildSettings, build_tiny, tiny_drafter_config
from dflash_eval.tiny.training import DrafterTrainingSettings, train_drafter

pytestmark = pytest.mark.slow

# an untrained-looking target (5 steps), few and short references: a build of seconds
SMALL = TinyBuildSettings(target_steps=5, corpus_bytes=200_000, train_prompts=16, eval_prompts=4, max_new_tokens=16,
                          drafter_training=DrafterTrainingSettings(steps=10, save_every=5))


@pytest.fixture(scope="module")
def small_build(tmp_path_factory):
    """A small tiny build with `tiny build`'s progress, stdout not a terminal (a log file): (run, what it printed)."""
    from dflash_eval.cli.tiny import BuildProgress

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed), BuildProgress() as progress:
        run = build_tiny(tmp_path_factory.mktemp("small") / "run", SMALL, log=print, progress=progress)
    return run, printed.getvalue()


def test_off_a_terminal_the_build_prints_progress_lines_while_it_runs(small_build):
    _, printed = small_build
    lines = printed.splitlines()
    # each long step says it started and when it is done, as it happens: before the build's own line that follows it
    for step, total, after in (("target training", 5, "target: "), ("greedy references", 20, "references + features: "),
                               ("drafter training", 10, "step_5: tau"), ("scoring saved steps", 2, "step_5: tau")):
        started = next(i for i, line in enumerate(lines) if line.startswith(f"{step}: "))
        done = next(i for i, line in enumerate(lines) if line.startswith(f"{step}: {total}/{total} (100%) after ")
                    and line.endswith(", done"))
        assert started <= done < next(i for i, line in enumerate(lines) if line.startswith(after)), printed
    assert lines[0] == "target training: 1/5 (20%) after 0 s", printed  # said when it starts
    assert "━" not in printed  # no progress bars drawn into a log


def test_a_progress_line_shows_at_most_every_few_seconds_with_the_time_left(capsys):
    import time

    from dflash_eval.cli.tiny import BuildProgress

    progress = BuildProgress(every_seconds=0.2)
    assert not progress.terminal  # pytest's captured stdout
    with progress:
        for done in range(1, 31):
            time.sleep(0.02)  # a unit of work
            progress("drafter training", done, 30)
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "drafter training: 1/30 (3%) after 0 s", lines
    assert lines[-1].startswith("drafter training: 30/30 (100%) after ") and lines[-1].endswith(", done"), lines
    assert 3 <= len(lines) <= 6, lines  # ~0.6 s of units: a line per 0.2 s, not one per unit
    assert all(" s left" in line for line in lines[1:-1]), lines


def test_the_drafter_run_holds_a_trainer_log_the_training_side_reads_as_specforges(small_build):
    run, _ = small_build
    drafter_run = run.root / "drafter"
    assert holds_training_log(drafter_run)  # what makes the flow set tau beside the trainer's numbers
    assert list((drafter_run / "runs").glob("events.out.tfevents.*"))  # where SpecForge's tracker writes it
    log = read_training_log(drafter_run)
    assert log.problems == []
    saves = run.record["steps"]
    for name in ("eval/simulated_acc_len", "eval/avg_acc", "eval/avg_loss"):  # SpecForge's evaluator, at each save
        assert [step for step, _ in log.scalars[name]] == saves, name
    assert {"train/loss", "train/acc", "train/acc_0", "train/acc_6"} <= set(log.scalars)
    at = log.at(saves[-1])
    assert at.trainer_acceptance_metric == "eval/simulated_acc_len" and 0 <= at.trainer_acceptance <= 1
    assert at.eval_accuracy == at.trainer_acceptance  # SpecForge's DFlash: the same accuracy under both names
    assert at.per_position_metric == "train/acc" and len(at.per_position_accuracy) == SMALL.block_size - 1


def test_the_trainer_log_changes_no_weight_and_each_save_is_handed_on_with_the_log_flushed(tmp_path):
    """The same training with and without its log, held-out scalars and the hand-over: the same bytes at every save.
    When a save is handed on, the log already holds the scalars of that save's step, and training goes on."""
    generator = torch.Generator().manual_seed(0)
    target = SimpleNamespace(hidden_size=32, max_positions=128, vocab_size=64, num_layers=4)
    raw = tiny_drafter_config(SMALL, target, mask_token_id=63)
    embed, head = torch.randn(64, 32, generator=generator), torch.randn(64, 32, generator=generator)
    references = [Reference(4, torch.randint(0, 63, (24,), generator=generator).tolist()) for _ in range(6)]
    features = [torch.randn(2, 24, 32, generator=generator) for _ in references]
    settings = DrafterTrainingSettings(steps=6, save_every=3, sequences_per_step=2, anchors_per_sequence=4)
    plain = train_drafter(raw, embed, head, references[:4], features[:4], tmp_path / "plain", settings, log=None)

    handed = []

    def on_save(path: Path) -> None:
        logged = read_training_log(tmp_path / "logged" / "runs").scalars.get("eval/simulated_acc_len", [])
        handed.append((path.name, [step for step, _ in logged], sorted(p.name for p in path.parent.glob("step_*"))))

    logged = train_drafter(raw, embed, head, references[:4], features[:4], tmp_path / "logged", settings, log=None,
                           log_dir=tmp_path / "logged" / "runs", held_out=(references[4:], features[4:]),
                           on_save=on_save)
    assert [p.name for p in plain] == [p.name for p in logged] == ["step_3", "step_6"]
    for a, b in zip(plain, logged):
        assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes(), a.name
    assert handed == [("step_3", [3], ["step_3"]), ("step_6", [3, 6], ["step_3", "step_6"])]


def test_a_first_demo_evaluates_each_save_while_the_drafter_trains_and_says_where_to_look_next(
        tmp_path, monkeypatch, prefect_api_url):
    from dflash_eval.cli import evaluation

    settings = replace(SMALL, drafter_training=DrafterTrainingSettings(steps=60, save_every=30))
    monkeypatch.setattr(evaluation, "demo_build_settings", lambda: settings)
    monkeypatch.setenv("DFLASH_TINY_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["demo", "--store", "store", "--out", "results"])
    output = result.output
    assert result.exit_code == 0, output
    assert "(building it; each drafter save is evaluated as soon as it is written)" in output
    # step_30 is taken up the moment it is written, while the drafter trains its next 30 steps
    assert "step_30 written" in output and "evaluating it while the drafter trains on" in output, output
    assert output.index("step_30 written") < output.index("drafter step 60:"), output
    assert "step_60 written" in output and "(the drafter's last save)" in output
    assert output.index("step_30: tau macro") < output.index("step_60: tau macro")

    # tau per step beside the trainer's numbers, then where to look next
    table = output[output.index("step        tau macro     95% CI  tau pooled  trainer eval acc  trainer implies  ran"):]
    rows = table.splitlines()[1:3]
    assert [row.split()[0] for row in rows] == ["step_30", "step_60"], table
    assert all(row.split()[4] != "-" and row.split()[5] != "-" for row in rows), table  # the trainer's log was read
    tiny = next(line.split("tiny run: ")[1].split(" (")[0] for line in output.splitlines()
                if line.startswith("tiny run: "))
    next_steps = output[output.index("\nnext:\n"):]
    report = (tmp_path / "store" / "report" / "report.html").resolve()
    assert str(report) in next_steps and report.is_file()
    assert "dflash-eval history --store store" in next_steps
    logdir = Path(tiny) / "drafter" / "runs"
    assert f"tensorboard --logdir {logdir}" in next_steps
    assert list(logdir.glob("events.out.tfevents.*"))  # the trainer's
    assert list((logdir / "dflash-eval").glob("events.out.tfevents.*"))  # ours: tau by step
    assert "demo: first tau " in output
    assert sorted(p.name for p in (tmp_path / "results").iterdir()) == ["step_30.json", "step_60.json"]
