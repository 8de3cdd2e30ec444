"""Tau in the team's tracker, through the flow: four saves of a training run whose log SpecForge's own
tracker and checkpoint manager wrote; TensorBoard's reader and a real `tensorboard --logdir` server see
dflash_eval/tau_macro at the four steps with history's values, re-evaluating replaces points, and the
best-mismatch flag is raised exactly when best_meta.json names a step that is not the best by tau."""

import json
import shutil
import subprocess
import sys

import pytest
import requests
from typer.testing import CliRunner

from dflash_eval.cli import app
from dflash_eval.reporting.history import history
from dflash_eval.reporting.training_log import read_training_log
from dflash_eval.storage import Store
from tests.ports import free_port
from tests.test_pipeline import MAX_NEW
from tests.test_served_settings import client_artifacts
from tests.test_training_log import write_run
from tests.waiting import NeverReady, answers, wait_until

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
STEPS = (100, 200, 300, 400)


def tensorboard_scalars(folder, tag: str) -> list[tuple[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(folder), size_guidance={"scalars": 0})
    accumulator.Reload()
    return [(e.step, e.value) for e in accumulator.Scalars(tag)]


@pytest.fixture(scope="module")
def evaluated(tiny, tmp_path_factory, prefect_api_url):
    """A SpecForge-style run folder (the tiny run's four saves, `epoch_0_step_N` as its older trainer names
    them, and its TensorBoard log), best_meta.json naming step 100, and the four saves evaluated."""
    from tests.evaluations import run_evaluation

    root = tmp_path_factory.mktemp("tracker")
    run, store = root / "run", root / "store"
    for step, folder in zip(STEPS, tiny.drafter_steps):
        shutil.copytree(folder, run / f"epoch_0_step_{step}")
    write_run(run, steps=STEPS, best=100, accuracy=lambda step: 0.5 + step / 2000)

    def evaluate(step, **kwargs):
        state = run_evaluation(target=str(tiny.target_dir), drafter=str(run / f"epoch_0_step_{step}"),
                                    prompts=str(tiny.prompts), max_new_tokens=MAX_NEW, store=str(store),
                                    return_state=True, **kwargs)
        flow_runs[step] = state.state_details.flow_run_id
        return state.result()

    flow_runs: dict = {}
    evaluate.flow_runs = flow_runs

    results = {step: evaluate(step) for step in STEPS}
    return run, store, results, evaluate


def test_tau_lands_in_tensorboard_at_each_training_step(evaluated):
    run, store, results, _ = evaluated
    (group,) = history(Store(store))
    taus = {row.step: row.tau_macro for row in group.rows}
    ours = run / "runs" / "dflash-eval"
    assert results[400]["training"]["tensorboard"] == str(ours)
    assert tensorboard_scalars(ours, "dflash_eval/tau_macro") == [(s, pytest.approx(taus[s])) for s in STEPS]
    low = tensorboard_scalars(ours, "dflash_eval/tau_macro_ci95_low")
    assert [v for _, v in low] == [pytest.approx(r.tau_macro_ci95[0]) for r in group.rows]
    assert len(tensorboard_scalars(ours, "dflash_eval_by_position/acceptance_at_position/1")) == 4
    assert len(tensorboard_scalars(ours, "dflash_eval/trainer_implied_acceptance")) == 4
    assert not [tag for tag in results[400]["training"]["tracker_tags"] if "selector" in tag]  # DFlash: none
    # the trainer's own event file is untouched, and ours is never read as the trainer's
    assert len(list((run / "runs").glob("events.out.tfevents.*"))) == 1
    assert not [name for name in read_training_log(run).scalars if name.startswith("dflash_eval")]


def test_the_trainers_best_that_is_not_the_best_by_tau_is_flagged(evaluated):
    run, store, results, evaluate = evaluated
    flags = results[400]["training"]["flags"]
    mismatch = [f for f in flags if f["kind"] == "best mismatch"]
    assert len(mismatch) == 1 and mismatch[0]["step"] == 100
    assert "step 100" in mismatch[0]["message"] and "best_meta.json" in mismatch[0]["message"]
    # in the Prefect UI: the summary says it with its reason, the history table marks the step
    artifacts = client_artifacts(evaluate.flow_runs[400])
    (summary,) = [a.data for a in artifacts if a.type == "markdown" and (a.key or "").endswith("-summary")]
    assert "### Training beside evaluation" in summary and "**BEST MISMATCH** (step 100)" in summary
    assert "TensorBoard run:" in summary
    (table,) = [json.loads(a.data) for a in artifacts if a.type == "table" and (a.key or "").endswith("-history")]
    assert {r["step"]: r["flags"] for r in table}["100"] == "best mismatch"
    summary_history = CliRunner().invoke(app, ["history", "--store", str(store)])
    assert summary_history.exit_code == 0 and "BEST MISMATCH (step 100)" in summary_history.output
    report = (store / "report" / "report.md").read_text()
    assert "Training beside evaluation" in report and "BEST MISMATCH (step 100)" in report
    # DFlash drafters have no selector: none of its numbers anywhere
    assert not [r for r in table if "unary head tau" in r]
    for shown in (summary, summary_history.output, report):
        assert "unary head" not in shown and "selector" not in shown.lower()

    # the trainer names the best by tau: no flag
    from specforge.training.checkpoint import CheckpointManager

    (group,) = history(Store(store))
    CheckpointManager(str(run), "run").update_best(group.best.step, {"eval/simulated_acc_len": 1.0})
    again = evaluate(400)
    assert again["stages"]["scores"] == "cached"
    assert not [f for f in again["training"]["flags"] if f["kind"] == "best mismatch"]


def test_re_evaluating_a_step_replaces_its_points(evaluated):
    run, store, results, evaluate = evaluated
    evaluate(300, refresh=["scores"])
    ours = run / "runs" / "dflash-eval"
    assert [s for s, _ in tensorboard_scalars(ours, "dflash_eval/tau_macro")] == list(STEPS)
    assert len(list(ours.glob("events.out.tfevents.*"))) == 1


def test_a_tensorboard_server_shows_the_same_scalars(evaluated):
    run, store, _, _ = evaluated
    (group,) = history(Store(store))
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "tensorboard.main", "--logdir", str(run / "runs"),
                               "--host", "127.0.0.1", "--port", str(port), "--load_fast", "false"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        url = f"http://127.0.0.1:{port}/data/plugin/scalars/scalars"

        def all_points():  # None until the server answers with every step (it reads the logs after it starts)
            answer = requests.get(url, params={"run": "dflash-eval", "tag": "dflash_eval/tau_macro"}, timeout=5)
            return answer.json() if answer.status_code == 200 and len(answer.json()) == 4 else None

        try:
            points = wait_until(all_points, 90, "the TensorBoard server's scalars", server, every=1)
        except NeverReady as e:
            raise AssertionError(f"{e}: {server.stderr.read()}") from None
        assert [(step, value) for _, step, value in points] == [
            (r.step, pytest.approx(r.tau_macro, rel=1e-6)) for r in group.rows]
        runs = requests.get(f"http://127.0.0.1:{port}/data/runs", timeout=5).json()
        assert set(runs) == {".", "dflash-eval"}  # SpecForge's run and ours, side by side
        # the Custom Scalars tab opens on tau beside SpecForge's simulated_acc_len: one chart, both runs
        layout = requests.get(f"http://127.0.0.1:{port}/data/plugin/custom_scalars/layout", timeout=5).json()
        assert layout["category"][0]["title"] == "dflash-eval: tau beside the trainer"
        regexes = layout["category"][0]["chart"][0]["multiline"]["tag"]
        lines = {run: requests.get(f"http://127.0.0.1:{port}/data/plugin/custom_scalars/scalars", timeout=5,
                                   params={"run": run, "tag": "|".join(f"({r})" for r in regexes)}).json()
                 for run in runs}
        assert set(lines["."]["tag_to_events"]) == {"eval/simulated_acc_len"}
        assert {"dflash_eval/tau_macro", "dflash_eval/trainer_implied_acceptance"} <= set(
            lines["dflash-eval"]["tag_to_events"])
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_all_positions_scores_add_the_teacher_forced_accuracy_beside_the_trainers(evaluated):
    run, store, _, evaluate = evaluated
    results = evaluate(400, all_positions=True)
    accuracy = results["teacher_forced_accuracy"]
    assert len(accuracy) == 7 and all(0 <= a <= 1 for a in accuracy) and accuracy[0] > accuracy[-1]
    scalars = tensorboard_scalars(run / "runs" / "dflash-eval", "dflash_eval_by_position/teacher_forced_accuracy/1")
    assert scalars == [(400, pytest.approx(accuracy[0]))]


def test_a_dflash2_drafter_s_selector_lands_in_tensorboard(dflash2_evaluated):
    """selector/unary_tau_macro, selector/lift and the three shares per draft position at each step, with
    scores.json's values; a position no step reached has no point."""
    from dflash_eval.reporting.tracker import _scalars
    from tests.evaluations import stored_scores

    evaluated = dflash2_evaluated
    steps = [results["drafter"]["step"] for results in evaluated.results]
    selectors = [stored_scores(evaluated.store, results)["selector"] for results in evaluated.results]

    def points(name: str) -> list[tuple[int, float]]:  # by draft position: in their own tag group
        group = "dflash_eval_by_position" if name[-1].isdigit() else "dflash_eval"
        return tensorboard_scalars(evaluated.tensorboard, f"{group}/selector/{name}")

    assert points("unary_tau_macro") == [(s, pytest.approx(x["unary_tau_macro"])) for s, x in zip(steps, selectors)]
    assert points("lift") == [(s, pytest.approx(x["lift"])) for s, x in zip(steps, selectors)]
    for name in ("selector_accuracy", "argmax_accuracy", "candidate_recall"):
        for k in range(1, len(selectors[-1][name]) + 1):
            assert points(f"{name}/{k}") == [(s, pytest.approx(x[name][k - 1])) for s, x in zip(steps, selectors)
                                             if x[name][k - 1] is not None]
    (group,) = history(Store(evaluated.store))
    scores = stored_scores(evaluated.store, evaluated.results[-1])
    scores["selector"]["argmax_accuracy"][-1] = None  # as where no decode step reached the last position
    tags = _scalars(group.rows[-1], scores, None)
    assert f"selector/argmax_accuracy/{len(selectors[-1]['argmax_accuracy'])}" not in tags
    assert {"selector/argmax_accuracy/1", f"selector/candidate_recall/{len(selectors[-1]['candidate_recall'])}"} <= \
        tags.keys()


def test_a_damaged_training_log_is_a_warning_and_the_evaluation_completes(evaluated, tmp_path):
    run, store, _, evaluate = evaluated
    (run / "run.best_meta.json").write_text("{not json")
    results = evaluate(200)
    assert results["stages"]["scores"] == "cached" and results["tau_macro"] > 1
    assert any("best_meta.json" in p for p in results["training"]["problems"])
    missing = evaluate(200, training_log=str(tmp_path / "nowhere"))
    assert any("does not exist" in p for p in missing["training"]["problems"]), missing["training"]
    assert json.dumps(missing["training"])


@pytest.fixture
def mlflow_server(tmp_path):
    """A real MLflow tracking server on loopback (SQLite store), as `mlflow server` runs for a team."""
    port = free_port()
    server = subprocess.Popen([sys.executable, "-m", "mlflow", "server", "--backend-store-uri",
                               f"sqlite:///{tmp_path / 'mlflow.db'}", "--default-artifact-root", str(tmp_path / "art"),
                               "--host", "127.0.0.1", "--port", str(port), "--workers", "1"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_until(answers(f"{url}/health"), 120, "the MLflow server", server, every=1)
        except NeverReady as e:
            raise AssertionError(f"{e}: {server.stderr.read()}") from None
        yield url
    finally:
        server.terminate()
        server.wait(timeout=30)


def test_mlflow_gets_the_same_points_and_a_rewrite_replaces_them(evaluated, mlflow_server):
    from mlflow.tracking import MlflowClient

    run, store, _, evaluate = evaluated
    (group,) = history(Store(store))
    first = evaluate(400, mlflow=mlflow_server)["training"]
    client = MlflowClient(mlflow_server)
    points = [(m.step, m.value) for m in client.get_metric_history(first["mlflow_run"], "dflash_eval/tau_macro")]
    assert sorted(points) == [(r.step, pytest.approx(r.tau_macro)) for r in group.rows]
    again = evaluate(300, mlflow=mlflow_server)["training"]
    assert client.get_run(first["mlflow_run"]).info.lifecycle_stage == "deleted"
    live = client.search_runs([client.get_experiment_by_name("dflash-eval").experiment_id])
    assert [r.info.run_id for r in live] == [again["mlflow_run"]]
    assert len(client.get_metric_history(again["mlflow_run"], "dflash_eval/tau_macro")) == 4
    assert live[0].data.tags["dflash_eval.training_run"] == str(run)

    dead = evaluate(200, mlflow=f"http://127.0.0.1:{free_port()}")
    assert dead["tau_macro"] > 1 and any("does not answer" in p for p in dead["training"]["problems"])
