import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForImageTextToText,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5Model,
)
from transformers.cache_utils import DynamicLayer, LinearAttentionLayer

from dflash_core.target import Target, find_backbone, load_target
from dflash_core.token_head import load_token_head

F32 = torch.float32

pytestmark = pytest.mark.usefixtures("one_thread")


def _ids(batch=2, length=12, seed=0, vocab=64):
    return torch.randint(0, vocab, (batch, length), generator=torch.Generator().manual_seed(seed))


def _hf_reference(model, ids):
    """HF hidden_states (and logits if the model has a head) from the model's own forward."""
    out = model(input_ids=ids, output_hidden_states=True)
    return out.hidden_states, getattr(out, "logits", None)


@pytest.fixture(scope="module")
def targets(qwen3_dir, llama_tied_dir, qwen3_5_dirs, gemma3_dir, qwen2_5_vl_dir):
    """Every supported layout, loaded once: name -> (Target, expected backbone class, expected backbone path)."""
    text_dir, vlm_dir = qwen3_5_dirs
    return {
        "qwen3": (load_target(qwen3_dir, dtype=F32), "Qwen3Model", "model"),
        "llama_tied": (load_target(llama_tied_dir, dtype=F32), "LlamaModel", "model"),
        "qwen3_5_text": (load_target(text_dir, dtype=F32), "Qwen3_5TextModel", "model"),
        # AutoModelForCausalLM maps a Qwen3.5 VLM checkpoint to the text-only Qwen3_5ForCausalLM
        "qwen3_5_vlm": (load_target(vlm_dir, dtype=F32), "Qwen3_5TextModel", "model"),
        "qwen3_5_conditional": (
            Target.from_model(Qwen3_5ForConditionalGeneration.from_pretrained(vlm_dir, dtype=F32)),
            "Qwen3_5TextModel",
            "model.language_model",
        ),
        "qwen3_5_automodel": (
            Target.from_model(AutoModel.from_pretrained(vlm_dir, dtype=F32)),
            "Qwen3_5TextModel",
            "language_model",
        ),
        "gemma3": (load_target(gemma3_dir, dtype=F32), "Gemma3TextModel", "model.language_model"),
        "qwen2_5_vl": (load_target(qwen2_5_vl_dir, dtype=F32), "Qwen2_5_VLTextModel", "model.language_model"),
    }


ALL = [
    "qwen3",
    "llama_tied",
    "qwen3_5_text",
    "qwen3_5_vlm",
    "qwen3_5_conditional",
    "qwen3_5_automodel",
    "gemma3",
    "qwen2_5_vl",
]
WITH_HEAD = [name for name in ALL if name != "qwen3_5_automodel"]


@pytest.mark.parametrize("name", ALL)
def test_structure_discovery(targets, name):
    target, backbone_class, backbone_path = targets[name]
    assert type(target.backbone).__name__ == backbone_class
    assert find_backbone(target.model)[0] == backbone_path
    assert target.backbone is target.model.get_submodule(backbone_path)
    assert target.num_layers == len(target.backbone.layers) == target.text_config.num_hidden_layers
    assert target.embed_weight is target.backbone.embed_tokens.weight
    assert target.head_weight.shape == target.embed_weight.shape == (64, target.hidden_size)
    assert target.vocab_size == 64
    assert target.max_positions == target.text_config.max_position_embeddings
    assert not target.model.training
    assert not any(p.requires_grad for p in target.model.parameters())


@pytest.mark.parametrize("name", WITH_HEAD)
def test_head_is_the_models_lm_head(targets, name):
    target, _, _ = targets[name]
    assert target.head_weight is target.model.get_output_embeddings().weight


def test_tied_head_is_the_embedding(targets):
    for name in ("llama_tied", "gemma3"):
        target = targets[name][0]
        assert target.head_weight.data_ptr() == target.embed_weight.data_ptr()
    qwen3 = targets["qwen3"][0]
    assert not torch.equal(qwen3.head_weight, qwen3.embed_weight)


def test_qwen3_5_model_head_comes_from_safetensors(targets, qwen3_5_dirs):
    target = targets["qwen3_5_automodel"][0]
    assert isinstance(target.model, Qwen3_5Model)
    assert target.model.get_output_embeddings() is None
    assert torch.equal(target.head_weight, load_token_head(qwen3_5_dirs[1]).head_weight)
    assert torch.equal(target.head_weight, targets["qwen3_5_conditional"][0].head_weight)


def test_model_without_head_and_without_checkpoint_dir_is_an_error(qwen3_5_dirs):
    config = AutoConfig.from_pretrained(qwen3_5_dirs[1])
    config.name_or_path = ""  # an in-memory model that was never loaded from a directory
    model = Qwen3_5Model(config)
    with pytest.raises(ValueError, match="has no lm_head and no checkpoint directory"):
        Target.from_model(model)


@pytest.mark.parametrize("name", ALL)
def test_features_equal_hf_hidden_states(targets, name):
    target, _, _ = targets[name]
    ids = _ids()
    hidden_states, ref_logits = _hf_reference(target.model, ids)
    assert len(hidden_states) == target.num_layers + 1
    layer_ids = list(range(target.num_layers))
    out = target.forward(ids, layer_ids=layer_ids, logits=True)
    for i in layer_ids:
        assert torch.equal(out.features[i], hidden_states[i + 1]), f"layer {i}"
    # off by one in either direction gives other values
    for i in layer_ids:
        assert not torch.allclose(out.features[i], hidden_states[i], atol=1e-3)
        if i + 2 < len(hidden_states):
            assert not torch.allclose(out.features[i], hidden_states[i + 2], atol=1e-3)
    if ref_logits is not None:
        assert torch.equal(out.logits, ref_logits)
    else:
        assert torch.equal(out.logits, hidden_states[-1] @ target.head_weight.T)


def test_last_feature_is_after_the_final_norm(targets):
    target = targets["qwen3"][0]
    ids = _ids()
    last = target.num_layers - 1
    raw = {}
    hook = target.backbone.layers[last].register_forward_hook(lambda m, a, o: raw.setdefault("out", o))
    try:
        out = target.forward(ids, layer_ids=[last], logits=False)
    finally:
        hook.remove()
    assert torch.equal(out.features[last], target.backbone.norm(raw["out"]))
    assert not torch.allclose(out.features[last], raw["out"], atol=1e-3)


def test_features_in_requested_order_and_without_logits(targets):
    target = targets["qwen3_5_text"][0]
    ids = _ids()
    full = target.forward(ids, layer_ids=[0, 1, 2, 3])
    partial = target.forward(ids, layer_ids=[2, 0], logits=False)
    assert partial.logits is None
    assert list(partial.features) == [2, 0]
    for i in (0, 2):
        assert torch.equal(partial.features[i], full.features[i])


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5_text", "gemma3"])
def test_layers_after_the_last_requested_are_not_run(targets, name):
    target, _, _ = targets[name]
    calls = [0] * target.num_layers
    norm_calls = []
    hooks = [
        layer.register_forward_hook(lambda m, a, o, i=i: calls.__setitem__(i, calls[i] + 1))
        for i, layer in enumerate(target.backbone.layers)
    ]
    hooks.append(target.backbone.norm.register_forward_hook(lambda m, a, o: norm_calls.append(1)))
    try:
        target.forward(_ids(), layer_ids=[1, 0], logits=False)
        assert calls == [1, 1] + [0] * (target.num_layers - 2)
        assert norm_calls == []
        target.forward(_ids(), layer_ids=[1, 0], logits=True)  # the head needs every layer
        assert calls == [2, 2] + [1] * (target.num_layers - 2)
    finally:
        for h in hooks:
            h.remove()


def test_vision_tower_never_runs(targets):
    for name, tower_paths in [
        ("gemma3", ["model.vision_tower", "model.multi_modal_projector"]),
        ("qwen3_5_conditional", ["model.visual"]),
        ("qwen3_5_automodel", ["visual"]),
        ("qwen2_5_vl", ["model.visual"]),
    ]:
        target = targets[name][0]
        fired = []
        hooks = []
        for path in tower_paths:
            tower = target.model.get_submodule(path)
            hooks += [m.register_forward_pre_hook(lambda m, a: fired.append(path)) for m in tower.modules()]
        try:
            target.forward(_ids(), layer_ids=list(range(target.num_layers)), logits=True)
            target.forward(_ids(), layer_ids=[0], logits=False)
        finally:
            for h in hooks:
                h.remove()
        assert fired == [], name


@pytest.mark.parametrize("name", ["qwen3_5_conditional", "qwen2_5_vl", "gemma3"])
def test_backbone_matches_the_vlm_wrapper_forward(targets, name, qwen3_5_dirs):
    # mRoPE (Qwen) and image-aware masks (Gemma 3) must reduce to the backbone's own for text-only ids
    target, _, _ = targets[name]
    ids = _ids(length=20, seed=1)
    wrapper_out = target.model(input_ids=ids, output_hidden_states=True)
    out = target.forward(ids, layer_ids=list(range(target.num_layers)))
    assert torch.equal(out.logits, wrapper_out.logits)
    for i in range(target.num_layers):
        assert torch.equal(out.features[i], wrapper_out.hidden_states[i + 1])


def test_three_qwen3_5_loadings_agree(targets, qwen3_5_dirs):
    ids = _ids(length=16, seed=2)
    names = ["qwen3_5_text", "qwen3_5_vlm", "qwen3_5_automodel", "qwen3_5_conditional"]
    outs = [targets[n][0].forward(ids, layer_ids=[0, 1, 2, 3]) for n in names]
    for name, out in zip(names[1:], outs[1:]):
        assert torch.equal(out.logits, outs[0].logits), name
        for i in range(4):
            assert torch.equal(out.features[i], outs[0].features[i]), (name, i)
    # and the text-only dir really holds the same weights as the VLM, not a fresh random init
    vlm = AutoModelForImageTextToText.from_pretrained(qwen3_5_dirs[1], dtype=F32)
    assert torch.equal(targets["qwen3_5_text"][0].embed_weight, vlm.model.language_model.embed_tokens.weight)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_5_text", "gemma3"])
def test_incremental_decoding_with_cache_matches_one_pass(targets, name):
    target, _, _ = targets[name]
    ids = _ids(batch=1, length=20, seed=3)
    full = target.forward(ids, layer_ids=[0])
    cache = target.new_cache()
    pieces = []
    for start, end in [(0, 9), (9, 10), (10, 14), (14, 20)]:
        out = target.forward(ids[:, start:end], cache=cache, layer_ids=[0])
        assert cache.get_seq_length() == end
        pieces.append(out)
    logits = torch.cat([p.logits for p in pieces], dim=1)
    features = torch.cat([p.features[0] for p in pieces], dim=1)
    # chunked vs recurrent kernels round differently; positions must follow the cache
    torch.testing.assert_close(logits, full.logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(features, full.features[0], rtol=1e-5, atol=1e-5)


def test_cache_runs_every_layer_even_without_logits(targets):
    target = targets["qwen3"][0]
    cache = target.new_cache()
    target.forward(_ids(batch=1), cache=cache, layer_ids=[0], logits=False)
    assert all(layer.get_seq_length() == 12 for layer in cache.layers)


def test_qwen3_5_cache_has_linear_attention_layers(targets):
    target = targets["qwen3_5_text"][0]
    cache = target.new_cache()
    assert [type(layer) for layer in cache.layers] == [LinearAttentionLayer, DynamicLayer] * 2


def test_load_target_dtype(qwen3_dir):
    target = load_target(qwen3_dir)  # default bfloat16
    assert target.dtype == torch.bfloat16
    assert target.head_weight.dtype == torch.bfloat16
    out = target.forward(_ids(), layer_ids=[1])
    assert out.features[1].dtype == out.logits.dtype == torch.bfloat16


# ---- errors: each bad input gives one clear message


def test_missing_directory(tmp_path):
    with pytest.raises(ValueError, match="target directory .*nowhere does not exist"):
        load_target(tmp_path / "nowhere")


def test_missing_config(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(ValueError, match="no config.json in target directory"):
        load_target(tmp_path)


def test_checkpoint_missing_weights(qwen3_dir, tmp_path):
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "config.json").write_text((qwen3_dir / "config.json").read_text())
    tensors = load_file(qwen3_dir / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="lacks weights .*model.layers.1.mlp.up_proj.weight"):
        load_target(broken, dtype=F32)


@pytest.mark.parametrize("layer_id", [3, -1, 100])
def test_layer_id_out_of_range(targets, layer_id):
    target = targets["qwen3"][0]  # 3 layers
    with pytest.raises(ValueError, match=rf"layer id {layer_id} is out of range: the target has 3 layers"):
        target.forward(_ids(), layer_ids=[0, layer_id])


@pytest.mark.parametrize("bad_id", [64, -1])
def test_token_id_out_of_vocab(targets, bad_id):
    target = targets["qwen3"][0]
    ids = _ids()
    ids[1, 5] = bad_id
    with pytest.raises(ValueError, match=rf"token id {bad_id} is out of the target's vocabulary of 64"):
        target.forward(ids)


def test_sequence_longer_than_context(targets):
    target = targets["llama_tied"][0]  # max_position_embeddings = 64
    target.forward(_ids(batch=1, length=64))
    with pytest.raises(ValueError, match="prompt of 65 tokens exceeds the target's context of 64"):
        target.forward(_ids(batch=1, length=65))
    cache = target.new_cache()
    target.forward(_ids(batch=1, length=60), cache=cache)
    with pytest.raises(ValueError, match="prompt of 65 tokens exceeds the target's context of 64"):
        target.forward(_ids(batch=1, length=5), cache=cache)


def test_input_ids_must_be_2d(targets):
    with pytest.raises(ValueError, match=r"input_ids must be \[N, T\]"):
        targets["qwen3"][0].forward(torch.tensor([1, 2, 3]))


def test_read_target_config_matches_the_loaded_model_without_loading_it(qwen3_dir, qwen3_5_dirs):
    from dflash_core.target import read_target_config

    for path in (qwen3_dir, *qwen3_5_dirs):  # text-only, and a VLM whose text config is nested
        config = read_target_config(path)
        target = load_target(path, dtype=torch.float32)
        assert (config.hidden_size, config.vocab_size, config.num_layers, config.max_positions) == \
            (target.hidden_size, target.vocab_size, target.num_layers, target.max_positions)
        eos = target.model.generation_config.eos_token_id
        assert config.eos_token_ids == (() if eos is None else tuple(eos if isinstance(eos, list) else [eos]))
    with pytest.raises(ValueError, match="no config.json"):
        read_target_config(qwen3_dir.parent)


# ---- a Qwen3_5Model re-save: `AutoModel.from_pretrained(vlm).save_pretrained(out)` keeps language_model.*,
# visual.* and no lm_head (the published checkpoints hold model.language_model.*, model.visual.*, lm_head.weight)


@pytest.fixture(scope="module")
def resaved(qwen3_5_dirs, tmp_path_factory):
    """name -> folder: the bare re-save, the re-save with a tied config, and the re-save with the original
    head put back into the folder (as `lm_head.weight` or `language_model.lm_head.weight`, in a shard of its own)."""
    import json
    import shutil

    _, vlm_dir = qwen3_5_dirs
    root = tmp_path_factory.mktemp("resaved")
    AutoModel.from_pretrained(vlm_dir, dtype=F32).save_pretrained(root / "bare")
    dirs = {"bare": root / "bare"}
    head = load_file(vlm_dir / "model.safetensors")["lm_head.weight"]
    for name, head_key in [("head", "lm_head.weight"), ("prefixed_head", "language_model.lm_head.weight")]:
        folder = dirs[name] = root / name
        shutil.copytree(root / "bare", folder)
        (folder / "model.safetensors").rename(folder / "model-00001-of-00002.safetensors")
        save_file({head_key: head}, folder / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
        weight_map = {key: "model-00001-of-00002.safetensors"
                      for key in load_file(folder / "model-00001-of-00002.safetensors")}
        weight_map[head_key] = "model-00002-of-00002.safetensors"
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    folder = dirs["tied"] = root / "tied"
    shutil.copytree(root / "bare", folder)
    config = json.loads((folder / "config.json").read_text())
    config["tie_word_embeddings"] = config["text_config"]["tie_word_embeddings"] = True
    (folder / "config.json").write_text(json.dumps(config))
    return dirs


def test_qwen3_5_model_resave_really_has_that_layout(resaved):
    # guards the tests below against transformers changing what Qwen3_5Model.save_pretrained writes
    import json

    keys = load_file(resaved["bare"] / "model.safetensors").keys()
    assert "language_model.embed_tokens.weight" in keys and any(k.startswith("visual.") for k in keys)
    assert not any("lm_head" in k for k in keys) and not any(k.startswith("model.") for k in keys)
    config = json.loads((resaved["bare"] / "config.json").read_text())
    assert config["architectures"] == ["Qwen3_5Model"] and config["tie_word_embeddings"] is False


def test_resave_without_its_head_is_an_error_naming_the_prefix(resaved):
    from dflash_core.target import read_target_config

    message = (r"under language_model\.\* \(a Qwen3_5Model saved without its lm_head\) and no lm_head\.weight"
               r".*point --target at the original checkpoint")
    for read in (lambda p: load_target(p, dtype=F32), load_token_head, read_target_config):
        with pytest.raises(ValueError, match=message):
            read(resaved["bare"])


@pytest.mark.parametrize("name", ["head", "prefixed_head"])
def test_resave_with_its_head_equals_the_original(targets, resaved, name):
    from dflash_core.features import extract_features

    original = targets["qwen3_5_vlm"][0]
    target = load_target(resaved[name], dtype=F32)
    # the text-only class: the vision tower is not even built, so it cannot run
    assert type(target.model).__name__ == "Qwen3_5ForCausalLM"
    assert not any(_is_vision(n) for n, _ in target.model.named_modules())
    ids = _ids(length=16, seed=4)
    out, expected = target.forward(ids, layer_ids=[0, 1, 2, 3]), original.forward(ids, layer_ids=[0, 1, 2, 3])
    assert torch.equal(out.logits, expected.logits)
    for i in range(4):
        assert torch.equal(out.features[i], expected.features[i]), i
    sequences = [ids[0].tolist(), ids[1, :9].tolist()]
    for got, want in zip(extract_features(target, sequences, [1, 3]), extract_features(original, sequences, [1, 3])):
        assert torch.equal(got, want)
    head = load_token_head(resaved[name])
    assert torch.equal(head.head_weight, original.head_weight) and torch.equal(head.embed_weight, original.embed_weight)


def test_resave_with_a_tied_config_uses_the_embedding_as_its_head(targets, resaved):
    original = targets["qwen3_5_vlm"][0]
    target = load_target(resaved["tied"], dtype=F32)
    assert torch.equal(target.embed_weight, original.embed_weight)
    assert target.head_weight.data_ptr() == target.embed_weight.data_ptr()
    ids = _ids(length=16, seed=5)
    out, expected = target.forward(ids, layer_ids=[0, 2]), original.forward(ids, layer_ids=[0, 2, 3])
    for i in (0, 2):
        assert torch.equal(out.features[i], expected.features[i]), i
    torch.testing.assert_close(out.logits, expected.features[3] @ original.embed_weight.T)
    assert load_token_head(resaved["tied"]).tied


def _is_vision(name: str) -> bool:
    return any(part in ("visual", "vision_tower") for part in name.split("."))



# ---- --dtype auto: the checkpoint's own dtype, resolved once (tasks/target.py)


@pytest.mark.parametrize("config, name, note", [
    ({"dtype": "bfloat16", "text_config": {"dtype": "float32"}}, "bfloat16", None),  # top level first
    ({"torch_dtype": "bfloat16"}, "bfloat16", None),  # older transformers
    ({"text_config": {"dtype": "bfloat16"}}, "bfloat16", None),  # a VLM that names it only for its text model
    ({"dtype": "float32"}, "float32", None),
    ({"dtype": "float16"}, "float32", "float16 hidden states overflow"),  # never computed in fp16
    ({}, "float32", "names no dtype"),
])
def test_auto_dtype_is_the_checkpoints_own(tmp_path, config, name, note):
    import json

    from dflash_eval.tasks.target import DtypeChoice, resolve_dtype

    (tmp_path / "config.json").write_text(json.dumps(config))
    choice = resolve_dtype("auto", tmp_path)
    assert (choice.name, choice.requested) == (name, "auto")
    assert choice.note is None if note is None else note in choice.note
    # an explicit name is taken as it is, whatever the checkpoint says
    for explicit in ("float32", "bfloat16"):
        assert resolve_dtype(explicit, tmp_path) == DtypeChoice(explicit, explicit, None)


def test_auto_dtype_of_the_fixtures_and_unknown_names(qwen3_5_dirs):
    from dflash_eval.tasks.target import resolve_dtype

    for path in qwen3_5_dirs:  # saved in float32, as the tiny fixtures are
        assert resolve_dtype("auto", path).name == "float32"
    with pytest.raises(ValueError, match="dtype must be one of auto, float32, bfloat16, got 'float16'"):
        resolve_dtype("float16", qwen3_5_dirs[0])
