"""Acceptance-length metrics: tau (macro and pooled), the histogram over 1..B, the clipped last steps.

An acceptance length is the number of tokens one target step emits: the accepted drafts plus the
target's bonus token, 1..B for block size B.

- tau_macro: mean over prompts of each prompt's mean acceptance length (what z-lab reports).
- tau_pooled: total emitted tokens / total target steps (what vLLM and SpecForge report).
  Long completions weigh more in the pooled number.

A reference ends where the target stopped, so a prompt's last step can only be compared against the
tokens the reference holds: when that step accepted all of them and its block reached past the end,
it is *clipped* (it might have been longer had the target gone on). Online decoding stops at the
same place, so clipped steps are exactly what a real run emits; they are counted and reported.
"""

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PromptScore:
    """One prompt's decode steps. starts[i] is the position of step i's first token."""

    id: str
    category: str | None
    acceptance_lengths: list[int]
    starts: list[int]
    reference_len: int  # prompt + completion (+ lookahead) tokens

    @property
    def tau(self) -> float:
        return sum(self.acceptance_lengths) / len(self.acceptance_lengths)

    def last_step_clipped(self, block_size: int) -> bool:
        """Whether the last step accepted every token the reference still had, fewer than a block
        (with more reference tokens it might have been longer)."""
        available = self.reference_len - 1 - self.starts[-1]
        return self.acceptance_lengths[-1] == available < block_size


def tau_macro(prompts: Sequence[PromptScore]) -> float:
    """Mean over prompts of each prompt's mean acceptance length."""
    return sum(p.tau for p in prompts) / len(prompts)


def tau_pooled(prompts: Sequence[PromptScore]) -> float:
    """Total tokens emitted / total target steps over all prompts."""
    return sum(sum(p.acceptance_lengths) for p in prompts) / sum(len(p.acceptance_lengths) for p in prompts)


def histogram(prompts: Sequence[PromptScore], block_size: int) -> list[int]:
    """counts[k - 1] = number of steps with acceptance length k, for k = 1..block_size."""
    counts = [0] * block_size
    for p in prompts:
        for length in p.acceptance_lengths:
            counts[length - 1] += 1
    return counts


CLIPPING_NOTE = (
    "Each reference ends where the target stopped, so a prompt's last step is scored against the tokens the "
    "reference holds (clipped); online decoding stops at the same place."
)
LOOKAHEAD_NOTE = (
    "Each reference holds B-1 greedy tokens past where the target stopped (lookahead), so every step, the "
    "last one included, is scored against a whole block; a last step may count tokens past the stop."
)


def summarize(prompts: Sequence[PromptScore], block_size: int, lookahead: bool = False) -> dict:
    """The scores record: tau (macro, pooled), histogram, clipped steps and per-prompt detail (JSON-able).

    Prompts without any decode step (the target stopped right after the prompt) have no acceptance
    length; they are listed in `per_prompt` with tau None and left out of every aggregate.
    lookahead: whether the references hold lookahead tokens (only recorded and explained here).
    """
    scored = [p for p in prompts if p.acceptance_lengths]
    if not scored:
        raise ValueError("no prompt has a decode step to score (every reference ends right after its prompt)")
    return {
        "tau_macro": tau_macro(scored),
        "tau_pooled": tau_pooled(scored),
        "block_size": block_size,
        "histogram": {str(k): n for k, n in enumerate(histogram(scored, block_size), start=1)},
        "n_prompts": len(prompts),
        "n_scored_prompts": len(scored),
        "n_steps": sum(len(p.acceptance_lengths) for p in scored),
        "n_tokens": sum(sum(p.acceptance_lengths) for p in scored),
        "clipped_last_steps": sum(p.last_step_clipped(block_size) for p in scored),
        "lookahead": lookahead,
        "clipping_note": LOOKAHEAD_NOTE if lookahead else CLIPPING_NOTE,
        "per_prompt": [
            {
                "id": p.id,
                "category": p.category,
                "tau": p.tau if p.acceptance_lengths else None,
                "acceptance_lengths": p.acceptance_lengths,
                "last_step_clipped": p.last_step_clipped(block_size) if p.acceptance_lengths else False,
            }
            for p in prompts
        ],
    }
