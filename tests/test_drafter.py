"""The drafter: forward pass against an independent eager implementation, masks, loading, bad input."""

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding, apply_rotary_pos_emb

from dflash_core.drafter import load_drafter, save_drafter
from dflash_core.drafter_config import (
    DrafterConfig,
    DrafterConfigWarning,
    DrafterError,
    fallback_layer_ids,
    read_drafter_config,
)
from tests.drafters import drafter_config, random_drafter

pytestmark = pytest.mark.usefixtures("one_thread")


@torch.no_grad()
def reference_block_hidden(model, features, start, block_embeds, semantics):
    """Eager, loop-built reference of one block's forward (the DFlash definition, written plainly).

    features [K, T, H] (only [:start] is context); block_embeds [B, H]. Uses transformers' RoPE
    and an explicit per-(query, key) visibility rule instead of the drafter's vectorised masks.
    """
    cfg = model.cfg
    B = block_embeds.shape[0]
    ctx_in = features[:, :start].permute(1, 0, 2).reshape(start, -1)
    ctx = model.hidden_norm(ctx_in @ model.fc.weight.T)  # [S, H]
    rotary = Qwen3RotaryEmbedding(cfg.rope)
    key_pos = list(range(start)) + list(range(start, start + B))
    cos, sin = rotary(ctx, torch.tensor([key_pos]))

    def causal(layer_type):  # z-lab's rule: the config's is_causal decides every layer; unset, by layer type
        if cfg.is_causal is not None:
            return cfg.is_causal
        return layer_type == "sliding_attention" and semantics == "causal"

    def visible(layer_type, q, kpos, is_block_key):
        if is_block_key and causal(layer_type) and kpos > q:
            return False
        if layer_type == "full_attention":
            return True
        if q - kpos >= cfg.sliding_window:
            return False
        if is_block_key and kpos - q >= cfg.sliding_window:
            return False
        return True

    x = block_embeds * cfg.input_embedding_scale
    for layer, layer_type in zip(model.layers, cfg.layer_types):
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        kv_in = torch.cat([ctx, h])  # [S+B, H]
        q = attn.q_norm((h @ attn.q_proj.weight.T).view(B, cfg.num_heads, cfg.head_dim)).transpose(0, 1)
        k = attn.k_norm((kv_in @ attn.k_proj.weight.T).view(-1, cfg.num_kv_heads, cfg.head_dim)).transpose(0, 1)
        v = (kv_in @ attn.v_proj.weight.T).view(-1, cfg.num_kv_heads, cfg.head_dim).transpose(0, 1)
        q, _ = apply_rotary_pos_emb(q[None], q[None], cos[:, start:], sin[:, start:])
        _, k = apply_rotary_pos_emb(k[None], k[None], cos, sin)
        q, k = q[0], k[0]
        groups = cfg.num_heads // cfg.num_kv_heads
        out = torch.zeros(cfg.num_heads, B, cfg.head_dim)
        for head in range(cfg.num_heads):
            for qi in range(B):
                scores = []
                for kj, kpos in enumerate(key_pos):
                    if visible(layer_type, start + qi, kpos, kj >= start):
                        scores.append((kj, float(q[head, qi] @ k[head // groups, kj]) / math.sqrt(cfg.head_dim)))
                weights = torch.softmax(torch.tensor([s for _, s in scores]), 0)
                for w, (kj, _) in zip(weights, scores):
                    out[head, qi] += w * v[head // groups, kj]
        x = x + out.transpose(0, 1).reshape(B, -1) @ attn.o_proj.weight.T
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.norm(x)


def run_block(model, features, start, block_embeds):
    ctx = [(k[None], v[None]) for k, v in model.context_kv(features[:, :start])]
    return model(block_embeds[None], torch.tensor([start]), ctx)[0]


@pytest.mark.parametrize("semantics", ["causal", "non_causal"])
@pytest.mark.parametrize("layer_types,window", [(None, None), (["sliding_attention", "full_attention"], 5)])
def test_forward_matches_eager_reference(semantics, layer_types, window):
    raw = drafter_config(layer_types=layer_types, sliding_window=window, block_size=4)
    model = random_drafter(raw, seed=1, sliding_semantics=semantics)
    torch.manual_seed(2)
    features = torch.randn(2, 12, 32)
    block = torch.randn(4, 32)
    for start in (1, 3, 9):
        got = run_block(model, features, start, block)
        want = reference_block_hidden(model, features, start, block, semantics)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("is_causal", [True, False])
def test_is_causal_forward_matches_eager_reference(is_causal):
    # the config's is_causal overrides the sliding semantics and reaches the full layer too
    raw = drafter_config(layer_types=["sliding_attention", "full_attention"], sliding_window=5, block_size=4,
                         is_causal=is_causal, dflash_config={"target_layer_ids": [0, 1], "mask_token_id": 1,
                                                             "input_embedding_scale": 1.7})
    # asked for the other sliding semantics: the config wins, with a warning
    with pytest.warns(DrafterConfigWarning, match="sliding_semantics=.* has no effect"):
        model = random_drafter(raw, seed=11, sliding_semantics="non_causal" if is_causal else "causal")
    torch.manual_seed(12)
    features, block = torch.randn(2, 12, 32), torch.randn(4, 32)
    for start in (1, 9):
        want = reference_block_hidden(model, features, start, block, semantics="unused: is_causal is set")
        torch.testing.assert_close(run_block(model, features, start, block), want, rtol=1e-5, atol=1e-5)


def test_sliding_semantics_differ_and_window_limits_context():
    raw = drafter_config(layer_types=["sliding_attention", "sliding_attention"], sliding_window=3, block_size=4)
    causal = random_drafter(raw, seed=3, sliding_semantics="causal")
    non_causal = random_drafter(raw, seed=3, sliding_semantics="non_causal")
    torch.manual_seed(4)
    features, block = torch.randn(2, 10, 32), torch.randn(4, 32)
    a, b = run_block(causal, features, 8, block), run_block(non_causal, features, 8, block)
    # position 0 sees only itself in the block under causal semantics: differs from non-causal
    assert not torch.allclose(a[0], b[0])
    # with window 3 the block at 8 reaches context positions 6 and 7 only: earlier features do not matter
    changed = features.clone()
    changed[:, :5] = torch.randn(2, 5, 32)
    torch.testing.assert_close(run_block(causal, changed, 8, block), a)
    changed[:, 7] += 1.0
    assert not torch.allclose(run_block(causal, changed, 8, block), a)


def test_batched_blocks_equal_single_blocks():
    raw = drafter_config(layer_types=["sliding_attention", "full_attention"], sliding_window=4)
    model = random_drafter(raw, seed=5)
    torch.manual_seed(6)
    features = torch.randn(2, 16, 32)
    blocks = torch.randn(3, 4, 32)
    starts = torch.tensor([2, 7, 13])
    ctx = [(k[None].expand(3, -1, -1, -1), v[None].expand(3, -1, -1, -1)) for k, v in model.context_kv(features[:, :13])]
    batched = model(blocks, starts, ctx)
    for n in range(3):
        torch.testing.assert_close(batched[n], run_block(model, features, int(starts[n]), blocks[n]), rtol=1e-5, atol=1e-6)


def test_save_load_roundtrip_single_and_sharded(tmp_path):
    raw = drafter_config()
    model = random_drafter(raw, seed=7)
    save_drafter(model, tmp_path / "single")
    loaded = load_drafter(tmp_path / "single")
    for name, p in model.state_dict().items():
        assert torch.equal(p, loaded.state_dict()[name]), name

    # the same weights split into two shards with an index
    shard_dir = tmp_path / "sharded"
    shard_dir.mkdir()
    state = load_file(str(tmp_path / "single" / "model.safetensors"))
    names = sorted(state)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for file, keys in halves.items():
        save_file({k: state[k] for k in keys}, str(shard_dir / file))
        weight_map.update({k: file for k in keys})
    (shard_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (shard_dir / "config.json").write_text(json.dumps(raw))
    sharded = load_drafter(shard_dir)
    torch.manual_seed(8)
    features, block = torch.randn(2, 6, 32), torch.randn(4, 32)
    torch.testing.assert_close(run_block(sharded, features, 5, block), run_block(model, features, 5, block))


def test_load_with_a_parsed_config(tmp_path):
    # a caller that read the config once passes it on; config.json is not read again
    raw = drafter_config(mask_token_id=3)
    model = random_drafter(raw, seed=7)
    save_drafter(model, tmp_path)
    config = read_drafter_config(tmp_path, mask_token_id=5)
    (tmp_path / "config.json").unlink()
    loaded = load_drafter(tmp_path, config=config)
    assert loaded.cfg is config and loaded.mask_token_id == 5
    for name, p in model.state_dict().items():
        assert torch.equal(p, loaded.state_dict()[name]), name
    with pytest.raises(ValueError, match="belong to read_drafter_config"):
        load_drafter(tmp_path, config=config, mask_token_id=5)


def test_bf16_drafter_runs_and_stays_close():
    raw = drafter_config()
    model = random_drafter(raw, seed=9)
    bf16 = random_drafter(raw, seed=9).to(torch.bfloat16)
    torch.manual_seed(10)
    features, block = torch.randn(2, 6, 32), torch.randn(4, 32)
    out = run_block(bf16, features.bfloat16(), 5, block.bfloat16())
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), run_block(model, features, 5, block), rtol=0.1, atol=0.1)


def test_rope_scaling_is_read_through_transformers():
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}
    plain = DrafterConfig.from_dict(drafter_config())
    scaled = DrafterConfig.from_dict(drafter_config(rope_scaling=yarn))
    assert scaled.rope.rope_parameters["rope_type"] == "yarn"
    assert not torch.allclose(Qwen3RotaryEmbedding(plain.rope).inv_freq, Qwen3RotaryEmbedding(scaled.rope).inv_freq)


def test_fallback_layer_ids_warn():
    assert fallback_layer_ids(64, 5) == [1, 16, 31, 46, 61]
    assert fallback_layer_ids(36, 1) == [18]
    raw = drafter_config(num_layers=2, num_target_layers=8)
    del raw["dflash_config"]["target_layer_ids"]
    with pytest.warns(UserWarning, match="fallback"):
        cfg = DrafterConfig.from_dict(raw)
    assert cfg.target_layer_ids == (1, 5) and cfg.layer_ids_from_fallback


@pytest.mark.parametrize("edit,message", [
    (lambda r: r.pop("hidden_size"), "missing required field 'hidden_size'"),
    (lambda r: r["dflash_config"].pop("mask_token_id"), "mask_token_id"),
    (lambda r: r.update(block_size=1), "block_size must be an integer >= 2"),
    (lambda r: r.update(layer_types=["full_attention"]), "layer_types must list"),
    (lambda r: r.update(layer_types=["sliding_attention", "full_attention"], sliding_window=None), "sliding_window"),
    (lambda r: r["dflash_config"].update(target_layer_ids=[]), "target_layer_ids must be a non-empty list"),
    (lambda r: r.update(rope_scaling={"rope_type": "no-such-rope"}), "invalid rope settings"),
])
def test_bad_config_fields(edit, message):
    raw = drafter_config()
    edit(raw)
    with pytest.raises(DrafterError, match=message):
        DrafterConfig.from_dict(raw)


def test_malformed_config_json(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 32,\n "oops" }')
    with pytest.raises(DrafterError, match=r"malformed JSON at line 2"):
        load_drafter(tmp_path)
    with pytest.raises(DrafterError, match="config.json does not exist"):
        load_drafter(tmp_path / "nowhere")


def test_missing_unexpected_and_misshapen_weights(tmp_path):
    raw = drafter_config()
    save_drafter(random_drafter(raw), tmp_path)
    state = load_file(str(tmp_path / "model.safetensors"))

    def write(s):
        save_file(s, str(tmp_path / "model.safetensors"))

    write({k: v for k, v in state.items() if k != "layers.1.mlp.up_proj.weight"})
    with pytest.raises(DrafterError, match=r"missing \['layers.1.mlp.up_proj.weight'\]"):
        load_drafter(tmp_path)
    write({**state, "lm_head.weight": torch.zeros(4, 32)})
    with pytest.raises(DrafterError, match=r"unexpected \['lm_head.weight'\]"):
        load_drafter(tmp_path)
    write({**state, "fc.weight": torch.zeros(32, 96)})
    with pytest.raises(DrafterError, match=r"fc.weight has shape \[32, 96\].*takes 3 target layers; the config names 2"):
        load_drafter(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"truncated")
    with pytest.raises(DrafterError, match="cannot read safetensors"):
        load_drafter(tmp_path)
