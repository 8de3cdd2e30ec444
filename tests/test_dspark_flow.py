"""A DSpark drafter through the flow (the tiny `qwen3_dspark` run's last save): the confidence threshold as a served
setting and a sweep over thresholds, in every place a run is read.

- `run --confidence-thresholds 0,0.5` prints the sweep's table (tau, tokens verified per step, tokens per verified
  token: DeepSpec's verify_rate, per threshold); its `--out` holds `threshold_sweep`, whose row at 0 is the run's own
  tau; the confidence head's calibration is in the report as a reliability curve;
- `run --confidence-threshold 0.5` is a series of its own in `history` (its label names the threshold), and its
  results hold what the target verified (`verification`); both land in TensorBoard under the setting's prefix;
- a drafter without a confidence head given a threshold is refused in one line.
"""

import json

import pytest

from tests.tiny_models import first_prompts

PROMPTS = 6
MAX_NEW = 48
THRESHOLD = 0.5


@pytest.fixture(scope="module")
def dspark_run():
    from tests.trained_runs import trained_run

    return trained_run("qwen3_dspark")


@pytest.fixture(scope="module")
def evaluated(dspark_run, prefect_api_url, tmp_path_factory):
    """The last save run twice through the command line into one store: with the sweep over 0 and THRESHOLD, then
    served at THRESHOLD; each run's console output and results."""
    from typer.testing import CliRunner

    from dflash_eval.cli import app

    root = tmp_path_factory.mktemp("dspark-flow")
    prompts = first_prompts(dspark_run, PROMPTS, root / "prompts.jsonl")
    common = ["run", "--target", str(dspark_run.target_dir), "--drafter", str(dspark_run.drafter_steps[-1]),
              "--prompts", str(prompts), "--max-new-tokens", str(MAX_NEW), "--store", str(root / "store"),
              "--tensorboard", str(root / "tensorboard")]
    runs = {}
    for name, extra in (("sweep", ["--confidence-thresholds", f"0,{THRESHOLD:g}"]),
                        ("threshold", ["--confidence-threshold", f"{THRESHOLD:g}"])):
        out = root / f"{name}.json"
        result = CliRunner().invoke(app, [*common, *extra, "--out", str(out)], env={"COLUMNS": "200"})
        assert result.exit_code == 0, (result.output, result.exception)
        runs[name] = (result.output, json.loads(out.read_text()))
    return root, runs


def table_rows(output: str) -> list[list[str]]:
    """The console's table rows, as their cells."""
    return [[cell.strip() for cell in line.strip().strip("│").split("│")] for line in output.splitlines()
            if line.count("│") >= 2]


@pytest.mark.slow
def test_the_sweep_gives_tau_and_verification_per_threshold(evaluated):
    _, runs = evaluated
    output, results = runs["sweep"]
    sweep = results["threshold_sweep"]
    assert [row["threshold"] for row in sweep] == [0, THRESHOLD]
    at_zero, at_threshold = sweep
    # at 0 every draft is verified: the run's own drafts and tau (the run is served at threshold 0)
    assert "confidence_threshold" not in results["served"] and "verification" not in results  # (threshold 0)
    assert at_zero["tau_macro"] == results["tau_macro"] and at_zero["tau_pooled"] == results["tau_pooled"]
    assert at_zero["verified_per_step"] == results["block_size"]  # every draft and the anchor
    for row in sweep:
        assert 0 < row["tokens_per_verified_token"] <= 1
        assert results["block_size"] >= row["verified_per_step"] >= 1
    assert at_threshold["verified_per_step"] <= at_zero["verified_per_step"]
    assert at_threshold["tokens_per_verified_token"] >= at_zero["tokens_per_verified_token"]
    # the console's table: a row per threshold
    assert "by confidence threshold" in output
    rows = table_rows(output)
    for row in sweep:
        low, high = row["tau_macro_ci95"]
        assert [f"{row['threshold']:g}", f"{row['tau_macro']:.3f}", f"{low:.2f}-{high:.2f}", f"{row['tau_pooled']:.3f}",
                f"{row['verified_per_step']:.3f}", f"{row['tokens_per_verified_token']:.3f}"] in rows
    # the confidence head's calibration at threshold 0
    assert results["confidence"]["overall"]["ece"] is not None
    assert "expected calibration error" in output


@pytest.mark.slow
def test_a_run_at_a_threshold_is_its_own_series_and_says_what_it_verified(evaluated):
    from typer.testing import CliRunner

    from dflash_eval.cli import app

    root, runs = evaluated
    _, swept = runs["sweep"]
    output, results = runs["threshold"]
    assert results["served"]["confidence_threshold"] == THRESHOLD
    assert f"confidence threshold {THRESHOLD:g}" in results["served"]["label"]
    verification = results["verification"]
    # the sweep's row at THRESHOLD: the same drafts and scores, from the store
    row = next(r for r in swept["threshold_sweep"] if r["threshold"] == THRESHOLD)
    assert results["tau_macro"] == row["tau_macro"]
    assert verification == {"verified_per_step": row["verified_per_step"],
                            "tokens_per_verified_token": row["tokens_per_verified_token"]}
    assert (f"{verification['verified_per_step']:.3f} tokens per step, "
            f"{verification['tokens_per_verified_token']:.3f} tokens emitted per token verified") in output
    # two series: every draft verified, and THRESHOLD
    assert results["series"]["key"] != swept["series"]["key"]
    listed = json.loads(CliRunner().invoke(app, ["history", "--store", str(root / "store"), "--json"]).stdout)
    by_key = {series["key"]: series for series in listed["series"]}
    assert {swept["series"]["key"], results["series"]["key"]} <= set(by_key)
    assert "confidence threshold" not in by_key[swept["series"]["key"]]["setting"]
    assert f"confidence threshold {THRESHOLD:g}" in by_key[results["series"]["key"]]["setting"]
    assert f"confidence threshold {THRESHOLD:g}" in by_key[results["series"]["key"]]["title"]
    (shown,) = by_key[results["series"]["key"]]["rows"]
    assert shown["tokens_per_verified_token"] == verification["tokens_per_verified_token"]
    assert shown["verified_per_step"] == verification["verified_per_step"]
    table = CliRunner().invoke(app, ["history", "--store", str(root / "store")], env={"COLUMNS": "240"})
    assert table.exit_code == 0 and f"confidence threshold {THRESHOLD:g}" in table.output


@pytest.mark.slow
def test_the_report_draws_the_confidence_head_s_reliability_curve(evaluated):
    root, _ = evaluated
    report = root / "store" / "report"
    html, markdown = (report / "report.html").read_text(), (report / "report.md").read_text()
    alt = "confidence head: share accepted against predicted acceptance (bin mean)"
    assert f'alt="{alt}"' in html and 'src="data:image/png;base64,' in html
    curves = sorted(report.glob("img/*-confidence-curve.png"))
    assert curves and all(f"![{alt}]({curve.relative_to(report)})" in markdown for curve in curves)
    assert "tokens per verified token" in html  # the verification's table, the series at THRESHOLD


@pytest.mark.slow
def test_the_threshold_s_series_lands_in_tensorboard(evaluated):
    from dflash_eval.reporting.tracker import PREFIX
    from tests.test_tracker import tensorboard_scalars

    root, runs = evaluated
    _, results = runs["threshold"]
    tags = results["training"]["tracker_tags"]
    prefix = f"{PREFIX}/greedy_confidence_threshold_{THRESHOLD:g}"
    assert {f"{prefix}/tau_macro", f"{prefix}/verification/tokens_per_verified_token",
            f"{prefix}/verification/verified_per_step", f"{PREFIX}/tau_macro", f"{PREFIX}/confidence/ece"} <= set(tags)
    step = results["drafter"]["step"]
    assert tensorboard_scalars(root / "tensorboard", f"{prefix}/verification/tokens_per_verified_token") == [
        (step, pytest.approx(results["verification"]["tokens_per_verified_token"]))]
    assert tensorboard_scalars(root / "tensorboard", f"{prefix}/tau_macro") == [(step, pytest.approx(results["tau_macro"]))]


def test_a_threshold_for_a_drafter_without_a_confidence_head_is_one_line(tmp_path):
    from tests.test_bad_input import one_line
    from tests.trained_runs import trained_run

    run = trained_run("qwen3")  # DFlash: no confidence head
    for option, value in (("--confidence-threshold", "0.5"), ("--confidence-thresholds", "0,0.5")):
        said = one_line(["run", "--target", str(run.target_dir), "--drafter", str(run.drafter_steps[-1]), "--prompts",
                         str(run.prompts_file), "--store", str(tmp_path / "store"), option, value])
        assert said.startswith(f"error: {option}") and "has no confidence head" in said, said
    assert not list((tmp_path / "store").rglob("entry.json"))  # nothing stored
