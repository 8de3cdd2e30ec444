"""The sampled-drafts rule's replay (dflash_core.sampled_drafts): its expectation over the acceptance coins equals
the enumeration of every draw of the coins, its draws are seeded, and with acceptance probabilities of 0 and 1 it
is the greedy rule."""

import itertools
import math

import numpy as np
import pytest
import torch

from dflash_core.metrics import PromptScore, histogram, position_counts
from dflash_core.sampled_drafts import acceptance, coin_seed, coin_steps, expected_steps

CASES = [  # (prompt_len, end, length, block_size)
    (2, 9, 9, 4),  # no lookahead: the last step may be clipped
    (3, 10, 13, 4),  # lookahead tokens past the end
    (1, 8, 8, 3),
    (4, 6, 6, 5),  # fewer completion tokens than a block
]


def every_draw(a: np.ndarray, prompt_len: int, end: int, length: int, block_size: int):
    """(probability, starts, acceptance lengths) of every draw of the coins: each draft position's coin is a
    Bernoulli(a) on its own, the block's accepted drafts its leading successes (no formula shared with the code)."""
    draws = []

    def walk(s: int, probability: float, starts: list[int], lengths: list[int]):
        if not s + 1 < end:
            draws.append((probability, starts, lengths))
            return
        available = length - 1 - s
        compared = min(block_size - 1, available)
        by_length: dict[int, float] = {}
        for bits in itertools.product((0, 1), repeat=compared):
            p = math.prod(a[s - prompt_len, k] if bit else 1 - a[s - prompt_len, k] for k, bit in enumerate(bits))
            leading = next((k for k, bit in enumerate(bits) if not bit), compared)
            step = min(leading + 1, available)
            by_length[step] = by_length.get(step, 0.0) + p
        for step, p in by_length.items():
            if p > 0:
                walk(s + step, probability * p, [*starts, s], [*lengths, step])

    walk(prompt_len, 1.0, [], [])
    return draws


def random_acceptances(rng: np.random.Generator, rows: int, block_size: int) -> np.ndarray:
    a = rng.random((rows, block_size - 1))
    a[rng.random(a.shape) < 0.2] = 0.0  # drafts outside q's support
    a[rng.random(a.shape) < 0.2] = 1.0  # q(y) >= p(y)
    return a


@pytest.mark.parametrize("case", CASES)
def test_the_expectation_is_the_mean_over_every_draw_of_the_coins(case):
    prompt_len, end, length, block_size = case
    rng = np.random.default_rng(sum(case))
    for _ in range(5):
        a = random_acceptances(rng, end - 1 - prompt_len, block_size)
        draws = every_draw(a, prompt_len, end, length, block_size)
        assert math.isclose(sum(p for p, _, _ in draws), 1.0, rel_tol=1e-12)
        scores = [(p, PromptScore("r", None, lengths, starts, length)) for p, starts, lengths in draws]
        expected = expected_steps(a, prompt_len, end, length, block_size)
        assert expected.tau == pytest.approx(sum(p * s.tau for p, s in scores), rel=1e-12)
        assert expected.steps == pytest.approx(sum(p * len(s.acceptance_lengths) for p, s in scores), rel=1e-12)
        assert expected.tokens == pytest.approx(sum(p * sum(s.acceptance_lengths) for p, s in scores), rel=1e-12)
        assert expected.histogram == pytest.approx(
            np.sum([p * np.array(histogram([s], block_size)) for p, s in scores], axis=0).tolist(), rel=1e-12)
        reached, accepted = (np.sum([p * np.array(position_counts([s], block_size)[i]) for p, s in scores], axis=0)
                             for i in (0, 1))
        assert expected.reached == pytest.approx(reached.tolist(), rel=1e-12, abs=1e-15)
        assert expected.accepted == pytest.approx(accepted.tolist(), rel=1e-12, abs=1e-15)
        assert expected.clipped == pytest.approx(sum(p * s.last_step_clipped(block_size) for p, s in scores), abs=1e-12)


def test_a_completion_without_a_decode_step_has_none_in_expectation_either():
    expected = expected_steps(np.zeros((0, 3)), 5, 6, 6, 4)
    assert (expected.steps, expected.tokens, expected.tau) == (0.0, 0.0, 0.0)
    assert coin_steps(np.zeros((0, 3)), 5, 6, 6, 4, seed=0) == ([], [])


def test_acceptance_probabilities_of_0_and_1_are_the_greedy_rule():
    """q one-hot on the drafter's argmax: a = 1 where the draft is the emitted token, else 0; the expectation is then
    the one path greedy decoding takes, and every draw of the coins is that path."""
    prompt_len, end, length, block_size = CASES[0]
    matches = np.array([[1, 1, 0], [0, 1, 1], [1, 1, 1], [1, 0, 1], [0, 0, 0], [1, 1, 1]], dtype=float)
    expected = expected_steps(matches, prompt_len, end, length, block_size)
    starts, lengths = coin_steps(matches, prompt_len, end, length, block_size, seed=7)
    # by hand: at 2, two drafts then a miss (3 tokens); at 5 one draft (2); at 7 the one token left (clipped)
    assert (starts, lengths) == ([2, 5, 7], [3, 2, 1])
    assert expected.tau == pytest.approx(sum(lengths) / len(lengths)) and expected.steps == len(lengths)
    assert coin_steps(matches, prompt_len, end, length, block_size, seed=8) == (starts, lengths)
    q = torch.tensor([1.0, 0.0, 0.0, 1.0])
    p = torch.tensor([0.3, 0.3, 0.0, 0.0])
    assert acceptance(q, p).tolist() == [1.0, 0.0, 0.0, 1.0]  # p = 0 < q: a token the target's numbers lost


def test_the_coins_are_seeded_per_reference_and_block_and_average_to_the_expectation():
    prompt_len, end, length, block_size = 3, 40, 40, 5
    a = random_acceptances(np.random.default_rng(0), end - 1 - prompt_len, block_size)
    first = coin_steps(a, prompt_len, end, length, block_size, coin_seed(0, "p1#s0"))
    assert first == coin_steps(a, prompt_len, end, length, block_size, coin_seed(0, "p1#s0"))
    assert coin_seed(0, "p1#s0") != coin_seed(0, "p1#s1") != coin_seed(1, "p1#s0")
    taus = [np.mean(coin_steps(a, prompt_len, end, length, block_size, coin_seed(seed, "r"))[1]) for seed in range(4000)]
    expected = expected_steps(a, prompt_len, end, length, block_size)
    assert abs(np.mean(taus) - expected.tau) < 4 * np.std(taus) / np.sqrt(len(taus))


def test_the_logit_transforms_change_sampled_drafts_and_leave_greedy_ones():
    """output_multiplier and final_logit_softcapping cannot change an argmax, but they shape q: z-lab's
    compute_logits applies both, and so do sampled drafts here."""
    from transformers import Qwen3ForCausalLM

    from dflash_core.decoding import decode
    from dflash_core.features import extract
    from dflash_core.replay import BlockScorer, Reference, replay
    from dflash_core.sampled_drafts import SampledDrafts
    from dflash_core.sampling import Sampling
    from dflash_core.target import Target
    from tests.drafters import drafter_config, random_drafter
    from tests.tiny_models import qwen3_config

    torch.manual_seed(0)
    target = Target.from_model(Qwen3ForCausalLM(qwen3_config(vocab_size=24, num_hidden_layers=4, initializer_range=0.2)))
    raw = drafter_config(hidden_size=64, layer_ids=(0, 2))
    transformed = {**raw, "dflash_config": {**raw["dflash_config"], "output_multiplier": 0.25,
                                            "final_logit_softcapping": 2.0}}
    plain, scaled = random_drafter(raw, seed=1, scale=3.0), random_drafter(transformed, seed=1, scale=3.0)
    assert (scaled.cfg.output_multiplier, scaled.cfg.final_logit_softcapping) == (0.25, 2.0)
    sampling = Sampling(temperature=1.0)
    references = [Reference(3, decode(target, [5, 9, 7], 30, (), sampling, torch.Generator().manual_seed(seed)))
                  for seed in range(4)]
    extracted = extract(target, [r.token_ids for r in references], plain.target_layer_ids, probabilities=sampling)
    features = [e.features for e in extracted]
    args = (target.embed_weight, target.head_weight, references, features)
    assert [r.acceptance_lengths for r in replay(plain, *args)] == [r.acceptance_lengths for r in replay(scaled, *args)]
    sampled = SampledDrafts(sampling, [e.probabilities for e in extracted], [0, 1, 2, 3])
    taus = [[r.expected.tau for r in replay(drafter, *args, sampled=sampled)] for drafter in (plain, scaled)]
    assert taus[0] != pytest.approx(taus[1], abs=1e-3)
    # the acceptance probability of one draft, from the transformed logits' q by hand
    scorer = BlockScorer(scaled, target.embed_weight, target.head_weight, references[:1], features[:1])
    (a,) = scorer.acceptance_probabilities([(0, 3)], sampling, sampled.target_probabilities, every_position=True).drafts
    with torch.no_grad():
        hidden = scorer._hidden([(0, 3)], scorer._truth([(0, 3)]))[0, 1]
        q = torch.softmax(torch.tanh(0.25 * (hidden @ target.head_weight.T) / 2.0) * 2.0, -1)
    y = references[0].token_ids[4]
    assert float(a[0]) == pytest.approx(min(1.0, float(q[y]) / float(extracted[0].probabilities[4])), rel=1e-5)
