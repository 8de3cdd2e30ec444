"""Fetch checks a checkpoint before committing it: weights that are not finite, of the wrong shape, or
missing get exit 2 naming the tensor, and nothing of the checkpoint enters the store."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from dflash_eval.cli import app
from dflash_eval.storage import Store
from tests.tiny_models import first_prompts

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]


def damaged_copy(tiny, tmp_path, damage) -> str:
    directory = tmp_path / "drafter" / "step_400"
    shutil.copytree(tiny.drafter_steps[-1], directory)
    weights = load_file(directory / "model.safetensors")
    damage(weights)
    save_file(weights, directory / "model.safetensors")
    return str(directory)


def nan_in_one_weight(weights):
    weights["layers.1.mlp.up_proj.weight"][3, 5] = float("nan")


def wrong_shape(weights):
    weights["layers.0.self_attn.o_proj.weight"] = weights["layers.0.self_attn.o_proj.weight"][:, :-1].contiguous()


def missing_weight(weights):
    del weights["norm.weight"]


@pytest.mark.parametrize("damage,message", [
    (nan_in_one_weight, "weight layers.1.mlp.up_proj.weight has 1 of 73728 values NaN or infinite"),
    (wrong_shape, "weight layers.0.self_attn.o_proj.weight has shape [192, 191], expected [192, 192]"),
    (missing_weight, "missing ['norm.weight']"),
])
def test_a_bad_checkpoint_gets_exit_2_naming_the_tensor_and_stays_out_of_the_store(
        tiny_qwen3_run, tmp_path, prefect_api_url, damage, message):
    prompts = first_prompts(tiny_qwen3_run, 2, tmp_path / "prompts.jsonl")
    store = tmp_path / "store"
    result = CliRunner().invoke(app, ["run", "--target", str(tiny_qwen3_run.target_dir),
                                      "--drafter", damaged_copy(tiny_qwen3_run, tmp_path, damage),
                                      "--prompts", str(prompts), "--max-new-tokens", "8", "--store", str(store)])
    assert result.exit_code == 2, result.output
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("error: drafter ") and message in last, result.output
    assert Store(store).keys("fetch") == []
    # not even a lock file: the store holds only the digests of the files it read (file-digests.json)
    assert [p.name for p in store.rglob("*") if p.is_file()] == ["file-digests.json"]
    assert not (store / "references").exists()  # refused before any other stage ran


def test_the_same_drafter_undamaged_is_fetched(tiny_qwen3_run, tmp_path, prefect_api_url):
    """The control: the copy itself (new files, same bytes) passes every check."""
    prompts = first_prompts(tiny_qwen3_run, 2, tmp_path / "prompts.jsonl")
    result = CliRunner().invoke(app, ["run", "--target", str(tiny_qwen3_run.target_dir),
                                      "--drafter", damaged_copy(tiny_qwen3_run, tmp_path, lambda w: None),
                                      "--prompts", str(prompts), "--max-new-tokens", "8",
                                      "--store", str(tmp_path / "store"), "--out", str(tmp_path / "r.json")])
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "r.json").read_text())["stages"]["fetch"] == "ran"
    assert torch.isfinite(torch.tensor(json.loads((tmp_path / "r.json").read_text())["tau_macro"]))
