"""The replay against z-lab's published decode loop, PyPI `dflash` 0.1.0, run once on a tiny trained pair stored
beside its record (tests/golden/dflash010/; tests/golden/make_dflash010_golden.py ran the package's own loop and
wrote what it emitted, tests/golden/dflash010_loop.json):

- greedy drafts: the replay over the loop's output takes the loop's steps, one by one, on every whole block (the
  package shortens its last verify blocks to the tokens left; serving stacks, and the replay, do not);
- sampled drafts (accepted by rejection sampling, as the package does at a temperature): the expected tau of our
  own sampled references lies within 4 standard errors of the mean of the package's 500 runs per prompt, at two
  settings; the greedy-draft rule over the same references does not (the metric the issue was about).
"""

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_core.decoding import decode
from dflash_core.drafter import load_drafter
from dflash_core.features import extract, extract_features
from dflash_core.replay import Reference, replay
from dflash_core.sampled_drafts import SampledDrafts, coin_seed
from dflash_core.sampling import Sampling, sample_seed

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

GOLDEN_DIR = Path(__file__).parent / "golden"
GOLDEN = json.loads((GOLDEN_DIR / "dflash010_loop.json").read_text())
META = GOLDEN["metadata"]
PROMPTS = [p["input_ids"] for p in META["prompts"]]
SAMPLES = 40  # our sampled references per prompt


@pytest.fixture(scope="module")
def pair():
    from dflash_core.target import load_target

    return (load_target(GOLDEN_DIR / "dflash010" / "target", dtype=torch.float32),
            load_drafter(GOLDEN_DIR / "dflash010" / "drafter"))


def test_greedy_drafts_take_the_package_loop_s_steps_on_every_whole_block(pair):
    target, drafter = pair
    B, stop = drafter.block_size, META["stop_token_ids"]
    compared = 0
    for prompt, run in zip(PROMPTS, GOLDEN["greedy"]):
        tokens = prompt + run["output_ids"]
        assert tokens == decode(target, prompt, META["max_new_tokens"], stop)  # the same target, the same greedy text
        reference = Reference(len(prompt), tokens)
        (ours,) = replay(drafter, target.embed_weight, target.head_weight, [reference],
                         extract_features(target, [tokens], drafter.target_layer_ids))
        starts = (len(prompt) + np.cumsum([0] + run["acceptance_lengths"][:-1])).tolist()
        whole = [(s, a) for s, a in zip(starts, run["acceptance_lengths"])
                 if s + B <= len(prompt) + META["max_new_tokens"]]
        assert list(zip(ours.starts, ours.acceptance_lengths))[:len(whole)] == whole
        compared += len(whole)
    assert compared >= 50 and GOLDEN["metadata"]["summary"]["greedy"]["tau"] > 2.5  # a drafter that drafts


def macro_with_error(per_prompt: list[list[float]]) -> tuple[float, float]:
    """The mean over prompts of each prompt's mean, and its standard error over the runs (prompts held fixed)."""
    means = [np.mean(v) for v in per_prompt]
    return float(np.mean(means)), math.sqrt(sum(np.var(v, ddof=1) / len(v) for v in per_prompt)) / len(per_prompt)


@pytest.mark.parametrize("setting", GOLDEN["sampled"], ids=lambda s: f"T={s['temperature']:g}-k{s['top_k']}-p{s['top_p']:g}")
def test_sampled_drafts_tau_lies_within_4_standard_errors_of_the_package_loop(pair, setting):
    target, drafter = pair
    sampling = Sampling(setting["temperature"], setting["top_k"], setting["top_p"])
    theirs, their_error = macro_with_error([[float(np.mean(a)) for a in p["acceptance_lengths"] if a]
                                            for p in setting["prompts"]])
    references = [Reference(len(prompt), decode(target, prompt, META["max_new_tokens"], META["stop_token_ids"], sampling,
                                                 torch.Generator().manual_seed(sample_seed(0, i, k))))
                  for i, prompt in enumerate(PROMPTS) for k in range(SAMPLES)]
    extracted = extract(target, [r.token_ids for r in references], drafter.target_layer_ids, probabilities=sampling)
    features = [e.features for e in extracted]
    sampled = replay(drafter, target.embed_weight, target.head_weight, references, features,
                     sampled=SampledDrafts(sampling, [e.probabilities for e in extracted],
                                           [coin_seed(0, str(n)) for n in range(len(references))]))
    greedy_drafts = replay(drafter, target.embed_weight, target.head_weight, references, features)

    def per_prompt(taus) -> list[list[float]]:
        return [[t for t in taus[i * SAMPLES:(i + 1) * SAMPLES] if t is not None] for i in range(len(PROMPTS))]

    ours, our_error = macro_with_error(per_prompt([r.expected.tau if r.acceptance_lengths else None for r in sampled]))
    argmax, argmax_error = macro_with_error(per_prompt([float(np.mean(r.acceptance_lengths)) if r.acceptance_lengths
                                                        else None for r in greedy_drafts]))
    print(f"{sampling.describe()}: dflash 0.1.0 {theirs:.4f} +- {their_error:.4f}, sampled drafts here {ours:.4f} +- "
          f"{our_error:.4f}, greedy drafts here {argmax:.4f} +- {argmax_error:.4f}")
    assert abs(ours - theirs) < 4 * math.hypot(our_error, their_error)
    assert abs(argmax - theirs) > 4 * math.hypot(argmax_error, their_error)
