"""The fetch stage and the command line against a real relay on loopback serving the tiny drafter run."""

import os
import re
import shutil

import pytest
from typer.testing import CliRunner

from dflash_eval.cli import app
from dflash_eval.services.relay.server import RelayServer
from dflash_eval.storage import Store
from tests.tiny_models import first_prompts

pytestmark = pytest.mark.slow

TOKEN = "s3cret-relay-token"


@pytest.fixture(scope="module")
def relay(tiny_qwen3_run, tmp_path_factory):
    """A relay with a token over the tiny run's drafter folder (step_100 ... step_400)."""
    state = tmp_path_factory.mktemp("relay_state")
    with RelayServer(tiny_qwen3_run.root / "drafter", token=TOKEN, state_dir=state, settle_seconds=0) as server:
        yield server


def run(tiny, drafter, store, tmp_path, *extra):
    prompts = first_prompts(tiny, 6, tmp_path / "prompts.jsonl")
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
    listed = [f"{relay.url}/step_{s}" for s in (100, 200, 300, 400)]
    rows = {checkpoint: [line for line in listing.output.splitlines() if re.search(rf"{re.escape(checkpoint)}\b", line)]
            for checkpoint in listed}
    assert all(len(found) == 1 for found in rows.values()), listing.output
    assert "yes" in rows[url][0] and "no" in rows[f"{relay.url}/step_100"][0], listing.output
    assert re.search(r"[│|]\s*400\s*[│|]", rows[url][0]), listing.output


def test_a_wrong_token_is_refused_before_anything_is_stored(tiny_qwen3_run, relay, tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_RELAY_TOKEN", "wrong")
    result = run(tiny_qwen3_run, f"{relay.url}/step_400", tmp_path / "store", tmp_path)
    assert result.exit_code == 2
    assert "refused the token" in result.output and "wrong" not in result.output
    assert not (tmp_path / "store").exists()
    missing = run(tiny_qwen3_run, f"{relay.url}/step_999", tmp_path / "store", tmp_path, "--relay-token-file", "/nonexistent")
    assert missing.exit_code == 2 and "/nonexistent" in missing.output


def test_a_training_save_moves_only_the_drafter_and_scores_like_its_hf_folder(tiny_qwen3_run, tmp_path, prefect_api_url):
    """A save as HF's Trainer leaves it: the drafter plus 1 GB of optimizer state, RNG and scheduler
    files. Only config + weights (+ trainer_state.json) cross the relay and enter the store."""
    import json

    trained = tiny_qwen3_run.drafter_steps[-1]
    save = tmp_path / "runs" / "run1" / "checkpoint-400"
    shutil.copytree(trained, save)
    with open(save / "optimizer.pt", "wb") as f:  # 1 GB, sparse: never read, so never really written
        f.truncate(1 << 30)
    for name, size in (("scheduler.pt", 1000), ("rng_state_0.pth", 15000), ("training_args.bin", 5000)):
        (save / name).write_bytes(os.urandom(size))
    (save / "trainer_state.json").write_text(json.dumps({"global_step": 400, "log_history": []}))
    needed = sum((save / n).stat().st_size for n in ("config.json", "model.safetensors", "trainer_state.json"))
    store = tmp_path / "store"
    with RelayServer(tmp_path / "runs", state_dir=tmp_path / "relay", settle_seconds=0) as relay:
        result = run(tiny_qwen3_run, f"{relay.url}/run1/checkpoint-400", store, tmp_path)
        assert result.exit_code == 0, result.output
        assert needed <= relay.bytes_sent <= 1.05 * needed
        assert relay.digests.misses == 3  # the relay hashed the three files it sends, not the optimizer
    results = json.loads((tmp_path / "results.json").read_text())
    entry = Store(store).entry("fetch", results["drafter"]["key"])
    held = sum(p.stat().st_size for p in entry.rglob("*") if p.is_file() and p.name != "entry.json")
    assert needed <= held <= 1.05 * needed
    assert results["drafter"]["step"] == 400

    plain = run(tiny_qwen3_run, trained, store, tmp_path)  # the same drafter as a plain HF folder
    assert plain.exit_code == 0, plain.output
    hf = json.loads((tmp_path / "results.json").read_text())
    assert hf["drafter"]["key"] != results["drafter"]["key"]  # trainer_state.json makes it other files ...
    assert hf["per_prompt"] == results["per_prompt"]  # ... with exactly the same score
