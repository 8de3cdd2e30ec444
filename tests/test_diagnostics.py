"""Diagnostics, baselines, history and Prefect artifacts on the tiny trained run, through real flow
runs against the session's Prefect server (artifacts are read back through Prefect's API)."""

import json
import shutil

import pytest

from tests.tiny_models import first_prompts

pytestmark = pytest.mark.slow

N_PROMPTS = 12
MAX_NEW = 64


@pytest.fixture(scope="module")
def run_dir(tiny_qwen3_run, tmp_path_factory):
    """A short prompt file, a stand-in for a published drafter (step_200's weights under another
    name, no step), and a store path."""
    root = tmp_path_factory.mktemp("diagnosed")
    prompts = first_prompts(tiny_qwen3_run, N_PROMPTS, root / "prompts.jsonl")
    published = root / "published" / "dflash-tiny"
    shutil.copytree(tiny_qwen3_run.drafter_steps[1], published)
    config = json.loads((published / "config.json").read_text())
    (published / "config.json").write_text(json.dumps({**config, "note": "published"}))
    return {"tiny": tiny_qwen3_run, "prompts": prompts, "store": root / "store", "root": root, "published": published}


def evaluate(run_dir, drafter, store=None, **kwargs):
    from tests.evaluations import run_evaluation

    tiny = run_dir["tiny"]
    state = run_evaluation(target=str(tiny.target_dir), drafter=str(drafter), prompts=str(run_dir["prompts"]),
                                max_new_tokens=MAX_NEW, store=str(store or run_dir["store"]), return_state=True,
                                **kwargs)
    return state.result(), state.state_details.flow_run_id


@pytest.fixture(scope="module")
def diagnosed(run_dir, prefect_api_url):
    """Results of every saved step, run with diagnostics and the published stand-in as baseline."""
    return [evaluate(run_dir, step, until="diagnostics", baseline=str(run_dir["published"]))
            for step in run_dir["tiny"].drafter_steps]


def probe(diagnostics) -> dict[int, float]:
    return {p["offset"]: p["tau_macro"] for p in diagnostics["layer_offset_probe"] if p["tau_macro"] is not None}


def test_offset_probe_peaks_at_the_true_offset(run_dir, diagnosed):
    for results, _ in diagnosed[1:]:  # trained steps
        taus = probe(results["diagnostics"])
        assert len(taus) >= 3 and max(taus, key=taus.get) == 0, taus
        assert taus[0] == results["tau_macro"]
    # A training-time off-by-one: the last step's weights, with a config that names the layers below
    # the ones its features came from. The probe must peak at +1 (the layers it was trained on).
    last = run_dir["tiny"].drafter_steps[-1]
    shifted = run_dir["root"] / "off_by_one" / "step_400"
    shutil.copytree(last, shifted)
    config = json.loads((shifted / "config.json").read_text())
    ids = config["dflash_config"]["target_layer_ids"]
    config["dflash_config"]["target_layer_ids"] = [i - 1 for i in ids]
    (shifted / "config.json").write_text(json.dumps(config))
    results, _ = evaluate(run_dir, shifted, store=run_dir["root"] / "other_store", until="diagnostics")
    taus = probe(results["diagnostics"])
    assert max(taus, key=taus.get) == 1, taus
    assert taus[1] == pytest.approx(diagnosed[-1][0]["tau_macro"])  # the right layers give the right tau back
    assert results["tau_macro"] < taus[1] - 0.1


def test_ablation_lowers_tau_and_all_layers_remove_most_of_the_gain(diagnosed):
    for results, _ in diagnosed[1:]:
        d = results["diagnostics"]
        tau = results["tau_macro"]
        assert all(a["tau_macro"] < tau for a in d["layer_ablation"]), d["layer_ablation"]
        # All context gone, the drafter guesses from the bonus token alone: tau falls most of the way to 1
        # (the tiny drafter keeps a bigram-like guess for position 1: ~1.2-1.6 here).
        assert d["all_layers_ablated"] < min(a["tau_macro"] for a in d["layer_ablation"])
        assert d["all_layers_ablated"] - 1 < 0.35 * (tau - 1), (d["all_layers_ablated"], tau)


def test_sliding_switch_and_first_divergences(run_dir, diagnosed):
    from dflash_eval.storage import Store, read_json

    results, _ = diagnosed[-1]
    d = results["diagnostics"]
    # the fixture drafter's sliding window (4) is shorter than its block (8): the semantics matter
    assert d["sliding_switch"]["to"] == "non_causal" and d["sliding_switch"]["tau_macro"] < results["tau_macro"] - 0.1
    drafts = read_json(Store(run_dir["store"]).entry("drafts", results["keys"]["drafts"]) / "drafts.json")["per_prompt"]
    by_id = {p["id"]: p for p in drafts}
    assert d["first_divergence"]
    for example in d["first_divergence"]:
        steps = by_id[example["id"]]
        k = example["acceptance_length"] - 1  # the drafts accepted before the first rejected one
        # the drafted block matches the reference up to the first rejected draft, which the replay recorded
        assert example["drafted_tokens"][:k] == example["reference_tokens"][:k]
        assert example["drafted_tokens"][k] != example["reference_tokens"][k]
        assert steps["rejected_drafts"][example["decode_step"]] == example["drafted_tokens"][k]
        assert all(r == -1 for r in steps["rejected_drafts"][:example["decode_step"]])
        assert example["context"] and example["drafted"] and example["reference"]


def test_diagnostics_of_a_new_checkpoint_reuse_the_features(diagnosed):
    for results, _ in diagnosed[1:]:
        assert results["stages"]["references"] == results["stages"]["features"] == "cached"
        assert results["stages"]["diagnostics"] == "ran"
        assert results["stages"]["baseline scores"] == "cached"


def test_history_rises_with_training_and_shows_the_baseline(run_dir, diagnosed):
    from typer.testing import CliRunner

    from dflash_eval.cli import app
    from dflash_eval.reporting.history import history
    from dflash_eval.storage import Store

    (group,) = history(Store(run_dir["store"]))
    steps = [r.step for r in group.candidates]
    taus = [r.tau_macro for r in group.candidates]
    assert steps == sorted(steps) and len(steps) == len(diagnosed)
    assert taus[-1] > taus[0] and taus == [r["tau_macro"] for r, _ in diagnosed]
    (baseline,) = group.baselines
    assert baseline.label == "published/dflash-tiny" and baseline.step is None and baseline.mark == "baseline"
    assert baseline.tau_macro == taus[1]  # step_200's weights
    assert diagnosed[-1][0]["baseline"]["tau_macro"] == taus[1]
    result = CliRunner().invoke(app, ["history", "--store", str(run_dir["store"])])
    assert result.exit_code == 0, result.output
    rows = [[cell.strip() for cell in line.split("│")] for line in result.output.splitlines()
            if "step_" in line or "dflash-tiny" in line]
    # the verdict column (the tiny run's trainer log adds the trainer's columns after it)
    marks = [next((cell for cell in r[2:] if cell in ("best", "baseline", "REGRESSION")), "") for r in rows]
    assert [(r[1], mark) for r, mark in zip(rows, marks)] == \
        [("100", ""), ("200", ""), ("300", ""), ("400", "best"), ("baseline", "baseline")]


def test_artifacts_of_a_run_are_in_prefect(run_dir, diagnosed):
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    results, flow_run_id = diagnosed[-1]
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    by_key = {a.key: a for a in artifacts if a.key}
    series = results["series"]["key"]
    assert set(by_key) == {f"{series}-scores", f"{series}-summary", f"{series}-report", f"{series}-history"}
    table = by_key[f"{series}-scores"].data
    table = json.loads(table) if isinstance(table, str) else table
    assert {"metric": "tau macro", "value": f"{results['tau_macro']:.3f}"} in table
    summary = by_key[f"{series}-summary"].data
    assert f"{results['tau_macro']:.3f}" in summary and "previous step" in summary and "baseline" in summary
    assert "Best step" in summary
    link = by_key[f"{series}-report"].data  # markdown: [path](file:///.../report.html)
    report = run_dir["store"] / "report" / "report.html"
    assert f"({report.resolve().as_uri()})" in link and report.is_file()
    # the same keys across runs: one version per flow run
    with get_client(sync_client=True) as client:
        from prefect.client.schemas.filters import ArtifactFilterKey

        versions = client.read_artifacts(artifact_filter=ArtifactFilter(key=ArtifactFilterKey(any_=[f"{series}-scores"])))
    assert {a.flow_run_id for a in versions} >= {run_id for _, run_id in diagnosed}


def test_a_regression_is_flagged_in_the_summary(run_dir, diagnosed):
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    # step_500 holds step_100's weights: significantly worse than the best step before it
    relapse = run_dir["root"] / "relapse" / "step_500"
    shutil.copytree(run_dir["tiny"].drafter_steps[0], relapse)
    config = json.loads((relapse / "config.json").read_text())
    (relapse / "config.json").write_text(json.dumps({**config, "note": "relapse"}))  # another checkpoint's content
    results, flow_run_id = evaluate(run_dir, relapse)
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    (summary,) = [a.data for a in artifacts if a.key and a.key.endswith("-summary")]
    assert "**REGRESSION**" in summary and f"{results['tau_macro']:.3f}" in summary


def test_all_positions_tau_is_scored_on_request(run_dir, diagnosed):
    from dflash_eval.reporting.history import history
    from dflash_eval.storage import Store

    results, _ = evaluate(run_dir, run_dir["tiny"].drafter_steps[-1], all_positions=True)
    assert results["tau_macro"] == diagnosed[-1][0]["tau_macro"]  # the same decode path
    from dflash_eval.storage import read_json

    per_prompt = read_json(Store(run_dir["store"]).entry("drafts", results["keys"]["drafts"]) / "drafts.json")["per_prompt"]
    for prompt in per_prompt:  # the decode path visits a subset of all positions, with the same lengths there
        first = prompt["starts"][0]
        assert [prompt["all_positions"][s - first] for s in prompt["starts"]] == prompt["acceptance_lengths"]
    means = [sum(p["all_positions"]) / len(p["all_positions"]) for p in per_prompt]
    assert results["all_positions_tau"] == pytest.approx(sum(means) / len(means))
    (group,) = history(Store(run_dir["store"]))
    rows = [r for r in group.rows if r.step == 400 and not r.baseline]
    assert len(rows) == 1 and rows[0].all_positions_tau == results["all_positions_tau"]
