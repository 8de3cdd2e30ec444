"""The fetch stage and the command line against a real relay on loopback serving the tiny drafter run."""

import pytest
from typer.testing import CliRunner

from flows.cli import app
from storage.relay_server import RelayServer

pytestmark = pytest.mark.slow

TOKEN = "s3cret-relay-token"


@pytest.fixture(scope="module")
def relay(tiny_qwen3_run, tmp_path_factory):
    """A relay with a token over the tiny run's drafter folder (step_100 ... step_400)."""
    state = tmp_path_factory.mktemp("relay_state")
    with RelayServer(tiny_qwen3_run.root / "drafter", token=TOKEN, state_dir=state, settle_seconds=0) as server:
        yield server


def run(tiny, drafter, store, tmp_path, *extra):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(tiny.prompts_file.read_text().splitlines(keepends=True)[:6]))
    return CliRunner().invoke(app, ["run", "--target", str(tiny.target_dir), "--drafter", str(drafter),
                                    "--prompts", str(prompts), "--max-new-tokens", "32", "--store", str(store),
                                    "--out", str(tmp_path / "results.json"), *extra])


def test_a_relay_url_evaluates_like_the_local_folder_and_is_fetched_once(tiny_qwen3_run, relay, tmp_path,
                                                                          prefect_api_url):
    import json

    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    store = tmp_path / "store"
    url = f"{relay.url}/step_400"

    result = run(tiny_qwen3_run, url, store, tmp_path, "--relay-token-file", str(token_file))
    assert result.exit_code == 0, result.output
    remote = json.loads((tmp_path / "results.json").read_text())
    assert remote["stages"]["fetch"] == "ran" and remote["drafter"]["step"] == 400
    sent = relay.bytes_sent
    assert sent >= sum(p.stat().st_size for p in tiny_qwen3_run.drafter_steps[-1].iterdir())

    # the same checkpoint by its local folder: the same content key, so nothing is copied again
    local = run(tiny_qwen3_run, tiny_qwen3_run.drafter_steps[-1], store, tmp_path)
    assert local.exit_code == 0, local.output
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["stages"]["fetch"] == "cached" and results["keys"] == remote["keys"]
    assert results["per_prompt"] == remote["per_prompt"]

    # and by URL again: not downloaded again (only config.json travels, for the input check)
    again = run(tiny_qwen3_run, url, store, tmp_path, "--relay-token-file", str(token_file))
    assert again.exit_code == 0
    config_bytes = (tiny_qwen3_run.drafter_steps[-1] / "config.json").stat().st_size
    assert relay.bytes_sent - sent in (config_bytes, 2 * config_bytes)  # the command line and the flow check inputs

    listing = CliRunner().invoke(app, ["relay", "ls", relay.url, "--store", str(store), "--token-file", str(token_file)])
    assert listing.exit_code == 0, listing.output
    rows = {line.split("│")[1].strip(): line for line in listing.output.splitlines() if "/step_" in line}
    assert list(rows) == [f"{relay.url}/step_{s}" for s in (100, 200, 300, 400)]
    assert "yes" in rows[url] and "no" in rows[f"{relay.url}/step_100"]
    assert "│ 400 " in rows[url]


def test_a_wrong_token_is_refused_before_anything_is_stored(tiny_qwen3_run, relay, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_RELAY_TOKEN", "wrong")
    result = run(tiny_qwen3_run, f"{relay.url}/step_400", tmp_path / "store", tmp_path)
    assert result.exit_code == 2
    assert "refused the token" in result.output and "wrong" not in result.output
    assert not (tmp_path / "store").exists()
    missing = run(tiny_qwen3_run, f"{relay.url}/step_999", tmp_path / "store", tmp_path, "--relay-token-file", "/nonexistent")
    assert missing.exit_code == 2 and "/nonexistent" in missing.output
