"""Decoding with the target in the loop: plain decoding and real speculative decoding, greedy or sampled.

`speculative_decode` is the oracle the offline replay is tested against (and, later, the way to
measure wall-clock speedup). It drafts a block, verifies it with the target (dflash_core.sampling:
greedy, or sampled under either serving stack's rule), keeps the accepted prefix plus the target's
bonus token, and rolls the target's cache back to what was kept.

Rolling back: attention KV caches are cropped. Hybrid targets (Qwen3.5/3.6 Gated DeltaNet layers)
also carry a recurrent state that has absorbed every verified token, rejected ones included, and
`crop` cannot undo that. For them the recurrent state is snapshotted before verification and, when
a block is only partly accepted, restored and advanced over the kept tokens alone.
"""

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from transformers.cache_utils import LinearAttentionCacheLayerMixin

from .drafter import DFlashDrafter
from .drafter_config import check_block_size, check_compatible
from .sampling import GREEDY, Sampling, Verification, verify_block, verify_sampled_block
from .target import Target


@dataclass
class DecodeResult:
    """output_ids: prompt + completion. acceptance_lengths: tokens emitted per verification step."""

    output_ids: list[int]
    prompt_len: int
    acceptance_lengths: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)


def _check_prompt(target: Target, prompt_ids, max_new_tokens: int) -> list[int]:
    prompt_ids = [int(t) for t in prompt_ids]
    if not prompt_ids:
        raise ValueError("empty prompt")
    bad = [t for t in prompt_ids if not 0 <= t < target.vocab_size]
    if bad:
        raise ValueError(f"prompt token ids {bad[:5]} are outside the target's vocabulary of {target.vocab_size}")
    if target.max_positions is not None and len(prompt_ids) + max_new_tokens > target.max_positions:
        raise ValueError(
            f"prompt of {len(prompt_ids)} tokens + {max_new_tokens} new tokens exceeds the target's context of "
            f"{target.max_positions} positions: shorten the prompt or lower max_new_tokens"
        )
    return prompt_ids


def _crop(cache, length: int) -> None:
    """Drop cached positions >= length (transformers 5 crops by a negative count)."""
    cache.crop(-(cache.get_seq_length() - length))


def _recurrent_states(cache) -> list:
    return [layer for layer in cache.layers if isinstance(layer, LinearAttentionCacheLayerMixin)]


def _snapshot(layers) -> list[dict]:
    return [{i: s.clone() for i, s in layer.recurrent_states.items() if s is not None} for layer in layers]


def _restore(layers, snapshot) -> None:
    for layer, states in zip(layers, snapshot):
        for i, s in states.items():
            layer.recurrent_states[i].copy_(s)


@torch.no_grad()
def decode(target: Target, prompt_ids, max_new_tokens: int, stop_token_ids=(), sampling: Sampling = GREEDY,
           generator: torch.Generator | None = None) -> list[int]:
    """Plain decoding with a KV cache: prompt + completion, ending at a stop token (kept) or after
    max_new_tokens; greedy, or sampled with `sampling` from `generator` (one draw per token)."""
    ids = _check_prompt(target, prompt_ids, max_new_tokens)
    stop = set(stop_token_ids)
    cache = target.new_cache()
    next_input = torch.tensor([ids], device=target.device)
    for _ in range(max_new_tokens):
        logits = target.forward(next_input, cache=cache).require_logits()
        token = int(sampling.sample(logits[0, -1], generator))
        ids.append(token)
        if token in stop:
            break
        next_input = torch.tensor([[token]], device=target.device)
    return ids


def greedy_decode(target: Target, prompt_ids, max_new_tokens: int, stop_token_ids=()) -> list[int]:
    """Plain greedy decoding (decode at temperature 0)."""
    return decode(target, prompt_ids, max_new_tokens, stop_token_ids)


@torch.no_grad()
def speculative_decode(
    target: Target, drafter: DFlashDrafter, prompt_ids, max_new_tokens: int, stop_token_ids=(),
    sampling: Sampling = GREEDY, rule: Verification = "match", generator: torch.Generator | None = None,
    block_size: int | None = None, draft_sampling: Sampling | None = None, verify_threshold: float = 0.0,
) -> DecodeResult:
    """Speculative decoding with the target verifying every block.

    Each step drafts [last token, MASK x (B-1)] from the features of all committed tokens (the drafter's
    argmax, as every serving stack drafts; a DFlash2 drafter's selector walk from the anchor), verifies it in
    one target forward, and emits the accepted drafts plus the target's own next token: greedy, or sampled with
    `sampling` under `rule` (dflash_core.sampling.verify_block). Emitted tokens are clipped at a stop token and at
    max_new_tokens, exactly as the replay clips. Greedy, its output equals greedy_decode's.
    block_size: verify blocks of b <= the drafter's block size (SGLang's --speculative-num-draft-tokens):
    the drafter runs on b positions, not on its whole block cut short. draft_sampling: draw each draft from the
    drafter's logits processed so (q; DFlash2: its selector's softmax at that temperature) and verify by rejection sampling against the target's p (`rule` is then
    not used: dflash_core.sampling.verify_sampled_block), as dflash 0.1.0 and vLLM's probabilistic drafting do.
    verify_threshold: a drafter that schedules its verification (DSpark's confidence head) verifies only the drafts
    before the first one it is less confident of than this, as DeepSpec's evaluator does (0: every draft).
    """
    if verify_threshold and not drafter.generation.schedules_verification(drafter.cfg):
        raise ValueError(f"a verify threshold needs a drafter that schedules its verification; this "
                         f"{drafter.generation.NAME} drafter verifies every draft")
    check_compatible(drafter.cfg, target.hidden_size, target.vocab_size, target.num_layers)
    ids = _check_prompt(target, prompt_ids, max_new_tokens)
    B = drafter.block_size if block_size is None else check_block_size(block_size, drafter.block_size)
    prompt_len, layer_ids = len(ids), drafter.target_layer_ids
    max_len = prompt_len + max_new_tokens
    stop = set(stop_token_ids)
    embed = target.embed_weight.to(drafter.device, drafter.dtype)
    head = target.head_weight.to(drafter.device, drafter.dtype)
    result = DecodeResult(output_ids=ids, prompt_len=prompt_len)

    def features(out, n):  # [K, n, H] for the first n positions of a forward
        return torch.stack([out.features[i][0, :n] for i in layer_ids])

    cache = target.new_cache()
    cache.activate_past_recording()  # lets sliding-window and conv states crop back
    out = target.forward(torch.tensor([ids], device=target.device), cache=cache, layer_ids=layer_ids)
    ids.append(int(sampling.sample(out.require_logits()[0, -1], generator)))
    context = [[k, v] for k, v in drafter.context_kv(features(out, prompt_len))]
    recurrent = _recurrent_states(cache)

    start = prompt_len  # ids[start] is emitted but not yet seen by the target
    while start + 1 < max_len and ids[start] not in stop:
        block = torch.full((1, B), drafter.mask_token_id, dtype=torch.long, device=drafter.device)
        block[0, 0] = ids[start]
        ctx = [(k[None], v[None]) for k, v in context]
        hidden = drafter(F.embedding(block, embed), torch.tensor([start], device=drafter.device), ctx)
        # B-1 drafted tokens (B when the anchor's slot drafts too; DFlash2: the selector's walk from the anchor), and
        # q [drafts, V] when sampled
        drafting = hidden[0] if drafter.cfg.drafts_from_anchor else hidden[0, 1:]
        drafts, draft_probs = drafter.draft_block(drafting, head, ids[start], draft_sampling, generator)
        if verify_threshold:  # the drafts before the first the drafter is not confident of (given those before it)
            previous = torch.tensor([[ids[start], *drafts[:-1]]], device=drafter.device)
            confidence = drafter.generation.confidences(drafter, drafting[None], previous)
            assert confidence is not None, "the verify threshold was checked against the drafter"
            verified = int(drafter.generation.verified_drafts(confidence, verify_threshold)[0])
            drafts, draft_probs = drafts[:verified], None if draft_probs is None else draft_probs[:verified]

        verify = [ids[start]] + drafts
        snapshot = _snapshot(recurrent)
        out = target.forward(torch.tensor([verify], device=target.device), cache=cache, layer_ids=layer_ids)
        if draft_sampling is None:
            new_tokens = verify_block(drafts, out.require_logits()[0], sampling, rule, generator)
        else:
            assert draft_probs is not None
            new_tokens = verify_sampled_block(drafts, draft_probs, out.require_logits()[0], sampling, generator)
        new_tokens = new_tokens[: max_len - start - 1]
        for j, t in enumerate(new_tokens):
            if t in stop:
                new_tokens = new_tokens[: j + 1]
                break
        step = len(new_tokens)

        # keep the target's state for verify[:step] (positions start .. start+step-1)
        if step < len(verify) and recurrent:
            _crop(cache, start)
            _restore(recurrent, snapshot)
            target.forward(torch.tensor([verify[:step]], device=target.device), cache=cache)
        _crop(cache, start + step)
        for layer, (k, v) in zip(context, drafter.context_kv(features(out, step), start_position=start)):
            layer[0] = torch.cat([layer[0], k], dim=1)
            layer[1] = torch.cat([layer[1], v], dim=1)

        ids.extend(new_tokens)
        result.starts.append(start)
        result.acceptance_lengths.append(step)
        start += step
    return result
