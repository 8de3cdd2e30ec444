"""Tiny target models built from configs, for tests. Nothing is downloaded.

Each builder seeds torch, builds a randomly initialised model in float32 and
`save_pretrained`s it into `path` (created if needed), then returns `path`.
Vocabularies are 64 tokens and hidden sizes 32..64 so that a forward pass takes
milliseconds on a CPU. The Qwen3 and Qwen3.5 configs are `dflash_eval.tiny.target`'s,
shrunk by `SHRUNK`. `first_prompts` cuts a tiny run's held-out prompts to the few a test needs.
"""

from pathlib import Path

import torch
from transformers import (
    Gemma3Config,
    Gemma3ForConditionalGeneration,
    Gemma3TextConfig,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3ForCausalLM,
    SiglipVisionConfig,
)

from dflash_eval.tiny import target as tiny_target

VOCAB_SIZE = 64
# Larger than the HF default (0.02) so that layers change the residual stream visibly and
# greedy continuations are not one repeated token.
INIT_RANGE = 0.05

# The text shape every tiny model here starts from (GQA: 4 query heads of 16 dims, 2 key/value heads);
# `dflash_eval.tiny.target`'s configs with these overrides train or run in milliseconds.
SHRUNK = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
# The Gated DeltaNet layers of a shrunk Qwen3.5 (2 key heads, 4 value heads, 16 dims each).
SHRUNK_LINEAR = dict(linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4)
_TEXT = dict(SHRUNK, max_position_embeddings=128, initializer_range=INIT_RANGE)
# A one-block Qwen-VL vision tower merging 2x2 patches of 4 pixels into the 64-wide text stream.
_QWEN_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, spatial_merge_size=2,
                    temporal_patch_size=2, out_hidden_size=_TEXT["hidden_size"])
_QWEN_VISION_TOKENS = dict(image_token_id=60, video_token_id=61, vision_start_token_id=62, vision_end_token_id=63)

CORPUS_BYTES = 200_000  # the conftest `corpus` fixture's size (the tiny run's own corpus is larger)
SHORT_PROMPTS = 10  # held-out prompts in the conftest `tiny` fixture's prompt file


def _save(model, path, max_shard_size=None) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(path, **kwargs)
    return path


def qwen3_config(vocab_size: int = VOCAB_SIZE, eos_token_id: int | None = None, **overrides):
    """A Qwen3Config: `dflash_eval.tiny.target.qwen3_config` shrunk: 3 layers, hidden 64, untied lm_head, 128 positions.
    `overrides` replace any field."""
    return tiny_target.qwen3_config(vocab_size, eos_token_id, **{**_TEXT, "num_hidden_layers": 3, **overrides})


def build_qwen3(path, *, max_shard_size=None, seed=0, **overrides) -> Path:
    """Qwen3ForCausalLM, untied embeddings."""
    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(qwen3_config(**overrides)).eval()
    return _save(model, path, max_shard_size)


def build_llama_tied(path, *, max_shard_size=None, seed=0) -> Path:
    """LlamaForCausalLM whose lm_head is tied to the embedding (no lm_head key is saved)."""
    torch.manual_seed(seed)
    config = LlamaConfig(**dict(_TEXT, vocab_size=VOCAB_SIZE, hidden_size=32, intermediate_size=64, head_dim=None,
                                num_hidden_layers=2, max_position_embeddings=64, tie_word_embeddings=True))
    model = LlamaForCausalLM(config).eval()
    return _save(model, path, max_shard_size)


def qwen3_5_text_config():
    """A Qwen3_5TextConfig: `dflash_eval.tiny.target.qwen3_5_text_config` shrunk: Gated DeltaNet (linear attention) and full
    attention layers alternating over 4 layers, hidden 64, 128 positions."""
    # rotary dim = 16 * 0.5 = 8 -> 4 frequencies, split 2/1/1 over the t/h/w mRoPE sections
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1],
            "mrope_interleaved": True}
    return tiny_target.qwen3_5_text_config(VOCAB_SIZE, None, **_TEXT, **SHRUNK_LINEAR, rope_parameters=rope)


def build_qwen3_5_pair(text_path, vlm_path, *, seed=0) -> tuple[Path, Path]:
    """The same hybrid Qwen3.5 text weights saved twice.

    `text_path`: text-only `Qwen3_5ForCausalLM` (keys `model.*`, `lm_head.weight`).
    `vlm_path`: `Qwen3_5ForConditionalGeneration` with a tiny vision tower
    (keys `model.language_model.*`, `model.visual.*`, `lm_head.weight`), like the
    published Qwen3.5/3.6 checkpoints.
    """
    torch.manual_seed(seed)
    text_config = qwen3_5_text_config()
    text_model = Qwen3_5ForCausalLM(text_config).eval()
    config = Qwen3_5Config(text_config=text_config.to_dict(), vision_config=dict(_QWEN_VISION, num_position_embeddings=16),
                           **_QWEN_VISION_TOKENS, tie_word_embeddings=False)
    vlm = Qwen3_5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        vlm.model.language_model.load_state_dict(text_model.model.state_dict())
        vlm.lm_head.weight.copy_(text_model.lm_head.weight)
    return _save(text_model, text_path), _save(vlm, vlm_path)


def build_gemma3_vlm(path, *, max_shard_size=None, seed=0) -> Path:
    """Gemma3ForConditionalGeneration: SigLIP vision tower, projector, sliding-window text
    backbone with a scaled embedding, lm_head tied to the embedding."""
    torch.manual_seed(seed)
    text_config = Gemma3TextConfig(
        **_TEXT,
        vocab_size=VOCAB_SIZE,
        num_hidden_layers=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
        query_pre_attn_scalar=16,
        sliding_window=4,
    )
    vision_config = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                       image_size=16, patch_size=4, vision_use_head=False)
    config = Gemma3Config(
        text_config=text_config,
        vision_config=vision_config,
        mm_tokens_per_image=4,
        boi_token_index=60,
        eoi_token_index=61,
        image_token_index=62,
        initializer_range=INIT_RANGE,
        tie_word_embeddings=True,
    )
    model = Gemma3ForConditionalGeneration(config).eval()
    return _save(model, path, max_shard_size)


def build_qwen2_5_vl(path, *, seed=0) -> Path:
    """Qwen2_5_VLForConditionalGeneration (mRoPE text backbone, untied lm_head)."""
    torch.manual_seed(seed)
    text_config = {key: value for key, value in _TEXT.items() if key != "head_dim"}  # Qwen2.5-VL derives it
    text_config.update(
        vocab_size=VOCAB_SIZE,
        num_hidden_layers=2,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]},
        bos_token_id=0,
        eos_token_id=1,
        tie_word_embeddings=False,
    )
    config = Qwen2_5_VLConfig(
        text_config=text_config,
        vision_config=dict(_QWEN_VISION, window_size=16, fullatt_block_indexes=[0]),
        **_QWEN_VISION_TOKENS,
        tie_word_embeddings=False,
    )
    model = Qwen2_5_VLForConditionalGeneration(config).eval()
    return _save(model, path)


def first_prompts(run, n: int, path) -> Path:
    """Write the first `n` held-out prompts of tiny run `run` to the JSONL file `path`; returns it."""
    path = Path(path)
    path.write_text("".join(run.prompts_file.read_text().splitlines(keepends=True)[:n]))
    return path
