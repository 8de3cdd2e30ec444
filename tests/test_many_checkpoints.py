"""`dflash-eval run` over several checkpoints in one process (a training run's folder, repeated --drafter), and
what the command line prints for scripts (`history --json`, `verify --json`, `--version`)."""

import json
import shutil
from importlib.metadata import version

import pytest
from typer.testing import CliRunner

from dflash_eval.cli import app
from tests.tiny_models import first_prompts

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

MAX_NEW = 16


@pytest.fixture(scope="module")
def run_folder(tiny_qwen3_run, tmp_path_factory):
    """A training run's folder as a trainer leaves it: its saves, a TensorBoard folder and a save still being
    written (no weights yet), which is left out."""
    root = tmp_path_factory.mktemp("many")
    run = root / "run"
    for step in tiny_qwen3_run.drafter_steps:
        shutil.copytree(step, run / step.name)
    (run / "runs").mkdir()
    (run / "step_9999").mkdir()
    (run / "step_9999" / "config.json").write_text("{}")
    return {"run": run, "prompts": first_prompts(tiny_qwen3_run, 3, root / "prompts.jsonl"), "root": root}


def run_command(tiny, folder, drafters, store, out, *more) -> list[str]:
    return ["run", "--target", str(tiny.target_dir), *[a for d in drafters for a in ("--drafter", str(d))],
            "--prompts", str(folder["prompts"]), "--max-new-tokens", str(MAX_NEW), "--store", str(store),
            "--out", str(out), *more]


@pytest.fixture(scope="module")
def folder_evaluated(tiny_qwen3_run, run_folder, prefect_api_url):
    """`run --drafter RUN_FOLDER --out DIR` into the store `<root>/store`: its CliRunner result."""
    root = run_folder["root"]
    return CliRunner().invoke(app, run_command(tiny_qwen3_run, run_folder, [run_folder["run"]], root / "store",
                                               root / "out"))


def test_a_run_folder_is_each_of_its_checkpoints_in_step_order_with_the_results_of_separate_runs(
        tiny_qwen3_run, run_folder, folder_evaluated):
    from prefect import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterTags

    root, steps, result = run_folder["root"], [p.name for p in tiny_qwen3_run.drafter_steps], folder_evaluated
    assert result.exit_code == 0, result.output
    assert f"{len(steps)} finished checkpoints, in step order: {', '.join(steps)}" in result.output
    together = {p.stem: json.loads(p.read_text()) for p in (root / "out").glob("*.json")}
    assert sorted(together) == sorted(steps)
    # the closing table, a row per checkpoint in step order under its header (log lines may follow it)
    table = result.output[result.output.index("\ncheckpoint ") + 1:].splitlines()[1:1 + len(steps)]
    assert [(line.split() or [""])[0] for line in table] == steps, result.output
    for step in (steps[0], steps[-1]):  # the same acceptance lengths as a run of that checkpoint alone
        alone = CliRunner().invoke(app, run_command(tiny_qwen3_run, run_folder, [run_folder["run"] / step],
                                                    root / f"store-{step}", root / f"{step}.json"))
        assert alone.exit_code == 0, alone.output
        single = json.loads((root / f"{step}.json").read_text())
        assert [p["acceptance_lengths"] for p in together[step]["per_prompt"]] == \
            [p["acceptance_lengths"] for p in single["per_prompt"]]
        assert together[step]["tau_macro"] == single["tau_macro"]
    # each checkpoint its own flow run, in the one series
    (key,) = {r["series"]["key"] for r in together.values()}
    with get_client(sync_client=True) as client:
        runs = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(all_=[f"series:{key}"])))
    assert sorted(run.name for run in runs) == sorted(f"run/{s}" for s in steps)


def test_a_failing_checkpoint_is_said_and_the_others_still_run(tiny_qwen3_run, run_folder, prefect_api_url, tmp_path):
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken" / "step_7"
    shutil.copytree(tiny_qwen3_run.drafter_steps[0], broken)
    weights = load_file(broken / "model.safetensors")
    weights["norm.weight"][0] = float("nan")
    save_file(weights, broken / "model.safetensors")
    good = tiny_qwen3_run.drafter_steps[-1]
    result = CliRunner().invoke(app, run_command(tiny_qwen3_run, run_folder, [broken, good], tmp_path / "store",
                                                 tmp_path / "out"))
    assert result.exit_code == 2, result.output
    assert f"error: {broken}: drafter " in result.output and "NaN" in result.output
    assert "1 of 2 checkpoints failed" in result.output.splitlines()[-1]
    assert [p.name for p in (tmp_path / "out").iterdir()] == [f"{good.name}.json"]


def test_bad_input_for_any_checkpoint_stops_before_any_runs(tiny_qwen3_run, run_folder, tmp_path):
    result = CliRunner().invoke(app, run_command(tiny_qwen3_run, run_folder, [tiny_qwen3_run.drafter_steps[0],
                                                                              tiny_qwen3_run.target_dir],
                                                 tmp_path / "store", tmp_path / "out"))
    assert result.exit_code == 2 and "looks like a target" in result.output.splitlines()[-1], result.output
    assert not list((tmp_path / "store").rglob("entry.json")) and not (tmp_path / "out").exists()  # nothing ran


def test_history_and_verify_print_json_that_carries_what_the_tables_show(tiny_qwen3_run, run_folder,
                                                                          folder_evaluated):
    store = run_folder["root"] / "store"
    assert folder_evaluated.exit_code == 0, folder_evaluated.output
    table = CliRunner().invoke(app, ["history", "--store", str(store)])
    listed = CliRunner().invoke(app, ["history", "--store", str(store), "--json"])
    assert listed.exit_code == 0, listed.output
    history = json.loads(listed.stdout)
    (series,) = history["series"]
    assert series["title"] in table.output and len(series["rows"]) == len(tiny_qwen3_run.drafter_steps)
    for row in series["rows"]:
        assert row["series"] == series["key"]
        assert f"{row['tau_macro']:.3f}" in table.output and row["checkpoint"] in table.output
    assert [r["best"] for r in series["rows"]].count(True) == 1
    checked = CliRunner().invoke(app, ["verify", "--store", str(store), "--json"])
    assert checked.exit_code == 0, checked.output
    report = json.loads(checked.stdout)
    assert report["entries"] > 0 and report["problems"] == [] and report["store"] == str(store.resolve())
    assert CliRunner().invoke(app, ["history", "--store", str(run_folder["root"] / "nothing"), "--json"]).exit_code == 2


def test_version():
    result = CliRunner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"dflash-eval {version('dflash-eval')}"
