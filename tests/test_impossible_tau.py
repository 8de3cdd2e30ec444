"""A tau no decoding gives is never stored: a step emits 1 to B tokens (B: the tokens it verifies), so a tau below
1, above B or not a number comes from a bug or from numbers that are not finite (a drafter's q made NaN), and the
stage that meets it commits nothing and says what to check (dflash_core.metrics.ImpossibleTau). The config checks
(test_config_values.py) stop the known causes at the door; these are the guards behind them."""

import json
import shutil
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from dflash_core.metrics import ImpossibleTau, PromptScore, summarize
from dflash_core.sampled_drafts import ExpectedSteps, acceptance, expected_steps

pytestmark = pytest.mark.usefixtures("one_thread")

GOLDEN = Path(__file__).parent / "golden"
B = 4


def expected(tau: float, steps: float = 2.0, tokens: float | None = None) -> ExpectedSteps:
    return ExpectedSteps(tau=tau, steps=steps, tokens=tau * steps if tokens is None else tokens, histogram=[0.0] * B,
                         reached=[0.0] * (B - 1), accepted=[0.0] * (B - 1), clipped=0.0)


@pytest.mark.parametrize("score,says", [
    (PromptScore("p", None, [2, 1], [5, 7], 9, expected=expected(0.0)), "the tau of prompt p, 0, lies outside"),
    (PromptScore("p", None, [2, 1], [5, 7], 9, expected=expected(float("nan"))), "the tau of prompt p, nan, lies"),
    (PromptScore("p", None, [2, 1], [5, 7], 9, expected=expected(4.5)), "the tau of prompt p, 4.5, lies outside"),
    (PromptScore("p", None, [5, 1], [5, 10], 12), "an acceptance length of prompt p, 5, lies outside"),  # mean 3
    (PromptScore("p", None, [0, 3], [5, 5], 9), "an acceptance length of prompt p, 0, lies outside"),
    (PromptScore("p", None, [2, 1], [5, 7], 9, expected=expected(2.0, tokens=100.0)), "tau_pooled, 26.25, lies"),
], ids=["zero", "NaN", "above B", "a step above B", "a step of 0", "pooled"])
def test_summarize_refuses_a_tau_no_decoding_gives(score, says):
    good = PromptScore("q", None, [4, 1], [5, 9], 11)
    with pytest.raises(ImpossibleTau) as refused:
        summarize([good, score], block_size=B)
    assert says in str(refused.value) and "a step emits 1 to 4 tokens, so no decoding gives it" in str(refused.value)
    assert "check the drafter's config (its numbers) and weights" in str(refused.value)


def test_taus_at_the_edges_are_scores():
    ones = PromptScore("ones", None, [1, 1], [5, 6], 8)
    whole = PromptScore("whole", None, [4, 4], [5, 9], 14)
    assert summarize([ones, whole], block_size=B)["tau_macro"] == pytest.approx(2.5)
    tiny = PromptScore("p", None, [2, 1], [5, 7], 9, expected=expected(1.0 - 1e-12))  # an expectation's rounding
    assert summarize([tiny], block_size=B)["tau_macro"] == pytest.approx(1.0)


def test_a_nan_p_or_q_is_no_acceptance_probability():
    q = torch.tensor([0.5, float("nan"), 0.2, 0.3], dtype=torch.float64)
    p = torch.tensor([0.25, 0.5, float("nan"), 0.0], dtype=torch.float64)
    a = acceptance(q, p)
    assert a[0] == 1.0 and a[3] == 1.0  # (p = 0 < q: a token the target's numbers lost)
    assert a[1].isnan() and a[2].isnan()  # not 1 (as p = 0 would be), not 0


def test_an_acceptance_probability_that_is_not_a_number_refuses_the_reference():
    a = np.full((6, B - 1), 0.5)
    assert 1 <= expected_steps(a, 3, 10, 10, B).tau <= B
    a[2, 1] = np.nan  # one position: its paths would drop out, leaving a tau too low that looks like a result
    with pytest.raises(ImpossibleTau, match=r"1 of the 18 acceptance probabilities min\(1, q/p\) of a reference are "
                                            r"not numbers: the drafter's q or the target's p is NaN there"):
        expected_steps(a, 3, 10, 10, B)


def test_the_scores_stage_commits_no_impossible_tau(tmp_path):
    """drafts.json as a bug might write it (an expected tau of 0): the scores task ends Failed with the message, and
    the store holds no scores entry."""
    from dflash_eval.storage import Store
    from dflash_eval.tasks.drafts import Drafts
    from dflash_eval.tasks.references import ReferenceSet
    from dflash_eval.tasks.scores import score
    refs_dir, drafts_dir = tmp_path / "refs", tmp_path / "drafts"
    refs_dir.mkdir()
    drafts_dir.mkdir()
    (refs_dir / "seq_0.json").write_text(json.dumps({"id": "p", "prompt": None, "category": None, "turns": [
        {"prompt_len": 5, "token_ids": list(range(9)), "completion_end": None, "finish": "length", "verified": True}]}))
    (drafts_dir / "drafts.json").write_text(json.dumps({"per_prompt": [
        {"starts": [5, 7], "acceptance_lengths": [2, 1], "expected": asdict(expected(0.0))}]}))
    refs = ReferenceSet(key="r" * 64, path=str(refs_dir), n_prompts=1, n=1, lookahead=0)
    drafts = Drafts(key="d" * 64, path=str(drafts_dir), block_size=B, verified_tokens=B, sliding_semantics="causal",
                    draft_sampling={"q": {"temperature": 0.6}, "seed": 0})
    state = score.fn(drafts, refs, str(tmp_path / "store"))
    assert state.is_failed() and "the tau of prompt p, 0, lies outside [1, 4]" in state.message
    assert Store(tmp_path / "store").keys("scores") == []


@pytest.mark.slow
def test_a_target_whose_numbers_are_nan_stops_the_run_in_one_line_and_stores_no_tau(tmp_path, prefect_api_url):
    """A target whose head holds a NaN row (its p is NaN at every token, and so is the drafter's q, read through the
    same head): the drafts stage refuses, the run ends in one line naming what to check, exit 2, and neither drafts
    nor scores are stored."""
    from dflash_eval.storage import Store

    target = tmp_path / "target"
    shutil.copytree(GOLDEN / "dflash010" / "target", target)
    weights = load_file(target / "model.safetensors")
    weights["lm_head.weight"][-1] = float("nan")
    save_file(weights, target / "model.safetensors", metadata={"format": "pt"})
    run = json.loads((GOLDEN / "dflash010_loop.json").read_text())
    references = tmp_path / "references.jsonl"
    references.write_text("".join(json.dumps({"id": p["id"], "input_ids": p["input_ids"],
                                              "completion_ids": g["output_ids"]}) + "\n"
                                  for p, g in zip(run["metadata"]["prompts"][:2], run["greedy"][:2])))
    store = tmp_path / "store"
    from dflash_eval.cli import app

    result = CliRunner().invoke(app, ["run", "--target", str(target), "--drafter", str(GOLDEN / "dflash010" / "drafter"),
                                      "--references", str(references), "--temperature", "0.6",
                                      "--draft-sample-method", "probabilistic", "--store", str(store),
                                      "--settle-seconds", "0"])
    assert result.exit_code == 2, result.output
    last = result.output.strip().splitlines()[-1]
    assert last.startswith("error: ") and "acceptance probabilities min(1, q/p) of a reference are not numbers" in last
    assert Store(store).keys("drafts") == [] and Store(store).keys("scores") == []
