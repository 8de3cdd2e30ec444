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

Speed: context keys/values are computed once per sequence (drafter.context_kv); blocks from many
sequences or start positions run as one batch under a mask; the lm_head runs only for blocks still
matching, since positions after the first mismatch cannot change the answer (while few blocks are
alive, one pass over the head serves several positions: it costs what one position does).
"""

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from .drafter import DFlashDrafter
from .drafter_config import check_block_size, check_compatible
from .sampled_drafts import ExpectedSteps, SampledDrafts, acceptance, coin_steps, expected_steps, step_distribution
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


class BlockScorer:
    """Scores draft blocks of a set of references against those references."""

    def __init__(self, drafter: DFlashDrafter, embed_weight: torch.Tensor, head_weight: torch.Tensor,
                 references: Sequence[Reference], features: Iterable[torch.Tensor], block_size: int | None = None):
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
        self.B = drafter.block_size if block_size is None else check_block_size(block_size, drafter.block_size)
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
        """The drafter's last hidden states for each block [N, B, H]."""
        N, B = len(blocks), self.B
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
        return hidden

    @torch.no_grad()
    def draft_tokens(self, blocks: Sequence[tuple[int, int]], positions: int | None = None) -> list[list[int]]:
        """The drafter's guesses at block positions 1..positions (default all, B-1) for each (reference
        index, start)."""
        hidden = self._hidden(blocks, self._truth(blocks))
        last = self.B if positions is None else 1 + positions
        return (hidden[:, 1:last] @ self.head.T).argmax(-1).tolist()

    @torch.no_grad()
    def score(self, blocks: Sequence[tuple[int, int]]) -> tuple[list[int], list[int]]:
        """Acceptance length and rejected draft token for each (reference index, start) block."""
        truth = self._truth(blocks)
        # how many tokens R has after each start
        available = torch.tensor([len(self.tokens[s]) - 1 - p for s, p in blocks], device=truth.device)
        hidden = self._hidden(blocks, truth)
        return self._accept(hidden, truth, available)

    @torch.no_grad()
    def score_every_position(self, blocks: Sequence[tuple[int, int]]) -> tuple[list[int], list[int], list[list[int]]]:
        """score(), and for each block whether each draft position 1..B-1 matches the reference whatever the
        positions before it did (teacher-forced, as training measures accuracy): 1, 0, or -1 where the
        reference ends before it. Every position needs the head here, not only those still matching."""
        truth = self._truth(blocks)
        available = torch.tensor([len(self.tokens[s]) - 1 - p for s, p in blocks], device=truth.device)
        hidden = self._hidden(blocks, truth)
        drafts = (hidden[:, 1:] @ self.head.T).argmax(-1)  # [N, B-1]
        hits = (drafts == truth[:, 1:]).long()
        hits[truth[:, 1:] < 0] = -1
        # the same acceptance as _accept: the leading matches, and the draft at the first compared mismatch
        accepted = (hits == 1).long().cumprod(1).sum(1)  # [N]
        steps = torch.minimum(accepted + 1, available)
        first = accepted.clamp(max=self.B - 2).unsqueeze(1)
        compared = (accepted < self.B - 1) & (hits.gather(1, first).squeeze(1) == 0)
        rejected = torch.where(compared, drafts.gather(1, first).squeeze(1), torch.full_like(accepted, -1))
        return steps.tolist(), rejected.tolist(), hits.tolist()

    @torch.no_grad()
    def acceptance_probabilities(self, blocks: Sequence[tuple[int, int]], q: Sampling,
                                 target_probabilities: Sequence[torch.Tensor], every_position: bool = False) -> torch.Tensor:
        """a[n, k - 1] = min(1, q(y) / p(y)) for draft position k of block n, y = R[start + k] (0 where R ends
        before it): the probability that a sampled draft there was accepted given that y was emitted
        (dflash_core.sampled_drafts). Unless every_position, a position after one whose a is 0 is not computed
        (left 0): no path reaches it. [N, B-1], float64."""
        truth = self._truth(blocks)
        available = torch.tensor([len(self.tokens[s]) - 1 - p for s, p in blocks], device=truth.device)
        hidden = self._hidden(blocks, truth)
        a = torch.zeros(len(blocks), self.B - 1, dtype=torch.float64)
        alive = torch.arange(len(blocks), device=truth.device)
        for k in range(1, self.B):
            alive = alive[available[alive] >= k]
            if len(alive) == 0:
                break
            q_of_y = q.probability_of(self.drafter.logits(hidden[alive, k], self.head), truth[alive, k])
            p_of_y = torch.tensor([float(target_probabilities[blocks[n][0]][blocks[n][1] + k]) for n in alive.tolist()],
                                  dtype=torch.float64)
            a_k = acceptance(q_of_y.double().cpu(), p_of_y)
            a[alive.cpu(), k - 1] = a_k
            if not every_position:
                alive = alive[(a_k > 0).to(alive.device)]
        return a

    def _accept(self, hidden: torch.Tensor, truth: torch.Tensor,
                available: torch.Tensor) -> tuple[list[int], list[int]]:
        """Acceptance length and rejected draft of each block from the drafter's hidden states [N, B, H]."""
        N, B = hidden.shape[0], self.B

        accepted = torch.zeros(N, dtype=torch.long, device=truth.device)
        rejected = torch.full((N,), -1, dtype=torch.long, device=truth.device)
        alive = torch.arange(N, device=truth.device)
        k = 1
        while k < B:
            alive = alive[available[alive] >= k]
            if len(alive) == 0:
                break
            # Only blocks still matching need position k's logits. A pass over the [V, H] head reads
            # all of it (2.5 GB at the Qwen3.6 shape), which costs about as much as HEAD_ROWS rows of
            # arithmetic: every block needs position 1, but the few blocks still matching after it
            # get several next positions' drafts from one pass.
            width = 1 if k == 1 else min(B - k, max(1, HEAD_ROWS // len(alive)))
            drafts = (hidden[alive, k:k + width] @ self.head.T).argmax(-1)  # [n_alive, width]
            for j in range(width):
                if j:
                    still = available[alive] >= k + j
                    alive, drafts = alive[still], drafts[still]
                    if len(alive) == 0:
                        break
                draft = drafts[:, j]
                match = draft == truth[alive, k + j]
                accepted[alive[match]] += 1
                rejected[alive[~match]] = draft[~match]
                alive, drafts = alive[match], drafts[match]
            k += width
        steps = torch.minimum(accepted + 1, available)
        return steps.tolist(), rejected.tolist()


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
    scorer = BlockScorer(drafter, embed_weight, head_weight, references, features, block_size)
    results = [ReplayResult() for _ in references]
    done = 0

    def run(blocks: list[tuple[int, int]], every_position: bool = False) -> tuple[list, list, list]:
        nonlocal done
        out: tuple[list, list, list] = ([], [], [])
        i = 0
        while i < len(blocks):
            # as many blocks as the budget allows for the longest context in the batch
            n = 1
            while (i + n < len(blocks) and n < max_blocks
                   and (n + 1) * max(p for _, p in blocks[i:i + n + 1]) <= max_context_tokens):
                n += 1
            if sampled is not None:  # acceptance probabilities, rows [B-1]
                out[2].extend(scorer.acceptance_probabilities(blocks[i:i + n], sampled.q, sampled.target_probabilities,
                                                              every_position).numpy())
            elif every_position:
                steps, rejected, hits = scorer.score_every_position(blocks[i:i + n])
                out[0].extend(steps)
                out[1].extend(rejected)
                out[2].extend(hits)
            else:
                steps, rejected = scorer.score(blocks[i:i + n])
                out[0].extend(steps)
                out[1].extend(rejected)
            i += n
            done += n
            if progress:
                progress(done)
        return out

    if sampled is not None:
        blocks = [(s, p) for s, ref in enumerate(references) for p in range(ref.prompt_len, ref.end - 1)]
        rows = run(blocks, every_position=all_positions)[2]
        first_row = 0
        for s, ref in enumerate(references):
            res, length = results[s], len(ref.token_ids)
            a = np.array(rows[first_row:first_row + ref.end - 1 - ref.prompt_len]).reshape(-1, scorer.B - 1)
            first_row += ref.end - 1 - ref.prompt_len
            res.expected = expected_steps(a, ref.prompt_len, ref.end, length, scorer.B)
            res.starts, res.acceptance_lengths = coin_steps(a, ref.prompt_len, ref.end, length, scorer.B,
                                                            sampled.seeds[s])
            res.rejected_drafts = [-1] * len(res.starts)
            if all_positions:
                available = length - 1 - np.arange(ref.prompt_len, ref.end - 1)
                res.all_positions = [sum(step * p for step, p in step_distribution(row, int(left), scorer.B))
                                     for row, left in zip(a, available)]
                res.position_hits = [(float(a[:, k].sum()), int((available > k).sum())) for k in range(scorer.B - 1)]
        return results

    if all_positions:
        blocks = [(s, p) for s, ref in enumerate(references) for p in range(ref.prompt_len, ref.end - 1)]
        steps, rejected, hits = run(blocks, every_position=True)
        by_block = {b: (a, r) for b, a, r in zip(blocks, steps, rejected)}
        for res in results:
            res.position_hits = [(0, 0)] * (scorer.B - 1)
        for (s, _), block_hits in zip(blocks, hits):
            counts = results[s].position_hits
            assert counts is not None
            for k, hit in enumerate(block_hits):
                if hit >= 0:
                    counts[k] = (counts[k][0] + hit, counts[k][1] + 1)
        for s, ref in enumerate(references):
            res = results[s]
            res.all_positions = [by_block[(s, p)][0] for p in range(ref.prompt_len, ref.end - 1)]
            p = ref.prompt_len
            while p + 1 < ref.end:
                a, r = by_block[(s, p)]
                res.starts.append(p)
                res.acceptance_lengths.append(a)
                res.rejected_drafts.append(r)
                p += a
        return results

    # decode mode: every unfinished reference advances one step per batch
    frontier = {s: ref.prompt_len for s, ref in enumerate(references) if ref.prompt_len + 1 < ref.end}
    while frontier:
        blocks = sorted(frontier.items(), key=lambda b: b[1])  # similar context lengths batch together
        steps, rejected, _ = run(blocks)
        for (s, p), a, r in zip(blocks, steps, rejected):
            res = results[s]
            res.starts.append(p)
            res.acceptance_lengths.append(a)
            res.rejected_drafts.append(r)
            if p + a + 1 < references[s].end:
                frontier[s] = p + a
            else:
                del frontier[s]
    return results
