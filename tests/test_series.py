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
