"""The dflash-eval command line."""

import json

import pytest
from typer.testing import CliRunner

from dflash_eval.flows.cli import app


@pytest.mark.slow
def test_tiny_build_writes_a_run_a_user_can_point_at(tmp_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["tiny", "build", "--out", str(out), "--target-steps", "5",
                                      "--drafter-steps", "4", "--save-every", "2"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (out / "drafter").iterdir()) == ["step_2", "step_4"]
    for step in ("step_2", "step_4"):
        assert {"config.json", "model.safetensors"} <= {p.name for p in (out / "drafter" / step).iterdir()}
    assert (out / "target" / "tokenizer.json").exists() and (out / "target" / "model.safetensors").exists()
    record = json.loads((out / "build.json").read_text())
    assert record["steps"] == [2, 4] and set(record["tau"]) == {"step_2", "step_4"}
    prompts = [json.loads(line) for line in (out / "prompts.jsonl").read_text().splitlines()]
    assert len(prompts) == record["settings"]["eval_prompts"] and all(p["input_ids"] for p in prompts)
    assert "step      tau" in result.output and "     4" in result.output


def test_bad_arch_is_refused(tmp_path):
    result = CliRunner().invoke(app, ["tiny", "build", "--out", str(tmp_path), "--arch", "gpt2"])
    assert result.exit_code != 0
    assert "arch must be qwen3 or qwen3_5" in result.output
    assert not any(tmp_path.iterdir())
