"""Acceptance-length metrics: tau (macro and pooled), the histogram over 1..B, the clipped last steps.

An acceptance length is the number of tokens one target step emits: the accepted drafts plus the
target's bonus token, 1..B for block size B.

- tau_macro: mean over prompts of each prompt's mean acceptance length (what z-lab reports).
- tau_pooled: total emitted tokens / total target steps (what vLLM and SpecForge report).
  Long completions weigh more in the pooled number.

- position_acceptance: P(draft position k accepted | positions < k accepted), k = 1..B-1: where
  a drafter loses its way inside the block.
- 95% intervals: percentile bootstrap over prompts (the prompt is the unit that varies); with several
  sampled completions per prompt (temperature > 0), a two-level bootstrap: prompts, then the samples
  within each prompt drawn.
- projected speedup: tau / (1 + c) for a drafter forward costing c target forwards, an upper bound (a step
  verifying a block is taken to cost one decode step).

With sampled drafts (dflash_core.sampled_drafts) a prompt's steps are known in expectation over the acceptance
coins (`PromptScore.expected`): its tau is the expected tau, and the counts below (steps, tokens, histogram,
positions, clipped steps) are expected counts; `acceptance_lengths` then hold one draw of the coins.

No decoding gives a tau below 1 (a step emits the target's token at least) or above B (it verifies B tokens), nor
one that is not a number: `summarize` refuses such a tau (ImpossibleTau) rather than let a bug or bad numbers
upstream (a drafter's logits made NaN) be stored as a result.

A reference ends where the target stopped, so a prompt's last step can only be compared against the
tokens the reference holds: when that step accepted all of them and its block reached past the end,
it is *clipped* (it might have been longer had the target gone on). Online decoding stops at the
same place, so clipped steps are exactly what a real run emits; they are counted and reported.
"""

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol


class ImpossibleTau(ValueError):
    """A tau no decoding can give (below 1, above the tokens a step verifies, or not a number): never stored."""


# Draft/target forward-cost ratios the scores project speedups for (a 5-layer drafter over a 64-layer
# target is ~0.05-0.1 of a target forward).
SPEEDUP_COST_RATIOS = (0.05, 0.1, 0.2)


@dataclass(frozen=True)
class PromptScore:
    """One prompt's decode steps. starts[i] is the position of step i's first token."""

    id: str
    category: str | None
    acceptance_lengths: list[int]
    starts: list[int]
    reference_len: int  # prompt + completion (+ lookahead) tokens
    prompt: str | None = None  # the prompt (and turn) this reference is a sample of; None: its own id
    expected: Any = None  # sampled drafts: dflash_core.sampled_drafts.ExpectedSteps; None: the steps are exact

    @property
    def tau(self) -> float:
        return tau_of(self)

    def last_step_clipped(self, block_size: int) -> bool:
        """Whether the last step accepted every token the reference still had, fewer than a block
        (with more reference tokens it might have been longer)."""
        available = self.reference_len - 1 - self.starts[-1]
        return self.acceptance_lengths[-1] == available < block_size


class Steps(Protocol):
    """One prompt's decode steps: a PromptScore, or a replay's ReplayResult."""

    @property
    def acceptance_lengths(self) -> Sequence[int]: ...


def mean_acceptance(acceptance_lengths: Sequence[int]) -> float:
    """One prompt's tau: its mean acceptance length (tokens emitted per target step)."""
    return sum(acceptance_lengths) / len(acceptance_lengths)


def tau_of(steps: Steps) -> float:
    """One prompt's tau: its expected tau with sampled drafts (an `expected` with one), else its mean acceptance
    length."""
    expected = getattr(steps, "expected", None)
    return expected.tau if expected is not None else mean_acceptance(steps.acceptance_lengths)


def tau_macro(prompts: Sequence[Steps]) -> float:
    """Mean over prompts of each prompt's tau (each prompt with one step or more)."""
    return sum(tau_of(p) for p in prompts) / len(prompts)


def teacher_forced_accuracy(position_hits: Sequence[Sequence[Sequence[int]]]) -> list[float | None]:
    """Per draft position k = 1..B-1, the share of blocks (a block at every position of every completion)
    whose position k matched the reference whatever the positions before it did: the accuracy training
    logs. position_hits: per prompt, per position, (hits, blocks compared) (dflash_core.replay)."""
    positions = len(position_hits[0]) if position_hits else 0
    hits = [sum(p[k][0] for p in position_hits) for k in range(positions)]
    compared = [sum(p[k][1] for p in position_hits) for k in range(positions)]
    return [h / n if n else None for h, n in zip(hits, compared)]


def _tokens(p: PromptScore) -> float:
    return p.expected.tokens if p.expected is not None else sum(p.acceptance_lengths)


def _steps(p: PromptScore) -> float:
    return p.expected.steps if p.expected is not None else len(p.acceptance_lengths)


def tau_pooled(prompts: Sequence[PromptScore]) -> float:
    """Total tokens emitted / total target steps over all prompts (expected, with sampled drafts)."""
    return sum(_tokens(p) for p in prompts) / sum(_steps(p) for p in prompts)


def all_positions_tau(acceptance_by_position: Sequence[Sequence[int]]) -> float:
    """Mean acceptance length of a block drafted at every position of each completion (the
    all-positions mode of dflash_core.replay), macro-averaged over prompts. Unlike tau it does not
    follow the decode path, so it weighs every position once (what training losses average)."""
    per_prompt = [sum(lengths) / len(lengths) for lengths in acceptance_by_position if lengths]
    return sum(per_prompt) / len(per_prompt)


def histogram(prompts: Sequence[PromptScore], block_size: int) -> list[float]:
    """counts[k - 1] = number of steps with acceptance length k, for k = 1..block_size (expected, with sampled
    drafts)."""
    counts = [0.0] * block_size
    for p in prompts:
        if p.expected is not None:
            counts = [c + e for c, e in zip(counts, p.expected.histogram)]
            continue
        for length in p.acceptance_lengths:
            counts[length - 1] += 1
    return [whole(c) for c in counts]


def position_acceptance(prompts: Sequence[PromptScore], block_size: int) -> list[float | None]:
    """rates[k - 1] = P(draft position k accepted | positions < k accepted), k = 1..B-1.

    A step of length L accepted positions 1..L-1 and was rejected at position L (when L < B). A
    clipped last step compared no position after its last accepted one, so it counts only as reached
    for positions 1..L-1. None where no step reached position k."""
    reached, accepted = position_counts(prompts, block_size)
    return [a / r if r else None for a, r in zip(accepted, reached)]


def position_counts(prompts: Sequence[PromptScore], block_size: int) -> tuple[list, list]:
    """(reached, accepted): per draft position k = 1..B-1, the steps that compared it (every earlier one accepted)
    and those that accepted it (position_acceptance's rule for clipped last steps); expected, with sampled
    drafts."""
    reached, accepted = [0.0] * (block_size - 1), [0.0] * (block_size - 1)
    for p in prompts:
        if p.expected is not None:
            reached = [r + e for r, e in zip(reached, p.expected.reached)]
            accepted = [a + e for a, e in zip(accepted, p.expected.accepted)]
            continue
        for i, length in enumerate(p.acceptance_lengths):
            clipped = i == len(p.acceptance_lengths) - 1 and p.last_step_clipped(block_size)
            for k in range(1, min(length if not clipped else length - 1, block_size - 1) + 1):
                reached[k - 1] += 1
            for k in range(1, length):
                accepted[k - 1] += 1
    return [whole(r) for r in reached], [whole(a) for a in accepted]


def whole(count: float) -> int | float:
    """A count as an int where it is one (the exact steps), else as it is (an expectation)."""
    return int(count) if float(count).is_integer() else count


def clipped_last_steps(prompts: Sequence[PromptScore], block_size: int) -> int | float:
    """How many prompts' last step is clipped (its probability, summed, with sampled drafts)."""
    return whole(sum(p.expected.clipped if p.expected is not None else p.last_step_clipped(block_size)
                      for p in prompts))


def position_acceptance_intervals(prompts: Sequence[PromptScore], block_size: int, draws: int = 1000, seed: int = 0,
                                  level: float = 0.95) -> list[tuple[float, float] | None]:
    """95% interval of each position_acceptance rate: a percentile bootstrap over prompts (then samples within a
    prompt), as tau's, so that a rate from a handful of blocks shows as the guess it is. None where no step
    reached the position; where some draws never reach it, the interval is over the draws that do."""
    import numpy as np  # (only here: history and the report import this module, and only need plain Python)

    counts = np.array([position_counts([p], block_size) for p in prompts], dtype=np.float64)  # [N, 2, B-1]
    groups: dict[str, list[int]] = {}
    for n, p in enumerate(prompts):
        groups.setdefault(p.prompt or p.id, []).append(n)
    units = list(groups.values())
    rng = random.Random(seed)
    times_drawn = np.array([np.bincount(_two_levels(units, rng), minlength=len(prompts)) for _ in range(draws)])
    reached, accepted = (times_drawn @ counts[:, 0, :]), (times_drawn @ counts[:, 1, :])  # [draws, B-1] each
    rates = [(accepted[:, k][reached[:, k] > 0] / reached[:, k][reached[:, k] > 0]).tolist()
             for k in range(block_size - 1)]
    return [_percentiles(values, level) if values else None for values in rates]


def by_prompt(scores: Sequence[PromptScore]) -> list[list[PromptScore]]:
    """The references grouped by the prompt they sample (each reference alone when greedy), in order."""
    groups: dict[str, list[PromptScore]] = {}
    for p in scores:
        groups.setdefault(p.prompt or p.id, []).append(p)
    return list(groups.values())


def bootstrap_interval(prompts: Sequence[PromptScore], statistic, draws: int = 1000, seed: int = 0,
                       level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of statistic(prompts): prompts resampled with replacement, then, for a
    prompt with several samples, its samples resampled with replacement (two levels)."""
    rng = random.Random(seed)
    groups = by_prompt(prompts)
    return _percentiles([statistic(_two_levels(groups, rng)) for _ in range(draws)], level)


def _two_levels(groups: Sequence[Sequence], rng: random.Random) -> list:
    """One bootstrap draw: groups (prompts) with replacement, then within a drawn group of several (the
    samples of one prompt) its members with replacement."""
    drawn: list = []
    for group in (rng.choice(groups) for _ in groups):
        drawn += group if len(group) == 1 else [rng.choice(group) for _ in group]
    return drawn


def _percentiles(values: list[float], level: float) -> tuple[float, float]:
    """The percentile interval at `level` of bootstrap values."""
    values = sorted(values)
    return values[int((1 - level) / 2 * len(values))], values[min(len(values) - 1, int((1 + level) / 2 * len(values)))]


def paired_difference_interval(pairs: Sequence[tuple[str, float, float]], draws: int = 1000, seed: int = 0,
                               level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of a - b over references scored by two drafters on the same
    references: pairs (the prompt a reference samples, a's tau, b's tau), resampled together, prompts then
    the samples within a prompt (two levels, as bootstrap_interval). Pairing removes what the references
    share, so it is much narrower than comparing the two intervals."""
    groups: dict[str, list[float]] = {}
    for prompt, a, b in pairs:
        groups.setdefault(prompt, []).append(a - b)
    units = list(groups.values())
    rng = random.Random(seed)
    return _percentiles([sum(drawn) / len(drawn) for drawn in (_two_levels(units, rng) for _ in range(draws))], level)


def slope(xs: Sequence[float], ys: Sequence[float]) -> float:
    """Least-squares slope of ys against xs (0 when the xs do not vary)."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    spread = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / spread if spread else 0.0


def slope_interval(xs: Sequence[float], ys: Sequence[float], draws: int = 1000, seed: int = 0,
                   level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of slope(xs, ys), the (x, y) points resampled with replacement (e.g. a
    trainer's logged accuracy by step)."""
    rng = random.Random(seed)
    points = list(zip(xs, ys))
    values = []
    for _ in range(draws):
        drawn = [rng.choice(points) for _ in points]
        values.append(slope([x for x, _ in drawn], [y for _, y in drawn]))
    return _percentiles(values, level)


def paired_slope_interval(steps: Sequence[float], taus: Sequence[dict[str, tuple[str, float]]], draws: int = 1000,
                          seed: int = 0, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the slope of tau against the training step over several checkpoints
    scored on the same references: taus[i] = {reference id: (the prompt it samples, tau)} of the checkpoint
    at steps[i]. The references all of them scored are resampled together (prompts, then samples within a
    prompt, as bootstrap_interval) and each checkpoint's mean tau refitted: what the references share cancels."""
    shared = sorted(set.intersection(*(set(t) for t in taus)))
    if not shared:
        raise ValueError("the checkpoints share no scored reference")
    groups: dict[str, list[str]] = {}
    for ref in shared:
        groups.setdefault(taus[0][ref][0], []).append(ref)
    units = list(groups.values())
    rng = random.Random(seed)
    values = []
    for _ in range(draws):
        drawn = _two_levels(units, rng)
        values.append(slope(steps, [sum(t[ref][1] for ref in drawn) / len(drawn) for t in taus]))
    return _percentiles(values, level)


def projected_speedup(tau: float, cost_ratio: float) -> float:
    """An upper bound on the speedup: tokens per unit of target time when each step costs one target forward
    plus one drafter forward (DFlash drafts the whole block in one pass) of `cost_ratio` target forwards, and
    emits tau tokens; plain decoding emits one token per target forward. speedup = tau / (1 + c). Verifying a
    block of B tokens costs more than decoding one (it is only free while decoding is bound by memory
    bandwidth), so a real speedup is lower: --step-cost projects from a step's measured cost instead."""
    return tau / (1.0 + cost_ratio)


CLIPPING_NOTE = (
    "Each reference ends where the target stopped, so a prompt's last step is scored against the tokens the "
    "reference holds (clipped); online decoding stops at the same place."
)
LOOKAHEAD_NOTE = (
    "Each reference holds B-1 greedy tokens past where the target stopped (lookahead), so every step, the "
    "last one included, is scored against a whole block; a last step may count tokens past the stop."
)


def drawn_taus(prompts: Sequence[PromptScore]) -> dict[str, float]:
    """With sampled drafts: tau macro and pooled of the one draw of the acceptance coins the steps hold (what one
    served run would have logged; tau itself is their expectation)."""
    drawn = [PromptScore(p.id, p.category, p.acceptance_lengths, p.starts, p.reference_len, p.prompt) for p in prompts]
    return {"tau_macro": tau_macro(drawn), "tau_pooled": tau_pooled(drawn)}


def benchmark_summary(prompts: Sequence[PromptScore], groups: dict[str, str], draws: int = 1000,
                      seed: int = 0) -> dict:
    """Per benchmark (a prompt's category) and per group of benchmarks (`groups`: benchmark -> group, in the
    order to show them), as z-lab's tables give them: each benchmark's tau_macro with its 95% interval and
    responses, and each group's Average (the plain mean of its benchmarks' taus) with a stratified interval (each
    benchmark's prompts resampled within it). Beside them the same for tau_pooled (`tau_pooled`, `pooled_ci95`:
    what DeepSpec publishes), from the same resamples. Benchmarks without a scored prompt are left out."""
    scored = {name: [p for p in prompts if p.category == name and p.acceptance_lengths] for name in groups}
    scored = {name: ps for name, ps in scored.items() if ps}
    taus = {name: tau_macro(ps) for name, ps in scored.items()}
    pooled = {name: tau_pooled(ps) for name, ps in scored.items()}
    # each benchmark's bootstrap draws, once: its own interval, and (the same draw across benchmarks) its groups'
    rng = random.Random(seed)
    resamples = {name: [_two_levels(by_prompt(ps), rng) for _ in range(draws)] for name, ps in scored.items()}
    draws_by_name = {name: [tau_macro(r) for r in drawn] for name, drawn in resamples.items()}
    pooled_draws = {name: [tau_pooled(r) for r in drawn] for name, drawn in resamples.items()}
    benchmarks = {name: {"tau": taus[name], "ci95": _percentiles(draws_by_name[name], 0.95), "responses": len(ps),
                         "tau_pooled": pooled[name], "pooled_ci95": _percentiles(pooled_draws[name], 0.95)}
                  for name, ps in scored.items()}
    grouped: dict[str, list[str]] = {}
    for name in scored:
        grouped.setdefault(groups[name], []).append(name)
    averages = {}
    for group, names in grouped.items():
        means = [sum(draws_by_name[n][d] for n in names) / len(names) for d in range(draws)]
        pooled_means = [sum(pooled_draws[n][d] for n in names) / len(names) for d in range(draws)]
        averages[group] = {"tau": sum(taus[n] for n in names) / len(names),
                           "ci95": _percentiles(means, 0.95), "benchmarks": names,
                           "tau_pooled": sum(pooled[n] for n in names) / len(names),
                           "pooled_ci95": _percentiles(pooled_means, 0.95)}
    return {"benchmarks": benchmarks, "groups": averages}


def check_taus(prompts: Sequence[PromptScore], block_size: int) -> None:
    """Refuse (ImpossibleTau) a step's acceptance length, a prompt's tau or the pooled tau outside [1, block_size] or
    not a number: each step emits 1 to block_size tokens (the tokens it verifies), so any mean of them, or
    expectation, lies there."""
    slack = 1e-9 * block_size  # an expectation's rounding

    def outside(value: float) -> bool:
        return not 1 - slack <= value <= block_size + slack  # (NaN too)

    bad: list[tuple[str, float]] = [(f"an acceptance length of prompt {p.id}", a) for p in prompts
                                    for a in p.acceptance_lengths if outside(a)]
    bad += [(f"the tau of prompt {p.id}", p.tau) for p in prompts if outside(p.tau)]
    bad += [("tau_pooled", pooled) for pooled in [tau_pooled(prompts)] if outside(pooled)]
    if bad:
        name, value = bad[0]
        raise ImpossibleTau(
            f"{name}, {value:g}, lies outside [1, {block_size}]{f' (and {len(bad) - 1} more)' if len(bad) > 1 else ''}: "
            f"a step emits 1 to {block_size} tokens, so no decoding gives it, and no tau is stored. It comes from a bug "
            "or from numbers that are not finite upstream: check the drafter's config (its numbers) and weights, the "
            "target's weights, and the store (dflash-eval verify)")


def summarize(prompts: Sequence[PromptScore], block_size: int, lookahead: bool = False) -> dict:
    """The scores record: tau (macro, pooled), histogram, clipped steps and per-prompt detail (JSON-able).

    Prompts without any decode step (the target stopped right after the prompt) have no acceptance
    length; they are listed in `per_prompt` with tau None and left out of every aggregate.
    lookahead: whether the references hold lookahead tokens (only recorded and explained here).
    """
    scored = [p for p in prompts if p.acceptance_lengths]
    if not scored:
        raise ValueError("no prompt has a decode step to score (every reference ends right after its prompt)")
    check_taus(scored, block_size)
    categories = sorted({p.category for p in scored if p.category is not None})
    return {
        "tau_macro": tau_macro(scored),
        "tau_pooled": tau_pooled(scored),
        "tau_macro_ci95": bootstrap_interval(scored, tau_macro),
        "tau_pooled_ci95": bootstrap_interval(scored, tau_pooled),
        "block_size": block_size,
        "position_acceptance": position_acceptance(scored, block_size),
        "position_acceptance_ci95": position_acceptance_intervals(scored, block_size),
        # per draft position: the steps that compared it, and those that accepted it
        "position_counts": dict(zip(("reached", "accepted"), position_counts(scored, block_size))),
        "tau_by_category": {c: tau_macro([p for p in scored if p.category == c]) for c in categories},
        "projected_speedup": {str(c): projected_speedup(tau_macro(scored), c) for c in SPEEDUP_COST_RATIOS},
        "speedup_note": ("an upper bound: tau_macro / (1 + c) for a drafter forward costing c target forwards, "
                         "with verifying a block costing what one decode step costs (metrics.projected_speedup); "
                         "--step-cost projects from measured step costs"),
        "histogram": {str(k): n for k, n in enumerate(histogram(scored, block_size), start=1)},
        "n_prompts": len(prompts),
        "samples_per_prompt": max(len(g) for g in by_prompt(prompts)),  # 1: greedy
        "n_scored_prompts": len(scored),
        "n_steps": whole(sum(_steps(p) for p in scored)),
        "n_tokens": whole(sum(_tokens(p) for p in scored)),
        "clipped_last_steps": clipped_last_steps(scored, block_size),
        "lookahead": lookahead,
        "clipping_note": LOOKAHEAD_NOTE if lookahead else CLIPPING_NOTE,
        **({"tau_drawn": drawn_taus(scored)} if any(p.expected is not None for p in scored) else {}),
        "per_prompt": [
            {
                "id": p.id,
                "prompt": p.prompt,
                "category": p.category,
                "tau": p.tau if p.acceptance_lengths else None,
                "acceptance_lengths": p.acceptance_lengths,
                "last_step_clipped": p.last_step_clipped(block_size) if p.acceptance_lengths else False,
            }
            for p in prompts
        ],
    }
