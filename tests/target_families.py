"""The target family matrix: one tiny random target of each family that published DFlash-family drafters serve,
built from its own transformers config and saved as its published checkpoints are (wrappers and towers included).

Every model is small: 64 tokens, hidden size 64, 4 decoder layers (its drafter reads layers 1 and 2; layer 3, the
last, is the one a tap is refused on), MoE blocks of 4 experts choosing 2, towers of one block. The wrappers' image,
audio and video marker ids lie outside the vocabulary (MARKER_IDS): a random target would generate them, and a
wrapper treats a marker in the text as a place for an image, not as the token the text model embeds. Each family's weights are drawn
with its own spread (`init_range`): where its greedy continuations neither repeat one token nor look like noise,
so its drafter learns something and its steps take every length.

Adding a family: one `Family(...)` in FAMILIES. tests/golden/make_families.py builds it, trains its tiny drafter on
its greedy continuations and stores both under tests/golden/families/<name>/; tests/golden/make_families_golden.py
records z-lab's loop on them; tests/test_target_families.py checks the replay, the online loop and the flow against
that record.
"""

import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import PreTrainedModel

VOCAB_SIZE = 64
HIDDEN = 64
LAYERS = 4
EOS = 1
PROMPT_IDS = range(2, 56)  # the ids a prompt is drawn from: 0 pads, 1 is eos, 63 is the drafters' mask token
MASK_TOKEN_ID = 63
MARKER_IDS = dict(zip(("image", "video", "start", "end", "audio", "audio_start", "audio_end"), range(VOCAB_SIZE, 80)))
_TEXT = dict(vocab_size=VOCAB_SIZE, hidden_size=HIDDEN, num_hidden_layers=LAYERS, max_position_embeddings=256,
             eos_token_id=EOS, bos_token_id=None, pad_token_id=0)
_HEADS = dict(num_attention_heads=4, num_key_value_heads=2, head_dim=16)


@dataclass(frozen=True)
class Family:
    """One target family of the matrix."""

    name: str  # its folder under tests/golden/families/
    architecture: str  # what its config.json's `architectures` says
    serves: str  # the published drafters for targets of this family
    build: Callable[[float], PreTrainedModel]  # a freshly initialised model with weights of this spread
    init_range: float
    input_embedding_scale: float = 1.0  # what its drafter multiplies the raw embedding by (Gemma: sqrt(hidden))


def _gpt_oss(init: float) -> PreTrainedModel:
    from transformers import GptOssConfig, GptOssForCausalLM

    # gpt-oss's YaRN rope (factor 32 over an original context of 8 here, 4096 in the published models)
    rope = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "truncate": False, "original_max_position_embeddings": 8}
    return GptOssForCausalLM(GptOssConfig(
        **_TEXT, **_HEADS, initializer_range=init, intermediate_size=64, sliding_window=4, num_local_experts=4,
        num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"] * 2, rope_parameters=rope))


def _gemma4(init: float, audio: bool = False, **text) -> PreTrainedModel:
    from transformers import Gemma4Config, Gemma4ForConditionalGeneration

    text_config = dict(_TEXT, **_HEADS, initializer_range=init, intermediate_size=128, global_head_dim=32,
                       sliding_window=4, layer_types=["sliding_attention", "full_attention"] * 2,
                       final_logit_softcapping=30.0, vocab_size_per_layer_input=VOCAB_SIZE, **text)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, patch_size=4, position_embedding_size=64, pooling_kernel_size=2)
    audio_config = dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, subsampling_conv_channels=[8, 4],
                        output_proj_dims=32)
    return Gemma4ForConditionalGeneration(Gemma4Config(
        text_config=text_config, vision_config=vision, audio_config=audio_config if audio else None,
        boi_token_id=MARKER_IDS["start"], eoi_token_id=MARKER_IDS["end"], image_token_id=MARKER_IDS["image"],
        video_token_id=MARKER_IDS["video"], boa_token_id=MARKER_IDS["audio_start"],
        eoa_token_index=MARKER_IDS["audio_end"], audio_token_id=MARKER_IDS["audio"], initializer_range=init,
        tie_word_embeddings=True))


def _gemma4_audio(init: float) -> PreTrainedModel:
    # the E-model kind (E2B/E4B): vision and audio towers, per-layer inputs, the last two layers sharing KV
    return _gemma4(init, audio=True, hidden_size_per_layer_input=16, num_kv_shared_layers=2)


def _gemma4_vision(init: float) -> PreTrainedModel:
    # gemma-4-31B-it's kind: a vision tower only
    return _gemma4(init, hidden_size_per_layer_input=0)


def _gemma4_moe(init: float) -> PreTrainedModel:
    # gemma-4-26B-A4B-it's kind: an MoE block beside the dense MLP of every layer
    return _gemma4(init, hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=4, top_k_experts=2,
                   moe_intermediate_size=32)


def _qwen3_moe(init: float) -> PreTrainedModel:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        **_TEXT, **_HEADS, initializer_range=init, intermediate_size=128, moe_intermediate_size=32, num_experts=4,
        num_experts_per_tok=2, tie_word_embeddings=False))


# Gated DeltaNet layers (Qwen3.5/3.6, Qwen3-Next): 2 key heads, 4 value heads of 16 dims
_LINEAR = dict(linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
               linear_conv_kernel_dim=4, layer_types=["linear_attention", "full_attention"] * 2)
_MOE = dict(moe_intermediate_size=32, shared_expert_intermediate_size=32, num_experts=4, num_experts_per_tok=2)


def _qwen3_5_moe(init: float) -> PreTrainedModel:
    from transformers import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5, "mrope_section": [2, 1, 1],
            "mrope_interleaved": True}
    text = dict(_TEXT, **_HEADS, **_LINEAR, **_MOE, initializer_range=init, rope_parameters=rope)
    vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, patch_size=4, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=HIDDEN, num_position_embeddings=16)
    return Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(
        text_config=text, vision_config=vision, image_token_id=MARKER_IDS["image"], video_token_id=MARKER_IDS["video"],
        vision_start_token_id=MARKER_IDS["start"], vision_end_token_id=MARKER_IDS["end"], tie_word_embeddings=False))


def _qwen3_next(init: float) -> PreTrainedModel:
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    return Qwen3NextForCausalLM(Qwen3NextConfig(
        **_TEXT, **_HEADS, **_LINEAR, **_MOE, initializer_range=init, intermediate_size=128,
        partial_rotary_factor=0.5))


# multi-head latent attention (low-rank q and kv, a separate rope part) and routed + shared experts after one dense layer
_DEEPSEEK = dict(intermediate_size=128, moe_intermediate_size=32, num_attention_heads=4, num_key_value_heads=4,
                 n_shared_experts=1, n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                 first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16,
                 v_head_dim=16, num_mtp_layers=0)


def _deepseek_v3(init: float) -> PreTrainedModel:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    return DeepseekV3ForCausalLM(DeepseekV3Config(**_TEXT, **_DEEPSEEK, initializer_range=init))


def _kimi_k25(init: float) -> PreTrainedModel:
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    text = dict(_TEXT, **_DEEPSEEK, initializer_range=init, model_type="deepseek_v3")
    vision = dict(patch_size=4, pos_emb_height=8, pos_emb_width=8, num_attention_heads=2, num_hidden_layers=1,
                  hidden_size=32, intermediate_size=64)
    return Kimi_K25ForConditionalGeneration(Kimi_K25Config(
        text_config=text, vision_config=vision, projection_hidden_size=32, image_token_id=MARKER_IDS["image"],
        video_token_id=MARKER_IDS["video"], vision_start_token_id=MARKER_IDS["start"],
        vision_end_token_id=MARKER_IDS["end"], tie_word_embeddings=False))


def _minimax_m2(init: float) -> PreTrainedModel:
    from transformers import MiniMaxM2Config, MiniMaxM2ForCausalLM

    return MiniMaxM2ForCausalLM(MiniMaxM2Config(
        **_TEXT, **_HEADS, initializer_range=init, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2))


def _llama3_1(init: float) -> PreTrainedModel:
    from transformers import LlamaConfig, LlamaForCausalLM

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    return LlamaForCausalLM(LlamaConfig(**_TEXT, **_HEADS, initializer_range=init, intermediate_size=128,
                                        rope_parameters=rope, tie_word_embeddings=False))


def _nemotron_h(init: float) -> PreTrainedModel:
    from transformers import NemotronHConfig, NemotronHForCausalLM

    # Mamba-2, attention, Mamba-2 and MoE blocks (its decoder: `embeddings`, `layers`, `norm_f`)
    text = {key: value for key, value in _TEXT.items() if key != "num_hidden_layers"}
    return NemotronHForCausalLM(NemotronHConfig(
        **text, **_HEADS, initializer_range=init, layers_block_type=["mamba", "attention", "mamba", "moe"],
        intermediate_size=128, ssm_state_size=16, mamba_num_heads=4, mamba_head_dim=16, n_groups=1, chunk_size=16,
        n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=32))


GEMMA_SCALE = math.sqrt(HIDDEN)  # Gemma scales its embedding by sqrt(hidden): its drafters' input_embedding_scale
FAMILIES = {f.name: f for f in [
    Family("gpt_oss", "GptOssForCausalLM", "z-lab gpt-oss-20b-DFlash, gpt-oss-120b-DFlash", _gpt_oss, 0.04),
    Family("gemma4_audio", "Gemma4ForConditionalGeneration",
           "Gemma 4 E2B-it/E4B-it (the audio kind; no drafter named yet)", _gemma4_audio, 0.12, GEMMA_SCALE),
    Family("gemma4_vision", "Gemma4ForConditionalGeneration",
           "z-lab gemma-4-31B-it-DFlash; DeepSpec dflash_gemma4_12b_block7, dspark_gemma4_12b_block7", _gemma4_vision,
           0.08, GEMMA_SCALE),
    Family("gemma4_moe", "Gemma4ForConditionalGeneration", "z-lab gemma-4-26B-A4B-it-DFlash", _gemma4_moe, 0.08,
           GEMMA_SCALE),
    Family("qwen3_moe", "Qwen3MoeForCausalLM", "z-lab Qwen3-Coder-30B-A3B-DFlash", _qwen3_moe, 0.04),
    Family("qwen3_5_moe", "Qwen3_5MoeForConditionalGeneration",
           "z-lab Qwen3.6-35B-A3B-DFlash, Qwen3.5-35B-A3B-DFlash", _qwen3_5_moe, 0.02),
    Family("qwen3_next", "Qwen3NextForCausalLM", "z-lab Qwen3-Coder-Next-DFlash", _qwen3_next, 0.02),
    Family("deepseek_v3", "DeepseekV3ForCausalLM", "Kimi-K2.5's language model as a text-only target (MLA + MoE)",
           _deepseek_v3, 0.04),
    Family("kimi_k25", "Kimi_K25ForConditionalGeneration", "z-lab Kimi-K2.5-DFlash, Kimi-K2.6-DFlash", _kimi_k25, 0.04),
    Family("minimax_m2", "MiniMaxM2ForCausalLM", "z-lab MiniMax-M2.5-DFlash, MiniMax-M2.7-DFlash", _minimax_m2, 0.12),
    Family("llama3_1", "LlamaForCausalLM", "z-lab LLaMA3.1-8B-Instruct-DFlash-UltraChat", _llama3_1, 0.08),
    Family("nemotron_h", "NemotronHForCausalLM", "NVIDIA's Nemotron-3-Nano DFlash recipe", _nemotron_h, 0.25),
]}


def build_target(family: Family, path, seed: int = 0) -> Path:
    """Build `family`'s tiny target (seeded, float32) and save it into `path` as its published checkpoints are saved."""
    torch.manual_seed(seed)
    model = family.build(family.init_range).eval()
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    return path
