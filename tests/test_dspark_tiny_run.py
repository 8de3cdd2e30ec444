"""The tiny DSpark run (`qwen3_dspark` in tests/trained_runs.py): a DSpark drafter trained on the Qwen3 run's target
as DeepSpec trains one (tiny/training.py: every slot drafting, slot k learning the token at anchor + k + 1; the loss
its DSpark.head_loss gives, the Markov head trained through the biased logits and the confidence head toward each
slot's acceptance) and saved in DeepSpec's layout. It drafts, its Markov head lifts what its backbone drafts alone,
and its confidences separate the drafts accepted from those rejected.

The run is cached like the others (built when missing: about 4 minutes of one core).
"""

import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from dflash_core.decoding import greedy_decode
from dflash_core.drafter import load_drafter
from dflash_core.features import extract_features
from dflash_core.generations import by_architecture
from dflash_core.metrics import mean_acceptance, paired_difference_interval, tau_macro
from dflash_core.replay import Reference, replay
from dflash_core.target import load_target
from dflash_eval.tiny.build import deepspec_drafter_config
from tests.trained_runs import RUNS

GOLDEN_DIR = Path(__file__).parent / "golden"


def test_the_tiny_run_s_config_is_the_one_deepspec_builds():
    """deepspec_drafter_config against what DeepSpec's build_draft_config and save_pretrained wrote for the same drafter
    on the same target (tests/golden/deepspec/dspark, make_deepspec_golden.py), but for the versions' own fields."""
    settings = RUNS["qwen3_dspark"]
    theirs = json.loads((GOLDEN_DIR / "deepspec" / "dspark" / "config.json").read_text())
    target_config = json.loads((GOLDEN_DIR / "dflash010" / "target" / "config.json").read_text())
    ours = deepspec_drafter_config(settings, target_config, theirs["mask_token_id"],
                                   dict(by_architecture("Qwen3DSparkModel").TINY_FIELDS))
    provenance = ("transformers_version",)
    assert {k: v for k, v in ours.items() if k not in provenance} == {k: v for k, v in theirs.items()
                                                                       if k not in provenance}
    with pytest.raises(ValueError, match="full attention layers only"):
        deepspec_drafter_config(RUNS["qwen3"], target_config, 3, {})


@pytest.fixture(scope="module")
def run():
    from tests.trained_runs import trained_run

    return trained_run("qwen3_dspark")


class Held:
    """The run's target, its held-out references (32 prompts) and their features, and the last save."""

    def __init__(self, run):
        self.target = load_target(run.target_dir, dtype=torch.float32)
        eos = json.loads((run.target_dir / "config.json").read_text())["eos_token_id"]
        prompts = [json.loads(line)["input_ids"] for line in run.prompts_file.read_text().splitlines()]
        max_new = run.record["settings"]["max_new_tokens"]
        self.refs = [Reference(len(p), greedy_decode(self.target, p, max_new, [eos])) for p in prompts]
        self.drafter = load_drafter(run.drafter_steps[-1])
        self.features = extract_features(self.target, [r.token_ids for r in self.refs], self.drafter.target_layer_ids)

    def replay(self, **kwargs):
        return replay(self.drafter, self.target.embed_weight, self.target.head_weight, self.refs, self.features,
                      **kwargs)


@pytest.fixture(scope="module")
def held(run):
    return Held(run)


@pytest.mark.slow
def test_the_run_is_saved_in_deepspec_s_layout(run):
    target_config = json.loads((run.target_dir / "config.json").read_text())
    target = load_file(run.target_dir / "model.safetensors")
    for save in run.drafter_steps:
        config = json.loads((save / "config.json").read_text())
        assert config["architectures"] == ["Qwen3DSparkModel"] and set(target_config) < set(config)
        assert {k: config[k] for k in ("hidden_size", "num_attention_heads", "head_dim", "intermediate_size")} == {
            k: target_config[k] for k in ("hidden_size", "num_attention_heads", "head_dim", "intermediate_size")}
        weights = load_file(save / "model.safetensors")
        assert torch.equal(weights["embed_tokens.weight"], target["model.embed_tokens.weight"])
        assert torch.equal(weights["lm_head.weight"], target["lm_head.weight"])
        assert load_drafter(save).cfg.source_format == "deepspec"


@pytest.mark.slow
def test_it_drafts_and_its_markov_head_lifts_its_backbone(run, held):
    taus = run.record["tau"]
    assert taus["step_400"] > 3.5 and taus["step_400"] > taus["step_100"] + 1  # it trains
    results = [r for r in held.replay() if r.acceptance_lengths]
    backbone = [r.base for r in results]
    lift = tau_macro(results) - tau_macro(backbone)
    low, _ = paired_difference_interval([(str(i), mean_acceptance(r.acceptance_lengths),
                                          mean_acceptance(b.acceptance_lengths))
                                         for i, (r, b) in enumerate(zip(results, backbone))])
    print(f"tau {tau_macro(results):.3f}, backbone alone {tau_macro(backbone):.3f}, lift {lift:+.3f} (CI low {low:+.3f})")
    assert lift > 0.5 and low > 0.3
    assert max(a for r in results for a in r.acceptance_lengths) == 8  # 7 drafts and the bonus: every slot drafts


def confidences_of_steps(held) -> tuple[np.ndarray, np.ndarray]:
    """At every decode step of the replay but a last one cut at the reference's end, the confidence of each draft
    compared (given the reference's token before it: the drafts' own while they match) and whether it was accepted:
    the drafts accepted, then the first rejected."""
    drafter, B = held.drafter, held.drafter.block_size
    scores, accepted = [], []
    for s, (ref, result) in enumerate(zip(held.refs, held.replay())):
        tokens = torch.tensor([*ref.token_ids, *[0] * B])  # (past the end: any token, never compared)
        steps = [(p, a) for p, a in zip(result.starts, result.acceptance_lengths) if p + a < len(ref.token_ids) - 1]
        if not steps:
            continue
        starts = torch.tensor([p for p, _ in steps])
        block = torch.full((len(steps), B), drafter.mask_token_id)
        block[:, 0] = tokens[starts]
        previous = torch.stack([tokens[p:p + B] for p, _ in steps])  # the anchor, then the reference's tokens
        with torch.no_grad():
            hidden = drafter.forward_in_sequence(F.embedding(block, held.target.embed_weight), starts,
                                                 drafter.context_kv(held.features[s]))
            confidence = drafter.generation.confidences(drafter, hidden, previous)
        for row, (_, step) in zip(confidence, steps):
            compared = min(step, B)
            scores += row[:compared].tolist()
            accepted += [1] * (step - 1) + [0] * (compared - step + 1)
    return np.array(scores), np.array(accepted)


@pytest.mark.slow
def test_its_confidences_separate_the_drafts_accepted_from_those_rejected(held):
    scores, accepted = confidences_of_steps(held)
    hit, miss = scores[accepted == 1], scores[accepted == 0]
    auc = float((hit[:, None] > miss[None, :]).mean())
    print(f"confidence: accepted {hit.mean():.3f} ({len(hit)}), rejected {miss.mean():.3f} ({len(miss)}), AUC {auc:.3f}")
    assert len(miss) > 100 and hit.mean() - miss.mean() > 0.2 and auc > 0.75
    # served with a threshold, a step verifies fewer drafts and each verified token is worth more (DeepSpec's
    # verify_rate: tokens per token verified)
    greedy = held.replay()
    scheduled = held.replay(verify_threshold=0.3)
    verified = [v for r in scheduled for v in r.verified_drafts or ()]
    rate = sum(sum(r.acceptance_lengths) for r in scheduled) / sum(v + 1 for v in verified)
    every = sum(sum(r.acceptance_lengths) for r in greedy) / sum(8 for r in greedy for _ in r.acceptance_lengths)
    assert np.mean(verified) < 6 and rate > every + 0.1


@pytest.mark.slow
def test_its_trainer_logs_the_markov_walk_s_accuracy_at_every_slot(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = EventAccumulator(str(run.drafter_run / "runs"))
    log.Reload()
    tags = set(log.Tags()["scalars"])
    assert {"train/markov_acc", "train/acc_0", "train/acc_6"} <= tags and "train/acc_7" not in tags
    assert log.Scalars("train/markov_acc")[-1].value > log.Scalars("train/acc")[-1].value  # the head adds
