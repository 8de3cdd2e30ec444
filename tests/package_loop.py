"""What the golden tests against dflash 0.1.0's own loop share (tests/test_dflash010_golden.py, DFlash, and
tests/test_dflash2_golden.py, DFlash2): our tau with sampled drafts, over sampled references of our own, beside the
package's recorded runs."""

import math

import numpy as np
import torch

from dflash_core.decoding import decode
from dflash_core.features import extract
from dflash_core.replay import Reference, replay
from dflash_core.sampled_drafts import SampledDrafts, coin_seed
from dflash_core.sampling import Sampling, sample_seed


def macro_with_error(per_prompt: list[list[float]]) -> tuple[float, float]:
    """The mean over prompts of each prompt's mean, and its standard error over the runs (prompts held fixed)."""
    means = [np.mean(v) for v in per_prompt]
    return float(np.mean(means)), math.sqrt(sum(np.var(v, ddof=1) / len(v) for v in per_prompt)) / len(per_prompt)


def sampled_taus(target, drafter, golden: dict, setting: dict, samples: int) -> dict[str, tuple[float, float]]:
    """(tau, standard error) at one recorded sampled setting: `package` (its runs), `sampled drafts` (ours, the
    expectation over the acceptance coins, `samples` references per prompt), `greedy drafts` (the argmax-draft rule
    over the same references) and, for DFlash2, `unary head` (its head's q alone). Runs and references without a
    target step (the first token a stop) are left out, as the package's summary leaves them out."""
    meta = golden["metadata"]
    prompts = [p["input_ids"] for p in meta["prompts"]]
    sampling = Sampling(setting["temperature"], setting["top_k"], setting["top_p"])
    references = [Reference(len(prompt), decode(target, prompt, meta["max_new_tokens"], meta["stop_token_ids"],
                                                sampling, torch.Generator().manual_seed(sample_seed(0, i, k))))
                  for i, prompt in enumerate(prompts) for k in range(samples)]
    extracted = extract(target, [r.token_ids for r in references], drafter.target_layer_ids, probabilities=sampling)
    features = [e.features for e in extracted]
    sampled = replay(drafter, target.embed_weight, target.head_weight, references, features,
                     sampled=SampledDrafts(sampling, [e.probabilities for e in extracted],
                                           [coin_seed(0, str(n)) for n in range(len(references))]))
    greedy_drafts = replay(drafter, target.embed_weight, target.head_weight, references, features)

    def per_prompt(taus) -> list[list[float]]:
        return [[t for t in taus[i * samples:(i + 1) * samples] if t is not None] for i in range(len(prompts))]

    taus = {
        "package": macro_with_error([[float(np.mean(a)) for a in p["acceptance_lengths"] if a]
                                     for p in setting["prompts"]]),
        "sampled drafts": macro_with_error(per_prompt([r.expected.tau if r.acceptance_lengths else None
                                                       for r in sampled])),
        "greedy drafts": macro_with_error(per_prompt([float(np.mean(r.acceptance_lengths)) if r.acceptance_lengths
                                                      else None for r in greedy_drafts])),
    }
    if drafter.generation.BASE_WALK is not None:
        taus["unary head"] = macro_with_error(per_prompt([r.base.expected.tau if r.acceptance_lengths else None
                                                          for r in sampled]))
    print(f"{sampling.describe()}: " + ", ".join(f"{name} {tau:.4f} +- {error:.4f}" for name, (tau, error) in taus.items()))
    return taus


def within(a: tuple[float, float], b: tuple[float, float], standard_errors: float) -> bool:
    """Whether two (tau, standard error) lie within that many standard errors of their difference."""
    return abs(a[0] - b[0]) < standard_errors * math.hypot(a[1], b[1])
