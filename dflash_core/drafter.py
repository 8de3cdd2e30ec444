"""The DFlash drafter: a small block-diffusion model conditioned on the target's hidden states.

Read top to bottom: config, norm, attention, MLP, decoder layer, drafter, loading.

One forward drafts a whole block of B tokens: the block is [bonus token, MASK x (B-1)] at absolute
positions start .. start+B-1, and block position k predicts token start+k (no shift). Queries come
from the block only; keys/values are projections of [context ; block], where the context is
hidden_norm(fc(concat(target features))) of every token before `start`. The context keys/values do
not depend on the block, so `context_kv` computes them once per sequence and every block reuses them.

Parameter names equal the checkpoint's keys (fc.weight, layers.N.self_attn.q_proj.weight, ...).
There is no embedding and no lm_head: the target's are used (see token_head.py).
"""

import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers import Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

# How sliding-window layers treat the block. "causal": block position k sees block positions <= k and
# a window over context + block, as SGLang, vLLM and the SpecForge training mask do (the default).
# "non_causal": the whole block is visible, as the z-lab transformers reference did.
SLIDING_SEMANTICS = ("causal", "non_causal")


class DrafterError(ValueError):
    """A drafter checkpoint that cannot be used as it is; the message says what to fix."""


# ----------------------------------------------------------------------------------------------
# Config


def fallback_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The layer ids DFlash training uses when a config names none: evenly from 1 to n_target - 3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    span = end - start
    return [int(round(start + i * span / (num_draft_layers - 1))) for i in range(num_draft_layers)]


@dataclass(frozen=True)
class DrafterConfig:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    attention_bias: bool
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    layer_ids_from_fallback: bool  # True when the config named no target_layer_ids (often wrong: warned)
    num_target_layers: int | None
    vocab_size: int | None
    layer_types: tuple[str, ...]  # "full_attention" | "sliding_attention" per layer
    sliding_window: int | None
    rope: Qwen3Config  # only its rope fields are used, through transformers' rope utilities
    raw: dict = field(compare=False, repr=False)  # config.json as read, written back by save_drafter

    @classmethod
    def from_dict(cls, raw: dict, source: str = "config.json", mask_token_id: int | None = None) -> "DrafterConfig":
        """Validate a drafter config.json (a Qwen3 config with DFlash fields); `source` names it in errors."""

        def need(key, kind=int, where=raw):
            if key not in where:
                raise DrafterError(f"{source}: missing required field '{key}'")
            value = where[key]
            if kind is int and (isinstance(value, bool) or not isinstance(value, int)):
                raise DrafterError(f"{source}: field '{key}' must be an integer, got {value!r}")
            return value

        dflash = raw.get("dflash_config") or {}
        if not isinstance(dflash, dict):
            raise DrafterError(f"{source}: 'dflash_config' must be an object, got {type(dflash).__name__}")
        hidden = need("hidden_size")
        num_layers = need("num_hidden_layers")
        num_heads = need("num_attention_heads")
        num_kv_heads = raw.get("num_key_value_heads", num_heads)
        head_dim = raw.get("head_dim") or hidden // num_heads
        if num_heads % num_kv_heads:
            raise DrafterError(f"{source}: num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
        block_size = dflash.get("block_size", raw.get("block_size"))
        if not isinstance(block_size, int) or block_size < 2:
            raise DrafterError(f"{source}: block_size must be an integer >= 2, got {block_size!r}")

        if mask_token_id is None:
            mask_token_id = dflash.get("mask_token_id", raw.get("mask_token_id"))
        if not isinstance(mask_token_id, int) or mask_token_id < 0:
            raise DrafterError(
                f"{source}: no valid dflash_config.mask_token_id (got {mask_token_id!r}); older checkpoints used a "
                "'<|MASK|>' token added to the tokenizer: pass its id explicitly (mask_token_id=...)"
            )

        num_target_layers = raw.get("num_target_layers")
        layer_ids = dflash.get("target_layer_ids", raw.get("target_layer_ids"))
        from_fallback = layer_ids is None
        if from_fallback:
            if not isinstance(num_target_layers, int):
                raise DrafterError(f"{source}: neither dflash_config.target_layer_ids nor num_target_layers is set")
            layer_ids = fallback_layer_ids(num_target_layers, num_layers)
            warnings.warn(
                f"{source} names no dflash_config.target_layer_ids; using the training fallback {layer_ids} "
                f"for {num_target_layers} target layers. It differs from the trained ids in most published "
                "checkpoints: check it against the training config.",
                stacklevel=2,
            )
        if not layer_ids or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in layer_ids):
            raise DrafterError(f"{source}: target_layer_ids must be a non-empty list of layer indices >= 0, got {layer_ids!r}")

        layer_types = raw.get("layer_types") or ["full_attention"] * num_layers
        if len(layer_types) != num_layers or not set(layer_types) <= {"full_attention", "sliding_attention"}:
            raise DrafterError(
                f"{source}: layer_types must list 'full_attention'/'sliding_attention' once per layer "
                f"({num_layers}), got {layer_types!r}"
            )
        sliding_window = raw.get("sliding_window")
        if "sliding_attention" in layer_types and not (isinstance(sliding_window, int) and sliding_window > 0):
            raise DrafterError(f"{source}: sliding layers need a positive sliding_window, got {sliding_window!r}")

        rope_fields = {k: raw[k] for k in ("rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings") if raw.get(k) is not None}
        try:
            rope = Qwen3Config(hidden_size=hidden, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                               head_dim=head_dim, num_hidden_layers=num_layers, **rope_fields)
        except Exception as e:  # transformers validates rope types and their parameters
            raise DrafterError(f"{source}: invalid rope settings {rope_fields}: {e}") from e
        rope_type = rope.rope_parameters.get("rope_type", "default")
        if rope_type != "default" and rope_type not in ROPE_INIT_FUNCTIONS:
            raise DrafterError(f"{source}: invalid rope settings {rope_fields}: unknown rope_type {rope_type!r} "
                               f"(known: default, {', '.join(sorted(ROPE_INIT_FUNCTIONS))})")

        return cls(
            hidden_size=hidden, num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, intermediate_size=need("intermediate_size"),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)), attention_bias=bool(raw.get("attention_bias", False)),
            block_size=block_size, mask_token_id=mask_token_id, target_layer_ids=tuple(layer_ids),
            layer_ids_from_fallback=from_fallback, num_target_layers=num_target_layers,
            vocab_size=raw.get("vocab_size"), layer_types=tuple(layer_types),
            sliding_window=sliding_window if "sliding_attention" in layer_types else None, rope=rope, raw=raw,
        )


# ----------------------------------------------------------------------------------------------
# Modules


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        # computed in float32 like Qwen3RMSNorm, so bf16 drafters match the reference numerics
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate(x, cos, sin):
    """Apply RoPE; x [..., T, D], cos/sin broadcastable to it."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def keys_values(self, x, cos, sin):
        """x [N, T, H] -> k, v [N, n_kv, T, hd] with k_norm and RoPE applied."""
        N, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(N, T, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(N, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return rotate(k, cos[:, None], sin[:, None]), v

    def forward(self, x, cos, sin, context_k, context_v, mask):
        """x [N, B, H] block; context_k/v [N, n_kv, S, hd]; mask [N, 1, B, S+B] (True = may attend)."""
        N, B, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(N, B, self.num_heads, self.head_dim)).transpose(1, 2)
        q = rotate(q, cos[:, None], sin[:, None])
        k, v = self.keys_values(x, cos, sin)
        k = torch.cat([context_k, k], dim=2)  # [N, n_kv, S+B, hd]
        v = torch.cat([context_v, v], dim=2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(y.transpose(1, 2).reshape(N, B, -1))


class MLP(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, context_k, context_v, mask):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, context_k, context_v, mask)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x


# ----------------------------------------------------------------------------------------------
# The drafter


class DFlashDrafter(nn.Module):
    def __init__(self, cfg: DrafterConfig, sliding_semantics: str = "causal"):
        super().__init__()
        if sliding_semantics not in SLIDING_SEMANTICS:
            raise ValueError(f"sliding_semantics must be one of {SLIDING_SEMANTICS}, got {sliding_semantics!r}")
        self.cfg = cfg
        self.sliding_semantics = sliding_semantics
        n_ids = len(cfg.target_layer_ids)
        self.fc = nn.Linear(n_ids * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.layers = nn.ModuleList([DecoderLayer(cfg) for _ in range(cfg.num_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary = Qwen3RotaryEmbedding(cfg.rope)  # transformers' rope (default, yarn, llama3, ...)

    @property
    def block_size(self) -> int:
        return self.cfg.block_size

    @property
    def mask_token_id(self) -> int:
        return self.cfg.mask_token_id

    @property
    def target_layer_ids(self) -> list[int]:
        return list(self.cfg.target_layer_ids)

    @property
    def dtype(self) -> torch.dtype:
        return self.fc.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    def rope(self, positions):
        """positions [N, T] -> cos, sin [N, T, hd] in the drafter's dtype."""
        return self.rotary(self.fc.weight, positions)

    def context_kv(self, features: torch.Tensor, start_position: int = 0):
        """Per-layer context keys/values of one sequence, or of a batch of equally long ones.

        features [K, T, H] (or [N, K, T, H]): the target's features of the K layers in
        target_layer_ids order, for the tokens at positions start_position .. start_position+T-1.
        Returns a list (one per layer) of (k, v), each [n_kv, T, hd] (or [N, n_kv, T, hd]). They
        depend only on the features, so they are computed once per sequence (or appended to, token
        by token, in the online loop).
        """
        single = features.dim() == 3
        if single:
            features = features[None]
        N, K, T, H = features.shape
        if K != len(self.cfg.target_layer_ids) or H != self.cfg.hidden_size:
            raise ValueError(
                f"features have shape [layers={K}, tokens={T}, hidden={H}]; this drafter needs "
                f"{len(self.cfg.target_layer_ids)} layers {list(self.cfg.target_layer_ids)} of hidden size {self.cfg.hidden_size}"
            )
        x = features.to(device=self.device, dtype=self.dtype).permute(0, 2, 1, 3).reshape(N, T, K * H)
        ctx = self.hidden_norm(self.fc(x))  # [N, T, H]
        positions = torch.arange(start_position, start_position + T, device=self.device)[None]
        cos, sin = self.rope(positions)
        out = []
        for layer in self.layers:
            k, v = layer.self_attn.keys_values(ctx, cos, sin)
            out.append((k[0], v[0]) if single else (k, v))
        return out

    def attention_masks(self, starts: torch.Tensor, context_len: int):
        """Boolean masks [N, 1, B, S+B] for full and sliding layers (True = may attend).

        starts [N]: each block's first position; every block sees the context positions < its start.
        """
        B, S = self.cfg.block_size, context_len
        q_pos = starts[:, None] + torch.arange(B, device=starts.device)  # [N, B]
        ctx_pos = torch.arange(S, device=starts.device)
        ctx_visible = ctx_pos[None, None, :] < starts[:, None, None]  # [N, 1, S]
        full = torch.cat([ctx_visible.expand(-1, B, -1), torch.ones(len(starts), B, B, dtype=torch.bool, device=starts.device)], dim=2)
        masks = {"full_attention": full[:, None]}
        if self.cfg.sliding_window is not None:
            window = self.cfg.sliding_window
            k_pos = torch.cat([ctx_pos.expand(len(starts), S), q_pos], dim=1)  # [N, S+B]
            distance = q_pos[:, :, None] - k_pos[:, None, :]  # [N, B, S+B], query minus key position
            sliding = full & (distance < window)
            block = torch.arange(S + B, device=starts.device) >= S
            if self.sliding_semantics == "causal":
                sliding = sliding & ~(block & (distance < 0))
            else:
                sliding = sliding & ~(block & (-distance >= window))
            masks["sliding_attention"] = sliding[:, None]
        return masks

    def forward(self, block_embeds: torch.Tensor, starts: torch.Tensor, context: list) -> torch.Tensor:
        """Draft N blocks at once.

        block_embeds [N, B, H]: target embeddings of [bonus token, MASK x (B-1)] for each block.
        starts [N]: absolute position of each block's first token.
        context: per layer (k, v), each [N, n_kv, S, hd], context keys/values padded to S >= max(starts);
        positions >= a block's start are masked out for it.
        Returns the final-normed hidden states [N, B, H]; position k predicts token start+k.
        """
        N, B, _ = block_embeds.shape
        positions = starts[:, None] + torch.arange(B, device=starts.device)
        cos, sin = self.rope(positions)
        masks = self.attention_masks(starts, context[0][0].shape[2])
        x = block_embeds.to(self.dtype)
        for layer, layer_type, (k, v) in zip(self.layers, self.cfg.layer_types, context):
            x = layer(x, cos, sin, k, v, masks[layer_type])
        return self.norm(x)


    def forward_in_sequence(self, block_embeds: torch.Tensor, starts: torch.Tensor, context: list) -> torch.Tensor:
        """Draft N blocks of ONE sequence: context is that sequence's context_kv (per layer (k, v),
        each [n_kv, T, hd]), shared by every block without copies."""
        N, S = block_embeds.shape[0], int(starts.max())
        shared = [(k[None, :, :S].expand(N, -1, -1, -1), v[None, :, :S].expand(N, -1, -1, -1)) for k, v in context]
        return self(block_embeds, starts, shared)


# ----------------------------------------------------------------------------------------------
# Loading


def _checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise DrafterError(f"{index}: not a safetensors index ({e})") from e
        files = sorted({path / name for name in weight_map.values()})
        missing = [str(f) for f in files if not f.exists()]
        if missing:
            raise DrafterError(f"{index} names shard files that do not exist: {missing}")
        return files
    single = path / "model.safetensors"
    if single.exists():
        return [single]
    raise DrafterError(f"{path}: no model.safetensors or model.safetensors.index.json")


def read_drafter_config(path: str | Path, mask_token_id: int | None = None) -> DrafterConfig:
    """Parse and validate `path/config.json` of a DFlash drafter checkpoint."""
    config_file = Path(path) / "config.json"
    if not config_file.exists():
        raise DrafterError(f"{config_file} does not exist: a drafter checkpoint needs config.json and model.safetensors")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise DrafterError(f"{config_file}: malformed JSON at line {e.lineno} column {e.colno}: {e.msg}") from e
    if not isinstance(raw, dict):
        raise DrafterError(f"{config_file}: expected a JSON object")
    return DrafterConfig.from_dict(raw, source=str(config_file), mask_token_id=mask_token_id)


def load_drafter(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    sliding_semantics: str = "causal",
    mask_token_id: int | None = None,
) -> DFlashDrafter:
    """Load a DFlash drafter checkpoint (config.json + model.safetensors or a sharded index).

    Every weight must be present with the shape the config implies, and no unexpected weight may be
    present (a different architecture under the same name must not load silently).
    """
    path = Path(path)
    cfg = read_drafter_config(path, mask_token_id=mask_token_id)
    with torch.device("meta"):
        model = DFlashDrafter(cfg, sliding_semantics)
    expected = {name: p.shape for name, p in model.named_parameters()}
    state = {}
    for file in _checkpoint_files(path):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    state[name] = f.get_tensor(name)
        except Exception as e:
            raise DrafterError(f"{file}: cannot read safetensors ({e}); re-fetch the checkpoint") from e
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise DrafterError(
            f"{path}: weights do not match a DFlash drafter with {cfg.num_layers} layers: "
            f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}"
        )
    for name, shape in expected.items():
        if state[name].shape != shape:
            hint = ""
            if name == "fc.weight" and state[name].shape[0] == shape[0] and state[name].shape[1] % cfg.hidden_size == 0:
                hint = (f" (it takes {state[name].shape[1] // cfg.hidden_size} target layers; the config names "
                        f"{len(cfg.target_layer_ids)}: {list(cfg.target_layer_ids)})")
            raise DrafterError(f"{path}: weight {name} has shape {list(state[name].shape)}, expected {list(shape)}{hint}")
    model = model.to_empty(device=device)
    model.load_state_dict(state, strict=True)
    model = model.to(dtype=dtype)
    # rope frequencies stay float32 (a bf16 cast would blur them); they were on the meta device anyway
    model.rotary = Qwen3RotaryEmbedding(cfg.rope).to(device)
    return model.eval()


def save_drafter(drafter: DFlashDrafter, path: str | Path) -> None:
    """Write a drafter in the published format: config.json + model.safetensors."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(drafter.cfg.raw, indent=2, sort_keys=True))
    save_file({k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}, str(path / "model.safetensors"))


def check_compatible(
    drafter: "DFlashDrafter | DrafterConfig", hidden_size: int, vocab_size: int, num_layers: int | None = None
) -> None:
    """Refuse a drafter (loaded, or just its config) that cannot run on a target of this shape, naming
    the mismatch. num_layers=None skips the layer-id checks (the features at hand already fix the layers)."""
    cfg = drafter.cfg if isinstance(drafter, DFlashDrafter) else drafter
    if cfg.hidden_size != hidden_size:
        raise DrafterError(f"drafter hidden_size {cfg.hidden_size} != target hidden_size {hidden_size}: this drafter was trained for another target")
    if not 0 <= cfg.mask_token_id < vocab_size:
        raise DrafterError(f"drafter mask_token_id {cfg.mask_token_id} is outside the target's vocabulary of {vocab_size} tokens")
    if cfg.vocab_size is not None and cfg.vocab_size != vocab_size:
        warnings.warn(f"drafter config vocab_size {cfg.vocab_size} != target vocab_size {vocab_size}", stacklevel=2)
    if num_layers is None:
        return
    bad = [i for i in cfg.target_layer_ids if i >= num_layers]
    if bad:
        raise DrafterError(f"drafter target_layer_ids {list(cfg.target_layer_ids)} include {bad}, but the target has only {num_layers} layers (0..{num_layers - 1})")
    if cfg.num_target_layers is not None and cfg.num_target_layers != num_layers:
        warnings.warn(f"drafter num_target_layers {cfg.num_target_layers} != target layers {num_layers}", stacklevel=2)
