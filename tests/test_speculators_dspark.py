"""A DSpark drafter saved by vLLM's speculators 0.9.0 (tests/golden/make_speculators_dspark_golden.py, run once in a
venv with its wheel: the DeepSpec golden case's tiny DSpark drafter, tests/golden/deepspec/dspark, written by
speculators' own `--draft-config` path, model class and trainer checkpointer into tests/golden/speculators_dspark/),
against what speculators' own DSpark model drafts at every block of the DeepSpec golden references
(tests/golden/speculators_dspark_golden.json):

- the save is read as the speculators save it is: `speculators_model_type "dspark"`, every slot drafting
  (`sample_from_anchor`), the aux ids one above DeepSpec's, the heads' fields, no embedding or head in the save;
- our drafts equal speculators' at every block and slot: the greedy Markov walk from the anchor, and each slot given
  the reference's token before it (what its training forward computes), and its confidences are ours;
- its drafts are DeepSpec's save's, weight for weight.
"""

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from dflash_core.drafter import load_drafter
from dflash_core.drafter_config import read_drafter_config
from dflash_core.features import extract_features
from dflash_core.generations.dspark import heads_of
from dflash_core.replay import BlockScorer, Reference

pytestmark = pytest.mark.usefixtures("one_thread")

GOLDEN_DIR = Path(__file__).parent / "golden"
GOLDEN = json.loads((GOLDEN_DIR / "speculators_dspark_golden.json").read_text())
SAVE = GOLDEN_DIR / GOLDEN["metadata"]["save"]
SEQUENCES = GOLDEN["sequences"]


@pytest.fixture(scope="module")
def target():
    from dflash_core.target import load_target

    return load_target(GOLDEN_DIR / "dflash010" / "target", dtype=torch.float32)


def test_a_speculators_dspark_save_loads_as_a_speculators_save():
    drafter = load_drafter(SAVE)
    assert drafter.cfg.source_format == "speculators" and not drafter.saved_token_head


def test_the_save_is_read_as_what_speculators_wrote():
    cfg = read_drafter_config(SAVE)
    raw = json.loads((SAVE / "config.json").read_text())
    deepspec = json.loads((GOLDEN_DIR / "deepspec" / "dspark" / "config.json").read_text())
    assert raw["speculators_model_type"] == "dspark" and raw["sample_from_anchor"] is True
    assert raw["aux_hidden_state_layer_ids"] == [i + 1 for i in deepspec["target_layer_ids"]]
    assert cfg.generation.NAME == "DSpark" and cfg.drafts_from_anchor and cfg.verified_tokens(cfg.block_size) == 8
    assert list(cfg.target_layer_ids) == deepspec["target_layer_ids"] and cfg.mask_token_id == deepspec["mask_token_id"]
    heads = heads_of(cfg)
    assert (heads.markov_rank, heads.markov_head_type, heads.confidence_head, heads.confidence_with_markov) == (
        deepspec["markov_rank"], deepspec["markov_head_type"], True, True)
    assert cfg.verifier_architectures == ("Qwen3ForCausalLM",)


@pytest.fixture(scope="module")
def scorer(target):
    drafter = load_drafter(SAVE)
    refs = [Reference(s["prompt_len"], s["input_ids"]) for s in SEQUENCES]
    return BlockScorer(drafter, target.embed_weight, target.head_weight, refs,
                       extract_features(target, [r.token_ids for r in refs], drafter.target_layer_ids))


def blocks_of(s: int, recorded: dict) -> list[tuple[int, int]]:
    return [(s, recorded["first_anchor"] + j) for j in range(len(recorded["drafts"]))]


def test_the_drafts_equal_speculators_own_at_every_block(scorer):
    near_ties = {(seq, anchor, slot) for r in GOLDEN["per_sequence"] for seq, anchor, slot, _ in r["near_ties"]}
    compared, differing = 0, []
    for s, (sequence, recorded) in enumerate(zip(SEQUENCES, GOLDEN["per_sequence"], strict=True)):
        blocks = blocks_of(s, recorded)
        for (_, anchor), mine, theirs in zip(blocks, scorer.draft_tokens(blocks), recorded["drafts"], strict=True):
            compared += len(theirs)
            differing += [(sequence["id"], anchor, k) for k, (a, b) in enumerate(zip(mine, theirs)) if a != b]
    # a walk that differs at a near tie drafts from another token after it: the block's later slots are left out
    tied = {(seq, anchor) for seq, anchor, _ in near_ties}
    assert compared > 2000 and [d for d in differing if d[:2] not in tied] == []


def test_each_slot_given_the_reference_s_token_before_it_drafts_and_is_as_confident_as_speculators_says(scorer):
    drafter, compared = scorer.drafter, 0
    for s, (sequence, recorded) in enumerate(zip(SEQUENCES, GOLDEN["per_sequence"], strict=True)):
        anchors = torch.tensor([a for _, a in blocks_of(s, recorded)])
        tokens = torch.tensor(sequence["input_ids"])
        B = drafter.block_size
        truth = torch.stack([tokens[a:a + B + 1] for a in anchors.tolist()])  # anchor, then the B drafted positions
        block = torch.full((len(anchors), B), drafter.mask_token_id)
        block[:, 0] = truth[:, 0]
        with torch.no_grad():
            hidden = drafter.forward_in_sequence(F.embedding(block, scorer.embed), anchors, scorer.context[s])
            drafts = drafter.draft(hidden, scorer.head, truth[:, :-1])
            confidence = drafter.generation.confidences(drafter, hidden, truth[:, :-1])
        assert drafts.tokens.tolist() == recorded["teacher_forced"]
        assert drafts.argmax.tolist() == recorded["backbone"]
        torch.testing.assert_close(confidence, torch.tensor(recorded["confidence"]), atol=2e-5, rtol=0)
        compared += drafts.tokens.numel()
    assert compared > 2000


def test_speculators_save_holds_deepspec_s_weights():
    from safetensors.torch import load_file

    theirs = load_file(SAVE / "model.safetensors")
    deepspec = load_file(GOLDEN_DIR / "deepspec" / "dspark" / "model.safetensors")
    assert "embed_tokens.weight" not in theirs and "lm_head.weight" not in theirs  # the verifier's, not saved
    assert sorted(theirs) == sorted(k for k in deepspec if k not in ("embed_tokens.weight", "lm_head.weight"))
    assert all(torch.equal(theirs[k], deepspec[k]) for k in theirs)
