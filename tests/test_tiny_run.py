"""The tiny trained target and drafter run: real acceptance, exactness, and faults that must show.

These use the cached build (tests/conftest.py); the first run on a machine trains it (minutes).
"""

import json
import math

import pytest
import torch

from dflash_core.decoding import greedy_decode, speculative_decode
from dflash_core.drafter import load_drafter
from dflash_core.features import extract_features
from dflash_core.metrics import mean_acceptance, tau_macro
from dflash_core.replay import Reference, replay
from dflash_core.target import load_target
from dflash_eval.tiny.training import init_drafter

pytestmark = pytest.mark.slow


def per_prompt_tau(results):
    return [mean_acceptance(r.acceptance_lengths) for r in results if r.acceptance_lengths]


def tau(results):
    return tau_macro([r for r in results if r.acceptance_lengths])


class Eval:
    """The run's target, held-out references and their features, shared by the tests below."""

    def __init__(self, run, target_dir=None, n_prompts=16):
        self.run = run
        self.target = load_target(target_dir or run.target_dir, dtype=torch.float32)
        self.eos = json.loads((run.target_dir / "config.json").read_text())["eos_token_id"]
        prompts = [json.loads(line)["input_ids"] for line in run.prompts_file.read_text().splitlines()][:n_prompts]
        max_new = run.record["settings"]["max_new_tokens"]
        self.refs = [Reference(len(p), greedy_decode(self.target, p, max_new, [self.eos])) for p in prompts]
        self.final = load_drafter(run.drafter_steps[-1])
        self.layer_ids = self.final.target_layer_ids

    def features(self, layer_ids=None):
        return extract_features(self.target, [r.token_ids for r in self.refs], layer_ids or self.layer_ids)

    def tau(self, drafter, features=None, head=None):
        head = self.target.head_weight if head is None else head
        return tau(replay(drafter, self.target.embed_weight, head, self.refs, features or self.features()))


@pytest.fixture(scope="module")
def qwen3_eval(tiny_qwen3_run):
    return Eval(tiny_qwen3_run, n_prompts=32)


def test_tau_rises_with_training(qwen3_eval):
    run = qwen3_eval.run
    untrained = init_drafter(json.loads((run.drafter_steps[0] / "config.json").read_text()), seed=123)
    taus = [qwen3_eval.tau(load_drafter(p)) for p in run.drafter_steps]
    print(f"tau untrained {qwen3_eval.tau(untrained):.2f}, per step {[round(t, 2) for t in taus]}")
    assert qwen3_eval.tau(untrained) < taus[0] < taus[-1]
    assert taus[-1] >= 2.5, f"final tau {taus[-1]:.2f} < 2.5 with block size {qwen3_eval.final.block_size}"


def test_replay_equals_online_loop_with_trained_drafter(qwen3_eval):
    ev = qwen3_eval
    replayed = replay(ev.final, ev.target.embed_weight, ev.target.head_weight, ev.refs, ev.features())
    lengths = []
    for ref, rp in zip(ev.refs[:8], replayed):
        prompt = list(ref.token_ids[: ref.prompt_len])
        online = speculative_decode(ev.target, ev.final, prompt, len(ref.token_ids) - ref.prompt_len, [ev.eos])
        assert online.output_ids == list(ref.token_ids)
        assert online.starts == rp.starts and online.acceptance_lengths == rp.acceptance_lengths
        lengths += online.acceptance_lengths
    # a trained drafter: full blocks and partial rejections both occur
    assert max(lengths) == ev.final.block_size and min(lengths) == 1


def test_head_passes_serving_several_positions_change_no_result(qwen3_eval, monkeypatch):
    """While few blocks are alive, one lm_head pass drafts several positions (replay.HEAD_ROWS): the same
    steps, lengths and rejected drafts as one position per pass, with a drafter that accepts many."""
    from dflash_core import replay as replay_module

    ev = qwen3_eval
    args = (ev.final, ev.target.embed_weight, ev.target.head_weight, ev.refs, ev.features())
    found = {}
    for rows in (1, replay_module.HEAD_ROWS, 4096):
        monkeypatch.setattr(replay_module, "HEAD_ROWS", rows)
        found[rows] = [(r.starts, r.acceptance_lengths, r.rejected_drafts, r.all_positions)
                       for r in replay(*args)] + [r.all_positions for r in replay(*args, all_positions=True)]
    assert found[1] == found[replay_module.HEAD_ROWS] == found[4096]
    assert max(a for starts, lengths, *_ in found[1][:len(ev.refs)] for a in lengths) == ev.final.block_size


def sign_test_p(losses: int, wins: int) -> float:
    """One-sided sign test: the chance of >= `losses` of `losses + wins` paired changes being losses
    if a fault changed nothing."""
    n = losses + wins
    return sum(math.comb(n, k) for k in range(losses, n + 1)) / 2**n


def test_injected_faults_lower_tau(qwen3_eval):
    ev = qwen3_eval
    ids = ev.layer_ids
    # the fixture drafter's first layer is sliding with a window shorter than the block
    # (tiny_build.TinyBuildSettings), trained with the causal semantics
    assert "sliding_attention" in ev.final.cfg.layer_types and ev.final.cfg.sliding_window < ev.final.block_size
    args = (ev.target.embed_weight, ev.target.head_weight, ev.refs)
    good = per_prompt_tau(replay(ev.final, *args, ev.features()))
    random_head = torch.randn_like(ev.target.head_weight) * ev.target.head_weight.std()
    faults = {
        "layer ids shifted by one": replay(ev.final, *args, ev.features([i + 1 for i in ids])),
        "features at the layer input": replay(ev.final, *args, ev.features([i - 1 for i in ids])),
        "random head": replay(ev.final, ev.target.embed_weight, random_head, ev.refs, ev.features()),
        "sliding semantics switched": replay(load_drafter(ev.run.drafter_steps[-1], sliding_semantics="non_causal"),
                                             *args, ev.features()),
    }
    def mean(xs):
        return sum(xs) / len(xs)

    print(f"tau {mean(good):.2f}; " + ", ".join(f"{name}: {mean(per_prompt_tau(r)):.2f}" for name, r in faults.items()))
    for name, results in faults.items():
        bad = per_prompt_tau(results)
        losses = sum(b < g for g, b in zip(good, bad))
        wins = sum(b > g for g, b in zip(good, bad))
        # measurable: a drop of the mean, and more prompts losing than chance allows (paired sign test)
        assert mean(bad) < mean(good) - 0.1, f"{name}: tau {mean(bad):.2f} vs {mean(good):.2f}"
        assert sign_test_p(losses, wins) < 0.01, f"{name}: {losses} prompts lose, {wins} gain"


def test_hybrid_target_fixture_same_tau_as_text_and_vlm(tiny_qwen3_5_run):
    run = tiny_qwen3_5_run
    text = Eval(run, n_prompts=8)
    vlm = Eval(run, target_dir=run.target_vlm_dir, n_prompts=8)
    assert [r.token_ids for r in text.refs] == [r.token_ids for r in vlm.refs]
    assert text.tau(text.final) == vlm.tau(vlm.final)
    untrained = init_drafter(json.loads((run.drafter_steps[0] / "config.json").read_text()), seed=123)
    assert text.tau(text.final) > text.tau(untrained) + 0.5
    # exactness on the hybrid target: the online loop rolls back the recurrent state
    replayed = replay(text.final, text.target.embed_weight, text.target.head_weight, text.refs, text.features())
    for ref, rp in zip(text.refs[:4], replayed):
        prompt = list(ref.token_ids[: ref.prompt_len])
        online = speculative_decode(vlm.target, vlm.final, prompt, len(ref.token_ids) - ref.prompt_len, [text.eos])
        assert online.output_ids == list(ref.token_ids)
        assert online.acceptance_lengths == rp.acceptance_lengths
