"""A new drafter generation is one module (tests/toy_generation.py: a toy head, a learned bias per token on the
backbone's logits, with its results section): a ToyDraftModel checkpoint made from the tiny run's last DFlash save
goes through the flow, and its section shows on the command line, in the results JSON, in `history`, in the report
and in TensorBoard, with no edit anywhere else."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from tests import toy_generation
from tests.tiny_models import SHORT_PROMPTS, first_prompts

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def toy_registered(tiny_qwen3_run):
    """The toy generation registered for this module's tests (after the tiny run is found: its cache key reads the
    registered generations' code)."""
    with toy_generation.registered():
        yield

MAX_NEW = 48


def toy_checkpoint(save: Path, folder: Path) -> Path:
    """A copy of DFlash save `save` as a ToyDraftModel: its architecture renamed, a seeded bias per token added."""
    shutil.copytree(save, folder)
    config = json.loads((folder / "config.json").read_text())
    config["architectures"] = ["ToyDraftModel"]
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    weights = load_file(folder / "model.safetensors")
    bias = 2 * torch.randn(config["vocab_size"], generator=torch.Generator().manual_seed(0))
    weights["toy_head.bias"] = bias.to(next(iter(weights.values())).dtype)
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


@pytest.fixture(scope="module")
def toy(tiny_qwen3_run, tmp_path_factory, prefect_api_url):
    """The toy checkpoint and the DFlash save it was made from, each evaluated through the flow into one store."""
    from tests.evaluations import run_evaluation

    root = tmp_path_factory.mktemp("toy")
    checkpoint = toy_checkpoint(tiny_qwen3_run.drafter_steps[-1], root / "toy-run" / "step_400")
    prompts = first_prompts(tiny_qwen3_run, SHORT_PROMPTS, root / "prompts.jsonl")
    settings = dict(target=str(tiny_qwen3_run.target_dir), prompts=str(prompts), max_new_tokens=MAX_NEW,
                    store=str(root / "store"), tensorboard=str(root / "tensorboard"))
    base = run_evaluation(drafter=str(tiny_qwen3_run.drafter_steps[-1]), **settings)
    results = run_evaluation(drafter=str(checkpoint), **settings)
    return root, checkpoint, prompts, base, results


def test_the_toy_head_drafts_and_its_base_is_the_backbone_alone(toy):
    """Its tau is the biased drafts'; its base walk is the DFlash save's own drafts, so the base's tau is that save's
    tau, and the lift is the difference."""
    _, _, _, base, results = toy
    numbers = results["toy"]
    assert numbers["base_tau_macro"] == pytest.approx(base["tau_macro"])
    assert numbers["lift"] == pytest.approx(results["tau_macro"] - base["tau_macro"])
    assert numbers["lift"] != 0  # the bias changed the drafts
    assert isinstance(results.section(toy_generation.ToySection), toy_generation.ToySection)
    assert "toy" not in base


def test_the_command_line_and_the_results_json_show_its_section(toy, tiny_qwen3_run):
    from dflash_eval.cli import app

    root, checkpoint, prompts, _, results = toy
    out = root / "results.json"
    run = CliRunner().invoke(app, ["run", "--target", str(tiny_qwen3_run.target_dir), "--drafter", str(checkpoint),
                                   "--prompts", str(prompts), "--max-new-tokens", str(MAX_NEW), "--store",
                                   str(root / "store"), "--out", str(out)], env={"COLUMNS": "200"})
    assert run.exit_code == 0, run.output
    numbers = results["toy"]
    assert (f"toy head: base alone tau macro {numbers['base_tau_macro']:.3f}, toy lift {numbers['lift']:+.3f} over "
            in run.output)
    written = json.loads(out.read_text())
    assert written["toy"] == numbers and written["stages"]["scores"] == "cached"
    assert list(written) == list(results)  # the flow's record, key for key

    listed = json.loads(CliRunner().invoke(app, ["history", "--store", str(root / "store"), "--json"]).stdout)
    rows = {row["checkpoint"]: row for series in listed["series"] for row in series["rows"]}
    assert rows["toy-run/step_400"]["toy_base_tau_macro"] == pytest.approx(numbers["base_tau_macro"])
    assert rows["toy-run/step_400"]["toy_lift"] == pytest.approx(numbers["lift"])
    assert "toy_lift" not in rows["drafter/step_400"]
    shown = CliRunner().invoke(app, ["history", "--store", str(root / "store")], env={"COLUMNS": "200"})
    assert "toy base" in shown.output and f"{numbers['lift']:+.3f}" in shown.output


def test_the_report_shows_its_section(toy):
    from dflash_eval.reporting.report import write_report
    from dflash_eval.storage import Store

    root, _, _, _, results = toy
    html = write_report(Store(root / "store"), root / "report").read_text()
    numbers = results["toy"]
    assert "<th>toy base tau</th><th>toy lift</th>" in html  # beside tau in the series' table
    assert f"<td>{numbers['base_tau_macro']:.3f}</td><td>{numbers['lift']:+.3f}</td>" in html
    assert "<h3>Toy head</h3>" in html and "The toy head&#39;s bias" not in html  # its own text, as written
    assert "<p>The toy head's bias against the backbone's argmax alone. The plot shows the same by draft position.</p>" \
        in html
    assert 'alt="toy head by draft position"' in html
    markdown = (root / "report" / "report.md").read_text()
    assert "| toy base tau | toy lift |" in markdown and "](img/group1-toy.png)" in markdown
    assert (root / "report" / "img" / "group1-toy.png").stat().st_size > 0


def test_tensorboard_holds_its_scalars_and_charts(toy):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.test_tracker_layout import written_layout

    root, _, _, _, results = toy
    accumulator = EventAccumulator(str(root / "tensorboard"), size_guidance={"scalars": 0})
    accumulator.Reload()
    tags = accumulator.Tags()["scalars"]
    numbers = results["toy"]
    [(step, value)] = [(e.step, e.value) for e in accumulator.Scalars("dflash_eval/toy/lift")]
    assert step == 400 and value == pytest.approx(numbers["lift"])
    assert "dflash_eval/toy/base_tau_macro" in tags and "dflash_eval_by_position/toy/toy_accuracy/1" in tags
    layout = written_layout(root / "tensorboard")
    charts = {chart.title for category in layout.category if category.title == "dflash-eval: toy head"
              for chart in category.chart}
    assert charts == {"tau against its base alone", "toy accuracy by draft position"}
