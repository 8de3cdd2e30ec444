"""DFlash2: the replay against z-lab's published decode loop, PyPI `dflash` 0.1.0, run once with its DFlash2DraftModel
on a tiny trained pair (the DFlash golden case's target, tests/golden/dflash010/target, and a DFlash2 drafter trained
on it, tests/golden/dflash2/drafter; tests/golden/make_dflash2_golden.py ran the package's own loop and wrote what it
emitted, tests/golden/dflash2_loop.json):

- greedy drafts (the selector's argmax walk from the anchor): the replay over the loop's output takes the loop's
  steps, one by one, on every whole block (the package shortens its last verify blocks to the tokens left; serving
  stacks, and the replay, do not), and so does the online speculative decode; the unary head alone does not;
- the same with output_multiplier and final_logit_softcapping added to the drafter's config (0.1.0 applies both to
  the logits its selector adds to a pairing term, so they change the walk): taken, and missed without either;
- sampled drafts (the walk sampled from the selector's softmax(score / T) over its top K, accepted by rejection
  sampling, as the package does at a temperature): the expected tau of our own sampled references lies within
  4 standard errors of the mean of the package's runs, at two settings; the greedy-draft rule over the same
  references does not.
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from dflash_core.decoding import decode, speculative_decode
from dflash_core.drafter import load_drafter
from dflash_core.drafter_config import DrafterConfig
from dflash_core.features import extract_features
from dflash_core.replay import Reference, replay
from tests.package_loop import sampled_taus, within

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

GOLDEN_DIR = Path(__file__).parent / "golden"
DRAFTER = GOLDEN_DIR / "dflash2" / "drafter"
GOLDEN = json.loads((GOLDEN_DIR / "dflash2_loop.json").read_text())
META = GOLDEN["metadata"]
PROMPTS = [p["input_ids"] for p in META["prompts"]]
SAMPLES = 50  # our sampled references per prompt (at T=0.6 the greedy-draft rule is 5 standard errors off; 4 at 40)


@pytest.fixture(scope="module")
def target():
    from dflash_core.target import load_target

    return load_target(GOLDEN_DIR / "dflash010" / "target", dtype=torch.float32)


@pytest.fixture(scope="module")
def references(target):
    """The package's greedy outputs, each checked to be the target's own greedy text, as references."""
    references = []
    for prompt, run in zip(PROMPTS, GOLDEN["greedy"]):
        tokens = prompt + run["output_ids"]
        assert tokens == decode(target, prompt, META["max_new_tokens"], META["stop_token_ids"])
        references.append(Reference(len(prompt), tokens))
    return references


def variant_drafter(**dflash_config):
    """The stored drafter with its config's dflash_config updated (what the recording passed the package)."""
    raw = json.loads((DRAFTER / "config.json").read_text())
    raw["dflash_config"] = {**raw["dflash_config"], **dflash_config}
    return load_drafter(DRAFTER, config=DrafterConfig.from_dict(raw, source=f"{DRAFTER}/config.json + {dflash_config}"))


def whole_blocks(runs: list[dict]) -> list[list[tuple[int, int]]]:
    """Per run, the package loop's (start, acceptance length) steps whose verify block was whole."""
    B, out = META["block_size"], []
    for prompt, run in zip(PROMPTS, runs):
        starts = (len(prompt) + np.cumsum([0] + run["acceptance_lengths"][:-1])).tolist()
        out.append([(s, a) for s, a in zip(starts, run["acceptance_lengths"])
                    if s + B <= len(prompt) + META["max_new_tokens"]])
    return out


def taken(results, expected: list[list[tuple[int, int]]]) -> list[bool]:
    """Per run, whether a replay's (or decode's) steps begin with the package's whole-block steps."""
    return [list(zip(r.starts, r.acceptance_lengths))[:len(w)] == w for r, w in zip(results, expected)]


def test_greedy_drafts_take_the_package_loop_s_steps_on_every_whole_block(target, references):
    drafter = load_drafter(DRAFTER)
    assert drafter.generation.NAME == "DFlash2" and drafter.layers[0].attention_conv is not None
    expected = whole_blocks(GOLDEN["greedy"])
    features = extract_features(target, [r.token_ids for r in references], drafter.target_layer_ids)
    ours = replay(drafter, target.embed_weight, target.head_weight, references, features)
    assert taken(ours, expected) == [True] * len(PROMPTS)
    online = [speculative_decode(target, drafter, p, META["max_new_tokens"], META["stop_token_ids"]) for p in PROMPTS]
    assert [o.output_ids for o in online] == [r.token_ids for r in references]
    assert taken(online, expected) == [True] * len(PROMPTS)
    # the comparison tells the selector from its head: the unary head's argmax alone takes other steps
    assert not all(taken([r.base for r in ours], expected))
    assert sum(map(len, expected)) >= 60 and META["summary"]["greedy"]["tau"] > 3.5  # a drafter that drafts


def test_output_multiplier_and_softcap_change_the_walk_as_the_package_s(target, references):
    variant = META["variant"]["dflash_config"]
    expected = whole_blocks(GOLDEN["greedy_variant"])
    assert [r["output_ids"] for r in GOLDEN["greedy_variant"]] == [r["output_ids"] for r in GOLDEN["greedy"]]  # lossless
    assert expected != whole_blocks(GOLDEN["greedy"])  # the fields change the package's walk
    drafter = variant_drafter(**variant)
    assert (drafter.cfg.output_multiplier, drafter.cfg.final_logit_softcapping) == (
        variant["output_multiplier"], variant["final_logit_softcapping"])
    features = extract_features(target, [r.token_ids for r in references], drafter.target_layer_ids)
    assert taken(replay(drafter, target.embed_weight, target.head_weight, references, features),
                 expected) == [True] * len(PROMPTS)
    for dropped in ({"output_multiplier": 1.0}, {"final_logit_softcapping": None}):  # each field is needed
        without = variant_drafter(**{**variant, **dropped})
        assert not all(taken(replay(without, target.embed_weight, target.head_weight, references, features), expected))


@pytest.mark.parametrize("setting", GOLDEN["sampled"],
                         ids=lambda s: f"T={s['temperature']:g}-k{s['top_k']}-p{s['top_p']:g}")
def test_sampled_drafts_tau_lies_within_4_standard_errors_of_the_package_loop(target, setting):
    drafter = load_drafter(DRAFTER)
    taus = sampled_taus(target, drafter, GOLDEN, setting, SAMPLES)
    assert within(taus["sampled drafts"], taus["package"], 4)
    assert not within(taus["greedy drafts"], taus["package"], 4)
