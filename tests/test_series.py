"""What a series is called and what tells two apart (reporting.history.series_key, checkpoint_files.model_name)."""

import json

from dflash_core.checkpoint_files import model_name
from dflash_eval.reporting.history import series_key
from dflash_eval.storage import Store


def test_a_target_is_named_by_its_hub_id_else_its_folder(tmp_path):
    cached = tmp_path / "hub" / "models--Qwen--Qwen3.6-27B" / "snapshots" / "9c1f0a7e2b4d6f8a"
    cached.mkdir(parents=True)
    assert model_name(str(cached)) == "Qwen/Qwen3.6-27B"  # not the commit hash
    saved = tmp_path / "target"
    saved.mkdir()
    assert model_name(str(saved)) == "target"
    (saved / "config.json").write_text(json.dumps({"_name_or_path": "org/model-8b"}))
    assert model_name(str(saved)) == "org/model-8b"
    (saved / "config.json").write_text(json.dumps({"_name_or_path": "/home/me/checkpoints/x"}))  # a path: not a name
    assert model_name(str(saved)) == "target"
    by_commit = tmp_path / "my-model" / "0123456789abcdef0123"
    by_commit.mkdir(parents=True)
    assert model_name(str(by_commit)) == "my-model"


def test_a_series_key_is_readable_and_tells_apart_what_does_not_compare(tmp_path):
    one, other = Store(tmp_path / "a"), Store(tmp_path / "b")
    key = series_key(one, "f" * 64, "causal", None, None, "Qwen/Qwen3.6-27B", "/data/math.jsonl")
    assert key.startswith("qwen-qwen3-6-27b-math-") and len(key.rsplit("-", 1)[1]) == 8
    assert key == series_key(one, "f" * 64, "causal", None, None, "Qwen/Qwen3.6-27B", "/data/math.jsonl")
    assert key != series_key(other, "f" * 64, "causal", None, None, "Qwen/Qwen3.6-27B", "/data/math.jsonl")  # a store
    assert key != series_key(one, "e" * 64, "causal", None, None, "Qwen/Qwen3.6-27B", "/data/math.jsonl")  # references
    assert key != series_key(one, "f" * 64, "non_causal", None, None, "Qwen/Qwen3.6-27B", "/data/math.jsonl")
    assert key != series_key(one, "f" * 64, "causal", 4, None, "Qwen/Qwen3.6-27B", "/data/math.jsonl")  # a block size
    sampled = {"q": {"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.0}, "seed": 0}
    assert key != series_key(one, "f" * 64, "causal", None, sampled, "Qwen/Qwen3.6-27B", "/data/math.jsonl")
    # the names only make it readable: what compares keeps its digits
    assert series_key(one, "f" * 64, "causal", None, None, "other", "x").endswith(key[-8:])
    assert len(f"series:{series_key(one, 'f' * 64, 'causal', None, None, 'a' * 100, 'b' * 100)}") <= 64


def test_a_series_is_named_by_its_target_drafter_run_and_prompts_as_people_call_them(tmp_path):
    from dflash_eval.reporting.history import drafter_run, readable_name

    tiny = "/home/me/.cache/dflash-eval/tiny/473b798f580296e5"  # folders that say what they are, under a hash
    assert readable_name(f"{tiny}/target") == "tiny/target"
    assert readable_name(f"{tiny}/prompts.jsonl") == "tiny/prompts.jsonl"
    assert drafter_run(f"{tiny}/drafter/step_100") == "tiny/drafter"
    assert drafter_run("/runs/exp7/step_300") == "exp7" and drafter_run("http://relay:8700/run1/step_1000") == "run1"
    assert drafter_run("/models/z-lab/Qwen3-8B-DFlash-b16") == "Qwen3-8B-DFlash-b16"  # a published drafter: its name
    assert readable_name("math") == "math" and readable_name("/data/math.jsonl") == "math.jsonl"
    store = Store(tmp_path)
    key = series_key(store, "f" * 64, "causal", None, None, "tiny/target", f"{tiny}/prompts.jsonl", run="tiny/drafter")
    assert key.startswith("tiny-target-drafter-prompts-")  # not target-prompts-<hex>: each word said once
    key = series_key(store, "f" * 64, "causal", None, None, "Qwen/Qwen3-8B", "/data/math.jsonl", run="exp7")
    assert key.startswith("qwen-qwen3-8b-exp7-math-")
    # the run only names it: what compares is in the digits
    assert key.endswith(series_key(store, "f" * 64, "causal", None, None, "Qwen/Qwen3-8B", "math")[-8:])
