"""Acceptance-length metrics on hand-computed examples."""

import pytest

from dflash_core.metrics import (
    PromptScore,
    bootstrap_interval,
    histogram,
    position_acceptance,
    projected_speedup,
    summarize,
    tau_macro,
    tau_pooled,
)


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


def test_position_acceptance_is_conditional_on_the_earlier_positions():
    # B = 4: lengths 3, 1, 4 -> position 1 accepted in 2 of 3 steps; position 2 in 2 of the 2 that got
    # there; position 3 in 1 of 2
    assert position_acceptance([prompt([3, 1, 4], [5, 8, 9], 40)], block_size=4) == [2 / 3, 1.0, 0.5]
    # a clipped last step (2 tokens left at start 8, both taken) reached only its accepted position
    assert position_acceptance([prompt([3, 2], [5, 8], 11)], block_size=4) == [1.0, 1.0, 0.0]
    assert position_acceptance([prompt([1, 1], [5, 6], 40)], block_size=4) == [0.0, None, None]


def test_bootstrap_interval_brackets_the_estimate_and_collapses_when_prompts_agree():
    varied = [prompt([k, 1], [5, 5 + k], 60, id=str(k)) for k in range(1, 9)]
    low, high = bootstrap_interval(varied, tau_macro)
    assert low < tau_macro(varied) < high
    assert bootstrap_interval(varied, tau_macro) == (low, high)  # seeded: reproducible
    same = [prompt([3, 3], [5, 8], 60, id=str(i)) for i in range(5)]
    assert bootstrap_interval(same, tau_macro) == (3.0, 3.0)


def test_samples_of_one_prompt_resample_together():
    """Two levels (prompts, then samples within a prompt): 4 equal samples of each of 5 prompts vary as 5
    prompts do, not as 20 independent references would; and spread within a prompt widens the interval."""
    taus = [1, 2, 3, 4, 5]
    grouped = [PromptScore(f"p{t}#s{k}", None, [t, t], [5, 5 + t], 60, prompt=f"p{t}") for t in taus for k in range(4)]
    independent = [PromptScore(p.id, None, p.acceptance_lengths, p.starts, 60) for p in grouped]
    low, high = bootstrap_interval(grouped, tau_macro)
    low_i, high_i = bootstrap_interval(independent, tau_macro)
    assert high - low > 1.5 * (high_i - low_i)
    assert summarize(grouped, 8)["samples_per_prompt"] == 4 and summarize(independent, 8)["samples_per_prompt"] == 1
    spread = [PromptScore(f"p#s{k}", None, [t, t], [5, 5 + t], 60, prompt="p") for k, t in enumerate((1, 5))]
    constant = [PromptScore(f"p#s{k}", None, [3, 3], [5, 8], 60, prompt="p") for k in range(2)]
    assert bootstrap_interval(constant, tau_macro) == (3.0, 3.0)
    assert bootstrap_interval(spread, tau_macro) != (3.0, 3.0)


def test_summary_has_categories_intervals_positions_and_speedups():
    prompts = [prompt([4, 2], [5, 9], 60, "a", "math"), prompt([1, 1, 2], [5, 6, 7], 60, "b", "code"),
               prompt([3], [5], 60, "c", "math")]
    summary = summarize(prompts, block_size=4)
    assert summary["tau_by_category"] == {"code": pytest.approx(4 / 3), "math": pytest.approx((3 + 3) / 2)}
    assert summary["tau_macro_ci95"][0] <= summary["tau_macro"] <= summary["tau_macro_ci95"][1]
    assert len(summary["position_acceptance"]) == 3
    assert summary["projected_speedup"]["0.1"] == pytest.approx(projected_speedup(summary["tau_macro"], 0.1))
    assert projected_speedup(3.0, 0.5) == pytest.approx(2.0)
