"""The DFlash drafter: a small block-diffusion model conditioned on the target's hidden states, the backbone every
drafter generation shares (dflash_core.generations: DFlash is the backbone alone, DFlash2 adds its modules).

Read top to bottom: norm, attention, MLP, decoder layer, the backbones, the drafter (its forward pass first, then how
it drafts a block), then loading and saving a checkpoint. Its config.json is read and validated in drafter_config.py.
The norms, layers, RoPE and embedding scale above are the Qwen3-style backbone's; DeepSpec's Gemma4DSparkModel runs
Gemma 4's (gemma4_backbone.py), picked by the config's architecture (Backbone, BACKBONES).

One forward drafts a whole block of B tokens: the block is [bonus token, MASK x (B-1)] at absolute
positions start .. start+B-1, and block position k predicts token start+k (no shift). Queries come
from the block only; keys/values are projections of [context ; block], where the context is
hidden_norm(fc(concat(target features))) of every token before `start`. The context keys/values do
not depend on the block, so `context_kv` computes them once per sequence and every block reuses them.

Parameter names equal the checkpoint's keys (fc.weight, layers.N.self_attn.q_proj.weight, ...).
There is no embedding and, but for a speculators save with a reduced vocabulary (its own lm_head over the kept
tokens and their target ids, d2t), no lm_head: the target's are used (see token_head.py).

A generation with a head (DFlash2's candidate selector) chooses each draft given the token drafted before it (the
anchor at block position 1), so a block's drafts are a walk from the anchor rather than an argmax per position.
While the drafts match the reference, the token before each is the reference's: drafting a position given the
reference's token before it is what the walk drafts there, which keeps the offline replay exact and batched
(dflash_core.replay).

Shapes in comments: N blocks (or sequences), B block size, S context length, T tokens, H hidden size,
K target layers read, n_heads / n_kv query / key-value heads, hd head dim.

Why this module is long: it is the drafter's whole forward path in one file read top to bottom (as a transformers
modeling file is), with the loading that checks every weight against it.
"""

import json
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, cast

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

from .checkpoint_files import WeightFilesError, weight_files
from .choices import SLIDING_SEMANTICS
from .drafter_config import DrafterConfig, DrafterConfigWarning, DrafterError, read_drafter_config
from .gemma4_backbone import Gemma4Backbone
from .generations import Generation, HeadChoice, SublayerWrapper, generations
from .sampling import Sampling, draw

# One layer's context keys and values, each [N, n_kv, S, hd] (or [n_kv, T, hd] for one sequence).
LayerKV = tuple[torch.Tensor, torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # computed in float32 like Qwen3RMSNorm, so bf16 drafters match the reference numerics
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Apply RoPE; x [..., T, D], cos/sin broadcastable to it."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


class Attention(nn.Module):
    """The block's queries attend to [context ; block] keys/values (grouped-query, Qwen3's q/k norms)."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * cfg.head_dim, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context_k: torch.Tensor,
                context_v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """x [N, B, H] block; context_k/v [N, n_kv, S, hd]; mask [N, 1, B, S+B] (True = may attend)."""
        N, B, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(N, B, self.num_heads, self.head_dim)).transpose(1, 2)  # [N, n_heads, B, hd]
        q = rotate(q, cos[:, None], sin[:, None])
        k, v = self.keys_values(x, cos, sin)  # [N, n_kv, B, hd]
        k = torch.cat([context_k, k], dim=2)  # [N, n_kv, S+B, hd]
        v = torch.cat([context_v, v], dim=2)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.num_heads != self.num_kv_heads)
        return self.o_proj(y.transpose(1, 2).reshape(N, B, -1))  # [N, B, H]

    def keys_values(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> LayerKV:
        """x [N, T, H] -> k, v [N, n_kv, T, hd] with k_norm and RoPE applied."""
        N, T, _ = x.shape
        k = self.k_norm(self.k_proj(x).view(N, T, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(N, T, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return rotate(k, cos[:, None], sin[:, None]), v


class MLP(nn.Module):
    """SwiGLU, as in Qwen3."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP, each added to the residual stream; a generation may wrap either sublayer (DFlash2:
    in its convolutions), under the tensor name it gives the wrapper."""

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)
        self.wrapped: dict[str, str] = {}  # sublayer ("attention", "mlp") -> its wrapper's module name
        for sublayer, (name, wrapper) in cfg.generation.sublayer_wrappers(cfg).items():
            self.add_module(name, wrapper)
            self.wrapped[sublayer] = name

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, context_k: torch.Tensor,
                context_v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        def attend(h: torch.Tensor) -> torch.Tensor:
            return self.self_attn(h, cos, sin, context_k, context_v, mask)

        x = x + self._sublayer("attention", attend, self.input_layernorm(x))
        return x + self._sublayer("mlp", self.mlp, self.post_attention_layernorm(x))

    def _sublayer(self, name: str, sublayer: Callable[[torch.Tensor], torch.Tensor], h: torch.Tensor) -> torch.Tensor:
        """The sublayer on its normed input h, inside its wrapper when the generation gives it one."""
        wrapper = self.wrapped.get(name)
        return sublayer(h) if wrapper is None else cast(SublayerWrapper, self.get_submodule(wrapper)).around(sublayer, h)


class Backbone(Protocol):
    """What differs between the backbones a drafter runs, picked by its config's architecture (DrafterConfig.backbone):
    its norms (hidden_norm, the final norm), its decoder layers (each called as DecoderLayer is, its self_attn giving
    keys_values), its RoPE (rotary(x, positions [N, T]) -> cos, sin [N, T, hd]) and how the block's token embeddings
    are scaled."""

    def norm(self, cfg: DrafterConfig) -> nn.Module: ...

    def layer(self, cfg: DrafterConfig, index: int) -> nn.Module: ...

    def rotary(self, cfg: DrafterConfig) -> nn.Module: ...

    def scale_embeddings(self, x: torch.Tensor, cfg: DrafterConfig) -> torch.Tensor: ...


class Qwen3Backbone:
    """The backbone above: Qwen3's norms, layers and RoPE (z-lab's, SpecForge's, speculators' and DeepSpec's Qwen3
    drafters)."""

    def norm(self, cfg: DrafterConfig) -> nn.Module:
        return RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def layer(self, cfg: DrafterConfig, index: int) -> nn.Module:
        return DecoderLayer(cfg)

    def rotary(self, cfg: DrafterConfig) -> nn.Module:
        assert cfg.rope is not None, "a Qwen3-style drafter config has its rope fields (drafter_config)"
        return Qwen3RotaryEmbedding(cfg.rope)  # transformers' rope (default, yarn, llama3, ...)

    def scale_embeddings(self, x: torch.Tensor, cfg: DrafterConfig) -> torch.Tensor:
        """The config's input_embedding_scale (z-lab's; Gemma targets' DFlash drafters: sqrt(hidden))."""
        return x if cfg.input_embedding_scale == 1.0 else x * cfg.input_embedding_scale


# DrafterConfig.backbone -> the backbone (Gemma 4's: DeepSpec's Gemma4DSparkModel, gemma4_backbone.py)
BACKBONES: dict[str, Backbone] = {"qwen3": Qwen3Backbone(), "gemma4": Gemma4Backbone()}


# ----------------------------------------------------------------------------------------------
# The drafter


@dataclass(frozen=True)
class Drafts:
    """What a drafter makes of block positions (any leading shape [...]), each given the token before it:
    DFlashDrafter.draft.

    Greedy drafts are `tokens`; sampled ones are drawn from `probabilities(q)`. With a generation's head (`head`:
    DFlash2's selector) the backbone's argmax and its processed distribution are the head's base alone (the unary
    head), which the head chooses from."""

    argmax: torch.Tensor  # [...] the backbone head's argmax: DFlash's greedy draft
    logits: torch.Tensor | None = None  # [..., V] float32, DFlashDrafter.logits (None unless asked for, or a head)
    head: HeadChoice | None = None  # the generation's head's choice (None: the backbone's argmax drafts)

    @property
    def tokens(self) -> torch.Tensor:
        """The greedy drafts [...]: the head's choice, else the backbone's argmax."""
        return self.argmax if self.head is None else self.head.tokens

    def probabilities(self, q: Sampling) -> torch.Tensor:
        """The distribution a sampled draft is drawn from, [..., V] float32: the logits processed as `q` says
        (temperature, top-k, top-p, min-p), or the head's own q (DFlash2: softmax(score / T) over its candidates)."""
        assert self.logits is not None, "draft(..., logits=True) for sampled drafts"
        return q.probabilities(self.logits) if self.head is None else self.head.probabilities(q, self.logits.shape[-1])

    def probability_of(self, tokens: torch.Tensor, q: Sampling) -> torch.Tensor:
        """probabilities(q) at `tokens` [...], float32 [...] (without building the [..., V] distribution for a head)."""
        return self.argmax_probability_of(tokens, q) if self.head is None else self.head.probability_of(tokens, q)

    def argmax_probability_of(self, tokens: torch.Tensor, q: Sampling) -> torch.Tensor:
        """The backbone's own processed distribution (q over the logits) at `tokens`: DFlash's q; with a head, its
        base drafting alone."""
        assert self.logits is not None, "draft(..., logits=True) for sampled drafts"
        return q.probability_of(self.logits, tokens)


class DFlashDrafter(nn.Module):
    """The drafter of a DrafterConfig: the backbone, with its generation's modules (cfg.generation: DFlash2's layers
    get their convolutions and the drafter its candidate selector) and, with cfg.draft_vocab_size, its own head over a
    reduced vocabulary. sliding_semantics says how sliding-window layers treat the block when the config does not fix
    it (choices.SLIDING_SEMANTICS)."""

    d2t: torch.Tensor  # buffers of a reduced vocabulary (register_buffer below)
    t2d: torch.Tensor

    def __init__(self, cfg: DrafterConfig, sliding_semantics: str = "causal"):
        super().__init__()
        if sliding_semantics not in SLIDING_SEMANTICS:
            raise ValueError(f"sliding_semantics must be one of {SLIDING_SEMANTICS}, got {sliding_semantics!r}")
        self.cfg = cfg
        # a config that fixes the sliding layers' semantics (speculators) wins; the results record the one used
        self.sliding_semantics = cfg.sliding_semantics or sliding_semantics
        if (cfg.is_causal is not None and "sliding_attention" in cfg.layer_types
                and cfg.is_causal != (sliding_semantics == "causal")):
            warnings.warn(f"the drafter config sets is_causal={str(cfg.is_causal).lower()}: every layer is "
                          f"{'causal' if cfg.is_causal else 'bidirectional'} within the block, and "
                          f"sliding_semantics={sliding_semantics!r} has no effect", DrafterConfigWarning, stacklevel=2)
        self.backbone = BACKBONES[cfg.backbone]  # its norms, layers, RoPE and embedding scale
        n_ids = len(cfg.target_layer_ids)
        self.fc = nn.Linear(n_ids * cfg.hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = self.backbone.norm(cfg)
        self.layers = nn.ModuleList([self.backbone.layer(cfg, i) for i in range(cfg.num_layers)])
        self.norm = self.backbone.norm(cfg)
        self.rotary = self.backbone.rotary(cfg)
        self.generation = cfg.generation
        for name, module in self.generation.head_modules(cfg).items():  # its head, under the checkpoint's names
            self.add_module(name, module)
        self.lm_head: nn.Linear | None = None
        # a DeepSpec save's copies of the target's embed_tokens and lm_head (load_drafter), to check against the target's
        self.saved_token_head: dict[str, torch.Tensor] = {}
        if cfg.draft_vocab_size is not None:  # its own head over a reduced vocabulary, and the tokens' target ids
            assert cfg.vocab_size is not None  # (the config checks)
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
            self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))  # target id - draft id
            self.register_buffer("t2d", torch.zeros(cfg.vocab_size, dtype=torch.bool))  # the target ids kept

    def forward(self, block_embeds: torch.Tensor, starts: torch.Tensor, context: list[LayerKV]) -> torch.Tensor:
        """Draft N blocks at once.

        block_embeds [N, B, H]: target embeddings of [bonus token, MASK x (B-1)] for each block (rows of
        the embedding matrix; the backbone's scale is applied here: the config's input_embedding_scale, Gemma 4's
        sqrt(hidden_size)).
        starts [N]: absolute position of each block's first token.
        context: per layer (k, v), each [N, n_kv, S, hd], context keys/values padded to S >= max(starts);
        positions >= a block's start are masked out for it.
        Returns the final-normed hidden states [N, B, H]; position k predicts token start+k.
        """
        B = block_embeds.shape[1]
        positions = starts[:, None] + torch.arange(B, device=starts.device)  # [N, B]
        cos, sin = self.rope(positions)
        masks = self.attention_masks(starts, context[0][0].shape[2], B)
        # Context a sliding layer cannot see for any block of the batch is left out of its attention
        # (masked keys change nothing; with long prompts they would be most of the work).
        first = {"full_attention": 0}
        if "sliding_attention" in masks:
            first["sliding_attention"] = max(0, int(starts.min()) + 1 - self._sliding_window())
        x = self.backbone.scale_embeddings(block_embeds.to(self.dtype), self.cfg)
        for layer, layer_type, (k, v) in zip(self.decoder_layers(), self.cfg.layer_types, context):
            f = first[layer_type]
            x = layer(x, cos, sin, k[:, :, f:], v[:, :, f:], masks[layer_type][..., f:])
        return self.norm(x)

    def forward_in_sequence(self, block_embeds: torch.Tensor, starts: torch.Tensor,
                            context: list[LayerKV]) -> torch.Tensor:
        """Draft N blocks of ONE sequence: context is that sequence's context_kv (per layer (k, v),
        each [n_kv, T, hd]), shared by every block without copies."""
        N, S = block_embeds.shape[0], int(starts.max())
        shared = [(k[None, :, :S].expand(N, -1, -1, -1), v[None, :, :S].expand(N, -1, -1, -1)) for k, v in context]
        return self(block_embeds, starts, shared)

    def logits(self, hidden: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
        """The drafter's logits: its hidden states [..., H] through the target's head [V, H], times the config's
        output_multiplier, then softcapped (tanh(x / cap) * cap), as z-lab's compute_logits does. Both are
        monotonic: the argmax (a greedy draft) is the raw logits', which the replay uses as they are; a sampled
        draft's distribution and DFlash2's selector need them. [..., V], float32."""
        return self._processed(self._head(hidden, head_weight))

    def raw_logits(self, hidden: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
        """The head's raw logits [..., V] in the drafter's dtype (before output_multiplier and the softcap), for
        draft(..., raw=): one pass over the head for positions a walk then drafts one at a time."""
        return self._head(hidden, head_weight)

    def _head(self, hidden: torch.Tensor, head_weight: torch.Tensor) -> torch.Tensor:
        """The raw logits over the target's vocabulary [..., V], in the drafter's dtype: through the target's head, or
        through its own over a reduced vocabulary with every other token at -inf (never drafted, probability 0;
        the kept tokens keep their order, so the argmax is the reduced head's, mapped to its target id)."""
        if self.lm_head is None:
            return hidden @ head_weight.T
        draft = self.lm_head(hidden)  # [..., Vd]
        raw = draft.new_full((*draft.shape[:-1], head_weight.shape[0]), float("-inf"))
        return raw.scatter_(-1, self.target_ids.expand_as(draft), draft)

    @property
    def target_ids(self) -> torch.Tensor:
        """A reduced vocabulary's target id of each draft token [Vd] (draft id + d2t)."""
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    def draft(self, hidden: torch.Tensor, head_weight: torch.Tensor, previous: torch.Tensor,
              logits: bool = False, raw: torch.Tensor | None = None) -> Drafts:
        """Drafts at block positions whose final hidden states are `hidden` [..., H], each given the token before it,
        `previous` [...] (the anchor before position 1, then the draft before it: DFlash2's selector depends on it,
        DFlash does not). logits: also the processed logits, which sampled drafts need (DFlash2 always has them).
        raw: the head's raw logits there [..., V] when one pass over the head already gave them (raw_logits)."""
        if raw is None:
            raw = self._head(hidden, head_weight)  # [..., V] in the drafter's dtype: its argmax is the backbone's draft
        if not self.generation.HEAD:
            return Drafts(raw.argmax(-1), self._processed(raw) if logits else None)
        processed = self._processed(raw)
        return Drafts(raw.argmax(-1), processed, self.generation.choose(self, processed, hidden, previous))

    def draft_block(self, hidden: torch.Tensor, head_weight: torch.Tensor, anchor: int, q: Sampling | None = None,
                    generator: torch.Generator | None = None) -> tuple[list[int], torch.Tensor | None]:
        """One block's drafts from its hidden states at positions 1 .. P ([P, H]): greedy (q None), or each drawn from
        Drafts.probabilities(q) with `generator`; returns the drafts and, when sampled, q at each position [P, V] (what
        verification needs). A generation whose drafts depend on the one before (DFlash2) walks from the anchor."""
        if not self.generation.WALKS_FROM_ANCHOR:
            drafts = self.draft(hidden, head_weight, torch.full(hidden.shape[:-1], anchor), logits=q is not None)
            if q is None:
                return drafts.tokens.tolist(), None
            probs = drafts.probabilities(q)
            return draw(probs, generator).tolist(), probs
        previous = torch.tensor([anchor], device=hidden.device)
        tokens, rows = [], []
        for k in range(len(hidden)):
            drafts = self.draft(hidden[k:k + 1], head_weight, previous, logits=q is not None)
            if q is None:
                previous = drafts.tokens
            else:
                rows.append(drafts.probabilities(q))
                previous = draw(rows[-1], generator)
            tokens.append(int(previous))
        return tokens, torch.cat(rows) if rows else None

    def _processed(self, raw_logits: torch.Tensor) -> torch.Tensor:
        """logits() of the head's raw output."""
        logits = raw_logits.float() * self.cfg.output_multiplier
        cap = self.cfg.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def context_kv(self, features: torch.Tensor, start_position: int = 0) -> list[LayerKV]:
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
                f"{len(self.cfg.target_layer_ids)} layers {list(self.cfg.target_layer_ids)} of hidden size "
                f"{self.cfg.hidden_size}"
            )
        x = features.to(device=self.device, dtype=self.dtype).permute(0, 2, 1, 3).reshape(N, T, K * H)
        ctx = self.hidden_norm(self.fc(x))  # [N, T, H]
        positions = torch.arange(start_position, start_position + T, device=self.device)[None]
        cos, sin = self.rope(positions)
        out = []
        for layer in self.decoder_layers():
            k, v = layer.self_attn.keys_values(ctx, cos, sin)
            out.append((k[0], v[0]) if single else (k, v))
        return out

    def attention_masks(self, starts: torch.Tensor, context_len: int,
                        block_len: int | None = None) -> dict[str, torch.Tensor]:
        """Boolean masks [N, 1, B, S+B] for each layer type (True = may attend), for blocks of block_len B
        (default the drafter's block size; a smaller one drafts fewer tokens, as served).

        starts [N]: each block's first position; every block sees the context positions < its start.
        Sliding layers also see only keys less than sliding_window positions before the query (and,
        when not causal, after it). Keys are [context ; block], as in Attention.forward.
        """
        B = self.cfg.block_size if block_len is None else block_len
        S, N, device = context_len, len(starts), starts.device
        q_pos = starts[:, None] + torch.arange(B, device=device)  # [N, B]
        ctx_pos = torch.arange(S, device=device)
        ctx_visible = (ctx_pos[None, None, :] < starts[:, None, None]).expand(-1, B, -1)  # [N, B, S]
        k = torch.arange(B, device=device)
        block_distance = k[:, None] - k[None, :]  # [B, B]: query minus key, the same for every block
        masks = {}
        for layer_type in set(self.cfg.layer_types):
            ctx_part, block_part = ctx_visible, torch.ones(B, B, dtype=torch.bool, device=device)
            if layer_type == "sliding_attention":
                window = self._sliding_window()
                ctx_part = ctx_part & (q_pos[:, :, None] - ctx_pos[None, None, :] < window)
                block_part = block_part & (block_distance < window) & (-block_distance < window)
            if self.layer_is_causal(layer_type):
                block_part = block_part & (block_distance >= 0)
            masks[layer_type] = torch.cat([ctx_part, block_part.expand(N, B, B)], dim=2)[:, None]
        return masks

    def layer_is_causal(self, layer_type: str) -> bool:
        """Whether a layer of this type is causal within the block (block position k sees block positions <= k).

        The config's is_causal, when set, decides for every layer (z-lab's reference, SGLang); unset, full
        layers see the whole block and sliding layers follow sliding_semantics.
        """
        if self.cfg.is_causal is not None:
            return self.cfg.is_causal
        return layer_type == "sliding_attention" and self.sliding_semantics == "causal"

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [N, T] -> cos, sin [N, T, hd] in the drafter's dtype."""
        cos, sin = self.rotary(self.fc.weight, positions)
        return cos, sin

    def token_head_differences(self, embed_weight: torch.Tensor, head_weight: torch.Tensor) -> dict[str, str]:
        """How the save's own copies of the target's embedding and head (a DeepSpec save's, saved_token_head) differ
        from the target's `embed_weight` and `head_weight` [V, H]: {tensor name: what differs}, {} when each equals the
        target's rounded to the save's dtype (or the save holds none). The drafter drafts with the target's, as served;
        a copy that differs says the save was made against another target (or damaged)."""
        differences = {}
        for name, target in zip(SAVED_TOKEN_HEAD, (embed_weight, head_weight), strict=True):
            saved = self.saved_token_head.get(name)
            if saved is None:
                continue
            if saved.shape != target.shape:
                differences[name] = f"shape {list(saved.shape)} in the save, {list(target.shape)} in the target"
                continue
            gap = (saved.float() - target.to(saved.dtype).float().to(saved.device)).abs()
            rows = int((gap.amax(-1) > 0).sum())
            if rows:
                differences[name] = (f"{rows} of {gap.shape[0]} rows differ from the target's, by up to "
                                     f"{float(gap.max()):.3g}")
        return differences

    def decoder_layers(self) -> list[DecoderLayer]:
        """self.layers, typed (nn.ModuleList yields plain Modules; the Gemma 4 backbone's are called alike)."""
        return [cast(DecoderLayer, layer) for layer in self.layers]

    def _sliding_window(self) -> int:
        # drafter_config gives every config with a sliding layer a window
        assert self.cfg.sliding_window is not None, "a sliding layer without a window"
        return self.cfg.sliding_window

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


# ----------------------------------------------------------------------------------------------
# Loading and saving


def load_drafter(
    path: str | Path,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    sliding_semantics: str = "causal",
    mask_token_id: int | None = None,
    tokenizer: Any = None,
    config: DrafterConfig | None = None,
) -> DFlashDrafter:
    """Load a drafter checkpoint of any generation (config.json + model.safetensors or a sharded index).

    Every weight must be present with the shape the config implies, and no unexpected weight may be
    present (a different architecture under the same name must not load silently). mask_token_id
    overrides the config's; tokenizer (the target's) resolves a dflash_config.mask_token string.
    config: this checkpoint's config.json as read_drafter_config already parsed it (with the mask_token_id and
    tokenizer given there), so it is not read again; None reads it here.
    """
    path = Path(path)
    if config is None:
        config = read_drafter_config(path, mask_token_id=mask_token_id, tokenizer=tokenizer)
    elif mask_token_id is not None or tokenizer is not None:
        raise ValueError("load_drafter: mask_token_id and tokenizer belong to read_drafter_config when a parsed "
                         "config is given")
    with torch.device("meta"):
        model = DFlashDrafter(config, sliding_semantics)
    saved_token_head: dict[str, torch.Tensor] = {}
    state = _checked_weights(path, config, {name: t.shape for name, t in model.state_dict().items()}, saved_token_head)
    if model.lm_head is not None:
        _check_token_map_types(path, state)  # before loading casts them to the buffers' long and bool
    model = model.to_empty(device=device)
    model.load_state_dict(state, strict=True)
    if model.lm_head is not None:
        _check_token_map(path, model)
    model = model.to(dtype=dtype)
    # rope frequencies stay float32 (a bf16 cast would blur them); they were on the meta device anyway
    model.rotary = model.backbone.rotary(config).to(device)
    model.saved_token_head = saved_token_head
    return model.eval()


def _checked_weights(path: Path, cfg: DrafterConfig, expected: dict[str, torch.Size],
                     saved_token_head: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint's weights, refused (DrafterError) unless they are exactly `expected`: name -> shape. A DeepSpec
    save's copies of the target's embedding and head (SAVED_TOKEN_HEAD, both required) go into `saved_token_head`."""
    try:
        files = weight_files(path)
    except WeightFilesError as e:
        raise DrafterError(str(e)) from None
    state = {}
    for file in files:
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 -- a safetensors handle, not a dict: it is not iterable
                    state[name] = f.get_tensor(name)
        except Exception as e:
            raise DrafterError(f"{file}: cannot read safetensors ({e}); re-fetch the checkpoint") from e
    state = published_names(state, cfg.generation)
    if cfg.source_format == "deepspec":
        if absent := [name for name in SAVED_TOKEN_HEAD if name not in state]:
            raise DrafterError(f"{path}: a DeepSpec save holds the target's embedding and head beside the drafter "
                               f"(embed_tokens.weight, lm_head.weight); this one lacks {absent}: re-save the drafter")
        saved_token_head.update((name, state.pop(name)) for name in SAVED_TOKEN_HEAD)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        raise DrafterError(
            f"{path}: weights do not match a {cfg.architecture} with {cfg.num_layers} layers: "
            f"missing {missing[:8]}{'...' if len(missing) > 8 else ''}, "
            f"unexpected {unexpected[:8]}{'...' if len(unexpected) > 8 else ''}"
        )
    for name, shape in expected.items():
        if state[name].shape != shape:
            hint = ""
            if name == "fc.weight" and state[name].shape[0] == shape[0] and state[name].shape[1] % cfg.hidden_size == 0:
                hint = (f" (it takes {state[name].shape[1] // cfg.hidden_size} target layers; the config names "
                        f"{len(cfg.target_layer_ids)}: {list(cfg.target_layer_ids)})")
            raise DrafterError(f"{path}: weight {name} has shape {list(state[name].shape)}, expected "
                               f"{list(shape)}{hint}")
    return state


# The target's embedding and head as DeepSpec saves them beside its drafters (frozen copies): checked against the
# target's (DFlashDrafter.saved_token_head), never drafted with (the drafter uses the target's, as served).
SAVED_TOKEN_HEAD = ("embed_tokens.weight", "lm_head.weight")


def published_names(state: dict[str, Any], generation: Generation | None = None) -> dict[str, Any]:
    """A drafter's weights (under any common prefix) with the tensor names other trainers save renamed to the published
    ones (Generation.KEY_RENAMES, of `generation`, else of every generation), unless the published name is there too
    (which the weight checks then refuse as unexpected)."""
    renames = {k: v for g in ([generation] if generation else generations()) for k, v in g.KEY_RENAMES.items()}
    renamed = {}
    for name, tensor in state.items():
        for other_name, published in renames.items():
            prefix = name[:-len(other_name)]
            if name.endswith(other_name) and prefix + published not in state:
                name = prefix + published
        renamed[name] = tensor
    return renamed


def _check_token_map_types(path: Path, state: dict[str, torch.Tensor]) -> None:
    """A reduced vocabulary's d2t holds integer offsets and its t2d booleans (or 0/1 as integers): loaded into the
    long and bool buffers, a float d2t would be truncated and any t2d value but 0 read as kept, without a word."""
    d2t, t2d = state["d2t"], state["t2d"]
    if d2t.dtype.is_floating_point or d2t.dtype.is_complex or d2t.dtype == torch.bool:
        raise DrafterError(f"{path}: d2t is {str(d2t.dtype).removeprefix('torch.')}: it must hold integer offsets "
                           "(target id = draft id + d2t[draft id], int64 as speculators saves it); re-save the drafter")
    if t2d.dtype != torch.bool and (t2d.dtype.is_floating_point or t2d.dtype.is_complex
                                    or not bool(((t2d == 0) | (t2d == 1)).all())):
        odd = t2d[(t2d != 0) & (t2d != 1)]
        held = f" holding {odd[0].item()!r}" if odd.numel() else ""
        raise DrafterError(f"{path}: t2d is {str(t2d.dtype).removeprefix('torch.')}{held}: it must mark each target "
                           "token kept or not (bool, as speculators saves it, or 0/1); re-save the drafter")


def _check_token_map(path: Path, model: DFlashDrafter) -> None:
    """A reduced vocabulary's d2t must give each draft token a distinct target id, in order (as speculators builds
    it from t2d), each of them one t2d keeps: else drafts would land on the wrong tokens."""
    ids = model.target_ids
    if ids.min() < 0 or ids.max() >= len(model.t2d) or not bool((ids[1:] > ids[:-1]).all()):
        raise DrafterError(f"{path}: d2t maps draft tokens outside the target's vocabulary or out of order: the token "
                           "map is damaged; re-save the drafter")
    if int(model.t2d.sum()) != len(ids) or not bool(model.t2d[ids].all()):
        raise DrafterError(f"{path}: d2t and t2d disagree on which target tokens the draft vocabulary keeps: the "
                           "token map is damaged; re-save the drafter")


def save_drafter(drafter: DFlashDrafter, path: str | Path) -> None:
    """Write a drafter in the published format: config.json + model.safetensors."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(drafter.cfg.raw, indent=2, sort_keys=True))
    weights = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    save_file(weights, str(path / "model.safetensors"))
