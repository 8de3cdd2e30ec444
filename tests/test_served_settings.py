"""Acceptance as it is served, through the flow on the tiny trained run: sampled references (--temperature,
--samples, --seed), completions you already have (--references FILE), fewer draft tokens (--block-size), each
cached as the greedy path is, on a local store, on S3 and on a Dask cluster."""

import json

import pytest
import torch
from typer.testing import CliRunner

from dflash_core.decoding import decode, speculative_decode
from dflash_core.drafter import load_drafter
from dflash_core.sampling import Sampling, sample_seed
from dflash_core.target import load_target, read_target_config
from dflash_eval.cli import app
from dflash_eval.storage import Store
from tests.test_pipeline import MAX_NEW, N_PROMPTS, STAGES, evaluate

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

SAMPLED = dict(temperature=0.6, top_k=20, top_p=0.95, samples=2, seed=0)
SETTINGS = Sampling(0.6, 20, 0.95)
LABEL = "T=0.6 top-k 20 top-p 0.95, 2 samples per prompt, seed 0"  # the served setting's one label


def prompt_ids(tiny) -> list[dict]:
    return [json.loads(line) for line in tiny.prompts.read_text().splitlines()]


def client_artifacts(flow_run_id):
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        return client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))


def test_sampled_references_through_the_flow(tiny, tmp_path, prefect_api_url):
    store = tmp_path / "store"
    first, _ = evaluate(tiny, store, step=0, **SAMPLED)
    assert first["stages"] == dict.fromkeys(STAGES, "ran")
    second, _ = evaluate(tiny, store, step=-1, **SAMPLED)
    assert second["stages"] == {"fetch": "ran", "references": "cached", "features": "cached", "drafts": "ran",
                                "scores": "ran"}
    assert second["served"] == {"label": LABEL, "references": "sampled", **SETTINGS.identity(), "samples": 2,
                                "seed": 0, "block_size": None, "draft_sample_method": "greedy",
                                "draft_truncation": True}
    assert second["n_prompts"] == 2 * N_PROMPTS
    prompts = prompt_ids(tiny)
    assert [p["id"] for p in second["per_prompt"]] == [f"{p['id']}#s{k}" for p in prompts for k in (0, 1)]

    # each stored completion is the target's sample with the request's own seed, and the samples differ
    target = load_target(tiny.target_dir, dtype=torch.float32)
    eos = list(read_target_config(tiny.target_dir).eos_token_ids)
    refs = Store(store).entry("references", second["keys"]["references"])
    for n, prompt in enumerate(prompts[:3]):
        stored = [json.loads((refs / f"seq_{2 * n + k}.json").read_text())["turns"][0]["token_ids"] for k in (0, 1)]
        for k in (0, 1):
            generator = torch.Generator().manual_seed(sample_seed(0, prompt["id"], k, 0))
            assert stored[k] == decode(target, prompt["input_ids"], MAX_NEW, eos, SETTINGS, generator)
    assert len({tuple(json.loads(p.read_text())["turns"][0]["token_ids"]) for p in refs.glob("seq_*.json")}) > N_PROMPTS

    # greedy on the same store: other references, its own history group; the sampled run's interval is two-level
    greedy, _ = evaluate(tiny, store, step=-1)
    assert greedy["keys"]["references"] != second["keys"]["references"] and greedy["served"]["label"] == "greedy"
    from dflash_eval.reporting.history import history

    titles = sorted(g.title for g in history(Store(store)))
    assert len(titles) == 2 and any(LABEL in t for t in titles)
    from dflash_eval.reporting.report import write_report

    report = write_report(Store(store), tmp_path / "report").read_text()
    assert "Checkpoints at every setting evaluated" in report and f"{LABEL} (group" in report
    # another seed: other samples, another references entry
    reseeded, _ = evaluate(tiny, store, step=-1, **{**SAMPLED, "seed": 1})
    assert reseeded["stages"]["references"] == "ran" and reseeded["tau_macro"] != second["tau_macro"]


def test_sampled_drafts_through_the_flow(tiny, tmp_path, prefect_api_url):
    """--draft-sample-method probabilistic: the same references and features entry, extended once with the
    target's probabilities of their tokens (verified, and extracted again when damaged), a series of its own, and a
    new checkpoint costs only fetch, drafts and scores. Its tau is the expectation dflash_core's replay gives over
    the stored references."""
    import numpy as np

    from dflash_core.drafter import load_drafter as load
    from dflash_core.replay import Reference, replay
    from dflash_core.sampled_drafts import SampledDrafts, coin_seed
    from dflash_eval.storage.feature_store import TARGET_PROBS

    store = tmp_path / "store"
    argmax, _ = evaluate(tiny, store, step=-1, **SAMPLED)
    sampled, _ = evaluate(tiny, store, step=-1, **SAMPLED, draft_sample_method="probabilistic")
    assert sampled["keys"]["references"] == argmax["keys"]["references"]
    assert sampled["keys"]["features"] == argmax["keys"]["features"]
    assert sampled["stages"] == {"fetch": "cached", "references": "cached", "features": "ran", "drafts": "ran",
                                 "scores": "ran"}
    features = Store(store).feature_store(sampled["keys"]["features"])
    assert not features.missing([TARGET_PROBS], 2 * N_PROMPTS)
    assert sampled["served"]["label"] == f"{LABEL}, sampled drafts"
    assert sampled["served"]["draft_sample_method"] == "probabilistic" and sampled["draft_sampling"]["seed"] == 0
    assert sampled["series"]["key"] != argmax["series"]["key"] and sampled["tau_macro"] != argmax["tau_macro"]
    assert set(sampled["tau_drawn"]) == {"tau_macro", "tau_pooled"}

    # its tau is the replay's expectation over the stored references and probabilities, nothing added
    refs = Store(store).entry("references", sampled["keys"]["references"])
    stored = [json.loads((refs / f"seq_{n}.json").read_text()) for n in range(2 * N_PROMPTS)]
    references = [Reference(r["turns"][0]["prompt_len"], r["turns"][0]["token_ids"]) for r in stored]
    drafter = load(tiny.drafter_steps[-1])
    target = load_target(tiny.target_dir, dtype=torch.float32)
    replayed = replay(drafter, target.embed_weight, target.head_weight, references,
                      [features.read(drafter.target_layer_ids, n) for n in range(len(stored))],
                      sampled=SampledDrafts(SETTINGS, [features.read_layer(TARGET_PROBS, n)[:, 0]
                                                       for n in range(len(stored))],
                                            [coin_seed(0, r["id"]) for r in stored]))
    by_prompt = {}
    for r, result in zip(stored, replayed):
        by_prompt.setdefault(r["prompt"], []).append(result.expected.tau)
    assert sampled["tau_macro"] == pytest.approx(np.mean([np.mean(t) for t in by_prompt.values()]), rel=1e-12)
    assert [p["acceptance_lengths"] for p in sampled["per_prompt"]] == [r.acceptance_lengths for r in replayed]

    # a new checkpoint: fetch, drafts and scores only
    new, _ = evaluate(tiny, store, step=0, **SAMPLED, draft_sample_method="probabilistic")
    assert new["stages"] == {"fetch": "ran", "references": "cached", "features": "cached", "drafts": "ran",
                             "scores": "ran"}
    # the target's probabilities are verified as the features are: a damaged array is extracted again, same tau
    chunk = next((store / "features").glob("*/*/features.zarr/target_probs/seq_1/c/0/0"))
    values = np.fromfile(chunk, dtype=np.float32)
    (values * 0.5).tofile(chunk)
    again, _ = evaluate(tiny, store, step=-1, **SAMPLED, draft_sample_method="probabilistic", refresh=["drafts"])
    assert again["tau_macro"] == sampled["tau_macro"] and again["per_prompt"] == sampled["per_prompt"]
    assert np.array_equal(np.fromfile(chunk, dtype=np.float32), values)


def test_completions_you_already_have_score_as_the_references_they_are(tiny, tmp_path, prefect_api_url):
    """The greedy run's own completions given as a file score exactly as the greedy run; a text line is flagged."""
    store = tmp_path / "store"
    greedy, _ = evaluate(tiny, store, step=-1)
    refs = Store(store).entry("references", greedy["keys"]["references"])
    lines = []
    for n in range(N_PROMPTS):
        record = json.loads((refs / f"seq_{n}.json").read_text())
        turn = record["turns"][0]
        lines.append({"id": record["id"], "category": record["category"],
                      "input_ids": turn["token_ids"][:turn["prompt_len"]],
                      "completion_ids": turn["token_ids"][turn["prompt_len"]:]})
    given = tmp_path / "logged.jsonl"
    given.write_text("".join(json.dumps(line) + "\n" for line in lines))
    results, _ = evaluate(tiny, store, step=-1, references=str(given))
    assert results["stages"] == {"fetch": "cached", "references": "ran", "features": "ran", "drafts": "ran",
                                 "scores": "ran"}
    assert results["references_file"] == str(given)
    assert [p["acceptance_lengths"] for p in results["per_prompt"]] == \
        [p["acceptance_lengths"] for p in greedy["per_prompt"]]
    assert results["tau_macro"] == greedy["tau_macro"] and results["unverified_references"] == []
    again, _ = evaluate(tiny, store, step=0, references=str(given))
    assert again["stages"]["references"] == again["stages"]["features"] == "cached"

    # the same id twice: two samples of one prompt; a text completion is tokenized here and flagged
    tokenizer_line = {"id": "as-text", "text": "def add(a, b):", "completion": "\n    return a + b\n"}
    given.write_text("".join(json.dumps(line) + "\n" for line in [lines[0], lines[0], tokenizer_line]))
    mixed, _ = evaluate(tiny, store, step=-1, references=str(given))
    assert [p["id"] for p in mixed["per_prompt"]] == [f"{lines[0]['id']}#s0", f"{lines[0]['id']}#s1", "as-text"]
    assert mixed["unverified_references"] == ["as-text"] and mixed["served"]["samples"] == 2
    assert mixed["served"]["label"] == "given completions" and mixed["served"]["references"] == "given"


def test_fewer_draft_tokens_through_the_flow(tiny, tmp_path, prefect_api_url):
    store = tmp_path / "store"
    full, _ = evaluate(tiny, store, step=-1)
    four, _ = evaluate(tiny, store, step=-1, block_size=4)
    assert four["stages"] == {"fetch": "cached", "references": "cached", "features": "cached", "drafts": "ran",
                              "scores": "ran"}
    assert four["block_size"] == 4 and four["served"]["block_size"] == 4 and four["served"]["label"] == "greedy, blocks of 4"
    assert list(four["histogram"]) == ["1", "2", "3", "4"]
    assert four["tau_macro"] < full["tau_macro"]
    # the online loop verifying blocks of 4 gives the same lengths
    target = load_target(tiny.target_dir, dtype=torch.float32)
    drafter = load_drafter(tiny.drafter_steps[-1])
    eos = list(read_target_config(tiny.target_dir).eos_token_ids)
    for prompt, scored in zip(prompt_ids(tiny)[:4], four["per_prompt"]):
        online = speculative_decode(target, drafter, prompt["input_ids"], MAX_NEW, eos, block_size=4)
        assert scored["acceptance_lengths"] == online.acceptance_lengths
    from dflash_eval.reporting.history import history

    titles = sorted(g.title for g in history(Store(store)))
    assert len(titles) == 2 and any(t.endswith("blocks of 4 (causal sliding layers)") for t in titles)


def test_served_settings_on_object_storage_equal_the_local_ones(tiny, s3_url, tmp_path, prefect_api_url,
                                                                 monkeypatch):
    local, _ = evaluate(tiny, tmp_path / "local", **SAMPLED, block_sizes=[4, 8])
    monkeypatch.setenv("DFLASH_STORE_CACHE", str(tmp_path / "machine"))
    on_s3, _ = evaluate(tiny, s3_url, **SAMPLED, block_sizes=[4, 8])
    assert on_s3["keys"] == local["keys"] and on_s3["per_prompt"] == local["per_prompt"]
    assert on_s3["tau_macro_ci95"] == local["tau_macro_ci95"] and on_s3["block_sweep"] == local["block_sweep"]
    # completions you already have, stored on S3: the local run's sampled completions score as they did
    refs = Store(tmp_path / "local").entry("references", local["keys"]["references"])
    given = tmp_path / "given.jsonl"
    with given.open("w") as f:
        for n in range(2 * N_PROMPTS):
            turn = json.loads((refs / f"seq_{n}.json").read_text())["turns"][0]
            f.write(json.dumps({"id": f"p{n // 2}", "input_ids": turn["token_ids"][:turn["prompt_len"]],
                                "completion_ids": turn["token_ids"][turn["prompt_len"]:]}) + "\n")
    from_file, _ = evaluate(tiny, s3_url, references=str(given))
    assert [p["acceptance_lengths"] for p in from_file["per_prompt"]] == \
        [p["acceptance_lengths"] for p in local["per_prompt"]]
    assert from_file["tau_macro_ci95"] == local["tau_macro_ci95"]  # the same samples of the same prompts


def test_the_run_name_tags_and_summary_show_the_setting(tiny, tmp_path, prefect_api_url):
    from prefect import get_client

    results, flow_run_id = evaluate(tiny, tmp_path / "store", **SAMPLED, block_size=4)
    with get_client(sync_client=True) as client:
        run = client.read_flow_run(flow_run_id)
    label = f"{LABEL}, blocks of 4"
    assert results["served"]["label"] == label and run.name.endswith(f"[{label}]")
    assert {"sampling:T=0.6 top-k 20 top-p 0.95", "samples:2", "block-size:4"} <= set(run.tags)
    summaries = [a for a in client_artifacts(flow_run_id) if a.type == "markdown"]
    assert any(label in a.data for a in summaries)
    assert client_flow_run_state_message(flow_run_id).endswith(f"; {label}")


def client_flow_run_state_message(flow_run_id) -> str:
    from prefect import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id).state.message


def test_the_drafter_s_own_block_size_is_no_block_size_chosen(tiny, tmp_path, prefect_api_url):
    """--block-size B equal to the drafter's own: the same keys, series, tags and name as no --block-size, in the
    results, the history, the run and (from a deployment's parameters, checked by the flow) the same again."""
    from prefect import get_client

    from dflash_eval.reporting.history import history

    store = tmp_path / "store"
    own = load_drafter(tiny.drafter_steps[-1]).block_size
    plain, plain_run = evaluate(tiny, store, step=-1)
    chosen, chosen_run = evaluate(tiny, store, step=-1, block_size=own)
    assert chosen["keys"] == plain["keys"] and chosen["series"] == plain["series"]
    assert chosen["served"] == plain["served"] and chosen["served"]["block_size"] is None
    assert chosen["stages"]["drafts"] == chosen["stages"]["scores"] == "cached"
    with get_client(sync_client=True) as client:
        runs = [client.read_flow_run(flow_run_id) for flow_run_id in (plain_run, chosen_run)]
    assert runs[0].name == runs[1].name == "drafter/step_400" and not any("block-size" in t for t in runs[1].tags)
    assert sorted(runs[0].tags) == sorted(runs[1].tags)
    assert len(history(Store(store))) == 1  # one series


def test_a_block_size_sweep_shares_the_features_and_projects_speedups(tiny, tmp_path, prefect_api_url):
    store = tmp_path / "store"
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"2": 1.05, "4": 1.1, "8": 1.25}))
    results, _ = evaluate(tiny, store, step=-1, block_sizes=[8, 2, 4], step_cost=str(costs))
    sweep = results["block_sweep"]
    assert [row["block_size"] for row in sweep] == [2, 4, 8]
    assert sweep[0]["tau_macro"] < sweep[1]["tau_macro"] < sweep[2]["tau_macro"] <= 8
    assert sweep[2]["tau_macro"] == results["tau_macro"]  # b 8 is the drafter's own block: the main drafts entry
    assert results["stages"]["drafts b8"] == "cached" and results["stages"]["drafts b2"] == "ran"
    for row, cost in zip(sweep, (1.05, 1.1, 1.25)):
        assert row["projected_speedup"] == pytest.approx(row["tau_macro"] / cost)
        assert row["tau_per_token"] == pytest.approx(row["tau_macro"] / row["block_size"])
    # the report the flow rewrote: tau(b), tau(b)/b and the projected speedup per b, labelled as projected
    report = (store / "report" / "report.md").read_text()
    assert "projected, not measured" in report
    for row, cost in zip(sweep, (1.05, 1.1, 1.25)):
        assert (f"| drafter/step_400 | {row['block_size']} | {row['tau_macro']:.3f} |" in report
                and f"| {row['tau_macro'] / row['block_size']:.3f} | {row['tau_macro'] / cost:.2f}x |" in report)
    # each size is the entry a run at --block-size b makes: found in the store
    four, _ = evaluate(tiny, store, step=-1, block_size=4)
    assert four["stages"]["drafts"] == "cached" and four["tau_macro"] == sweep[1]["tau_macro"]

    # `report --step-cost` with costs for some sizes only: the others show "-"; a bad cost file is refused
    costs.write_text(json.dumps({"4": 1.1}))
    result = CliRunner().invoke(app, ["report", "--store", str(store), "--out", str(tmp_path / "rep"),
                                      "--step-cost", str(costs)])
    assert result.exit_code == 0, result.output
    report = (tmp_path / "rep" / "report.md").read_text()
    assert f"| {sweep[1]['tau_macro'] / 1.1:.2f}x |" in report and f"| {sweep[0]['tau_macro'] / 2:.3f} | - |" in report
    costs.write_text(json.dumps({"4": -1}))
    result = CliRunner().invoke(app, ["report", "--store", str(store), "--out", str(tmp_path / "rep2"),
                                      "--step-cost", str(costs)])
    assert result.exit_code == 2 and "positive costs" in result.output and not (tmp_path / "rep2").exists()


def test_diagnostics_replay_at_the_block_size_verified(tiny, tmp_path, prefect_api_url):
    results, _ = evaluate(tiny, tmp_path / "store", step=-1, block_size=4, until="diagnostics")
    diagnostics = results["diagnostics"]
    assert diagnostics["first_divergence"], "no rejected draft to show"
    # each example's draft is the b-1 = 3 tokens a block of 4 drafts, not the drafter's 7
    assert all(len(d["drafted_tokens"]) <= 3 for d in diagnostics["first_divergence"])
    assert max(len(d["drafted_tokens"]) for d in diagnostics["first_divergence"]) == 3
    for probe in diagnostics["layer_offset_probe"]:
        assert probe["tau_macro"] is None or probe["tau_macro"] <= 4
