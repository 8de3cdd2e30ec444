"""Acceptance-length metrics on hand-computed examples."""

import pytest

from dflash_core.metrics import PromptScore, histogram, summarize, tau_macro, tau_pooled


def prompt(lengths, starts, reference_len, id="p", category=None):
    return PromptScore(id, category, lengths, starts, reference_len)


def test_macro_and_pooled_tau_weigh_prompts_differently():
    long = prompt([4, 4, 4, 4], [10, 14, 18, 22], 27, "long")  # 16 tokens in 4 steps
    short = prompt([1, 1], [10, 11], 13, "short")  # 2 tokens in 2 steps
    assert tau_macro([long, short]) == pytest.approx((4 + 1) / 2)
    assert tau_pooled([long, short]) == pytest.approx(18 / 6)
    assert histogram([long, short], block_size=4) == [2, 0, 0, 4]


def test_last_step_clipped_when_it_took_every_token_the_reference_had():
    # reference of 20 tokens: the step at 17 can emit at most 20 - 1 - 17 = 2 tokens
    assert prompt([8, 2], [9, 17], 20).last_step_clipped(block_size=8)
    # the step at 17 stopped at a mismatch before the reference ran out
    assert not prompt([8, 1], [9, 17], 20).last_step_clipped(block_size=8)
    # a whole block accepted exactly where the reference ends is a full step, not a clipped one
    assert not prompt([8, 8], [9, 17], 26).last_step_clipped(block_size=8)


def test_summary_leaves_out_prompts_without_a_step_and_reports_them():
    scored = prompt([3, 2], [5, 8], 11, "a", "math")
    empty = prompt([], [], 6, "b", "code")  # the target stopped right after the prompt
    summary = summarize([scored, empty], block_size=4)
    assert summary["tau_macro"] == pytest.approx(2.5) and summary["tau_pooled"] == pytest.approx(2.5)
    assert summary["histogram"] == {"1": 0, "2": 1, "3": 1, "4": 0}
    assert (summary["n_prompts"], summary["n_scored_prompts"], summary["n_steps"], summary["n_tokens"]) == (2, 1, 2, 5)
    assert summary["clipped_last_steps"] == 1  # 10 - 8 = 2 tokens left at start 8, both taken
    assert [p["id"] for p in summary["per_prompt"]] == ["a", "b"]
    assert summary["per_prompt"][1]["tau"] is None
    with pytest.raises(ValueError, match="no prompt"):
        summarize([empty], block_size=4)
