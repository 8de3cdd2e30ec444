"""Offline replay: the acceptance lengths greedy speculative decoding would reach, without the target.

At temperature 0 speculative decoding emits exactly the target's greedy continuation R, and the
target's hidden states for R, teacher-forced, are what it computes while decoding. So for any drafter:

    start = prompt_len                  # R[start] is the target's first output token
    while start + 1 < end:              # end = len(R), or where the completion ends when R holds lookahead
        draft block [R[start], MASK x (B-1)] with context = features[:start]
        a = leading k >= 1 with draft[k] == R[start + k], among the tokens R still has
        step = min(a + 1, len(R) - 1 - start)   # accepted drafts + the target's bonus token
        start += step

The last step of a reference is clipped: R ends where the target stopped, so only the tokens R holds
can be compared (this is also where an online loop stops). A reference with lookahead tokens (the
target's greedy tokens past its stop) scores the last step against a whole block instead.

With drafts sampled from the drafter's q and accepted by rejection sampling (`sampled`), a draft is accepted with
probability min(1, q(y)/p(y)) given the token y emitted: dflash_core.sampled_drafts replays that rule, in
expectation and in one seeded draw, from a block scored at every start position.

A drafter whose generation has a head (dflash_core.generations: DFlash2's candidate selector) drafts block position k
given the draft at k - 1. While a block matches the reference that draft is the reference's token, so each position
is scored given the reference's token before it (dflash_core.drafter), batched like DFlash's. Its replay also
replays the backbone's own argmax alone as the drafts (its base walk, `ReplayResult.base`: DFlash2's unary head),
each block scored once for both, and counts per draft position, where the decode reached it, how often the drafts,
the base argmax and the head's own counts held the reference's token (Generation.COUNTS,
`ReplayResult.position_counts`): what the head adds, which training logs cannot show.

Speed: context keys/values are computed once per sequence (drafter.context_kv); blocks from many
sequences or start positions run as one batch under a mask; the lm_head runs only for blocks still
matching, since positions after the first mismatch cannot change the answer (while few blocks are
alive, one pass over the head serves several positions: it costs what one position does).

Why this module is long: the block scorer's three modes (decode steps, every start position, sampled drafts'
acceptance rows) share its batching, walks and counts, and `replay` turns each into the results; split, each mode
would repeat the block and walk bookkeeping it shares.
"""

import warnings
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from .drafter import DFlashDrafter, Drafts
from .drafter_config import DrafterConfigWarning, check_block_size, check_compatible
from .generations.base import CALIBRATION_BINS
from .sampled_drafts import (
    ExpectedSteps,
    SampledDrafts,
    acceptance,
    coin_steps,
    expected_steps,
    position_reach,
    start_probabilities,
    step_distribution,
)
from .sampling import Sampling

# Rows of the lm_head's matmul whose arithmetic costs about what reading the head once does (at the
# Qwen3.6 shape, bf16 on 2 CPU cores: 83 ms for 1 row, 88 for 8, 109 for 16, 151 for 32; GPUs balance higher).
HEAD_ROWS = 32


@dataclass(frozen=True)
class Reference:
    """A greedy reference: the prompt followed by the target's greedy completion.

    completion_end: where decoding stops (the target's stop token or max_new_tokens), when the
    reference holds lookahead tokens after it (the target's greedy tokens past the stop, so the
    last step is compared against a whole block like every other one); None = len(token_ids).
    """

    prompt_len: int
    token_ids: Sequence[int]
    completion_end: int | None = None

    def __post_init__(self):
        if not 0 < self.prompt_len < self.end <= len(self.token_ids):
            raise ValueError(
                f"a reference needs a prompt and at least one completion token: prompt_len={self.prompt_len}, "
                f"completion_end={self.completion_end}, {len(self.token_ids)} tokens"
            )

    @property
    def end(self) -> int:
        """Length of prompt + completion: decode steps start before end - 1."""
        return len(self.token_ids) if self.completion_end is None else self.completion_end


@dataclass
class ReplayResult:
    """Acceptance lengths of one reference.

    starts[i], acceptance_lengths[i]: the decode steps greedy speculative decoding takes, in order.
    rejected_drafts[i]: the drafter's token at the first mismatching position of step i (-1 when the
    step accepted every draft it could compare).
    all_positions: acceptance length at every start position prompt_len .. len(R)-2 (all-positions
    mode), or None when it was not computed.
    position_hits: all-positions mode, per draft position k = 1..B-1: (blocks whose position k matched the
    reference whatever came before it, blocks the reference reaches position k in): teacher-forced accuracy.
    """

    starts: list[int] = field(default_factory=list)
    acceptance_lengths: list[int] = field(default_factory=list)
    rejected_drafts: list[int] = field(default_factory=list)
    all_positions: list[int] | list[float] | None = None
    position_hits: list[tuple[int, int]] | list[tuple[float, int]] | None = None
    # drafts sampled (dflash_core.sampled_drafts): the steps in expectation over the acceptance coins; the steps
    # above are then one draw of the coins, and all_positions and position_hits expectations
    expected: ExpectedSteps | None = None
    # a generation with a head (DFlash2): the replay of its base alone (the backbone's argmax as the drafts; sampled,
    # its q), and per draft position k = 1..B-1, over the positions the decode steps above compared, its
    # Generation.COUNTS: (reached, the drafts accepted, the base argmax would have been, the head's own counts); with
    # sampled drafts, expectations (each an acceptance probability, weighed by the probability of reaching it)
    base: "ReplayResult | None" = None
    position_counts: list[list[float]] | None = None
    # under a verify threshold (DSpark's confidence head): the drafts each step verified, beside those it accepted
    verified_drafts: list[int] | None = None
    # a drafter that predicts its drafts' acceptance (DSpark's confidence head): per draft position and
    # CALIBRATION_BINS bin of the prediction, over the positions the steps above compared (calibration_counts)
    calibration: list[list[list[float]]] | None = None


@dataclass(frozen=True)
class BlockScore:
    """One block's outcome for each walk drafted: walk 0 the drafter's drafts, walk 1 (a generation with a head) the
    backbone's argmax alone."""

    steps: list[int]  # acceptance length per walk
    rejected: list[int]  # the draft at the first compared mismatch per walk (-1: none)
    hits: list[int] | None = None  # every-position scoring: walk 0's teacher-forced hit per position (1, 0; -1 past R)
    # a head: [B-1, len(Generation.COUNTS)] at the positions walk 0 compared (0 elsewhere)
    positions: np.ndarray | None = None
    verified: int | None = None  # under a verify threshold: the drafts walk 0's step verifies
    confidence: np.ndarray | None = None  # [B-1] the drafter's predicted acceptance of each draft (Generation.confidences)


@dataclass(frozen=True)
class AcceptanceRows:
    """Sampled drafts: per block and draft position [N, B-1], float64, the probability that the draft was accepted
    given the reference's token (0 where R ends before it), for the drafter's drafts and (a head) the backbone's q
    alone, and the head's own counts of the reference's token [N, B-1, n] (HeadChoice.counts)."""

    drafts: np.ndarray
    base: np.ndarray | None = None
    head_counts: np.ndarray | None = None
    verified: np.ndarray | None = None  # [N] under a verify threshold: the drafts each block's step verifies
    confidence: np.ndarray | None = None  # [N, B-1] the drafter's predicted acceptance of each draft


class BlockScorer:
    """Scores draft blocks of a set of references against those references."""

    def __init__(self, drafter: DFlashDrafter, embed_weight: torch.Tensor, head_weight: torch.Tensor,
                 references: Sequence[Reference], features: Iterable[torch.Tensor], block_size: int | None = None,
                 verify_threshold: float = 0.0):
        if embed_weight.shape != head_weight.shape:
            raise ValueError(f"embedding {list(embed_weight.shape)} and head {list(head_weight.shape)} shapes differ")
        vocab_size = embed_weight.shape[0]
        check_compatible(drafter.cfg, hidden_size=embed_weight.shape[1], vocab_size=vocab_size)
        for i, ref in enumerate(references):
            bad = [t for t in ref.token_ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"reference {i}: token ids {bad[:5]} are outside the target's vocabulary of "
                                 f"{vocab_size}")
        self.drafter = drafter
        for name, how in drafter.token_head_differences(embed_weight, head_weight).items():
            warnings.warn(f"the drafter's save holds its own copy of the target's {name}, and {how}: it was saved "
                          "against another target, or damaged (the target's own is used, as served)",
                          DrafterConfigWarning, stacklevel=2)
        if verify_threshold and not drafter.generation.schedules_verification(drafter.cfg):
            raise ValueError(f"a verify threshold ({verify_threshold}) needs a drafter that schedules its verification "
                             f"(DSpark's confidence head); this {drafter.generation.NAME} drafter verifies every draft")
        self.verify_threshold = verify_threshold
        # the drafter's slots per block, and the tokens a step verifies (one more when the anchor's slot drafts too)
        self.slots = drafter.block_size if block_size is None else check_block_size(block_size, drafter.block_size)
        self.B = drafter.cfg.verified_tokens(self.slots)
        device, dtype = drafter.device, drafter.dtype
        self.embed = embed_weight.to(device=device, dtype=dtype)  # [V, H]
        self.head = head_weight.to(device=device, dtype=dtype)  # [V, H]
        self.tokens = [torch.as_tensor(list(r.token_ids), dtype=torch.long, device=device) for r in references]
        # Only the context keys/values are kept: each sequence's features ([K, T, H], ~K x 10 KB per
        # token at hidden 5120) are dropped once projected ([n_kv, T, hd] per layer, ~1/20 of that).
        self.context = []
        for i, feats in enumerate(features):
            if i >= len(references):
                raise ValueError(f"more feature tensors than the {len(references)} references")
            # features of the last token are never context (no step starts after it)
            needed = len(references[i].token_ids) - 1
            if feats.shape[1] < needed:
                raise ValueError(f"reference {i}: features cover {feats.shape[1]} tokens, the reference needs {needed}")
            with torch.no_grad():
                self.context.append(drafter.context_kv(feats[:, :needed]))
        if len(self.context) != len(references):
            raise ValueError(f"{len(references)} references but {len(self.context)} feature tensors")

    def _truth(self, blocks: Sequence[tuple[int, int]]) -> torch.Tensor:
        """truth[n, k] = R[start + k] where R has it, else -1: [N, B]."""
        truth = torch.full((len(blocks), self.B), -1, dtype=torch.long, device=self.drafter.device)
        for n, (s, p) in enumerate(blocks):
            after = self.tokens[s][p:p + self.B]
            truth[n, :len(after)] = after
        return truth

    def _hidden(self, blocks: Sequence[tuple[int, int]], truth: torch.Tensor) -> torch.Tensor:
        """The drafter's last hidden states for each block [N, B, H]: hidden[:, k] drafts block position k = 1..B-1
        (when the anchor's slot drafts too, slot k - 1 does: a row of zeros stands at 0)."""
        N, B = len(blocks), self.slots
        seqs = [s for s, _ in blocks]
        starts = torch.tensor([p for _, p in blocks], device=self.drafter.device)
        S = int(starts.max())
        # the drafter's input block: the bonus token R[start], then masks
        ids = torch.full((N, B), self.drafter.mask_token_id, dtype=torch.long, device=starts.device)
        ids[:, 0] = truth[:, 0]

        block_embeds = F.embedding(ids, self.embed)
        if len(set(seqs)) == 1:
            hidden = self.drafter.forward_in_sequence(block_embeds, starts, self.context[seqs[0]])
        else:  # pad each sequence's context to S; positions >= a block's start are masked anyway
            context = []
            for layer in range(len(self.drafter.layers)):
                k_ref = self.context[seqs[0]][layer][0]
                k = k_ref.new_zeros(N, k_ref.shape[0], S, k_ref.shape[2])
                v = torch.zeros_like(k)
                for n, (s, p) in enumerate(blocks):
                    k[n, :, :p], v[n, :, :p] = self.context[s][layer][0][:, :p], self.context[s][layer][1][:, :p]
                context.append((k, v))
            hidden = self.drafter(block_embeds, starts, context)  # [N, B, H]
        if self.drafter.cfg.drafts_from_anchor:
            hidden = torch.cat([hidden.new_zeros(N, 1, hidden.shape[-1]), hidden], 1)
        return hidden

    @property
    def walks(self) -> int:
        """The walks each block is scored for: the drafter's drafts, and (a head) the backbone's argmax alone."""
        return 1 if self.drafter.generation.BASE_WALK is None else 2

    @torch.no_grad()
    def draft_tokens(self, blocks: Sequence[tuple[int, int]], positions: int | None = None) -> list[list[int]]:
        """The drafter's guesses at block positions 1..positions (default all, B-1) for each (reference
        index, start): a walk from the anchor, each draft given the one before it, for a generation that walks."""
        truth = self._truth(blocks)
        hidden = self._hidden(blocks, truth)
        last = self.B if positions is None else 1 + positions
        if not self.drafter.generation.WALKS_FROM_ANCHOR:
            return self.drafter.draft(hidden[:, 1:last], self.head, truth[:, :last - 1]).tokens.tolist()
        previous, drafted = truth[:, 0], []
        for k in range(1, last):
            previous = self.drafter.draft(hidden[:, k], self.head, previous).tokens
            drafted.append(previous)
        return torch.stack(drafted, 1).tolist()

    @torch.no_grad()
    def score(self, blocks: Sequence[tuple[int, int]], every_position: bool = False,
              walks: Sequence[Sequence[bool]] | None = None) -> list[BlockScore]:
        """Each (reference index, start) block's acceptance length and rejected draft, per walk. every_position: also
        whether each draft position 1..B-1 matches the reference whatever the positions before it did (teacher-forced,
        as training measures accuracy); every position then needs the head, not only those still matching. walks:
        per block, whether each walk is scored there (default all); a walk not scored gets steps 0 and no counts."""
        truth = self._truth(blocks)
        # how many tokens R has after each start
        available = torch.tensor([len(self.tokens[s]) - 1 - p for s, p in blocks], device=truth.device)
        hidden = self._hidden(blocks, truth)
        if every_position:
            return self._accept_every_position(hidden, truth, available)
        return self._accept(hidden, truth, available, walks)

    @torch.no_grad()
    def acceptance_probabilities(self, blocks: Sequence[tuple[int, int]], q: Sampling,
                                 target_probabilities: Sequence[torch.Tensor],
                                 every_position: bool = False) -> AcceptanceRows:
        """a[n, k - 1] = min(1, q(y) / p(y)) for draft position k of block n, y = R[start + k] (0 where R ends
        before it): the probability that a sampled draft there was accepted given that y was emitted
        (dflash_core.sampled_drafts); q is the drafter's (a head's, given the token y before it), and with a head also
        the backbone's alone. Unless every_position, a position after one whose a is 0 in every walk is not computed
        (left 0): no path reaches it."""
        truth = self._truth(blocks)
        available = torch.tensor([len(self.tokens[s]) - 1 - p for s, p in blocks], device=truth.device)
        hidden = self._hidden(blocks, truth)
        N, walks = len(blocks), self.walks
        # given the emitted tokens before each draft: exact for the acceptance (a draft is accepted only after those
        # before it were, so the tokens before it are the emitted ones). Past the first rejected draft the step drew
        # tokens of its own, which no replay of its output knows: the drafts verified there are counted given the
        # emitted tokens instead (the verify rate under sampled drafts is that estimate; docs/drafter-config.md)
        confidence = self._confidences(hidden, truth)
        verified = self._verified(confidence)
        a = np.zeros((walks, N, self.B - 1))
        head_counts = np.zeros((N, self.B - 1, self.extra_counts)) if walks > 1 else None
        alive = [torch.arange(N, device=truth.device) for _ in range(walks)]
        for k in range(1, self.B):
            alive = [live[available[live] >= k] for live in alive]
            rows = _union(alive)
            if len(rows) == 0:
                break
            drafts = self.drafter.draft(hidden[rows, k], self.head, truth[rows, k - 1], logits=True)
            y = truth[rows, k]
            p_of_y = torch.tensor([float(target_probabilities[blocks[n][0]][blocks[n][1] + k]) for n in rows.tolist()],
                                  dtype=torch.float64)
            here = rows.cpu().numpy()
            a[0, here, k - 1] = acceptance(drafts.probability_of(y, q).double().cpu(), p_of_y).numpy()
            if walks > 1:
                assert head_counts is not None and drafts.head is not None
                a[1, here, k - 1] = acceptance(drafts.argmax_probability_of(y, q).double().cpu(), p_of_y).numpy()
                head_counts[here, k - 1] = drafts.head.counts(y).cpu().numpy()
            if not every_position:
                alive = [live[torch.from_numpy(a[w, live.cpu().numpy(), k - 1] > 0).to(live.device)]
                         for w, live in enumerate(alive)]
        if verified is not None:  # drafts past those a step verifies are never accepted: the step ends there
            a[0, np.arange(self.B - 1)[None, :] >= verified.cpu().numpy()[:, None]] = 0
        return AcceptanceRows(a[0], a[1] if walks > 1 else None, head_counts,
                              None if verified is None else verified.cpu().numpy(),
                              None if confidence is None else confidence.cpu().numpy())

    @property
    def extra_counts(self) -> int:
        """How many of the generation's counts per position its head gives (HeadChoice.counts)."""
        return len(self.drafter.generation.COUNTS) - 3

    def _accept(self, hidden: torch.Tensor, truth: torch.Tensor, available: torch.Tensor,
                scored: Sequence[Sequence[bool]] | None = None) -> list[BlockScore]:
        """Each block's acceptance length and rejected draft per walk, from the drafter's hidden states [N, B, H];
        scored: per block, the walks scored there (score's `walks`)."""
        N, B, device = hidden.shape[0], self.B, truth.device
        walks = self.walks
        accepted = torch.zeros(walks, N, dtype=torch.long, device=device)
        rejected = torch.full((walks, N), -1, dtype=torch.long, device=device)
        counted = len(self.drafter.generation.COUNTS)
        positions = torch.zeros(N, B - 1, counted, dtype=torch.long, device=device) if walks > 1 else None
        chosen = torch.ones(walks, N, dtype=torch.bool, device=device)
        if scored is not None:
            chosen = torch.tensor(scored, dtype=torch.bool, device=device).reshape(N, walks).T
        alive = [torch.nonzero(chosen[w]).flatten() for w in range(walks)]
        row_of = torch.zeros(N, dtype=torch.long, device=device)  # block -> its row among the drafted ones
        confidence = self._confidences(hidden, truth)
        verified = self._verified(confidence)  # the drafts each step verifies; None: all of them
        # the positions each walk compares: those R holds, and for the drafts (walk 0) those the step verifies
        limits = [available if verified is None else torch.minimum(available, verified), available][:walks]
        k = 1
        while k < B:
            alive = [live[limit[live] >= k] for live, limit in zip(alive, limits)]
            rows = _union(alive)
            if len(rows) == 0:
                break
            # Only blocks still matching need position k's logits. A pass over the [V, H] head reads
            # all of it (2.5 GB at the Qwen3.6 shape), which costs about as much as HEAD_ROWS rows of
            # arithmetic: every block needs position 1, but the few blocks still matching after it
            # get several next positions' drafts from one pass. Each position is drafted given the reference's
            # token before it: while a block matches, that is the token drafted there (DFlash2's walk).
            width = 1 if k == 1 else min(B - k, max(1, HEAD_ROWS // len(rows)))
            drafts = self.drafter.draft(hidden[rows, k:k + width], self.head, truth[rows, k - 1:k - 1 + width])
            row_of[rows] = torch.arange(len(rows), device=device)
            for j in range(width):
                for w in range(walks):
                    live = alive[w]
                    live = live[limits[w][live] >= k + j]
                    guess = (drafts.tokens if w == 0 else drafts.argmax)[row_of[live], j]
                    match = guess == truth[live, k + j]
                    accepted[w, live[match]] += 1
                    rejected[w, live[~match]] = guess[~match]
                    if w == 0 and positions is not None:
                        self._count_choices(positions, live, k + j, match, drafts, row_of[live], j, truth, available)
                    alive[w] = live[match]
            k += width
        steps = torch.where(chosen, torch.minimum(accepted + 1, available), 0)
        if verified is not None:
            verified = self._verified_past_the_accepted(hidden, truth, verified, accepted[0], chosen[0])
        return [BlockScore(steps[:, n].tolist(), rejected[:, n].tolist(),
                           positions=None if positions is None else positions[n].cpu().numpy(),
                           verified=None if verified is None else int(verified[n]),
                           confidence=None if confidence is None else confidence[n].cpu().numpy()) for n in range(N)]

    def _confidences(self, hidden: torch.Tensor, truth: torch.Tensor) -> torch.Tensor | None:
        """The drafter's predicted acceptance of each block's drafts [N, B-1] (None: it predicts none), given the
        reference's token before each draft: the drafts' own up to the first not accepted, which is all that the
        acceptance lengths and the calibration compare (past it, _verified_past_the_accepted)."""
        return self.drafter.generation.confidences(self.drafter, hidden[:, 1:], truth[:, :-1].clamp(min=0))

    def _verified(self, confidence: torch.Tensor | None) -> torch.Tensor | None:
        """How many drafts each block's step verifies under the verify threshold [N] (None: every draft): the drafter's
        rule (Generation.verified_drafts)."""
        if not self.verify_threshold:
            return None
        assert confidence is not None, "the verify threshold was checked against the drafter"
        return self.drafter.generation.verified_drafts(confidence, self.verify_threshold)

    def _verified_past_the_accepted(self, hidden: torch.Tensor, truth: torch.Tensor, verified: torch.Tensor,
                                    accepted: torch.Tensor, scored: torch.Tensor | None = None) -> torch.Tensor:
        """The drafts each step verifies [N], exact where the step verifies past its first draft not accepted.

        `verified` comes from the confidences given the reference's token before each draft: the walk's own tokens up
        to the first draft not accepted (slot accepted + 1), so it is exact while it stops there or before (and the
        acceptance lengths never need more). Past that slot the walk drafted on from its own draft, not the
        reference's token: where every slot up to it cleared the threshold, the walk is continued here, each slot's
        confidence given the draft before it, as the step drafted and verified them. scored [N]: the blocks the drafts'
        walk was scored at (default all)."""
        D = self.B - 1
        start = accepted + 1  # the first slot not accepted, whose token before it is the reference's
        continued = (verified >= start) & (start < D)
        blocks = torch.nonzero(continued if scored is None else continued & scored).flatten()
        if len(blocks) == 0:
            return verified
        verified = verified.clone()
        previous = truth[blocks, accepted[blocks]]
        slot = start[blocks]
        # one pass over the head for every slot these walks may draft (start .. D-1): the backbone's logits do not
        # depend on the drafts, only the head's choice among them does
        first = int(slot.min())
        raw = self.drafter.raw_logits(hidden[blocks, first:D], self.head)  # [n, D - first, V]
        row = torch.arange(len(blocks), device=blocks.device)
        while len(blocks):
            drafts = self.drafter.draft(hidden[blocks, slot], self.head, previous, raw=raw[row, slot - first])
            previous = drafts.tokens  # the draft at `slot`
            slot = slot + 1
            confidence = self.drafter.generation.confidences(self.drafter, hidden[blocks, slot], previous)
            assert confidence is not None, "the verify threshold was checked against the drafter"
            below = confidence < self.verify_threshold
            verified[blocks[below]] = slot[below] - 1
            verified[blocks[~below]] = slot[~below]  # (final where the block's last slot is reached)
            going = ~below & (slot < D)
            blocks, slot, previous, row = blocks[going], slot[going], previous[going], row[going]
        return verified

    def _accept_every_position(self, hidden: torch.Tensor, truth: torch.Tensor,
                               available: torch.Tensor) -> list[BlockScore]:
        """_accept's answer, and each position's teacher-forced hit, from drafts at every position."""
        N, B = hidden.shape[0], self.B
        drafts = self.drafter.draft(hidden[:, 1:], self.head, truth[:, :-1].clamp(min=0))  # [N, B-1]
        confidence = self._confidences(hidden, truth)
        verified = self._verified(confidence)
        outcomes, hit_rows = [], []
        for w, tokens in enumerate((drafts.tokens, drafts.argmax)[:self.walks]):
            hits = (tokens == truth[:, 1:]).long()
            hits[truth[:, 1:] < 0] = -1
            # the same acceptance as _accept: the leading matches (those verified), and the draft at the first
            # compared mismatch
            accepted = (hits == 1).long().cumprod(1).sum(1)  # [N]
            if w == 0 and verified is not None:
                accepted = torch.minimum(accepted, verified)
            steps = torch.minimum(accepted + 1, available)
            first = accepted.clamp(max=B - 2).unsqueeze(1)
            compared = (accepted < B - 1) & (hits.gather(1, first).squeeze(1) == 0)
            if w == 0 and verified is not None:  # (a draft past those verified was never compared)
                compared &= accepted < verified
            rejected = torch.where(compared, tokens.gather(1, first).squeeze(1), torch.full_like(accepted, -1))
            outcomes.append((steps, rejected, accepted))
            hit_rows.append(hits)
        if verified is not None:
            verified = self._verified_past_the_accepted(hidden, truth, verified, outcomes[0][2])
        positions = None
        if self.walks > 1:
            positions = torch.zeros(N, B - 1, len(self.drafter.generation.COUNTS), dtype=torch.long,
                                    device=truth.device)
            accepted = outcomes[0][2]
            reach = available if verified is None else torch.minimum(available, verified)
            for k in range(1, B):
                live = torch.nonzero((accepted >= k - 1) & (reach >= k)).flatten()  # walk 0 compared position k
                self._count_choices(positions, live, k, hit_rows[0][live, k - 1] == 1, drafts, live, k - 1, truth,
                                    available)
        return [BlockScore([int(o[0][n]) for o in outcomes], [int(o[1][n]) for o in outcomes], hit_rows[0][n].tolist(),
                           None if positions is None else positions[n].cpu().numpy(),
                           None if verified is None else int(verified[n]),
                           None if confidence is None else confidence[n].cpu().numpy()) for n in range(N)]

    @staticmethod
    def _count_choices(positions: torch.Tensor, blocks: torch.Tensor, k: int, match: torch.Tensor, drafts: Drafts,
                       rows: torch.Tensor, column: int, truth: torch.Tensor, available: torch.Tensor) -> None:
        """positions[n, k - 1] = the generation's COUNTS of `blocks` at draft position k, whose drafts are
        drafts[rows, column]: reached, the drafts accepted, the base argmax would have been, the head's own counts. A
        position the reference ends at (k = available) is left out, as metrics.position_counts leaves a clipped last
        step's last position out."""
        assert drafts.head is not None
        counted = available[blocks] > k
        blocks, match, rows = blocks[counted], match[counted], rows[counted]
        y = truth[blocks, k]
        grid = torch.full_like(drafts.argmax, -1)  # the reference's tokens where these blocks' drafts are
        grid[rows, column] = y
        positions[blocks, k - 1] = torch.cat([
            torch.stack([torch.ones_like(y), match.long(), (drafts.argmax[rows, column] == y).long()], -1),
            drafts.head.counts(grid)[rows, column].long()], dim=-1)


def _union(alive: list[torch.Tensor]) -> torch.Tensor:
    """The blocks alive in any walk (one walk: its own, in its order)."""
    return alive[0] if len(alive) == 1 else torch.cat(alive).unique()


def replay(
    drafter: DFlashDrafter,
    embed_weight: torch.Tensor,
    head_weight: torch.Tensor,
    references: Sequence[Reference],
    features: Iterable[torch.Tensor],
    all_positions: bool = False,
    block_size: int | None = None,
    max_blocks: int = 64,
    max_context_tokens: int = 1 << 18,
    progress: Callable[[int], None] | None = None,
    sampled: SampledDrafts | None = None,
    verify_threshold: float = 0.0,
) -> list[ReplayResult]:
    """Replay speculative decoding of `drafter` over references with cached target features: greedy drafts, or
    with `sampled`, drafts sampled from q and accepted by rejection sampling (dflash_core.sampled_drafts).

    features[i]: [K, T_i, H] target features of reference i (K layers in drafter.target_layer_ids order);
    any iterable, consumed once, in order: a generator that reads them one by one holds one at a time.
    all_positions: also score a block at every start position, and the teacher-forced accuracy of each
    draft position over them (the head at every position: the costliest mode); the decode steps then follow
    from it at no extra cost. block_size: draft blocks of b <= the drafter's block size, as a server verifying b
    tokens per step runs it (the drafter sees b positions; default its own block size). Batches hold at most max_blocks blocks and max_context_tokens padded context
    positions (memory). progress(n) is called with the number of blocks scored so far. sampled: every start
    position is scored (any may start a step on some draw of the coins): each result holds the steps in
    expectation (`expected`) and one draw of the coins (starts, acceptance_lengths; rejected_drafts -1: a sampled
    draft is not known); all_positions then holds each start's expected acceptance length, position_hits the
    expected accepted drafts per position.
    """
    scorer = BlockScorer(drafter, embed_weight, head_weight, references, features, block_size, verify_threshold)
    B, walks = scorer.B, scorer.walks
    results = [ReplayResult(base=ReplayResult() if walks > 1 else None) for _ in references]
    done = 0

    def run(blocks: list[tuple[int, int]], score: Callable[[list[tuple[int, int]]], Any]) -> list:
        """score(batch) over blocks in batches within the budget, concatenated."""
        nonlocal done
        out: list = []
        i = 0
        while i < len(blocks):
            # as many blocks as the budget allows for the longest context in the batch
            n = 1
            while (i + n < len(blocks) and n < max_blocks
                   and (n + 1) * max(p for _, p in blocks[i:i + n + 1]) <= max_context_tokens):
                n += 1
            out.extend(score(blocks[i:i + n]))
            i += n
            done += n
            if progress:
                progress(done)
        return out

    def walk_of(s: int, w: int) -> ReplayResult:
        base = results[s].base
        assert w == 0 or base is not None
        return results[s] if w == 0 else base  # type: ignore[return-value]

    def every_start(ref: Reference) -> range:
        return range(ref.prompt_len, ref.end - 1)

    if sampled is not None:
        blocks = [(s, p) for s, ref in enumerate(references) for p in every_start(ref)]
        rows = run(blocks, lambda batch: _rows(scorer.acceptance_probabilities(batch, sampled.q, sampled.target_probabilities,
                                                                               all_positions)))
        first_row = 0
        for s, ref in enumerate(references):
            length, n = len(ref.token_ids), len(every_start(ref))
            mine = rows[first_row:first_row + n]  # per start: its AcceptanceRows' fields
            first_row += n
            planes = [np.array([row[name] for row in mine]).reshape(-1, B - 1) for name in ("drafts", "base")[:walks]]
            for w, a in enumerate(planes):
                res = walk_of(s, w)
                res.expected = expected_steps(a, ref.prompt_len, ref.end, length, B)
                # the same coins for both walks: their difference is the drafts', not the coins'
                res.starts, res.acceptance_lengths = coin_steps(a, ref.prompt_len, ref.end, length, B, sampled.seeds[s])
                res.rejected_drafts = [-1] * len(res.starts)
            res, a = results[s], planes[0]
            if scorer.verify_threshold:  # the drafts the steps of the coins' draw verified, and in expectation
                verified = np.array([row["verified"] for row in mine], dtype=np.float64)
                res.verified_drafts = [int(verified[p - ref.prompt_len]) for p in res.starts]
                assert res.expected is not None
                res.expected = replace(res.expected, verified=float(
                    start_probabilities(a, ref.prompt_len, ref.end, length, B) @ (verified + 1)))
            if all_positions:
                available = length - 1 - np.arange(ref.prompt_len, ref.end - 1)
                res.all_positions = [sum(step * p for step, p in step_distribution(row, int(left), B))
                                     for row, left in zip(a, available)]
                res.position_hits = [(float(a[:, k].sum()), int((available > k).sum())) for k in range(B - 1)]
            if walks > 1:
                head_counts = np.array([row["head_counts"] for row in mine]).reshape(n, B - 1, scorer.extra_counts)
                counted = [a, planes[1], *np.moveaxis(head_counts, -1, 0)]  # each [starts, B-1]
                reach = position_reach(a, ref.prompt_len, ref.end, length, B)
                res.position_counts = [[float(reach[:, k].sum()), *(float((reach[:, k] * x[:, k]).sum())
                                                                    for x in counted)] for k in range(B - 1)]
                if mine and mine[0]["confidence"] is not None:  # weighed by the probability each was compared
                    confidence = np.array([row["confidence"] for row in mine]).reshape(-1, B - 1)
                    res.calibration = calibration_counts(confidence, reach, a).tolist()
        return results

    calibrations: dict[int, np.ndarray] = {}  # by reference, summed over its steps (ReplayResult.calibration)

    def record(s: int, w: int, p: int, outcome: BlockScore) -> None:
        """Walk w of reference s takes the step of the block it scored at p."""
        res = walk_of(s, w)
        res.starts.append(p)
        res.acceptance_lengths.append(outcome.steps[w])
        res.rejected_drafts.append(outcome.rejected[w])
        if w == 0 and outcome.positions is not None:
            counts = results[s].position_counts
            results[s].position_counts = (outcome.positions.tolist() if counts is None
                                          else (np.array(counts) + outcome.positions).tolist())
            if outcome.confidence is not None:  # over the positions the step compared (COUNTS: reached, accepted)
                found = calibration_counts(outcome.confidence[None], outcome.positions[None, :, 0],
                                           outcome.positions[None, :, 1])
                calibrations[s] = calibrations[s] + found if s in calibrations else found
        if w == 0 and outcome.verified is not None:
            res.verified_drafts = [*(res.verified_drafts or ()), outcome.verified]

    def calibrated() -> list[ReplayResult]:
        for s, found in calibrations.items():
            results[s].calibration = found.tolist()
        return results

    if all_positions:
        blocks = [(s, p) for s, ref in enumerate(references) for p in every_start(ref)]
        by_block = dict(zip(blocks, run(blocks, lambda batch: scorer.score(batch, every_position=True))))
        for s, ref in enumerate(references):
            res = results[s]
            res.all_positions = [by_block[(s, p)].steps[0] for p in every_start(ref)]
            counts = [(0, 0)] * (B - 1)
            for p in every_start(ref):
                for k, hit in enumerate(by_block[(s, p)].hits or ()):
                    if hit >= 0:
                        counts[k] = (counts[k][0] + hit, counts[k][1] + 1)
            res.position_hits = counts
            for w in range(walks):
                p = ref.prompt_len
                while p + 1 < ref.end:
                    record(s, w, p, by_block[(s, p)])
                    p += by_block[(s, p)].steps[w]
        return calibrated()

    # decode mode: every unfinished reference advances one step per batch (a head's generation: its base walk too,
    # each block scored once for the walks that may start there)
    frontier = {(s, w): ref.prompt_len for s, ref in enumerate(references) if ref.prompt_len + 1 < ref.end
                for w in range(walks)}
    scored: dict[tuple[int, int], BlockScore] = {}
    while frontier:
        blocks = sorted({(s, p) for (s, _), p in frontier.items()} - set(scored), key=lambda b: (b[1], b[0]))
        # each block is scored for the walks that may still start there: a walk already past it never will
        walks_at = {(s, p): [frontier.get((s, w), p + 1) <= p for w in range(walks)] for s, p in blocks}

        def score_walks(batch: list[tuple[int, int]], at: dict = walks_at) -> list[BlockScore]:
            return scorer.score(batch, walks=[at[b] for b in batch])
        scored.update(zip(blocks, run(blocks, score_walks)))
        for (s, w), p in list(frontier.items()):
            outcome = scored[(s, p)]
            record(s, w, p, outcome)
            if p + outcome.steps[w] + 1 < references[s].end:
                frontier[(s, w)] = p + outcome.steps[w]
            else:
                del frontier[(s, w)]
        # a block before every walk's next start is never needed again
        nearest: dict[int, int] = {}
        for (s, _), p in frontier.items():
            nearest[s] = min(p, nearest.get(s, p))
        scored = {(s, p): o for (s, p), o in scored.items() if s in nearest and p >= nearest[s]}
    return calibrated()


def _rows(rows: AcceptanceRows) -> list[dict[str, Any]]:
    """Per block, AcceptanceRows' fields of it (None where the rows hold none)."""
    fields = {name: getattr(rows, name) for name in ("drafts", "base", "head_counts", "verified", "confidence")}
    return [{name: None if plane is None else plane[n] for name, plane in fields.items()}
            for n in range(len(rows.drafts))]


def calibration_counts(confidence: np.ndarray, weight: np.ndarray, accepted: np.ndarray) -> np.ndarray:
    """A drafter's predictions of its drafts' acceptance against what happened: per draft position and
    CALIBRATION_BINS equal-width bin of the prediction c, (weight, weight x c, weight x accepted, weight x squared
    error) [B-1, BINS, 4], from c, the weight of each (1 where a step compared the position, 0 where none did; with
    sampled drafts the probability one did) and whether it was accepted (0/1; sampled, its acceptance probability a),
    each [n, B-1]. The squared error is its expectation over the acceptance coin, c^2 - 2ca + a (a 0/1: (c - a)^2)."""
    c, w, a = (np.asarray(x, dtype=np.float64) for x in (confidence, weight, accepted))
    bins = np.minimum((c * CALIBRATION_BINS).astype(np.int64), CALIBRATION_BINS - 1)
    positions = np.broadcast_to(np.arange(c.shape[-1]), c.shape)
    found = np.zeros((c.shape[-1], CALIBRATION_BINS, 4))
    np.add.at(found, (positions, bins), np.stack([w, w * c, w * a, w * (c * c - 2 * c * a + a)], -1))
    return found
