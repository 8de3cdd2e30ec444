"""The Gemma 4 backbone: DeepSpec's `Gemma4DSparkModel` (github deepseek-ai/DeepSpec, deepspec/modeling/dspark/gemma4,
on transformers 5.10.2's Gemma 4 modules, which it pins), the block-diffusion backbone drafter.py runs for the Qwen3
style, with Gemma 4's pieces. drafter.py picks it by the config's architecture (DrafterConfig.backbone); its config
is the target's Gemma 4 text config with DSpark's fields added (DeepSpec's build_draft_config), read here.

What differs from the Qwen3-style backbone (drafter.py), each as DeepSpec computes it:

- every layer is a full-attention layer of Gemma 4's global shape: heads of `global_head_dim`, and with
  `attention_k_eq_v` `num_global_key_value_heads` key heads whose raw projection is also the value (no v_proj), else
  `num_key_value_heads` with their own v_proj; q_norm and k_norm are Gemma 4's RMSNorm, v_norm an RMSNorm without a
  weight; the scores are not scaled (scaling 1.0: the norms set the scale);
- RoPE is Gemma 4's for full attention (rope_parameters.full_attention): `proportional` rotates the first
  partial_rotary_factor of each head's frequency pairs (the others get frequency 0: cos 1, sin 0), over the whole
  head dimension; `default` rotates every pair of a head of `head_dim` (which must then be global_head_dim);
- Gemma 4's RMSNorm: x * (mean(x^2) + eps)^-0.5 (torch.pow, as transformers computes it) times its weight (not
  1 + weight), in float32;
- four norms per layer: input, post-attention (on the attention's output, before the residual add),
  pre-feedforward, post-feedforward (on the MLP's output), and the layer's output times its `layer_scalar` buffer
  (saved with the weights);
- the MLP is GeGLU with tanh-approximated GELU (`hidden_activation` gelu_pytorch_tanh); transformers 5.10.2 doubles
  its width (`use_double_wide_mlp`) in the layers at or past num_hidden_layers - num_kv_shared_layers when that is
  above 0 (the drafter's layer count, the target's num_kv_shared_layers: DeepSpec copies it);
- the block's token embeddings are scaled by sqrt(hidden_size), rounded to the compute dtype first
  (Gemma4TextScaledWordEmbedding); the logits are softcapped by final_logit_softcapping (DFlashDrafter.logits).

Refused, each in one line naming its field, as DeepSpec's own model refuses them: the MoE block (enable_moe_block) and
per-layer inputs (hidden_size_per_layer_input > 0).

Shapes in comments: N blocks, B block size, T tokens, S context length, H hidden size, n_heads / n_kv query /
key-value heads, hd head dim (global_head_dim).
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, NoReturn, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from .config_values import boolean_problem, integer_problem, number_problem, shown


class ConfigShape(Protocol):
    """What the backbone is built from: a DrafterConfig's (drafter_config.py, which reads this module's fields:
    the config is typed by what it holds here, so the two modules do not import each other)."""

    @property
    def hidden_size(self) -> int: ...

    @property
    def num_heads(self) -> int: ...

    @property
    def num_kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...

    @property
    def rms_norm_eps(self) -> float: ...

    @property
    def attention_bias(self) -> bool: ...

    @property
    def backbone_fields(self) -> Mapping[str, Any]: ...

    @property
    def generation(self) -> Any: ...  # its generation (dflash_core.generations), checked for sublayer wrappers


NAME = "gemma4"
ARCHITECTURES = ("Gemma4DSparkModel",)  # config.json's `architectures` whose backbone this is
ACTIVATIONS = ("gelu_pytorch_tanh",)  # what Gemma 4 configs give (transformers' GELUTanh: F.gelu, approximate="tanh")
ROPE_TYPES = ("proportional", "default")  # full attention's rope types read here

# Gemma 4 text-config fields read here (beside the ones every drafter config has: drafter_config.READ_FIELDS)
FIELDS = ("global_head_dim", "num_global_key_value_heads", "attention_k_eq_v", "hidden_activation",
          "use_double_wide_mlp", "num_kv_shared_layers", "enable_moe_block", "hidden_size_per_layer_input",
          "target_model_type", "target_text_model_type")
# ... and those that do not change the drafted tokens, and why
IGNORED_FIELDS = {
    "vocab_size_per_layer_input": "per-layer inputs' vocabulary (refused: hidden_size_per_layer_input > 0)",
    "num_experts": "the MoE block's (refused: enable_moe_block)",
    "top_k_experts": "the MoE block's (refused: enable_moe_block)",
    "moe_intermediate_size": "the MoE block's (refused: enable_moe_block)",
    "use_bidirectional_attention": "the target's attention; DeepSpec's drafter sees the whole block whatever it says",
}


class Fields(Protocol):
    """The config reader drafter_config gives (its _Fields)."""

    raw: dict[str, Any]

    def fail(self, message: str) -> NoReturn: ...

    def number(self, key: str, value: Any, zero_allowed: bool = False, meaning: str = "") -> float | None: ...


@dataclass(frozen=True)
class Gemma4Shape:
    """What a Gemma4DSparkModel config says beyond the shapes every drafter config has."""

    k_eq_v: bool  # the value is the raw key projection (no v_proj)
    intermediate_sizes: tuple[int, ...]  # the MLP's width per layer (doubled in transformers' double-wide layers)
    rope_type: str  # ROPE_TYPES
    rope_theta: float
    partial_rotary_factor: float  # (proportional) the share of each head's frequency pairs rotated
    rope_factor: float  # (proportional) the frequencies divided by it
    embed_scale: float  # sqrt(hidden_size): the block's token embeddings are multiplied by it (rounded to the dtype)


def shape_of(cfg: ConfigShape) -> Gemma4Shape:
    """A Gemma 4 drafter config's Gemma4Shape (DrafterConfig.backbone_fields)."""
    return cfg.backbone_fields["gemma4"]


def read(fields: Fields, hidden_size: int, num_layers: int) -> dict[str, Any]:
    """A Gemma4DSparkModel config's own fields, validated (Fields.fail, one line naming the field, otherwise). Returns
    the shapes DrafterConfig takes from them (head_dim, num_kv_heads) and `backbone_fields`."""
    raw = fields.raw

    def integer(key: str, minimum: int, default: Any = None) -> int:
        value = raw.get(key, default)
        if problem := integer_problem(value, minimum):
            fields.fail(f"{key} {problem}")
        return value

    def flag(key: str) -> bool:
        value = raw.get(key)
        if problem := boolean_problem(value):
            fields.fail(f"{key} {problem}")
        return bool(value)

    if flag("enable_moe_block"):
        fields.fail("enable_moe_block = true: Gemma 4's MoE block, which DeepSpec's Gemma4DSparkModel does not build "
                    "(it refuses it: 'does not support Gemma4 MoE blocks yet'); no such drafter exists to score")
    if (per_layer := raw.get("hidden_size_per_layer_input")) not in (None, 0):
        integer("hidden_size_per_layer_input", 0)
        fields.fail(f"hidden_size_per_layer_input = {shown(per_layer)}: Gemma 4's per-layer inputs, which DeepSpec's "
                    "Gemma4DSparkModel does not build (it refuses them: 'does not support per-layer input gates "
                    "yet'); no such drafter exists to score")
    if "global_head_dim" not in raw:
        fields.fail("a Gemma4DSparkModel config needs global_head_dim (its heads' size: DeepSpec's build_draft_config "
                    "copies it from the target's Gemma 4 text config)")
    head_dim = integer("global_head_dim", 1)
    k_eq_v = flag("attention_k_eq_v")
    if k_eq_v and raw.get("num_global_key_value_heads") is not None:
        num_kv_heads = integer("num_global_key_value_heads", 1)
    elif k_eq_v:  # (transformers' default: the key heads of the sliding layers)
        num_kv_heads = integer("num_key_value_heads", 1)
    else:
        num_kv_heads = integer("num_key_value_heads", 1)
    num_heads = raw.get("num_attention_heads")
    if isinstance(num_heads, int) and num_heads % num_kv_heads:
        key = "num_global_key_value_heads" if k_eq_v and raw.get("num_global_key_value_heads") else \
            "num_key_value_heads"
        fields.fail(f"num_attention_heads {num_heads} is not a multiple of {key} {num_kv_heads}")
    activation = raw.get("hidden_activation", "gelu_pytorch_tanh")
    if activation not in ACTIVATIONS:
        fields.fail(f"hidden_activation {shown(activation)}: Gemma 4's MLP computed here is "
                    f"{' or '.join(ACTIVATIONS)} (tanh-approximated GELU)")
    layer_types = raw.get("layer_types")
    if layer_types is not None and (not isinstance(layer_types, list) or set(layer_types) != {"full_attention"}):
        fields.fail(f"layer_types {shown(layer_types)}: every layer of DeepSpec's Gemma4DSparkModel is a "
                    "full-attention layer (its build_draft_config writes 'full_attention' for each)")
    if raw.get("is_causal"):
        fields.fail("is_causal = true: DeepSpec's Gemma4DSparkModel attends to the whole block")

    intermediate = integer("intermediate_size", 1)
    first_shared = num_layers - integer("num_kv_shared_layers", 0, 0)
    double = flag("use_double_wide_mlp")
    # transformers 5.10.2's Gemma4TextMLP (DeepSpec's pin): double-wide in KV-shared layers, `layer >= first > 0`
    sizes = tuple(intermediate * (2 if double and index >= first_shared > 0 else 1) for index in range(num_layers))

    rope = raw.get("rope_parameters")
    settings = rope.get("full_attention") if isinstance(rope, dict) else None
    if not isinstance(settings, dict):
        fields.fail(f"rope_parameters.full_attention must be an object (Gemma 4's RoPE of its full-attention layers, "
                    f"which every layer here is), got rope_parameters {shown(rope)}")
    rope_type = settings.get("rope_type", "default")
    if rope_type not in ROPE_TYPES:
        fields.fail(f"rope_parameters.full_attention.rope_type {shown(rope_type)}: the full-attention RoPE read here "
                    f"is {' or '.join(ROPE_TYPES)}")
    if "rope_theta" not in settings:
        fields.fail("rope_parameters.full_attention needs rope_theta")
    theta = fields.number("rope_parameters.full_attention.rope_theta", settings["rope_theta"], meaning="RoPE's base")
    partial = settings.get("partial_rotary_factor", 1.0)
    factor = settings.get("factor", 1.0)
    if rope_type == "proportional":
        if number_problem(partial) or partial > 1:
            fields.fail(f"rope_parameters.full_attention.partial_rotary_factor must be a number in (0, 1], got "
                        f"{shown(partial)}")
        fields.number("rope_parameters.full_attention.factor", factor, meaning="the frequencies are divided by it")
    else:
        if settings.get("partial_rotary_factor") not in (None, 1, 1.0) or settings.get("factor") not in (None, 1, 1.0):
            fields.fail("rope_parameters.full_attention: a default RoPE takes no partial_rotary_factor or factor "
                        "(transformers' Gemma 4 default RoPE ignores them)")
        if raw.get("head_dim") != head_dim:
            fields.fail(f"rope_parameters.full_attention.rope_type 'default' rotates heads of head_dim "
                        f"{shown(raw.get('head_dim'))} (transformers' Gemma 4 default RoPE), but the heads are of "
                        f"global_head_dim {head_dim}: DeepSpec's model cannot run this config")
    shape = Gemma4Shape(k_eq_v=k_eq_v, intermediate_sizes=sizes, rope_type=rope_type, rope_theta=float(theta or 0),
                        partial_rotary_factor=float(partial), rope_factor=float(factor),
                        embed_scale=float(hidden_size) ** 0.5)
    return {"head_dim": head_dim, "num_kv_heads": num_kv_heads, "backbone_fields": {"gemma4": shape}}


# ----------------------------------------------------------------------------------------------
# The modules (parameter names as DeepSpec saves them)


class RMSNorm(nn.Module):
    """Gemma 4's RMSNorm: x * (mean(x^2) + eps)^-0.5 times the weight (without a weight: with_scale false), in
    float32, cast back."""

    def __init__(self, dim: int, eps: float, with_scale: bool = True):
        super().__init__()
        self.eps = eps
        self.weight: nn.Parameter | None
        self.register_parameter("weight", nn.Parameter(torch.ones(dim)) if with_scale else None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            h = h * self.weight.float()
        return h.type_as(x)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE (Gemma 4's apply_rotary_pos_emb, as drafter.rotate); x [..., T, D], cos/sin broadcastable to it."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class Attention(nn.Module):
    """The block's queries attend to [context ; block] keys/values, not scaled; the value is the raw key projection
    with attention_k_eq_v."""

    def __init__(self, cfg: ConfigShape):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        bias = cfg.attention_bias
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=bias)
        self.v_proj = None if shape_of(cfg).k_eq_v else nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim,
                                                                  bias=bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.v_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, with_scale=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context_k: torch.Tensor,
                context_v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [N, B, H] block; context_k/v [N, n_kv, S, hd]; mask [N, 1, B, S+B] (True = may attend)."""
        N, B, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(N, B, self.num_heads, self.head_dim)).transpose(1, 2)  # [N, n_heads, B, hd]
        q = rotate(q, cos[:, None], sin[:, None])
        k, v = self.keys_values(x, cos, sin)  # [N, n_kv, B, hd]
        k = torch.cat([context_k, k], dim=2)  # [N, n_kv, S+B, hd]
        v = torch.cat([context_v, v], dim=2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=1.0,
                                           enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(y.transpose(1, 2).reshape(N, B, -1))  # [N, B, H]

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, T, H] -> k (k_norm, RoPE), v (v_norm), each [N, n_kv, T, hd]."""
        N, T, _ = x.shape
        k = self.k_proj(x).view(N, T, self.num_kv_heads, self.head_dim)
        v = k if self.v_proj is None else self.v_proj(x).view(N, T, self.num_kv_heads, self.head_dim)
        k = self.k_norm(k).transpose(1, 2)
        v = self.v_norm(v).transpose(1, 2)
        return rotate(k, cos[:, None], sin[:, None]), v


class MLP(nn.Module):
    """GeGLU with tanh-approximated GELU (Gemma4TextMLP)."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Attention and MLP, each between a pre-norm and a post-norm and added to the residual stream; the layer's output
    times its layer_scalar."""

    layer_scalar: torch.Tensor  # [1] (register_buffer below; saved with the weights)

    def __init__(self, cfg: ConfigShape, index: int):
        super().__init__()
        if cfg.generation.sublayer_wrappers(cfg):
            raise ValueError(f"a {cfg.generation.NAME} drafter wraps its layers' sublayers; the Gemma 4 backbone has "
                             "no such wrappers")
        H, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = RMSNorm(H, eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(H, eps)
        self.pre_feedforward_layernorm = RMSNorm(H, eps)
        self.mlp = MLP(H, shape_of(cfg).intermediate_sizes[index])
        self.post_feedforward_layernorm = RMSNorm(H, eps)
        self.register_buffer("layer_scalar", torch.ones(1))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context_k: torch.Tensor,
                context_v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        h = self.self_attn(self.input_layernorm(x), cos, sin, context_k, context_v, mask)
        x = x + self.post_attention_layernorm(h)
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return x * self.layer_scalar


class Rotary(nn.Module):
    """Gemma 4's full-attention RoPE (transformers' Gemma4TextRotaryEmbedding for layer type full_attention, its
    proportional or default frequencies): positions [N, T] -> cos, sin [N, T, hd] in x's dtype."""

    inv_freq: torch.Tensor  # [hd / 2] float32 (register_buffer below)

    def __init__(self, cfg: ConfigShape):
        super().__init__()
        shape, head_dim = shape_of(cfg), cfg.head_dim
        pairs = torch.arange(0, head_dim, 2, dtype=torch.int64).float()  # [hd / 2]: 0, 2, ...
        if shape.rope_type == "proportional":  # the first `rotated` pairs turn, the others keep frequency 0
            rotated = int(shape.partial_rotary_factor * head_dim // 2)
            inv_freq = 1.0 / (shape.rope_theta ** (pairs[:rotated] / head_dim))
            inv_freq = torch.cat([inv_freq, torch.zeros(head_dim // 2 - rotated)]) / shape.rope_factor
        else:
            inv_freq = 1.0 / (shape.rope_theta ** (pairs / head_dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self.inv_freq[None, :, None].float().expand(positions.shape[0], -1, 1)  # [N, hd/2, 1]
        freqs = (inv_freq @ positions[:, None, :].float()).transpose(1, 2)  # [N, T, hd/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


class Gemma4Backbone:
    """The Gemma 4 backbone's pieces, as DFlashDrafter builds them (drafter.Backbone)."""

    NAME = NAME

    def norm(self, cfg: ConfigShape) -> nn.Module:
        return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def layer(self, cfg: ConfigShape, index: int) -> nn.Module:
        return DecoderLayer(cfg, index)

    def rotary(self, cfg: ConfigShape) -> nn.Module:
        return Rotary(cfg)

    def scale_embeddings(self, x: torch.Tensor, cfg: ConfigShape) -> torch.Tensor:
        """x [N, B, H] (rows of the target's embedding matrix) times sqrt(hidden_size) rounded to x's dtype, as
        Gemma4TextScaledWordEmbedding multiplies them."""
        return x * torch.tensor(shape_of(cfg).embed_scale, dtype=torch.float32).to(device=x.device, dtype=x.dtype)

