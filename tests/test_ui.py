"""What the Prefect UI shows of evaluations, read back through the session server's API: run names, tags,
state messages with tau, the series (what makes taus comparable) in tags and artifact keys, the history artifact
and its picture of tau by step, the deployments' typed forms."""

import json

import pytest

from tests.tiny_models import first_prompts

pytestmark = pytest.mark.slow

N_PROMPTS = 6
MAX_NEW = 32


@pytest.fixture(scope="module")
def series(tiny_qwen3_run, tmp_path_factory, prefect_api_url):
    """Every step of the tiny run evaluated, newest first (history must still list them by step), and one
    stage rerun from its deployment's flow; returns the flow runs and what they returned."""
    from dflash_eval.flows.evaluate import RERUN_FLOWS
    from tests.evaluations import run_evaluation

    root = tmp_path_factory.mktemp("ui")
    prompts = first_prompts(tiny_qwen3_run, N_PROMPTS, root / "held-out.jsonl")
    settings = dict(target=str(tiny_qwen3_run.target_dir), prompts=str(prompts), max_new_tokens=MAX_NEW,
                    store=str(root / "store"))
    runs = {}
    for step in reversed(tiny_qwen3_run.drafter_steps):
        state = run_evaluation(**settings, drafter=str(step), return_state=True)
        runs[step.name] = (state.state_details.flow_run_id, state.result())
    newest = tiny_qwen3_run.drafter_steps[-1]
    state = run_evaluation(RERUN_FLOWS["drafts"], **settings, drafter=str(newest), return_state=True)
    runs["rerun"] = (state.state_details.flow_run_id, state.result())
    return {"tiny": tiny_qwen3_run, "settings": settings, "runs": runs, "root": root}


def read_run(flow_run_id):
    from prefect import get_client

    with get_client(sync_client=True) as client:
        return client.read_flow_run(flow_run_id)


def artifacts_of(flow_run_id) -> dict:
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        found = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id])))
    return {a.key: a for a in found if a.key}


def test_each_run_is_named_and_tagged_by_checkpoint_and_step_and_its_state_holds_tau(series):
    for step in series["tiny"].drafter_steps:
        flow_run_id, results = series["runs"][step.name]
        run = read_run(flow_run_id)
        n = results["drafter"]["step"]
        assert run.name == f"drafter/{step.name}"  # its folder says its step: no "step_100 step 100"
        assert {"target:target", "prompts:held-out", f"step:{n}", f"tau:{results['tau_macro']:.3f}",
                f"series:{results['series']['key']}"} <= set(run.tags)
        assert "stage-rerun" not in run.tags
        low, high = results["tau_macro_ci95"]
        assert run.state.is_completed()
        assert run.state.message == (f"tau {results['tau_macro']:.3f} (95% CI {low:.2f}-{high:.2f}), "
                                     f"pooled {results['tau_pooled']:.3f}, step {n}")


def test_a_stage_rerun_reads_as_one_and_still_ends_with_tau(series):
    flow_run_id, results = series["runs"]["rerun"]
    run = read_run(flow_run_id)
    newest = series["tiny"].drafter_steps[-1]
    assert run.name == f"drafter/{newest.name} rerun drafts"
    assert "stage-rerun" in run.tags
    assert results["stages"]["drafts"] == "ran" and results["stages"]["features"] == "cached"
    assert run.state.message.startswith(f"tau {results['tau_macro']:.3f}")
    # the same acceptance lengths as the full evaluation of that checkpoint
    assert results["tau_macro"] == series["runs"][newest.name][1]["tau_macro"]


def test_the_history_artifact_lists_every_step_in_order_with_the_best_one(series):
    flow_run_id, results = series["runs"]["rerun"]
    history = artifacts_of(flow_run_id)[f"{results['series']['key']}-history"]
    table = history.data
    rows = json.loads(table) if isinstance(table, str) else table
    steps = [series["runs"][s.name][1]["drafter"]["step"] for s in series["tiny"].drafter_steps]
    assert [row["step"] for row in rows] == [str(n) for n in sorted(steps)]
    taus = {str(series["runs"][s.name][1]["drafter"]["step"]): series["runs"][s.name][1]["tau_macro"]
            for s in series["tiny"].drafter_steps}
    assert all(row["tau macro"] == f"{taus[row['step']]:.3f}" for row in rows)
    best = max(rows, key=lambda row: float(row["tau macro"]))
    assert [row["verdict"] for row in rows if row["verdict"] == "best"] == ["best"] and best["verdict"] == "best"
    # tau by step at a glance, with no server: a bar per row, a sparkline with the best one starred
    assert all(row["tau (bar from 1)"].startswith("█") for row in rows if float(row["tau macro"]) > 1.5)
    spark = history.description.split("tau by step ")[1].split(";")[0]
    assert len(spark.replace("*", "")) == len(rows) and spark.count("*") == 1
    assert spark.index("*") == [row["verdict"] for row in rows].index("best") + 1


def test_the_summary_gives_the_commands_that_rerun_a_stage_and_no_difference_against_itself(series):
    flow_run_id, results = series["runs"]["rerun"]
    summary = artifacts_of(flow_run_id)[f"{results['series']['key']}-summary"].data
    # no deployment was made on this server: no commands that would fail
    assert "prefect deployment run" not in summary
    chart = summary.split("```")[1].strip().splitlines()  # tau by checkpoint as text: no server needed
    assert len(chart) == len(series["tiny"].drafter_steps) and chart[-1].endswith("<- this run")
    this_row = next(line for line in summary.splitlines() if line.startswith("| this |"))
    assert this_row.endswith("| - |")
    assert "+0.000" not in this_row


def test_other_settings_and_another_store_are_series_of_their_own(series, tmp_path):
    """Runs of another max_new_tokens, or into another store, are never in the series of the fixture's runs: their
    own `series:` tag and artifacts, and the runs list filtered by a series holds only taus that compare."""
    from prefect import get_client
    from prefect.client.schemas.filters import (
        ArtifactCollectionFilter,
        ArtifactCollectionFilterKey,
        FlowRunFilter,
        FlowRunFilterTags,
    )

    from tests.evaluations import run_evaluation

    step = series["tiny"].drafter_steps[0]
    shorter = run_evaluation(**{**series["settings"], "max_new_tokens": MAX_NEW // 2}, drafter=str(step))
    elsewhere = run_evaluation(**{**series["settings"], "store": str(tmp_path / "store")}, drafter=str(step))
    mine = series["runs"][step.name][1]
    keys = {r["series"]["key"] for r in (mine, shorter, elsewhere)}
    assert len(keys) == 3, keys
    # readable (the tiny run's target, drafter run and prompts, each word once), then what tells them apart
    assert all(key.startswith("tiny-target-drafter-held-out-") for key in keys), keys
    with get_client(sync_client=True) as client:
        tagged = client.read_flow_runs(flow_run_filter=FlowRunFilter(tags=FlowRunFilterTags(
            all_=[f"series:{mine['series']['key']}"])))
    fixture_runs = {run_id for run_id, _ in series["runs"].values()}
    assert {run.id for run in tagged} == fixture_runs
    # each series keeps its own history: the newest one of the fixture's still lists its three steps
    history = artifacts_of(series["runs"]["rerun"][0])[f"{mine['series']['key']}-history"]
    with get_client(sync_client=True) as client:
        latest = client.read_latest_artifacts(artifact_filter=ArtifactCollectionFilter(key=ArtifactCollectionFilterKey(
            any_=[f"{k}-history" for k in keys])))
    rows = {a.key: len(json.loads(a.data) if isinstance(a.data, str) else a.data) for a in latest}
    assert rows == {f"{mine['series']['key']}-history": len(series["tiny"].drafter_steps),
                    f"{shorter['series']['key']}-history": 1, f"{elsewhere['series']['key']}-history": 1}
    assert history.key in rows
    # progress artifacts belong to their run: no key, so the Artifacts page holds results only
    progress = [a for a in artifacts_of_any(series["runs"][series["tiny"].drafter_steps[-1].name][0])
                if a.type == "progress"]
    assert progress and all(a.key is None for a in progress)


def artifacts_of_any(flow_run_id) -> list:
    from prefect import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    with get_client(sync_client=True) as client:
        return client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(
            any_=[flow_run_id])))


def test_the_deployments_forms_offer_choices_and_fix_a_reruns_stage(series, prefect_api_url):
    from prefect import get_client

    from dflash_eval.flows.deployments import build_deployments
    from dflash_eval.flows.settings import GROUPS, STAGES, Settings, by_group
    from tests.evaluations import setting_schema

    settings = Settings.checked(by_group(series["settings"]))
    with get_client(sync_client=True) as client:
        for flow, options in build_deployments(settings):
            deployment = client.read_deployment(flow.to_deployment(**options).apply())
            schema = deployment.parameter_openapi_schema
            properties = schema["properties"]
            # one section per group of settings, each setting with its choices, bounds and help
            assert [name for name in properties if name in GROUPS] == list(GROUPS)
            assert setting_schema(schema, "compute", "dtype")["enum"] == ["auto", "float32", "bfloat16"]
            assert setting_schema(schema, "compute", "device")["enum"] == ["cpu", "cuda"]
            assert setting_schema(schema, "scoring", "sliding_semantics")["enum"] == ["causal", "non_causal"]
            top_p = setting_schema(schema, "serving", "top_p")
            assert top_p["exclusiveMinimum"] == 0 and top_p["maximum"] == 1 and "mass" in top_p["description"]
            assert deployment.parameters["inputs"]["target"] == settings.inputs.target
            assert properties["drafter"]["description"].startswith("The checkpoint to score")
            if options["name"].startswith("rerun-"):
                assert "until" not in properties and "refresh" not in properties
            else:
                assert properties["until"]["enum"] == list(STAGES)

