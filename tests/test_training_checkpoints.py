"""Drafter checkpoints as training frameworks save them, evaluated exactly like their Hugging Face export.

The saves are made by SpecForge's own code (its 0.2.0 wheel, installed with --no-deps by the README's
test command: its pinned torch 2.11 and sglang are GPU builds), from the tiny run's trained step_400
weights in bf16, as SpecForge trains:

  hf/                 `specforge.export.to_hf.export_to_hf` of the step below (what a user exports)
  run1-step400/       `specforge.training.checkpoint.CheckpointManager.save`: training_state.pt (the
                      shared payload; the weights are `DFlashTrainStrategy.checkpoint_state_filter` of
                      the training wrapper's state dict) + training_state_rank0.pt, with run1-latest /
                      run1-best links and run1.best_meta.json beside it
  epoch_0_step_400/   the older `scripts/train_dflash.py` `save_checkpoint` (a script function, not in
                      the wheel; followed line by line): training_state.pt with the optimizer state and
                      the argparse args, then `DFlashDraftModel.save_pretrained(state_dict=...)`, then
                      the modeling file dflash.py copied beside it
"""

import argparse
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from prefect.states import State
from torch import nn

from dflash_eval.services.relay.server import RelayServer
from dflash_eval.storage import Store
from dflash_eval.tasks.fetch import CheckpointError, fetch_checkpoint
from tests.tiny_models import first_prompts

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

N_PROMPTS = 6
MAX_NEW = 32


class _TrainingWrapper(nn.Module):
    """What SpecForge's trainer holds: the drafter as `draft_model` beside the frozen target parts."""

    def __init__(self, draft_model: nn.Module, vocab: int, hidden: int):
        super().__init__()
        self.draft_model = draft_model
        self.target_embed = nn.Embedding(vocab, hidden)  # not the drafter's: the filter drops it


@pytest.fixture(scope="module")
def saves(tiny_qwen3_run, tmp_path_factory):
    from safetensors.torch import load_file
    from specforge.export.to_hf import export_to_hf
    from specforge.modeling.auto import AutoDraftModel, AutoDraftModelConfig
    from specforge.training.checkpoint import CheckpointManager
    from specforge.training.strategies.base import DFlashTrainStrategy

    root = tmp_path_factory.mktemp("specforge")
    trained = tiny_qwen3_run.drafter_steps[-1]
    config = json.loads((trained / "config.json").read_text())
    config["use_sliding_window"] = True  # SpecForge's DFlashDraftModel refuses sliding layers without it
    config_file = root / "draft_config.json"  # what a SpecForge run's model.draft_model_config names
    config_file.write_text(json.dumps(config, indent=2))

    draft_model = AutoDraftModel.from_config(AutoDraftModelConfig.from_file(str(config_file)), torch_dtype=torch.float32)
    missing, unexpected = draft_model.load_state_dict(load_file(trained / "model.safetensors"), strict=False)
    assert not missing and not unexpected
    draft_model = draft_model.to(torch.bfloat16)  # train_dflash.py: DFlashDraftModel(...).to(torch.bfloat16)
    wrapper = _TrainingWrapper(draft_model, config["vocab_size"], config["hidden_size"])
    optimizer = torch.optim.AdamW(draft_model.parameters())
    draft_state_dict = DFlashTrainStrategy(wrapper).checkpoint_state_filter(wrapper.state_dict())

    out = root / "out"
    manager = CheckpointManager(str(out), "run1")
    manager.save({"draft_state_dict": draft_state_dict, "global_step": 400, "epoch": 0, "strategy": "dflash",
                  "run_id": "run1", "world_size": 1}, 400,
                 rank_state={"optimizer": optimizer.state_dict(), "rng": {"torch": torch.get_rng_state()}})
    manager.update_best(400, {"eval/simulated_acc_len": 3.0})

    old = root / "old" / "epoch_0_step_400"  # scripts/train_dflash.py save_checkpoint, rank 0
    old.mkdir(parents=True)
    args = argparse.Namespace(output_dir=str(old.parent), block_size=config["block_size"])
    torch.save({"epoch": 0, "global_step": 400, "args": args, **optimizer.state_dict()}, old / "training_state.pt")
    draft_model.save_pretrained(str(old), state_dict=draft_state_dict)
    import specforge.modeling.draft.dflash as modeling

    shutil.copy(modeling.__file__, old / "dflash.py")

    hf = Path(export_to_hf(str(out / "run1-step400"), str(config_file), str(root / "hf")))
    prompts = first_prompts(tiny_qwen3_run, N_PROMPTS, root / "prompts.jsonl")
    return {"tiny": tiny_qwen3_run, "config": config_file, "hf": hf, "step": out / "run1-step400",
            "latest": out / "run1-latest", "old": old, "out": out, "prompts": prompts, "root": root}


def evaluate(saves, drafter, store, **kwargs) -> dict:
    from tests.evaluations import run_evaluation

    return run_evaluation(target=str(saves["tiny"].target_dir), drafter=str(drafter), prompts=str(saves["prompts"]),
                               max_new_tokens=MAX_NEW, store=str(store), **kwargs)


def lengths(results: dict) -> dict[str, list[int]]:
    return {p["id"]: p["acceptance_lengths"] for p in results["per_prompt"]}


def test_both_specforge_layouts_score_exactly_like_the_hf_export(saves, tmp_path, prefect_api_url):
    store = tmp_path / "store"
    exported = evaluate(saves, saves["hf"], store)
    assert exported["tau_macro"] > 1.5  # a trained drafter: equal lengths below mean something

    old = evaluate(saves, saves["old"], store)
    assert old["drafter"]["layout"] == "hf" and old["drafter"]["step"] == 400
    assert lengths(old) == lengths(exported)

    new = evaluate(saves, saves["step"], store, drafter_config=str(saves["config"]))
    assert new["drafter"]["layout"] == "specforge" and new["drafter"]["step"] == 400
    assert new["drafter"]["config_source"] == f"--drafter-config {saves['config']}"
    assert new["stages"]["fetch"] == "ran" and new["stages"]["drafts"] == "ran"
    assert lengths(new) == lengths(exported)

    # The store holds the drafter in the published format, not the payload and its optimizer.
    held = Path(Store(store).entry("fetch", new["drafter"]["key"])) / "checkpoint"
    assert sorted(p.name for p in held.iterdir()) == ["config.json", "model.safetensors"]
    record = Store(store).read_record("fetch", new["drafter"]["key"])
    assert record["weights_from"] == "training_state.pt: draft_state_dict"
    assert set(record["files"]) == {"config.json", "training_state.pt"}  # what was fetched, and keyed

    # run1-latest is the same checkpoint: nothing is fetched, drafted or scored again
    latest = evaluate(saves, saves["latest"], store, drafter_config=str(saves["config"]))
    assert latest["drafter"]["key"] == new["drafter"]["key"]
    assert {s: latest["stages"][s] for s in ("fetch", "drafts", "scores")} == dict.fromkeys(("fetch", "drafts", "scores"), "cached")


def test_through_a_relay_the_run_folder_config_is_used_and_links_are_one_checkpoint(saves, tmp_path, prefect_api_url):
    out = tmp_path / "out"
    shutil.copytree(saves["out"], out, symlinks=True)
    shutil.copy(saves["config"], out / "config.json")  # the run folder holds the drafter config
    store = tmp_path / "store"
    with RelayServer(out, state_dir=tmp_path / "relay", settle_seconds=0) as relay:
        listed = [c["path"] for c in relay.list_checkpoints()]
        assert listed == ["run1-step400"]  # the links are not listed as checkpoints of their own
        results = evaluate(saves, f"{relay.url}/run1-step400", store)
        assert results["drafter"]["config_source"] == "run folder" and results["drafter"]["layout"] == "specforge"
        sent = relay.bytes_sent
        payload = (out / "run1-step400" / "training_state.pt").stat().st_size
        rank_state = (out / "run1-step400" / "training_state_rank0.pt").stat().st_size
        assert payload <= sent < payload + rank_state  # the per-rank optimizer state never crossed the wire
        again = evaluate(saves, f"{relay.url}/run1-latest", store)
        assert again["drafter"]["key"] == results["drafter"]["key"] and again["stages"]["fetch"] == "cached"
        assert relay.bytes_sent - sent < 4096  # a config read for the input check, no download
    exported = evaluate(saves, saves["hf"], store)
    assert lengths(results) == lengths(exported)


def test_a_specforge_step_without_any_config_asks_for_one(saves, tmp_path, prefect_api_url):
    from dflash_eval.flows.checks import InputError

    with pytest.raises(InputError, match="has no config.json.*--drafter-config FILE"):
        evaluate(saves, saves["step"], tmp_path / "store")
    assert not (tmp_path / "store").exists()


def fetch(saves, source: str, store: str, **kwargs):
    """The fetch task's function (for the tiny target): its Checkpoint, or the CheckpointError its Failed state
    carries."""
    outcome = fetch_checkpoint.fn(source, store, str(saves["tiny"].target_dir), **kwargs)
    return outcome.result() if isinstance(outcome, State) else outcome


def specforge_step(tmp_path: Path, payload) -> Path:
    step = tmp_path / "run9-step10"
    step.mkdir()
    torch.save(payload, step / "training_state.pt")
    return step


def test_a_payload_with_python_objects_is_refused_with_how_to_export(saves, tmp_path):
    step = specforge_step(tmp_path, {"draft_state_dict": {}, "args": argparse.Namespace(lr=1e-4)})
    with pytest.raises(CheckpointError, match=r"not loaded.*specforge\.export\.to_hf"):
        fetch(saves, str(step), str(tmp_path / "store"), drafter_config=str(saves["config"]))
    assert Store(tmp_path / "store").keys("fetch") == []


class _Exploit:
    def __reduce__(self):
        return (os.system, (f"touch {_Exploit.marker}",))


def test_a_pickle_that_would_run_code_is_never_executed(saves, tmp_path):
    _Exploit.marker = tmp_path / "pwned"
    step = specforge_step(tmp_path, {"draft_state_dict": _Exploit()})  # its pickle calls os.system when loaded
    with pytest.raises(CheckpointError, match="not loaded"):
        fetch(saves, str(step), str(tmp_path / "store"), drafter_config=str(saves["config"]))
    assert not _Exploit.marker.exists()


def test_weights_found_by_structure_wherever_the_trainer_put_them(saves, tmp_path):
    from safetensors.torch import load_file

    exported = load_file(saves["hf"] / "model.safetensors")
    nested = {"model": {f"draft_model.{k}": v for k, v in exported.items()} | {"target.lm_head.weight": torch.zeros(1)},
              "global_step": 10}
    step = specforge_step(tmp_path, nested)
    checkpoint = fetch(saves, str(step), str(tmp_path / "store"), drafter_config=str(saves["config"]))
    held = load_file(Path(checkpoint.path) / "model.safetensors")
    assert held.keys() == exported.keys() and all(torch.equal(held[k], exported[k]) for k in held)
    assert Store(tmp_path / "store").read_record("fetch", checkpoint.key)["weights_from"] == \
        "training_state.pt: model[draft_model.*]"

    other = tmp_path / "other"
    other.mkdir()
    wrong = specforge_step(other, {"draft_state_dict": {k: v for k, v in exported.items() if k != "norm.weight"}})
    with pytest.raises(CheckpointError, match="no drafter weights found"):
        fetch(saves, str(wrong), str(tmp_path / "store"), drafter_config=str(saves["config"]))
