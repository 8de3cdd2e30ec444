"""Acceptance when the drafts themselves are sampled: the rule of z-lab's `dflash` 0.1.0 benchmark and of vLLM's
`draft_sample_method="probabilistic"`, replayed offline, exactly in distribution.

There each draft token x is sampled from the drafter's processed distribution q and accepted by rejection
sampling against the target's processed distribution p: accepted while u * q(x) < p(x), u ~ U(0, 1); at the first
rejection the emitted token is sampled from normalise((p - q)+), and with every draft accepted the bonus from p.
What is emitted is distributed as the target samples (lossless), so a reference y sampled from the target is what
such a run emits; and the joint probability that the token emitted at a position is y AND was an accepted draft
is q(y) * min(1, p(y)/q(y)) = min(q(y), p(y)). So, given the emitted y, the draft there was accepted with
probability

    a = min(1, q(y) / p(y))                     (1 where p(y) = 0 < q(y): a token the target's numbers lost)

position after position in the block, and a rejection ends the block there as it does under the greedy rule
(with q one-hot on the drafter's argmax, a is 1 where the draft equals y and 0 elsewhere: today's rule). The
future tokens do not depend on where a block ended (each is a sample of p given the past), so given the whole
reference these acceptances are independent coins, and the replay follows the same decode loop:

- `coin_steps`: one realisation, the coins drawn from a seeded generator (what one served run would log);
- `expected_steps`: the exact expectation over the coins given the reference (dynamic programming over block
  starts): the expected tau E[tokens / steps] (the distribution of the number of steps, carried per start), the
  expected number of steps, histogram and per-position counts. This is the reference's tau: the same quantity
  the coins estimate, without their noise.

`a[s - prompt_len, k - 1]` is the acceptance probability of draft position k of the block started at s (its
anchor R[s]), 0 where R has no token s + k; a position after one whose a is 0 is never reached and may hold
anything.
"""

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .metrics import ImpossibleTau
from .sampling import Sampling


@dataclass(frozen=True)
class SampledDrafts:
    """What a replay under this rule needs besides the drafter and the references."""

    q: Sampling  # how the drafter's logits become q: the served settings (dflash 0.1.0), or the temperature only (vLLM)
    # per reference, p[t]: the target's probability of token t after the tokens before it, processed as served
    target_probabilities: Sequence[torch.Tensor]
    seeds: Sequence[int]  # per reference, the seed of its acceptance coins (coin_seed)


def acceptance(q_of_y: torch.Tensor, p_of_y: torch.Tensor) -> torch.Tensor:
    """a = min(1, q(y) / p(y)) elementwise (1 where p(y) = 0 < q(y), 0 where both are; NaN where either is NaN, which
    expected_steps refuses: a NaN p must not read as p = 0, accepting every draft)."""
    a = torch.where(p_of_y > 0, (q_of_y / p_of_y.clamp_min(torch.finfo(p_of_y.dtype).tiny)).clamp(max=1.0),
                    (q_of_y > 0).to(q_of_y.dtype))
    return torch.where(q_of_y.isnan() | p_of_y.isnan(), torch.nan, a)


@dataclass(frozen=True)
class ExpectedSteps:
    """A reference's decode steps in expectation over the acceptance coins, given the reference."""

    tau: float  # E[tokens / steps]: the reference's tau (its mean acceptance length, in expectation)
    steps: float  # E[steps]
    tokens: float  # E[tokens emitted] (the completion's length, unless the reference holds lookahead tokens)
    histogram: list[float]  # expected steps of each acceptance length 1..B
    reached: list[float]  # per draft position 1..B-1: expected steps that compared it (metrics.position_counts)
    accepted: list[float]  # ... and accepted it
    clipped: float  # the probability that the last step is clipped (accepted every token the reference had)
    verified: float | None = None  # under a verify threshold: E[tokens the steps verified] (drafts verified + 1 each)


def step_distribution(a_row: np.ndarray, available: int, block_size: int) -> list[tuple[int, float]]:
    """(step length, probability) of one block: j drafts accepted, then the bonus, clipped to what R holds."""
    compared = min(block_size - 1, available)
    survive = np.concatenate([[1.0], np.cumprod(a_row[:compared])])  # P(the first j drafts accepted)
    outcomes = []
    for j in range(compared + 1):
        p = survive[j] * (1.0 - a_row[j]) if j < compared else survive[j]
        if p > 0:
            outcomes.append((min(j + 1, available), float(p)))
    return outcomes


def expected_steps(a: np.ndarray, prompt_len: int, end: int, length: int, block_size: int) -> ExpectedSteps:
    """The expectation over the acceptance coins of one reference's decode steps (module docstring).

    a: [end - 1 - prompt_len, B - 1] acceptance probabilities, one row per block start prompt_len .. end-2;
    end: where decoding stops (the reference's end); length: the tokens R holds (end, or more with lookahead).
    ImpossibleTau when an acceptance probability is not a number: the paths through it would drop out, leaving a
    tau too low (0 when every one is NaN) that looks like a result."""
    if not np.isfinite(a).all():
        raise ImpossibleTau(
            f"{int((~np.isfinite(a)).sum())} of the {a.size} acceptance probabilities min(1, q/p) of a reference are "
            "not numbers: the drafter's q or the target's p is NaN there, so its tau cannot be computed and none is "
            "stored. Check the drafter's config numbers (output_multiplier, final_logit_softcapping) and weights, and "
            "the target's weights")
    B = block_size
    first = prompt_len
    histogram, reached, accepted = np.zeros(B), np.zeros(B - 1), np.zeros(B - 1)
    visits = np.zeros(end - first)  # P(a step starts at s)
    visits[0] = 1.0 if first + 1 < end else 0.0  # (a completion of one token has no decode step)
    # steps[s] = P(a step starts at s after n steps), n = 0.. (kept for the starts still ahead)
    steps: dict[int, np.ndarray] = {first: np.array([1.0])}
    tau = clipped = 0.0
    for s in range(first, end - 1):
        by_n = steps.pop(s, None)
        if by_n is None:
            continue  # no path starts a step here
        v = visits[s - first]
        available = length - 1 - s
        for step, p in step_distribution(a[s - first], available, B):
            histogram[step - 1] += v * p
            last_clipped = step == available < B
            clipped += v * p * last_clipped
            reached[:min(step - 1 if last_clipped else step, B - 1)] += v * p
            accepted[:step - 1] += v * p
            nxt = s + step
            if nxt + 1 < end:
                visits[nxt - first] += v * p
                shifted = np.concatenate([[0.0], by_n * p])  # one more step
                held = steps.get(nxt)
                if held is None:
                    steps[nxt] = shifted
                else:
                    grown = np.zeros(max(len(held), len(shifted)))
                    grown[:len(held)] += held
                    grown[:len(shifted)] += shifted
                    steps[nxt] = grown
            else:  # the last step: tokens nxt - first in n + 1 steps
                n = np.arange(1, len(by_n) + 1)
                tau += float((by_n * p * (nxt - first) / n).sum())
    expected = float(visits.sum())
    return ExpectedSteps(tau=tau, steps=expected, tokens=float((histogram * np.arange(1, B + 1)).sum()),
                         histogram=histogram.tolist(), reached=reached.tolist(), accepted=accepted.tolist(),
                         clipped=clipped)


def position_reach(a: np.ndarray, prompt_len: int, end: int, length: int, block_size: int) -> np.ndarray:
    """r[s - prompt_len, k - 1]: the probability, over the acceptance coins given the reference, that a decode step
    starts at s and compares its draft position k (its first k - 1 drafts accepted). As in expected_steps, a last
    step's position k where the reference ends (k = the tokens left) is left out. a as expected_steps takes it."""
    first, B = prompt_len, block_size
    reach = np.zeros_like(a)
    for s, v in enumerate(start_probabilities(a, prompt_len, end, length, block_size), start=first):
        if v == 0:
            continue
        counted = min(B - 1, length - 2 - s)  # positions k < the tokens left
        reach[s - first, :counted] = v * np.concatenate([[1.0], np.cumprod(a[s - first, :counted - 1])])[:counted]
    return reach


def start_probabilities(a: np.ndarray, prompt_len: int, end: int, length: int, block_size: int) -> np.ndarray:
    """v[s - prompt_len]: the probability, over the acceptance coins given the reference, that a decode step starts at
    s, for s = prompt_len .. end - 2. a as expected_steps takes it."""
    first = prompt_len
    visits = np.zeros(end - first)
    visits[0] = 1.0 if first + 1 < end else 0.0
    for s in range(first, end - 1):
        v = visits[s - first]
        if v == 0:
            continue
        for step, p in step_distribution(a[s - first], length - 1 - s, block_size):
            if s + step + 1 < end:
                visits[s + step - first] += v * p
    return visits[:max(end - 1 - first, 0)]


def coin_seed(seed: int, reference: str) -> int:
    """The seed of one reference's acceptance coins: from the run's seed and the reference's id, so that a
    reference's coins are the same whatever group or process replays it."""
    digest = hashlib.sha256(f"coins\0{seed}\0{reference}".encode()).digest()
    return int.from_bytes(digest[:8], "little")


def coin_steps(a: np.ndarray, prompt_len: int, end: int, length: int, block_size: int,
               seed: int) -> tuple[list[int], list[int]]:
    """One realisation of the decode steps, each draft accepted when its coin u < a: (starts, acceptance lengths).
    The coins of the block started at s are drawn from a generator seeded by (seed, s), so any one block's draw is
    the same however the replay reaches it."""
    starts, lengths = [], []
    s = prompt_len
    while s + 1 < end:
        available = length - 1 - s
        compared = min(block_size - 1, available)
        coins = np.random.default_rng([seed, s]).random(block_size - 1)
        drafts = int(np.cumprod(coins[:compared] < a[s - prompt_len, :compared]).sum())
        step = min(drafts + 1, available)
        starts.append(s)
        lengths.append(step)
        s += step
    return starts, lengths
