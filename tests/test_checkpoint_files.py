"""What a checkpoint folder holds (dflash_core.checkpoint_files): its safetensors files and index, the
files evaluation takes from each layout, whether it is finished, its training step."""

import json
import os

import pytest
import torch

from dflash_core.checkpoint_files import (
    INDEX_FILE,
    SINGLE_FILE,
    CheckpointBroken,
    WeightFilesError,
    checkpoint_files,
    has_safetensors,
    not_ready,
    step_from_name,
    tensor_files,
    training_step,
    weight_file_problem,
    weight_files,
    weight_map,
)
from tests.checkpoints import settle, write_checkpoint

SHARDS = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")


def test_a_single_file_lists_its_tensors_from_its_header(tmp_path):
    folder = write_checkpoint(tmp_path / "single", {SINGLE_FILE: 200})
    assert has_safetensors(folder) and weight_map(folder) is None
    assert weight_files(folder) == [folder / SINGLE_FILE]
    assert tensor_files(folder) == {"w": folder / SINGLE_FILE}  # tests.checkpoints writes one tensor "w"


def test_an_index_names_the_shards_that_hold_each_tensor(tmp_path):
    folder = write_checkpoint(tmp_path / "sharded", {name: 200 for name in SHARDS})
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {}, "weight_map": {"a": SHARDS[1], "b": SHARDS[0],
                                                                                "c": SHARDS[1]}}))
    assert weight_map(folder) == {"a": SHARDS[1], "b": SHARDS[0], "c": SHARDS[1]}
    assert weight_files(folder) == [folder / SHARDS[0], folder / SHARDS[1]]  # each once, in order
    assert tensor_files(folder) == {"a": folder / SHARDS[1], "b": folder / SHARDS[0], "c": folder / SHARDS[1]}


@pytest.mark.parametrize("index, problem", [
    ("{not json", "not a safetensors index"),
    ('{"metadata": {}}', "not a safetensors index"),
    ('{"weight_map": ["a"]}', "weight_map is not an object"),
    ('{"weight_map": {"a": 3}}', "not a file name beside the index"),
    ('{"weight_map": {"a": "../elsewhere/model.safetensors"}}', "not a file name beside the index"),
    ('{"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}',
     r"names shard files that are not there: \['model-00002-of-00002.safetensors'\]"),
])
def test_a_malformed_index_or_missing_shards_are_one_clear_error(tmp_path, index, problem):
    folder = write_checkpoint(tmp_path / "bad", {SHARDS[0]: 200})
    (folder / INDEX_FILE).write_text(index)
    with pytest.raises(WeightFilesError, match=problem):
        tensor_files(folder)


def test_a_folder_without_weights_says_which_files_it_lacks(tmp_path):
    with pytest.raises(WeightFilesError, match="does not exist"):
        weight_files(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    assert not has_safetensors(tmp_path / "empty")
    with pytest.raises(WeightFilesError, match=f"no {SINGLE_FILE} or {INDEX_FILE}"):
        weight_files(tmp_path / "empty")
    folder = tmp_path / "not_safetensors"
    folder.mkdir()
    (folder / SINGLE_FILE).write_bytes(b"\xff" * 64)
    with pytest.raises(WeightFilesError, match="not a safetensors file"):
        tensor_files(folder)


def test_step_from_config_trainer_state_then_name(tmp_path):
    folder = tmp_path / "checkpoint-1200"
    folder.mkdir()
    assert training_step(folder) == 1200  # nothing in the files: the name
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 1190}))
    assert training_step(folder) == 1190  # HF Trainer's state wins over the name
    (folder / "config.json").write_text(json.dumps({"step": 1180}))
    assert training_step(folder) == 1180  # the config wins over both
    (folder / "config.json").write_text(json.dumps({"step": True, "global_step": "7"}))
    assert training_step(folder) == 1190  # not integers: ignored
    assert training_step(tmp_path / "final") is None  # no files, no number


def test_step_from_name():
    assert step_from_name("run1/step_1000") == 1000
    assert step_from_name("run1/iter42/") == 42
    assert step_from_name("run7/final") is None
    assert step_from_name("out/run1-step1500") == 1500  # SpecForge's CheckpointManager
    assert step_from_name("out/epoch_2_step_3000") == 3000  # SpecForge's older script
    assert step_from_name("run/3") == 3  # speculators' numbered saves
    assert step_from_name("z-lab/Qwen3-8B-DFlash-b16") is None  # a model's name, not a save's step
    assert step_from_name("snapshots/0a1b2c3d4e5f67") is None


# ---------------------------------------------------------------- which files evaluation takes


def test_a_training_save_yields_only_config_weights_and_step_metadata(tmp_path):
    folder = write_checkpoint(tmp_path / "checkpoint-500", {
        "model.safetensors": 1000, "optimizer.pt": 5000, "scheduler.pt": 100, "rng_state_0.pth": 100,
        "training_args.bin": 100, "trainer_state.json": 50,
    })
    (folder / "dflash.py").write_text("# modeling code a trainer copies beside its save")
    found = checkpoint_files(folder)
    assert found.layout == "hf" and found.config_source == "checkpoint"
    assert sorted(found.files) == ["config.json", "model.safetensors", "trainer_state.json"]
    widened = checkpoint_files(folder, include=["optimizer.*", "*.py"])
    assert sorted(widened.files) == ["config.json", "dflash.py", "model.safetensors", "optimizer.pt", "trainer_state.json"]


def test_a_sharded_save_takes_the_index_and_the_shards_it_names(tmp_path):
    folder = write_checkpoint(tmp_path / "step_9", {"model-00001-of-00002.safetensors": 200,
                                                     "model-00002-of-00002.safetensors": 200,
                                                     "model-00001-of-00003.safetensors": 200})  # stale, unnamed
    (folder / INDEX_FILE).write_text(json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors",
                                                                "b": "model-00002-of-00002.safetensors"}}))
    settle(folder)
    found = checkpoint_files(folder)
    assert sorted(found.files) == sorted(["config.json", INDEX_FILE, "model-00001-of-00002.safetensors",
                                          "model-00002-of-00002.safetensors"])
    assert not_ready(folder, settle_seconds=30) is None


def test_specforge_run_folders_take_the_payload_and_the_run_config(tmp_path):
    """SpecForge's CheckpointManager layout: {run_id}-stepN/training_state.pt (+ per-rank files), no config."""
    run = tmp_path / "out"
    step = run / "run1-step100"
    step.mkdir(parents=True)
    torch.save({"draft_state_dict": {"fc.weight": torch.zeros(2, 2)}, "global_step": 100}, step / "training_state.pt")
    torch.save({"optimizer": {"state": {}}}, step / "training_state_rank0.pt")
    settle(step)
    found = checkpoint_files(step)
    assert found.layout == "specforge" and sorted(found.files) == ["training_state.pt"]
    assert found.config_source is None  # nothing says how the drafter is shaped: --drafter-config must
    (run / "config.json").write_text("{}")
    found = checkpoint_files(step)
    assert found.config_source == "run folder" and found.files["config.json"] == run / "config.json"
    assert not_ready(step, settle_seconds=30) is None
    assert training_step(step) == 100
    assert checkpoint_files(run) is None  # the run folder itself holds no weights


# ---------------------------------------------------------------- finished or still being written


def test_a_folder_is_ready_only_once_settled_and_whole(tmp_path):
    folder = write_checkpoint(tmp_path / "step_1", {"model.safetensors": 4096}, age=0)
    assert "changed" in not_ready(folder, settle_seconds=30)  # just written
    assert not_ready(folder, settle_seconds=0) is None
    settle(folder)
    assert not_ready(folder, settle_seconds=30) is None
    # optimizer state still being written beside finished weights: not ready either
    (folder / "optimizer.pt").write_bytes(b"x")
    assert "changed" in not_ready(folder, settle_seconds=30)
    settle(folder)
    (folder / ".model.safetensors.tmp").write_bytes(b"x")  # a temporary file of the weights
    settle(folder)
    assert "temporary" in not_ready(folder, settle_seconds=30)
    os.unlink(folder / ".model.safetensors.tmp")
    with pytest.raises(FileNotFoundError):
        not_ready(tmp_path / "nope", settle_seconds=0)


def test_shards_without_their_index_or_an_index_without_its_shards_are_not_ready(tmp_path):
    folder = write_checkpoint(tmp_path / "step_2", {"model-00001-of-00002.safetensors": 200})
    assert "without model.safetensors.index.json" in not_ready(folder, settle_seconds=0)
    (folder / INDEX_FILE).write_text(json.dumps({"weight_map": {"a": "model-00001-of-00002.safetensors",
                                                                "b": "model-00002-of-00002.safetensors"}}))
    assert "not there yet" in not_ready(folder, settle_seconds=0)
    (folder / INDEX_FILE).write_text('{"metadata": {}}')  # settled, and no index: broken, not pending
    with pytest.raises(CheckpointBroken, match="not a safetensors index"):
        not_ready(folder, settle_seconds=0)


@pytest.mark.parametrize("damage", ["truncated", "empty", "random", "longer"])
def test_weights_that_are_not_whole_are_broken_not_pending(tmp_path, damage):
    folder = write_checkpoint(tmp_path / "step_3", {"model.safetensors": 4096})
    weights = folder / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes({"truncated": data[:3000], "empty": b"", "random": os.urandom(4096),
                         "longer": data + b"extra"}[damage])
    settle(folder)
    assert weight_file_problem(weights)
    with pytest.raises(CheckpointBroken, match="model.safetensors"):
        not_ready(folder, settle_seconds=30)


def test_a_torch_save_cut_short_is_broken(tmp_path):
    step = tmp_path / "run1-step7"
    step.mkdir()
    torch.save({"draft_state_dict": {"fc.weight": torch.zeros(64, 64)}}, step / "training_state.pt")
    assert weight_file_problem(step / "training_state.pt") is None
    data = (step / "training_state.pt").read_bytes()
    (step / "training_state.pt").write_bytes(data[: len(data) // 2])
    assert "not a complete torch.save" in weight_file_problem(step / "training_state.pt")
