import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import (
    AutoModelForCausalLM,
    Gemma3ForConditionalGeneration,
    Qwen3_5ForConditionalGeneration,
)

import dflash_core.token_head as token_head_module
from dflash_core.token_head import find_text_weights, is_text_key, load_token_head


def test_untied_single_file_matches_model(qwen3_dir):
    model = AutoModelForCausalLM.from_pretrained(qwen3_dir, dtype=torch.float32)
    head = load_token_head(qwen3_dir)
    assert not head.tied
    assert (head.embed_key, head.head_key) == ("model.embed_tokens.weight", "lm_head.weight")
    assert torch.equal(head.embed_weight, model.get_input_embeddings().weight)
    assert torch.equal(head.head_weight, model.get_output_embeddings().weight)
    assert not torch.equal(head.head_weight, head.embed_weight)


def test_tied_uses_the_embedding(llama_tied_dir):
    model = AutoModelForCausalLM.from_pretrained(llama_tied_dir, dtype=torch.float32)
    head = load_token_head(llama_tied_dir)
    assert head.tied and head.head_key is None
    assert head.head_weight is head.embed_weight
    assert torch.equal(head.head_weight, model.get_output_embeddings().weight)


def test_sharded_equals_single_file(qwen3_dir, qwen3_sharded_dir):
    index = json.loads((qwen3_sharded_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert index["model.embed_tokens.weight"] != index["lm_head.weight"]  # really read from two shards
    single = load_token_head(qwen3_dir)
    sharded = load_token_head(qwen3_sharded_dir)
    assert torch.equal(single.embed_weight, sharded.embed_weight)
    assert torch.equal(single.head_weight, sharded.head_weight)


def test_qwen3_5_vlm_prefix_equals_text_only(qwen3_5_dirs):
    text_dir, vlm_dir = qwen3_5_dirs
    vlm = Qwen3_5ForConditionalGeneration.from_pretrained(vlm_dir, dtype=torch.float32)
    head = load_token_head(vlm_dir)
    assert head.embed_key == "model.language_model.embed_tokens.weight"
    assert torch.equal(head.embed_weight, vlm.model.language_model.embed_tokens.weight)
    assert torch.equal(head.head_weight, vlm.lm_head.weight)
    text_head = load_token_head(text_dir)
    assert torch.equal(head.embed_weight, text_head.embed_weight)
    assert torch.equal(head.head_weight, text_head.head_weight)


def test_gemma3_legacy_vlm_prefix_tied(gemma3_dir):
    model = Gemma3ForConditionalGeneration.from_pretrained(gemma3_dir, dtype=torch.float32)
    head = load_token_head(gemma3_dir)
    assert head.embed_key == "language_model.model.embed_tokens.weight"
    assert head.tied
    assert torch.equal(head.embed_weight, model.model.language_model.embed_tokens.weight)
    assert torch.equal(head.head_weight, model.lm_head.weight)


def test_dtype_cast(qwen3_dir):
    head = load_token_head(qwen3_dir, dtype=torch.bfloat16)
    assert head.embed_weight.dtype == head.head_weight.dtype == torch.bfloat16


def test_reads_only_the_two_tensors(qwen3_dir, monkeypatch):
    read = []
    real_safe_open = token_head_module.safe_open

    class RecordingSafeOpen:
        def __init__(self, *args, **kwargs):
            self.inner = real_safe_open(*args, **kwargs)

        def __enter__(self):
            self.handle = self.inner.__enter__()
            return self

        def __exit__(self, *exc):
            return self.inner.__exit__(*exc)

        def keys(self):
            return self.handle.keys()

        def get_tensor(self, key):
            read.append(key)
            return self.handle.get_tensor(key)

    monkeypatch.setattr(token_head_module, "safe_open", RecordingSafeOpen)
    load_token_head(qwen3_dir)
    assert sorted(read) == ["lm_head.weight", "model.embed_tokens.weight"]


def _write_checkpoint(path, keys, config=None):
    path.mkdir(parents=True, exist_ok=True)
    save_file({key: torch.full((8, 4), float(n)) for n, key in enumerate(keys)}, str(path / "model.safetensors"))
    if config is not None:
        (path / "config.json").write_text(json.dumps(config))
    return path


def test_vision_mtp_and_layer_keys_are_not_candidates(tmp_path):
    keys = [
        "model.visual.embed_tokens.weight",
        "vision_tower.embed_tokens.weight",
        "mtp.embed_tokens.weight",
        "model.layers.3.embed_tokens.weight",
        "model.language_model.embed_tokens.weight",
        "multi_modal_projector.lm_head.weight",
        "lm_head.weight",
    ]
    head = load_token_head(_write_checkpoint(tmp_path / "ckpt", keys))
    assert head.embed_key == "model.language_model.embed_tokens.weight"
    assert head.head_key == "lm_head.weight"
    assert head.embed_weight[0, 0].item() == keys.index("model.language_model.embed_tokens.weight")
    assert head.head_weight[0, 0].item() == keys.index("lm_head.weight")
    assert is_text_key("language_model.model.embed_tokens.weight")
    assert not is_text_key("model.vision_model.embed_tokens.weight")


def test_ambiguous_embedding_is_an_error(tmp_path):
    path = _write_checkpoint(tmp_path / "ckpt", ["model.embed_tokens.weight", "model.language_model.embed_tokens.weight"])
    with pytest.raises(ValueError, match="ambiguous embed_tokens"):
        load_token_head(path)


def test_ambiguous_head_is_an_error(tmp_path):
    path = _write_checkpoint(
        tmp_path / "ckpt", ["model.embed_tokens.weight", "lm_head.weight", "language_model.lm_head.weight"]
    )
    with pytest.raises(ValueError, match="ambiguous lm_head"):
        load_token_head(path)


def test_missing_head_with_untied_config_is_an_error(tmp_path):
    path = _write_checkpoint(tmp_path / "ckpt", ["model.embed_tokens.weight"], {"tie_word_embeddings": False})
    with pytest.raises(ValueError, match=r"under model\.\* and no lm_head\.weight.* tie_word_embeddings=false"):
        load_token_head(path)


def test_qwen3_5_model_resave_without_head_names_its_prefix(tmp_path):
    # what Qwen3_5Model.save_pretrained writes: language_model.*, visual.*, no lm_head; the config stays untied
    path = _write_checkpoint(
        tmp_path / "ckpt", ["language_model.embed_tokens.weight", "language_model.norm.weight", "visual.pos_embed.weight"],
        {"tie_word_embeddings": False, "text_config": {"tie_word_embeddings": False}},
    )
    with pytest.raises(ValueError, match=r"under language_model\.\* \(a Qwen3_5Model saved without its lm_head\) "
                       r"and no lm_head\.weight.*point --target at the original checkpoint"):
        load_token_head(path)
    assert find_text_weights(_write_checkpoint(tmp_path / "tied", ["language_model.embed_tokens.weight"],
                                               {"tie_word_embeddings": True})).prefix == "language_model."


def test_head_is_found_wherever_it_is(tmp_path):
    path = _write_checkpoint(tmp_path / "ckpt", ["language_model.embed_tokens.weight", "language_model.lm_head.weight"],
                             {"tie_word_embeddings": False})
    weights = find_text_weights(path)
    assert (weights.prefix, weights.embed_key, weights.head_key) == \
        ("language_model.", "language_model.embed_tokens.weight", "language_model.lm_head.weight")
    head = load_token_head(path)
    assert not head.tied and torch.equal(head.head_weight, torch.full((8, 4), 1.0))


def test_tie_flag_in_text_config(tmp_path):
    path = _write_checkpoint(
        tmp_path / "ckpt", ["model.language_model.embed_tokens.weight"], {"text_config": {"tie_word_embeddings": True}}
    )
    assert load_token_head(path).tied
    path = _write_checkpoint(
        tmp_path / "ckpt2", ["model.language_model.embed_tokens.weight"], {"text_config": {"tie_word_embeddings": False}}
    )
    with pytest.raises(ValueError, match=r"under model\.language_model\.\* and no lm_head\.weight"):
        load_token_head(path)


def test_missing_embedding_is_an_error(tmp_path):
    path = _write_checkpoint(tmp_path / "ckpt", ["lm_head.weight", "model.visual.embed_tokens.weight"])
    with pytest.raises(ValueError, match="no embedding tensor"):
        load_token_head(path)


def test_missing_directory_and_files(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_token_head(tmp_path / "nowhere")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no model.safetensors or model.safetensors.index.json"):
        load_token_head(tmp_path / "empty")


def test_checkpoint_keys_really_have_the_prefixes(qwen3_5_dirs, gemma3_dir):
    # Guards the prefix tests above against transformers changing how it saves these classes.
    _, vlm_dir = qwen3_5_dirs
    with safe_open(vlm_dir / "model.safetensors", framework="pt") as f:
        assert "model.language_model.embed_tokens.weight" in f.keys()
        assert any(k.startswith("model.visual.") for k in f.keys())
    with safe_open(gemma3_dir / "model.safetensors", framework="pt") as f:
        assert "lm_head.weight" not in f.keys()
