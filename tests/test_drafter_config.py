"""Drafter config.json fields: each one that changes the math is read (with its effect shown) or
refused with its name in the message; docs/drafter-config.md lists every field the loader knows."""

import json
import re
import warnings
from pathlib import Path

import pytest
import torch
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from dflash_core.drafter import DFlashDrafter, load_drafter, save_drafter
from dflash_core.drafter_config import (
    EXTRA_MODULE_FIELDS,
    IGNORED_FIELDS,
    READ_FIELDS,
    SWITCHES,
    DrafterConfig,
    DrafterConfigWarning,
    DrafterError,
    dflash_fields,
    read_drafter_config,
)
from dflash_eval.tiny import target as tiny_target
from tests.drafters import drafter_config, random_drafter

pytestmark = pytest.mark.usefixtures("one_thread")

SLIDING_FULL = ["sliding_attention", "full_attention"]


def config(dflash=None, **top) -> dict:
    """drafter_config() with dflash_config entries added (None removes one) and top-level fields set."""
    raw = drafter_config(**top)
    for key, value in (dflash or {}).items():
        if value is None:
            raw["dflash_config"].pop(key, None)
        else:
            raw["dflash_config"][key] = value
    return raw


def quietly(raw: dict, **kwargs) -> DrafterConfig:
    """from_dict, failing on any DrafterConfigWarning."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", DrafterConfigWarning)
        return DrafterConfig.from_dict(raw, **kwargs)


def run_block(model, features, start, block_embeds):
    ctx = [(k[None], v[None]) for k, v in model.context_kv(features[:, :start])]
    return model(block_embeds[None], torch.tensor([start]), ctx)[0]


# ----------------------------------------------------------------------------------------------
# is_causal: which attention is causal within the block (z-lab's reference, SGLang)

# Block of 3 at positions 2, 3, 4; context padded to 4 positions (2 and 3 are not before the start);
# sliding window 2. Keys: context 0..3, then block 2, 3, 4. One row per query position 2, 3, 4.
FULL_BIDIRECTIONAL = ["1100111", "1100111", "1100111"]
FULL_CAUSAL = ["1100100", "1100110", "1100111"]
SLIDING_CAUSAL = ["0100100", "0000110", "0000011"]  # keys q-1 .. q only
SLIDING_BIDIRECTIONAL = ["0100110", "0000111", "0000011"]  # keys q-1 .. q+1


@pytest.mark.parametrize("top,dflash,semantics,sliding,full", [
    ({}, {}, "causal", SLIDING_CAUSAL, FULL_BIDIRECTIONAL),  # unset: sliding layers follow the semantics
    ({}, {}, "non_causal", SLIDING_BIDIRECTIONAL, FULL_BIDIRECTIONAL),
    ({"is_causal": True}, {}, "causal", SLIDING_CAUSAL, FULL_CAUSAL),  # set: every layer
    ({"is_causal": False}, {}, "non_causal", SLIDING_BIDIRECTIONAL, FULL_BIDIRECTIONAL),
    ({}, {"causal": True}, "causal", SLIDING_CAUSAL, FULL_CAUSAL),  # SGLang's dflash_config.causal
    ({}, {"causal": False}, "non_causal", SLIDING_BIDIRECTIONAL, FULL_BIDIRECTIONAL),
])
def test_attention_masks_follow_is_causal(top, dflash, semantics, sliding, full):
    raw = config(dflash, layer_types=SLIDING_FULL, sliding_window=2, block_size=3, **top)
    masks = DFlashDrafter(quietly(raw), semantics).attention_masks(torch.tensor([2]), context_len=4)
    as_rows = {t: ["".join(str(int(v)) for v in row) for row in m[0, 0].tolist()] for t, m in masks.items()}
    assert as_rows == {"sliding_attention": sliding, "full_attention": full}


def test_is_causal_set_overrides_sliding_semantics_with_a_warning():
    raw = config(layer_types=SLIDING_FULL, sliding_window=2, block_size=3, is_causal=False)
    with pytest.warns(DrafterConfigWarning, match="is_causal=false.*sliding_semantics='causal' has no effect"):
        model = DFlashDrafter(DrafterConfig.from_dict(raw), "causal")
    masks = model.attention_masks(torch.tensor([2]), context_len=4)
    assert masks["sliding_attention"][0, 0, 0].tolist() == [c == "1" for c in SLIDING_BIDIRECTIONAL[0]]


@pytest.mark.parametrize("is_causal", [None, True])
def test_causal_block_positions_do_not_see_later_ones(is_causal):
    # a full-attention drafter: with is_causal, block positions 0..1 ignore what stands at 2..3 in
    # every layer; without it, position 0 depends on them
    raw = config(block_size=4, **({} if is_causal is None else {"is_causal": is_causal}))
    model = random_drafter(raw, seed=3, scale=2.0)
    torch.manual_seed(4)
    features, block = torch.randn(2, 8, 32), torch.randn(4, 32)
    changed = block.clone()
    changed[2:] = torch.randn(2, 32)
    a, b = run_block(model, features, 6, block), run_block(model, features, 6, changed)
    if is_causal:
        torch.testing.assert_close(a[:2], b[:2])
    else:
        assert not torch.allclose(a[0], b[0], atol=1e-4)
    assert not torch.allclose(a[3], b[3], atol=1e-4)


def test_dflash_config_causal_is_read_and_is_causal_wins():
    assert quietly(config({"causal": False})).is_causal is False
    assert quietly(config()).is_causal is None
    with pytest.warns(DrafterConfigWarning, match=r"is_causal True and dflash_config.causal False differ"):
        assert DrafterConfig.from_dict(config({"causal": False}, is_causal=True)).is_causal is True


# ----------------------------------------------------------------------------------------------
# mask_token given as a string: resolved through the target's tokenizer (conftest's `tokenizer`)


def test_mask_token_string_is_resolved_through_the_tokenizer(tokenizer):
    mask_id = tokenizer.convert_tokens_to_ids(tiny_target.MASK_TOKEN)
    raw = config({"mask_token": tiny_target.MASK_TOKEN, "mask_token_id": None})
    assert quietly(raw, tokenizer=tokenizer).mask_token_id == mask_id != 1
    # the same string with the id it has: accepted
    assert quietly(config({"mask_token": tiny_target.MASK_TOKEN, "mask_token_id": mask_id}), tokenizer=tokenizer).mask_token_id == mask_id


@pytest.mark.parametrize("dflash,with_tokenizer,message", [
    ({"mask_token": tiny_target.MASK_TOKEN, "mask_token_id": None}, False,
     "dflash_config.mask_token is the token string .* Pass tokenizer="),
    ({"mask_token": "<|MASK|>", "mask_token_id": None}, True, r"dflash_config.mask_token '<\|MASK\|>' is not a single token"),
    ({"mask_token": tiny_target.MASK_TOKEN, "mask_token_id": 7}, True,
     r"dflash_config.mask_token_id 7 and dflash_config.mask_token .* disagree"),
    ({"mask_token": 5, "mask_token_id": None}, True, "dflash_config.mask_token must be a non-empty token string"),
    ({"mask_token_id": "7"}, True, "dflash_config.mask_token_id must be an integer"),
])
def test_bad_mask_tokens_are_refused(tokenizer, dflash, with_tokenizer, message):
    with pytest.raises(DrafterError, match=message):
        DrafterConfig.from_dict(config(dflash), tokenizer=tokenizer if with_tokenizer else None)


def test_mask_token_and_id_without_tokenizer_use_the_id_with_a_warning():
    with pytest.warns(DrafterConfigWarning, match="not checked against a tokenizer"):
        cfg = DrafterConfig.from_dict(config({"mask_token": "<|mask|>", "mask_token_id": 9}))
    assert cfg.mask_token_id == 9


def test_load_drafter_and_read_drafter_config_take_the_tokenizer(tmp_path, tokenizer):
    save_drafter(random_drafter(config()), tmp_path)
    raw = json.loads((tmp_path / "config.json").read_text())
    raw["dflash_config"] = {"target_layer_ids": [0, 1], "mask_token": tiny_target.MASK_TOKEN}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    mask_id = tokenizer.convert_tokens_to_ids(tiny_target.MASK_TOKEN)
    assert read_drafter_config(tmp_path, tokenizer=tokenizer).mask_token_id == mask_id
    assert load_drafter(tmp_path, tokenizer=tokenizer).mask_token_id == mask_id
    with pytest.raises(DrafterError, match=r"config.json: dflash_config.mask_token is the token string"):
        load_drafter(tmp_path)


# ----------------------------------------------------------------------------------------------
# Fields read from dflash_config, and the attention layout


def test_num_target_layers_and_block_size_inside_dflash_config():
    raw = config({"target_layer_ids": None, "num_target_layers": 8, "block_size": 5})
    del raw["num_target_layers"], raw["block_size"]
    with pytest.warns(UserWarning, match="fallback"):
        cfg = DrafterConfig.from_dict(raw)
    assert (cfg.num_target_layers, cfg.target_layer_ids, cfg.block_size) == (8, (1, 5), 5)
    # both places: dflash_config's wins (z-lab's reference and SGLang), and the disagreement is shown
    with pytest.warns(DrafterConfigWarning, match="dflash_config.block_size = 6 and top-level block_size = 4 differ"):
        assert DrafterConfig.from_dict(config({"block_size": 6}, block_size=4)).block_size == 6
    with pytest.warns(DrafterConfigWarning, match="dflash_config.num_target_layers"):
        assert DrafterConfig.from_dict(config({"num_target_layers": 12}, num_target_layers=4)).num_target_layers == 12


def test_rope_parameters_transformers5_style():
    def inv_freq(raw):
        return Qwen3RotaryEmbedding(quietly(raw).rope).inv_freq

    plain = config()  # rope_theta 1e4 at the top level
    theta = config(rope_theta=None, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    legacy = config(rope_theta=1e6)
    torch.testing.assert_close(inv_freq(theta), inv_freq(legacy))
    assert not torch.allclose(inv_freq(theta), inv_freq(plain))
    yarn = config(rope_theta=None, rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0,
                                                      "original_max_position_embeddings": 1024})
    assert not torch.allclose(inv_freq(yarn), inv_freq(theta))
    # the same value in both places is fine
    inv_freq(config(rope_theta=1e6, rope_parameters={"rope_type": "default", "rope_theta": 1e6}))


def test_layer_types_derived_from_use_sliding_window_as_transformers_does():
    # no layer_types: layers from max_window_layers on slide when use_sliding_window is true
    derived = quietly({**config(), "use_sliding_window": True, "sliding_window": 3, "max_window_layers": 1})
    assert (derived.layer_types, derived.sliding_window) == (("full_attention", "sliding_attention"), 3)
    off = quietly({**config(), "use_sliding_window": False, "sliding_window": 3, "max_window_layers": 1})
    assert (off.layer_types, off.sliding_window) == (("full_attention", "full_attention"), None)


def test_sliding_window_from_swa_window_size_and_their_order():
    cfg = quietly(config({"swa_window_size": 3}, layer_types=SLIDING_FULL, sliding_window=None))
    assert cfg.sliding_window == 3
    with pytest.warns(DrafterConfigWarning, match="sliding_window 5 and dflash_config.swa_window_size 3 differ"):
        assert DrafterConfig.from_dict(config({"swa_window_size": 3}, layer_types=SLIDING_FULL, sliding_window=5)).sliding_window == 5
    with pytest.warns(DrafterConfigWarning, match="use_sliding_window is false"):
        assert DrafterConfig.from_dict(config(layer_types=SLIDING_FULL, sliding_window=5, use_sliding_window=False)).sliding_window == 5
    # use_swa agreeing with layer_types is accepted
    assert quietly(config({"use_swa": True}, layer_types=SLIDING_FULL, sliding_window=5)).layer_types == tuple(SLIDING_FULL)


def test_input_embedding_scale_multiplies_the_block_embeddings():
    plain = random_drafter(config(), seed=5)
    scaled = random_drafter(config({"input_embedding_scale": 2.5}), seed=5)
    assert scaled.cfg.input_embedding_scale == 2.5
    torch.manual_seed(6)
    features, block = torch.randn(2, 8, 32), torch.randn(4, 32)
    torch.testing.assert_close(run_block(scaled, features, 6, block), run_block(plain, features, 6, 2.5 * block))
    assert not torch.allclose(run_block(scaled, features, 6, block), run_block(plain, features, 6, block))


# ----------------------------------------------------------------------------------------------
# Refused by name


@pytest.mark.parametrize("dflash,top,name", [
    ({}, {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ({}, {"draft_vocab_size": 32000}, "draft_vocab_size 32000 != vocab_size"),
    ({}, {"rope_theta": None, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25}},
     "rope_parameters.partial_rotary_factor"),
    ({"use_swa": True}, {}, "dflash_config.use_swa is true but the config has no layer_types"),
    ({}, {"use_swa": True}, "use_swa is true but the config has no layer_types"),
    ({"use_swa": True}, {"layer_types": ["full_attention"] * 2}, "dflash_config.use_swa is true but layer_types has no"),
    ({"attention_sink_bias": True}, {}, "dflash_config.attention_sink_bias"),
    ({}, {"attention_sink_bias": True}, "attention_sink_bias = true"),
    ({}, {"add_swa_attention_sink_bias": True}, "add_swa_attention_sink_bias"),
    ({}, {"architectures": ["DFlash2DraftModel"]}, "a DFlash2DraftModel needs dflash_config.conv_kernel_size"),
    ({}, {"architectures": ["DominoDraftModel"]}, r"read here are DFlashDraftModel \(DFlash\), DFlash2DraftModel \(DFlash2\), Qwen3DSparkModel \(DSpark\), "
     r".*DSparkDraftModel \(DSpark\); not read: .*Domino"),
    ({}, {"architectures": ["DFlashDraftModel", "DFlash2DraftModel"]}, "not read"),
    ({}, {"architectures": ["Qwen3ForCausalLM"]}, r"architectures \['Qwen3ForCausalLM'\]"),
    ({"conv_kernel_size": 2}, {}, "dflash_config.conv_kernel_size configures DFlash2's convolutions, but the "
                                  "architecture is DFlashDraftModel"),
    ({}, {"selector_rank": 256}, "selector_rank configures DFlash2's candidate selector"),
    ({"gru_hidden_dim": 64}, {}, "dflash_config.gru_hidden_dim"),
    ({}, {"swa_rope_theta": 1e4}, "swa_rope_theta"),
    ({"projector_type": "domino"}, {}, "dflash_config.projector_type"),
    ({"pure_draft_prefix_len": 2}, {}, "dflash_config.pure_draft_prefix_len"),
    ({"shift_label": True}, {}, "dflash_config.shift_label"),
    ({"sample_from_anchor": False}, {}, r"unknown dflash_config keys \['sample_from_anchor'\]"),
    ({}, {"hidden_act": "gelu"}, "hidden_act 'gelu'"),
    ({}, {"quantization_config": {"quant_method": "fp8"}}, "quantization_config"),
    ({}, {"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}, "rope_theta 10000.0 and rope_parameters.rope_theta"),
    ({}, {"rope_scaling": {"rope_type": "yarn", "factor": 2.0}, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}},
     r"rope_scaling and rope_parameters differ in \['factor'\]"),
    ({"output_multiplier": -1.0}, {}, "dflash_config.output_multiplier"),
    ({"input_embedding_scale": "x"}, {}, "dflash_config.input_embedding_scale"),
    ({"swa_window_size": 0}, {"layer_types": SLIDING_FULL}, "dflash_config.swa_window_size"),
    ({}, {"is_causal": "yes"}, "is_causal must be true, false or null"),
    ({"causal": 1}, {}, "dflash_config.causal must be true, false or null"),
    ({}, {"block_size": True}, "block_size must be an integer"),
])
def test_fields_refused_by_name(dflash, top, name):
    raw = config(dflash)
    for key, value in top.items():
        raw[key] = value
    with pytest.raises(DrafterError, match=name) as error:
        DrafterConfig.from_dict(raw, source="ckpt/config.json")
    assert str(error.value).startswith("ckpt/config.json: ")


@pytest.mark.parametrize("dflash,top", [
    ({"output_multiplier": 0.2, "final_logit_softcapping": 20.0}, {}),  # monotonic: greedy drafts unchanged
    ({"attention_sink_bias": False, "projector_type": None, "pure_draft_prefix_len": 0, "shift_label": False}, {}),
    ({}, {"partial_rotary_factor": 1.0, "attention_sink_bias": False, "max_window_layers": 5}),
    ({}, {"rope_theta": None, "rope_parameters": {"rope_type": "default", "rope_theta": 1e6, "mrope_section": [1, 1, 2]}}),
    ({}, {"vocab_size": 64, "draft_vocab_size": 64}),  # SpecForge writes it into every export
    ({}, {"model_type": "qwen3", "auto_map": {"AutoModel": "dflash.DFlashDraftModel"}, "torch_dtype": "bfloat16",
          "tie_word_embeddings": True, "eos_token_id": 2, "step": 100, "transformers_version": "5.8.1"}),
])
def test_fields_that_do_not_change_the_result_are_accepted_quietly(dflash, top):
    raw = config(dflash)
    raw.update(top)
    quietly(raw)


def test_unknown_top_level_fields_are_warned_about():
    with pytest.warns(DrafterConfigWarning, match=r"fields not read by dflash-eval: \['anchor_schedule'\]"):
        DrafterConfig.from_dict(config(anchor_schedule="cosine"))


# ----------------------------------------------------------------------------------------------
# The documented table (docs/drafter-config.md)


def test_the_docs_list_every_config_field():
    page = (Path(__file__).parents[1] / "docs" / "drafter-config.md").read_text()
    section = re.search(r"^## Drafter config fields\n(.*?)(?=^## )", page, re.S | re.M)
    assert section, "docs/drafter-config.md has no '## Drafter config fields' section"
    names = {*READ_FIELDS, *dflash_fields(), *SWITCHES, *EXTRA_MODULE_FIELDS, *IGNORED_FIELDS}
    missing = sorted(n for n in names if f"`{n}`" not in section.group(1) and f"`dflash_config.{n}`" not in section.group(1))
    assert not missing, f"docs/drafter-config.md 'Drafter config fields' does not list {missing}"
