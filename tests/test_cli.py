"""The dflash-eval command line."""

import json

import pytest
from typer.testing import CliRunner

from dflash_eval.cli import app


@pytest.mark.slow
def test_tiny_build_writes_a_run_a_user_can_point_at(tmp_path):
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["tiny", "build", "--out", str(out), "--target-steps", "5",
                                      "--drafter-steps", "4", "--save-every", "2"])
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (out / "drafter").iterdir()) == ["runs", "step_2", "step_4"]  # runs: the trainer's log
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
    assert result.exit_code == 2
    assert result.output == "error: --arch must be one of qwen3, qwen3_5\n"
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("command,line", [
    (["run", "--target", "t", "--drafter", "d", "--prompts", "p", "--dtype", "float16"],
     "error: --dtype must be one of auto, float32, bfloat16"),
    (["run", "--target", "t", "--drafter", "d", "--prompts", "p", "--device", "tpu"],
     "error: --device must be one of cpu, cuda"),
    (["stage", "everything", "--target", "t", "--drafter", "d", "--prompts", "p"],
     "error: NAME must be one of fetch, references, features, drafts, scores, diagnostics"),
    (["serve-reference", "--target", "t", "--dtype", "int8"],
     "error: --dtype must be one of auto, float32, bfloat16, float16"),
])
def test_a_value_outside_the_choices_gets_one_line(command, line):
    result = CliRunner().invoke(app, command)
    assert result.exit_code == 2 and result.output == line + "\n", result.output


def test_the_choices_are_the_constants_the_code_checks_against():
    """The settings' choices are written out for the command line and the deployment forms (no torch): they are the
    ones the code checks against."""
    from typing import get_args

    from dflash_core.choices import ATTENTION_CHOICES, SLIDING_SEMANTICS
    from dflash_core.drafter_config import architectures
    from dflash_core.target import DTYPES as SERVED_DTYPES
    from dflash_eval.cli.options import Arch, ServedDtype
    from dflash_eval.flows.settings import STAGES, AttentionName, DtypeName, SlidingSemanticsName
    from dflash_eval.storage.schema import Stage
    from dflash_eval.tasks.target import AUTO, DTYPE_CHOICES
    from dflash_eval.tiny.build import buildable_architectures
    from dflash_eval.tiny.target import DEFAULT_STEPS

    assert get_args(DtypeName) == DTYPE_CHOICES
    assert tuple(ServedDtype) == (AUTO, *SERVED_DTYPES)
    assert get_args(SlidingSemanticsName) == SLIDING_SEMANTICS
    assert get_args(AttentionName) == ATTENTION_CHOICES
    assert set(STAGES) <= {stage.value for stage in Stage}
    assert set(Arch) == set(DEFAULT_STEPS)
    # tiny build trains one drafter architecture of every generation read
    built = buildable_architectures()
    assert sorted(architectures()[a] for a in built) == sorted(set(architectures().values()))


def test_every_command_shows_an_example():
    commands = [["run"], ["stage"], ["demo"], ["serve"], ["watch"], ["notify"], ["serve-reference"], ["history"],
                ["report"], ["verify"], ["tiny", "build"], ["relay", "serve"], ["relay", "ls"]]
    for command in commands:
        result = CliRunner().invoke(app, [*command, "--help"])
        assert result.exit_code == 0 and "Example:" in result.output, (command, result.output)
        assert "dflash-eval " + " ".join(command) in result.output, (command, result.output)


def test_a_token_file_that_cannot_be_read_or_is_empty_gets_one_line(tmp_path):
    (tmp_path / "empty").write_text("\n")
    for name, needle in (("missing", "cannot read it"), ("empty", "is empty")):
        result = CliRunner().invoke(app, ["relay", "ls", "http://127.0.0.1:9", "--token-file", str(tmp_path / name)])
        assert result.exit_code == 2 and result.output.count("\n") == 1, result.output
        assert result.output.startswith(f"error: --token-file {tmp_path / name}") and needle in result.output


@pytest.mark.slow
def test_an_evaluation_checks_its_inputs_once_by_hand_and_without_the_command_line(
        tiny_qwen3_run, tmp_path, prefect_api_url, one_thread, monkeypatch):
    from dflash_eval.flows import checks, evaluate
    from tests.evaluations import run_evaluation
    from tests.tiny_models import first_prompts

    calls = []
    check_evaluation = checks.check_evaluation

    def counted(*arguments):
        calls.append(arguments)
        return check_evaluation(*arguments)

    monkeypatch.setattr(checks, "check_evaluation", counted)
    monkeypatch.setattr(evaluate, "check_evaluation", counted)
    parameters = {"target": str(tiny_qwen3_run.target_dir), "drafter": str(tiny_qwen3_run.drafter_steps[-1]),
                  "prompts": str(first_prompts(tiny_qwen3_run, 2, tmp_path / "prompts.jsonl")), "max_new_tokens": 8,
                  "store": str(tmp_path / "store")}
    result = CliRunner().invoke(app, ["run", *[x for name, value in parameters.items()
                                               for x in (f"--{name.replace('_', '-')}", str(value))]])
    assert result.exit_code == 0, result.output
    assert len(calls) == 1  # by the command line, before Prefect started; the flow run took what it found
    run_evaluation(**parameters)  # as a deployment's run starts it: no command line before it
    assert len(calls) == 2


def test_run_help_groups_its_options_in_panels_and_shows_no_type_for_flags():
    result = CliRunner().invoke(app, ["run", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    panels = [line.split("─ ")[1].split(" ─")[0] for line in result.output.splitlines() if line.startswith("╭─ ")]
    assert panels == ["Options", "Inputs", "References", "Serving", "Scoring", "Checkpoints", "Compute",
                      "Store and output", "Training run"]
    for form in ("SpecForge save", "relay URL", "training run's folder"):
        assert form in result.output
    for command in (["run"], ["stage"], ["demo"], ["serve"], ["watch"], ["serve-reference"], ["history"], ["report"],
                    ["verify"], ["relay", "serve"], ["relay", "ls"], ["tiny", "build"], []):
        shown = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "200"}).output
        assert "<bool>" not in shown, command  # flags take no value
        assert ".py" not in shown, command  # help names behaviour, not source files


def test_a_config_file_gives_defaults_that_the_command_line_overrides(tmp_path):
    config = tmp_path / "team.toml"
    config.write_text('target = "/nonexistent/from-file"\nmax-new-tokens = 8\nname = "Org/Model"\n')
    base = ["run", "--config", str(config), "--drafter", str(tmp_path), "--prompts", "math"]
    from_file = CliRunner().invoke(app, base)
    assert from_file.exit_code == 2 and "error: target /nonexistent/from-file is not a directory" in from_file.output
    overridden = CliRunner().invoke(app, [*base, "--target", "/nonexistent/from-line"])
    assert overridden.exit_code == 2 and "error: target /nonexistent/from-line is not" in overridden.output
    config.write_text("targett = 1\n")
    mistyped = CliRunner().invoke(app, base)
    assert mistyped.exit_code == 2
    assert "'targett' is no option of `" in mistyped.output and " run` (its options: all-positions," in mistyped.output
    config.write_text("target = [\n")
    assert CliRunner().invoke(app, base).output.startswith(f"error: Invalid value for --config: {config}: ")


def test_run_names_say_the_checkpoint_its_step_once_and_what_ran(tmp_path):
    from dflash_eval.flows.evaluate import run_name

    assert run_name("/runs/a/step_400") == "a/step_400"  # not "step_400 step 400"
    assert run_name("http://relay:8700/run1/step_1000") == "run1/step_1000"
    assert run_name("/runs/a/step_400", until="diagnostics") == "a/step_400 with diagnostics"
    assert run_name("/runs/a/step_400", until="features") == "a/step_400 stage features"
    assert run_name("/runs/a/step_400", refresh=["drafts"]) == "a/step_400 rerun drafts"
    saved = tmp_path / "run" / "epoch_2"  # a name without the step, which its config holds
    saved.mkdir(parents=True)
    (saved / "config.json").write_text('{"step": 1000}')
    assert run_name(str(saved)) == "run/epoch_2 step 1000"
