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
    """The command line builds its choices from dflash_core.choices (no torch): they are the ones the code checks
    against."""
    from dflash_core.choices import SLIDING_SEMANTICS
    from dflash_core.target import DTYPES as SERVED_DTYPES
    from dflash_core.tiny.target import DEFAULT_STEPS
    from dflash_eval.flows.cli.options import Arch, Dtype, ServedDtype, SlidingSemantics
    from dflash_eval.tasks.target import AUTO, DTYPE_CHOICES

    assert tuple(Dtype) == DTYPE_CHOICES
    assert tuple(ServedDtype) == (AUTO, *SERVED_DTYPES)
    assert tuple(SlidingSemantics) == SLIDING_SEMANTICS
    assert set(Arch) == set(DEFAULT_STEPS)


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
    from dflash_eval.flows import checks
    from dflash_eval.flows.evaluate import evaluate_checkpoint
    from tests.tiny_models import first_prompts

    calls = []
    check_inputs = checks.check_inputs
    monkeypatch.setattr(checks, "check_inputs", lambda **arguments: calls.append(arguments) or check_inputs(**arguments))
    parameters = {"target": str(tiny_qwen3_run.target_dir), "drafter": str(tiny_qwen3_run.drafter_steps[-1]),
                  "prompts": str(first_prompts(tiny_qwen3_run, 2, tmp_path / "prompts.jsonl")), "max_new_tokens": 8,
                  "store": str(tmp_path / "store")}
    result = CliRunner().invoke(app, ["run", *[x for name, value in parameters.items()
                                               for x in (f"--{name.replace('_', '-')}", str(value))]])
    assert result.exit_code == 0, result.output
    assert len(calls) == 1  # by the command line, before Prefect started; the flow run took what it found
    evaluate_checkpoint(**parameters)  # as a deployment's run starts it: no command line before it
    assert len(calls) == 2
