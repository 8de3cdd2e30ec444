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
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_core.decoding import decode
from dflash_core.drafter import load_drafter
from dflash_core.features import extract_features
from dflash_core.replay import Reference, replay
from tests.package_loop import sampled_taus, within

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


@pytest.mark.parametrize("setting", GOLDEN["sampled"], ids=lambda s: f"T={s['temperature']:g}-k{s['top_k']}-p{s['top_p']:g}")
def test_sampled_drafts_tau_lies_within_4_standard_errors_of_the_package_loop(pair, setting):
    target, drafter = pair
    taus = sampled_taus(target, drafter, GOLDEN, setting, SAMPLES)
    assert within(taus["sampled drafts"], taus["package"], 4)
    assert not within(taus["greedy drafts"], taus["package"], 4)
