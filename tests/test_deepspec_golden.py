"""DeepSpec (github deepseek-ai/DeepSpec, afdfa7c): its own saves and its own evaluator loop, run once on a tiny
trained DSpark drafter (tests/golden/make_deepspec_golden.py, in a venv with DeepSpec's requirements: the saves in
tests/golden/deepspec/, what its loop emitted in tests/golden/deepspec_loop.json), against the replay and the online
loop, on the DFlash golden case's target (tests/golden/dflash010/target):

- the saves are read: its DSpark (a vanilla Markov head of rank 32, a confidence head) and its DFlash (markov_rank 0,
  no confidence head), every slot drafting (block 7: 7 drafts, up to 8 tokens a step), with the target's embedding and
  head saved beside, equal to the target's; a save with an `rnn` Markov head is refused by name;
- greedy: the replay over DeepSpec's outputs takes its steps, one by one, at confidence threshold 0 and at the
  recorded threshold (which shortens most steps), and so does the online loop, whose drafts verified per step are its
  proposal lengths; the DFlash save likewise, and its steps are the DSpark drafter's backbone walk. Compared: every
  step whose verify block (its anchor, the drafts verified and the bonus token) lies inside the output. Left out: the
  last steps of a run, which DeepSpec takes whole past the output's end (it never shortens its last block, and takes
  one more step when the output is one token short of max_new_tokens; the output is then clipped, the recorded
  acceptance length not), and a step cut at an accepted stop token;
- sampled (temperature 1, DeepSpec's protocol: drafts sampled from the Markov walk, rejection sampling): our expected
  tau over sampled references of our own lies within 4 standard errors of the mean of DeepSpec's runs, each reference
  holding the target's tokens past max_new_tokens, which DeepSpec's last step verifies; the greedy-draft rule does not;
- the confidence head: its confidences at every step of DeepSpec's greedy runs (given the drafts before each),
  binned as its ConfidenceHeadRecorder bins them, give what the recorder reported, position by position.
"""

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from dflash_core.decoding import decode, speculative_decode
from dflash_core.drafter import load_drafter
from dflash_core.drafter_config import DrafterConfigWarning, DrafterError, read_drafter_config
from dflash_core.features import extract, extract_features
from dflash_core.generations.dspark import DSparkHeads, MarkovHead, heads_of
from dflash_core.replay import BlockScorer, Reference, replay
from dflash_core.sampled_drafts import SampledDrafts, coin_seed
from dflash_core.sampling import Sampling, sample_seed
from tests.package_loop import macro_with_error, within

pytestmark = pytest.mark.usefixtures("one_thread")

GOLDEN_DIR = Path(__file__).parent / "golden"
SAVES = GOLDEN_DIR / "deepspec"
GOLDEN = json.loads((GOLDEN_DIR / "deepspec_loop.json").read_text())
META = GOLDEN["metadata"]
PROMPTS = [p["input_ids"] for p in META["prompts"]]
THRESHOLD = META["threshold"]
# (drafter, confidence threshold) of each recorded greedy setting
GREEDY = {"dspark_t0": ("dspark", 0.0), f"dspark_t{THRESHOLD:g}": ("dspark", THRESHOLD), "dflash_t0": ("dflash", 0.0)}
SAMPLES = 50  # our sampled references per prompt


@pytest.fixture(scope="module")
def target():
    from dflash_core.target import load_target

    return load_target(GOLDEN_DIR / "dflash010" / "target", dtype=torch.float32)


def references(target, key: str) -> list[Reference]:
    """DeepSpec's greedy outputs of one setting, each checked to be the target's own greedy text, as references."""
    refs = []
    for prompt, run in zip(PROMPTS, GOLDEN["greedy"][key]):
        tokens = prompt + run["output_ids"]
        assert tokens == decode(target, prompt, META["max_new_tokens"], META["stop_token_ids"])
        refs.append(Reference(len(prompt), tokens))
    return refs


def whole_steps(key: str) -> list[list[tuple[int, int, int]]]:
    """Per run, DeepSpec's (start, acceptance length, drafts verified) steps up to the first whose verify block (anchor,
    drafts verified, bonus token) does not lie inside the output."""
    out = []
    for prompt, run in zip(PROMPTS, GOLDEN["greedy"][key]):
        end = len(prompt) + run["num_output_tokens"]
        starts = (len(prompt) + np.cumsum([0] + run["acceptance_lengths"][:-1])).tolist()
        steps = []
        for step in zip(starts, run["acceptance_lengths"], run["proposal_lengths"]):
            if step[0] + step[2] + 2 > end:
                break
            steps.append(step)
        out.append(steps)
    return out


def steps_of(result, verified: list[int] | None = None) -> list[tuple[int, int]]:
    return list(zip(result.starts, result.acceptance_lengths)) if verified is None else \
        list(zip(result.starts, result.acceptance_lengths, verified))


# ----------------------------------------------------------------------------------------------
# The saves


def test_deepspec_s_saves_are_read_as_it_built_them(target):
    dspark, dflash = read_drafter_config(SAVES / "dspark"), read_drafter_config(SAVES / "dflash")
    raw = json.loads((SAVES / "dspark" / "config.json").read_text())
    for cfg in (dspark, dflash):
        assert (cfg.source_format, cfg.architecture, cfg.generation.NAME) == ("deepspec", "Qwen3DSparkModel", "DSpark")
        assert cfg.drafts_from_anchor and (cfg.block_size, cfg.verified_tokens(cfg.block_size)) == (7, 8)
        assert list(cfg.target_layer_ids) == raw["target_layer_ids"] and cfg.mask_token_id == raw["mask_token_id"]
        assert cfg.layer_types == ("full_attention", "full_attention") and cfg.is_causal is None  # the block sees all
    heads = heads_of(dspark)
    assert (heads.markov_rank, heads.markov_head_type, heads.confidence_head, heads.confidence_with_markov) == (
        32, "vanilla", True, True)
    assert heads_of(dflash).markov_rank == 0 and not heads_of(dflash).confidence_head  # DeepSpec's DFlash
    for name in ("dspark", "dflash"):
        drafter = load_drafter(SAVES / name)
        saved = drafter.saved_token_head  # bfloat16 copies, as DeepSpec saves them
        assert torch.equal(saved["embed_tokens.weight"].float(), target.embed_weight)
        assert torch.equal(saved["lm_head.weight"].float(), target.head_weight)
    assert GOLDEN["greedy"]["dspark_t0"][0]["proposal_lengths"][0] == 7  # its loop verified 7 drafts a step


def copy_of(name: str, tmp_path: Path) -> Path:
    folder = tmp_path / name
    shutil.copytree(SAVES / name, folder)
    return folder


def test_a_deepspec_run_folder_is_its_saves_in_step_order(tmp_path):
    """DeepSpec's checkpoint manager writes step_N/ (with its training state) and links step_latest to the newest: a
    run folder given to --drafter is each save once, in step order, the link not a save of its own."""
    from dflash_eval.cli.evaluation import checkpoints_named

    for step in (300, 600):
        shutil.copytree(SAVES / "dspark", tmp_path / f"step_{step}")
        (tmp_path / f"step_{step}" / "training_state.rank0.pt").write_bytes(b"optimizer state")
    (tmp_path / "step_latest").symlink_to(tmp_path / "step_600")
    assert checkpoints_named([str(tmp_path)], None, 0) == [str(tmp_path / "step_300"), str(tmp_path / "step_600")]
    assert read_drafter_config(tmp_path / "step_latest").generation.NAME == "DSpark"  # (named itself, it is read)


@pytest.mark.parametrize("kind", ["vanilla", "gated"])
def test_each_markov_head_read_walks_as_deepspec_s_own(kind):
    """Each markov_head_type read here, as DeepSpec builds it (its build_markov_head;
    tests/golden/make_deepspec_markov_golden.py), with its weights: our head's greedy walk over the same backbone
    logits and hidden states chooses its tokens, with its biased logits."""
    golden = load_file(GOLDEN_DIR / "deepspec_markov.safetensors")
    base, hidden, previous = golden["base_logits"], golden["hidden"], golden["first_previous"]
    weights = {name.removeprefix(f"{kind}."): t for name, t in golden.items() if name.startswith(f"{kind}.")}
    tokens, logits = weights.pop("tokens"), weights.pop("logits")
    head = MarkovHead(hidden.shape[-1], base.shape[-1], DSparkHeads(weights["markov_w1.weight"].shape[1], kind,
                                                                    False, False))
    head.load_state_dict(weights, strict=True)  # DeepSpec's tensor names, none missing, none unexpected
    walked, biased = [], []
    with torch.no_grad():
        for k in range(base.shape[1]):
            biased.append(base[:, k] + head(previous, hidden[:, k]))
            previous = biased[-1].argmax(-1)
            walked.append(previous)
    assert torch.equal(torch.stack(walked, 1), tokens)
    torch.testing.assert_close(torch.stack(biased, 1), logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize(("kind", "says"), [("rnn", "state runs across the block"), ("gru", "as DeepSpec defines them$")])
def test_a_markov_head_not_read_is_refused_by_name(tmp_path, kind, says):
    """DeepSpec's `rnn` head carries a recurrent state across the block (its RNNHead: joint_proj, each slot's bias
    depending on every earlier one), which the replay does not compute; an unknown kind is named too."""
    folder = copy_of("dspark", tmp_path)
    raw = json.loads((folder / "config.json").read_text())
    raw["markov_head_type"] = kind
    (folder / "config.json").write_text(json.dumps(raw))
    with pytest.raises(DrafterError, match=f"markov_head_type '{kind}': the Markov heads read here are vanilla, "
                                           f"gated.*{says}"):
        read_drafter_config(folder)


def with_lm_head_row_changed(tmp_path: Path) -> Path:
    """A copy of the DSpark save whose saved lm_head differs from the target's in one row (a save made against
    another target, or a damaged one)."""
    folder = copy_of("dspark", tmp_path)
    weights = load_file(folder / "model.safetensors")
    weights["lm_head.weight"][7] += 0.5
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return folder


def test_a_save_s_own_copies_of_the_embedding_and_head_are_kept_beside_the_drafter(target, tmp_path):
    drafter = load_drafter(with_lm_head_row_changed(tmp_path))  # drafts with the target's own head, as served
    assert not torch.equal(drafter.saved_token_head["lm_head.weight"].float(), target.head_weight)
    assert torch.equal(drafter.saved_token_head["embed_tokens.weight"].float(), target.embed_weight)


def test_a_save_whose_head_differs_from_the_target_s_is_reported(target, tmp_path):
    same = load_drafter(SAVES / "dspark")
    assert same.token_head_differences(target.embed_weight, target.head_weight) == {}
    drafter = load_drafter(with_lm_head_row_changed(tmp_path))
    assert drafter.token_head_differences(target.embed_weight, target.head_weight) == {
        "lm_head.weight": "1 of 512 rows differ from the target's, by up to 0.502"}  # (+0.5, in bf16)
    refs = references(target, "dspark_t0")[:1]
    features = extract_features(target, [r.token_ids for r in refs], drafter.target_layer_ids)
    with pytest.warns(DrafterConfigWarning, match="lm_head"):
        replay(drafter, target.embed_weight, target.head_weight, refs, features)


# ----------------------------------------------------------------------------------------------
# Greedy, step by step


@pytest.mark.slow
@pytest.mark.parametrize("key", GREEDY)
def test_the_replay_takes_deepspec_s_steps(target, key):
    name, threshold = GREEDY[key]
    drafter = load_drafter(SAVES / name)
    refs = references(target, key)
    expected = whole_steps(key)
    features = extract_features(target, [r.token_ids for r in refs], drafter.target_layer_ids)
    ours = replay(drafter, target.embed_weight, target.head_weight, refs, features, verify_threshold=threshold)
    assert [steps_of(r)[:len(w)] for r, w in zip(ours, expected)] == [[s[:2] for s in w] for w in expected]
    assert sum(map(len, expected)) >= 80  # (most steps: 81, 97 and 114 of 104, 111 and 142)
    if threshold:
        verified = [r.verified_drafts for r in ours]
        shortened = [s for w in expected for s in w if s[2] < META["block_size"]]
        assert len(shortened) > sum(map(len, expected)) / 2  # the threshold shortens most steps
        # the drafts verified are DeepSpec's wherever its confidence decided inside the drafts accepted; past the first
        # rejected draft the replay reads its confidences given the reference's token (next test)
        for v, w in zip(verified, expected):
            for (start, accepted, theirs), mine in zip(w, v):
                assert mine == theirs or min(mine, theirs) >= accepted, (start, mine, theirs)
    else:
        assert all(r.verified_drafts is None for r in ours)
    if name == "dspark" and not threshold:  # the Markov head is what drafts: the backbone's argmax alone does worse
        assert not all(steps_of(r.base)[:len(w)] == [s[:2] for s in w] for r, w in zip(ours, expected))


@pytest.mark.slow
def test_the_replay_s_drafts_verified_per_step_are_deepspec_s_proposal_lengths(target):
    key = f"dspark_t{THRESHOLD:g}"
    drafter = load_drafter(SAVES / "dspark")
    refs = references(target, key)
    features = extract_features(target, [r.token_ids for r in refs], drafter.target_layer_ids)
    ours = replay(drafter, target.embed_weight, target.head_weight, refs, features, verify_threshold=THRESHOLD)
    expected = whole_steps(key)
    assert [steps_of(r, r.verified_drafts)[:len(w)] for r, w in zip(ours, expected)] == expected


@pytest.mark.slow
@pytest.mark.parametrize("key", GREEDY)
def test_the_online_loop_takes_deepspec_s_steps_and_verifies_its_drafts(target, key, monkeypatch):
    name, threshold = GREEDY[key]
    drafter = load_drafter(SAVES / name)
    verified: list[int] = []
    rule = drafter.generation.verified_drafts

    def recorded(*args, **kwargs):  # the online loop's own decision, step by step
        counts = rule(*args, **kwargs)
        verified.extend(counts.tolist())
        return counts

    monkeypatch.setattr(drafter.generation, "verified_drafts", recorded)
    for prompt, run, expected in zip(PROMPTS, GOLDEN["greedy"][key], whole_steps(key)):
        verified.clear()
        online = speculative_decode(target, drafter, prompt, META["max_new_tokens"], META["stop_token_ids"],
                                    verify_threshold=threshold)
        assert online.output_ids == prompt + run["output_ids"]
        counts = verified if threshold else [META["block_size"]] * len(online.starts)
        assert steps_of(online, counts)[:len(expected)] == expected


@pytest.mark.slow
def test_deepspec_s_dflash_save_drafts_as_the_dspark_drafter_s_backbone_alone(target):
    dspark, dflash = load_drafter(SAVES / "dspark"), load_drafter(SAVES / "dflash")
    refs = references(target, "dspark_t0")
    features = extract_features(target, [r.token_ids for r in refs], dspark.target_layer_ids)
    backbone = [r.base for r in replay(dspark, target.embed_weight, target.head_weight, refs, features)]
    alone = replay(dflash, target.embed_weight, target.head_weight, refs, features)
    assert [steps_of(b) for b in backbone] == [steps_of(a) for a in alone]
    # the Markov head's lift on DeepSpec's own numbers: its DSpark loop against its DFlash loop
    assert META["summary"]["greedy_dspark_t0"]["tau"] > META["summary"]["greedy_dflash_t0"]["tau"] + 0.5


# ----------------------------------------------------------------------------------------------
# Sampled


def sampled_references(target, prompt: list[int], samples: int, sampling: Sampling, index: int) -> list[Reference]:
    """Our sampled references of one prompt, each holding the target's tokens past max_new_tokens (a whole block's
    worth) and ending where DeepSpec's loop takes no more steps: a step starts while its anchor lies before
    max_new_tokens (its last one runs past them, whole), or until the stop token."""
    max_new, B = META["max_new_tokens"], META["block_size"]
    refs = []
    for k in range(samples):
        tokens = decode(target, prompt, max_new + B + 1, META["stop_token_ids"], sampling,
                        torch.Generator().manual_seed(sample_seed(0, index, k)))
        last_anchor = len(prompt) + max_new  # (exclusive) DeepSpec: while start < max_length
        refs.append(Reference(len(prompt), tokens, last_anchor + 1 if len(tokens) > last_anchor + 1 else None))
    return refs


def test_the_sampled_setting_is_deepspec_s_protocol():
    (setting,) = GOLDEN["sampled"]
    assert (setting["drafter"], setting["temperature"], setting["confidence_threshold"]) == ("dspark", 1.0, 0.0)
    assert len(setting["seeds"]) == META["runs_per_prompt"] >= 200


@pytest.mark.slow
def test_sampled_drafts_tau_lies_within_4_standard_errors_of_deepspec_s_loop(target):
    (setting,) = GOLDEN["sampled"]
    drafter = load_drafter(SAVES / "dspark")
    sampling = Sampling(setting["temperature"], setting["top_k"], setting["top_p"])
    refs = [r for i, prompt in enumerate(PROMPTS) for r in sampled_references(target, prompt, SAMPLES, sampling, i)]
    extracted = extract(target, [r.token_ids for r in refs], drafter.target_layer_ids, probabilities=sampling)
    features = [e.features for e in extracted]
    sampled = replay(drafter, target.embed_weight, target.head_weight, refs, features,
                     sampled=SampledDrafts(sampling, [e.probabilities for e in extracted],
                                           [coin_seed(0, str(n)) for n in range(len(refs))]))
    greedy_drafts = replay(drafter, target.embed_weight, target.head_weight, refs, features)

    def per_prompt(taus) -> list[list[float]]:
        return [[t for t in taus[i * SAMPLES:(i + 1) * SAMPLES] if t is not None] for i in range(len(PROMPTS))]

    theirs = macro_with_error([[float(np.mean(a)) for a in p["acceptance_lengths"] if a] for p in setting["prompts"]])
    ours = macro_with_error(per_prompt([r.expected.tau if r.acceptance_lengths else None for r in sampled]))
    greedy = macro_with_error(per_prompt([float(np.mean(r.acceptance_lengths)) if r.acceptance_lengths else None
                                          for r in greedy_drafts]))
    print(f"DeepSpec {theirs[0]:.4f} +- {theirs[1]:.4f}, sampled drafts {ours[0]:.4f} +- {ours[1]:.4f}, greedy drafts "
          f"{greedy[0]:.4f} +- {greedy[1]:.4f}")
    assert within(ours, theirs, 4)
    assert not within(greedy, theirs, 4)


# ----------------------------------------------------------------------------------------------
# The confidence head, as DeepSpec's recorder measures it


def recorder_rows(drafter, target, key: str, bins: int) -> list[dict]:
    """Per position, DeepSpec's ConfidenceHeadRecorder's count, mean prediction and target per coarse bin, and its
    ECE, from our confidences at every step of its greedy runs: the cumulative product of each step's confidences
    (each slot given the draft before it, the anchor at the first) over the drafts its step verified, against the
    accepted prefix (1 for the drafts accepted, 0 after)."""
    D = META["block_size"]
    count, pred, hit = np.zeros((D, bins)), np.zeros((D, bins)), np.zeros((D, bins))
    refs = references(target, key)
    features = extract_features(target, [r.token_ids for r in refs], drafter.target_layer_ids)
    scorer = BlockScorer(drafter, target.embed_weight, target.head_weight, refs, features)
    for s, (ref, run, feats) in enumerate(zip(refs, GOLDEN["greedy"][key], features)):
        starts = (ref.prompt_len + np.cumsum([0] + run["acceptance_lengths"][:-1])).tolist()
        drafts = torch.tensor(scorer.draft_tokens([(s, p) for p in starts]))  # [steps, D]: the greedy walk
        anchors = torch.tensor([ref.token_ids[p] for p in starts])
        block = torch.full((len(starts), D), drafter.mask_token_id)
        block[:, 0] = anchors
        with torch.no_grad():
            hidden = drafter.forward_in_sequence(F.embedding(block, target.embed_weight), torch.tensor(starts),
                                                 drafter.context_kv(feats))
            previous = torch.cat([anchors[:, None], drafts[:, :-1]], dim=1)
            confidence = drafter.generation.confidences(drafter, hidden, previous).double()
        for row, verified, accepted in zip(confidence, run["proposal_lengths"], run["accepted_draft_lengths"]):
            predicted = row[:verified].cumprod(0).clamp(1e-8, 1 - 1e-8).numpy()
            for k, p in enumerate(predicted):
                b = min(int(p * bins), bins - 1)
                count[k, b] += 1
                pred[k, b] += p
                hit[k, b] += k < accepted
    rows = []
    for k in range(D):
        total = count[k].sum()
        filled = count[k] > 0
        gap = np.abs(pred[k][filled] / count[k][filled] - hit[k][filled] / count[k][filled])
        rows.append({"total_weight": total, "ece": float((gap * count[k][filled]).sum() / total),
                     "pred_mean": pred[k].sum() / total, "target_mean": hit[k].sum() / total,
                     "bins": {int(b): (count[k, b], pred[k, b] / count[k, b]) for b in np.flatnonzero(filled)}})
    return rows


@pytest.mark.slow
def test_the_confidences_binned_as_deepspec_s_recorder_bins_them_give_what_it_reported(target):
    drafter = load_drafter(SAVES / "dspark")
    recorded = GOLDEN["confidence"]["greedy_dspark_t0"]["per_position"]
    ours = recorder_rows(drafter, target, "dspark_t0", bins=20)
    for mine, theirs in zip(ours, recorded, strict=True):
        assert mine["total_weight"] == theirs["total_weight"] > 0
        assert mine["target_mean"] == pytest.approx(theirs["target_mean"], abs=1e-12)
        assert mine["pred_mean"] == pytest.approx(theirs["pred_mean"], abs=1e-5)
        assert mine["ece"] == pytest.approx(theirs["ece"], abs=1e-5)
        assert {b: c for b, (c, _) in mine["bins"].items()} == {r["bin"]: r["weight"] for r in theirs["reliability"]}
        for r in theirs["reliability"]:
            assert mine["bins"][r["bin"]][1] == pytest.approx(r["avg_pred"], abs=1e-5)
    # a head that separates: the recorder's AUC at the first position, and predictions that fall with the position
    assert recorded[0]["auc"] > 0.75 and recorded[0]["pred_mean"] > recorded[-1]["pred_mean"]
    assert not any(math.isnan(r["ece"]) for r in ours)
