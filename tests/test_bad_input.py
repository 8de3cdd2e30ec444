"""Bad command lines and bad inputs, as an attacker or a careless user gives them: each gets one line naming
what is wrong (and what to do), exit code 2, and nothing is written or computed. None needs a model or a server
of ours, so these are fast; the flows' own refusals are in test_cli.py and test_fetch_checks.py."""

import json
import socket
import time

import pytest
from typer.testing import CliRunner

from dflash_eval.cli import app

RUN = ["run", "--target", "t", "--drafter", "d", "--prompts", "p"]


def one_line(args, **env) -> str:
    result = CliRunner().invoke(app, args, env=env or None)
    assert result.exit_code == 2, (args, result.output, result.exception)
    lines = result.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    return lines[0]


@pytest.mark.parametrize(("args", "says"), [
    (["verify", "--store", "/nonexistent"], "/nonexistent does not exist: no store there"),
    (["verify", "--store", "/etc/hostname"], "/etc/hostname is not a folder: no store there"),
    (["history", "--store", "/missing"], "/missing does not exist: no store there"),
    (["report", "--store", "/missing", "--out", "/tmp/r"], "/missing does not exist: no store there"),
    (["report", "--serve", "--port", "99999"], "'--port': Input should be less than or equal to 65535"),
    (["relay", "serve", "/tmp", "--port", "70000"], "'--port': Input should be less than or equal to 65535"),
    (["relay", "serve", "/tmp", "--max-connections", "0"], "'--max-connections': Input should be greater"),
    (["relay", "serve", "/tmp", "--max-rate-mb", "-1"], "'--max-rate-mb': Input should be greater"),
    (["serve-reference", "--target", "t", "--port", "-1"], "'--port': Input should be greater"),
    (["tiny", "build", "--out", "/proc/tinyx"], "--out: /proc/tinyx cannot be created: /proc is not writable"),
    (["tiny", "build", "--out", "/tmp/tinyx", "--drafter-architecture", "Gemma4DSparkModel"],
     "--drafter-architecture 'Gemma4DSparkModel': the tiny build trains DFlashDraftModel, DFlash2DraftModel, "
     "Qwen3DSparkModel"),
    ([*RUN, "--concurrency", "0"], "error: --concurrency must be at least 1, got 0"),
    ([*RUN, "--concurrency", "-1"], "error: --concurrency must be at least 1, got -1"),
    ([*RUN, "--checkpoint-wait", "-1"], "error: --checkpoint-wait must be at least 0, got -1.0"),
    ([*RUN, "--settle-seconds", "-1"], "error: --settle-seconds must be at least 0, got -1.0"),
    ([*RUN, "--temperature", "0.6", "--top-p", "1.5", "--samples", "0"],
     "error: --top-p must lie in (0, 1], got 1.5; --samples must lie in [1, 1000], got 0"),
    ([*RUN, "--top-k", "20"], "error: --top-k, --top-p and --min-p apply at a temperature above 0"),
    ([*RUN, "--samples", "4"], "error: --samples 4: greedy completions (temperature 0) are all the same"),
    ([*RUN, "--block-sizes", "2,x"], "error: --block-sizes '2,x': give whole numbers separated by commas"),
    ([*RUN, "--block-size", "1"], "error: --block-size must be at least 2, got 1"),
    ([*RUN, "--references", "r.jsonl", "--temperature", "0.6", "--samples", "2"],
     "error: --references FILE gives the completions: leave out --reference, --samples and --lookahead"),
    ([*RUN, "--references", "r.jsonl", "--temperature", "0.6"],
     "error: --references FILE gives the completions: --temperature (and the other sampling options) apply to them "
     "only with --draft-sample-method probabilistic"),
    (["run", "--target", "t", "--drafter", "d"], "error: give --prompts (a suite or a prompt file), or --references"),
    ([*RUN, "--protocol", "dflash-0.1"], "error: --protocol applies to published benchmarks as --prompts (gsm8k,"),
    ([*RUN, "--max-samples", "8"], "error: --max-samples applies to published benchmarks as --prompts"),
    ([*RUN[:-1], "gsm8k", "--thinking"], "error: --thinking: published benchmarks are templated as their protocol"),
    ([*RUN[:-1], "gsm8k,math"], "error: --prompts gsm8k,math: math is not a published benchmark"),
    ([*RUN[:-1], "gsm8k", "--protocol", "zlab-2027"], "error: --protocol must be one of zlab-2026-01, zlab-2026-04"),
    (["prompts", "gsm8k", "--max-samples", "0"], "'--max-samples': Input should be greater than or equal to 1"),
    (["serve", "--target", "t", "--prompts", "p", "--divergence-window", "2"],
     "error: --divergence-window must be at least 3, got 2"),
    ([*RUN, "--out", "/proc/r.json"], "--out: /proc/r.json cannot be created: /proc is not writable"),
    ([*RUN, "--report-dir", "/proc/rep"], "--report-dir: /proc/rep cannot be created: /proc is not writable"),
    ([*RUN, "--drafter-config", "/nonexistent.json"], "--drafter-config /nonexistent.json: no such file"),
    ([*RUN, "--bogus"], "No such option: --bogus"),
    (["run", "--target", "t"], "Missing option '--drafter'"),
    (["nosuch"], "No such command 'nosuch'"),
])
def test_a_bad_command_line_gets_one_line_and_exit_2(args, says):
    assert says in one_line(args)


def test_a_report_of_a_store_into_a_folder_that_cannot_be_written(tmp_path):
    (tmp_path / "store").mkdir()
    assert "--out: /proc/rep cannot be created" in one_line(["report", "--store", str(tmp_path / "store"), "--out",
                                                              "/proc/rep"])


def test_a_relay_on_a_taken_port(tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = one_line(["relay", "serve", str(tmp_path), "--port", str(port), "--state-dir", str(tmp_path / "s")])
    assert f"the relay cannot start on 127.0.0.1:{port}" in line


def test_a_prefect_api_url_where_no_server_answers(monkeypatch):
    import typer
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from dflash_eval.cli.common import start_local_server

    with socket.socket() as unused:
        unused.bind(("127.0.0.1", 0))
        port = unused.getsockname()[1]
    with temporary_settings(updates={PREFECT_API_URL: f"http://127.0.0.1:{port}/api"}), \
            pytest.raises(typer.Exit) as exited:
        start_local_server()
    assert exited.value.exit_code == 2


def test_a_mistyped_local_drafter_fails_at_once_naming_the_folder_meant(tmp_path):
    from dflash_eval.tasks.fetch import CheckpointError, await_checkpoint

    (tmp_path / "run1" / "step_100").mkdir(parents=True)
    started = time.monotonic()
    with pytest.raises(CheckpointError, match="did you mean step_100"):
        await_checkpoint(str(tmp_path / "run1" / "stpe_100"), wait_seconds=300)
    with pytest.raises(CheckpointError, match=r"nearest there: run1"):
        await_checkpoint(str(tmp_path / "rnu1" / "step_100"), wait_seconds=300)
    assert time.monotonic() - started < 10  # neither waited for --checkpoint-wait


def test_a_drafter_given_as_the_target_is_named_as_one(tmp_path):
    import torch
    from safetensors.torch import save_file

    from dflash_core.token_head import find_text_weights

    save_file({"fc.weight": torch.zeros(4, 8), "layers.0.mlp.up_proj.weight": torch.zeros(4, 4)},
              str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"], "dflash_config": {}}))
    with pytest.raises(ValueError, match="looks like a DFlash drafter .* not a target"):
        find_text_weights(tmp_path)


def test_a_prompt_line_without_a_prompt_field_names_the_fields_it_has(tmp_path):
    from dflash_core.prompts import PromptError, read_prompts

    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"id": "a", "txt": "hello"}) + "\n")
    with pytest.raises(PromptError, match="its fields: 'txt'"):
        read_prompts(prompts, tokenizer=None)


def test_a_plain_http_object_store_without_allow_http_says_so(monkeypatch):
    from dflash_eval.storage import Store
    from dflash_eval.storage.object_storage import ObjectStorageError

    monkeypatch.delenv("AWS_ALLOW_HTTP", raising=False)
    for name, value in (("AWS_ENDPOINT_URL", "http://127.0.0.1:9"), ("AWS_ACCESS_KEY_ID", "a"),
                        ("AWS_SECRET_ACCESS_KEY", "b"), ("AWS_REGION", "us-east-1")):
        monkeypatch.setenv(name, value)
    with pytest.raises(ObjectStorageError, match="AWS_ALLOW_HTTP=true"):
        Store("s3://bucket/prefix").keys("scores")


def test_a_target_given_as_the_drafter_is_named_as_one(tmp_path):
    from dflash_core.drafter_config import DrafterError, read_drafter_config

    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["Qwen3ForCausalLM"], "hidden_size": 8}))
    with pytest.raises(DrafterError, match="looks like a target model, not a DFlash drafter"):
        read_drafter_config(tmp_path)


def _as_nobody(command: list[str]) -> tuple[int, str]:
    """(exit code, output) of a command line run by an unprivileged user: a child forked from this process (its
    imports already loaded) that drops to nobody's uid and gid before it runs the command. CI runs as root, and
    root is never refused a permission."""
    import multiprocessing
    import os

    if os.geteuid() != 0:
        pytest.skip("dropping to another user needs root")
    CliRunner().invoke(app, command)  # load what the command imports while the files can still be read
    context = multiprocessing.get_context("fork")
    receive, send = context.Pipe(duplex=False)

    def run():
        os.setgroups([])
        os.setgid(65534)
        os.setuid(65534)
        result = CliRunner().invoke(app, command)
        send.send((result.exit_code, result.output))

    child = context.Process(target=run)
    child.start()
    try:
        assert receive.poll(60), "the unprivileged command did not finish"
        return receive.recv()
    finally:
        child.join(10)


@pytest.fixture
def open_folder():
    """A folder every user can reach (pytest's own tmp_path is its owner's alone), removed afterwards."""
    import shutil
    import tempfile
    from pathlib import Path

    folder = Path(tempfile.mkdtemp(prefix="dflash-eval-permissions-"))
    folder.chmod(0o755)  # readable by all, writable by its owner only
    yield folder
    shutil.rmtree(folder)


def test_a_store_this_user_cannot_read_is_one_line(open_folder):
    store = open_folder / "store"
    (store / "scores").mkdir(parents=True)
    store.chmod(0o700)
    for command in (["verify", "--store", str(store)], ["history", "--store", str(store)]):
        code, output = _as_nobody(command)
        assert code == 2 and output.strip().splitlines() == [
            f"error: --store {store} cannot be read by this user (permissions): run as its owner"], output


def test_an_out_folder_this_user_cannot_write_is_refused_before_any_work(open_folder):
    code, output = _as_nobody([*RUN, "--out", str(open_folder / "results.json")])
    assert code == 2, output
    assert f"--out: {open_folder / 'results.json'} cannot be created: {open_folder} is not writable" in output


def test_an_entry_this_user_cannot_read_is_reported_not_a_crash(open_folder):
    from dflash_eval.storage import Store, key_of

    store = Store(open_folder / "store")
    key = key_of({"test": "permissions"})
    directory = store.begin("scores", key)
    (directory / "scores.json").write_text('{"tau_macro": 3.0}')
    store.commit("scores", key, {"tau_macro": 3.0})
    (directory / "scores.json").chmod(0o600)
    for path in (store.root, *store.root.rglob("*")):
        if path.is_dir():
            path.chmod(0o755)
    code, output = _as_nobody(["verify", "--store", str(store.root)])
    assert code == 1 and f"unreadable scores/{key}:" in output and "permission denied" in output, output
    assert "nothing was changed" in output and (directory / "scores.json").is_file()


# --- a temperature out of range: refused by the settings (command line, --config, a deployment's parameters) and by
# Sampling, never left to crash in sampling or to sample noise

@pytest.mark.parametrize(("temperature", "says"), [
    ("1e-40", "error: --temperature 1e-40: give 0 for greedy, or at least 0.01 to sample"),
    ("0.005", "error: --temperature 0.005: give 0 for greedy, or at least 0.01 to sample"),
    ("1e308", "error: --temperature must lie in [0, 2], got 1e+308"),
    ("2.5", "error: --temperature must lie in [0, 2], got 2.5"),
    ("inf", "error: --temperature must be a finite number, got inf"),
    ("nan", "error: --temperature must be a finite number, got nan"),
])
def test_a_temperature_out_of_range_is_one_line_and_nothing_is_written(tmp_path, temperature, says):
    line = one_line([*RUN, "--temperature", temperature, "--top-k", "20", "--samples", "2",
                     "--store", str(tmp_path / "store"), "--out", str(tmp_path / "results.json")])
    assert line.startswith(says), line
    assert not any(tmp_path.iterdir())


def test_a_temperature_out_of_range_in_a_config_file_is_named_by_its_flag(tmp_path):
    config = tmp_path / "team.toml"
    config.write_text("temperature = 1e-40\n")
    assert one_line([*RUN, "--config", str(config)]).startswith("error: --temperature 1e-40: give 0 for greedy")
    config.write_text("temperature = 1e308\n")
    assert one_line([*RUN, "--config", str(config)]) == "error: --temperature must lie in [0, 2], got 1e+308"


@pytest.mark.parametrize(("temperature", "says"), [
    (1e-40, "serving.temperature 1e-40: give 0 for greedy, or at least 0.01 to sample"),
    (1e308, "serving.temperature must lie in [0, 2], got 1e+308"),
    (float("inf"), "serving.temperature must be a finite number, got inf"),
])
def test_a_deployments_temperature_out_of_range_is_refused_naming_the_parameter(temperature, says):
    from dflash_eval.flows.checks import InputError, check_evaluation

    with pytest.raises(InputError) as refused:
        check_evaluation({"inputs": {"target": "t", "prompts": "p"}, "serving": {"temperature": temperature},
                          "drafter": "d"})
    assert str(refused.value).startswith(says) and "\n" not in str(refused.value)


@pytest.mark.parametrize("temperature", [1e-40, 0.005, 2.5, 1e308, float("inf"), float("nan"), -1.0])
def test_sampling_refuses_the_temperatures_the_settings_refuse(temperature):
    from dflash_core.sampling import Sampling

    with pytest.raises(ValueError, match=r"temperature must be 0 \(greedy\) or lie in \[0.01, 2\]"):
        Sampling(temperature)


def test_the_temperature_bounds_are_the_same_in_the_settings_and_in_sampling():
    from dflash_core import sampling
    from dflash_eval.flows import settings

    assert (settings.MIN_TEMPERATURE, settings.MAX_TEMPERATURE) == (sampling.MIN_TEMPERATURE, sampling.MAX_TEMPERATURE)
    assert sampling.Sampling(0.01).temperature == 0.01 and sampling.Sampling(2.0).temperature == 2.0
