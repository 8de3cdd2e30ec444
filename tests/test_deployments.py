"""Unattended evaluation against a real `prefect server start` on loopback: `dflash-eval serve`
serves the deployments, `dflash-eval notify` events start evaluations, the relay watcher starts each
new checkpoint once in step order, and heavy stages of concurrent runs take turns."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_eval.flows.settings import STAGES
from dflash_eval.services.relay.server import RelayServer
from tests.evaluations import setting_schema
from tests.ports import free_port
from tests.tiny_models import first_prompts
from tests.waiting import NeverReady, answers, wait_until

pytestmark = pytest.mark.slow

N_PROMPTS = 6
MAX_NEW = 32


def wait_for(condition, timeout: float, what: str, every: float = 0.5):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.fixture(scope="module")
def prefect_server(tmp_path_factory):
    """A real Prefect server (with its event triggers and scheduler) in its own process and home."""
    home = tmp_path_factory.mktemp("prefect_home")
    port = free_port()
    env = {**os.environ, "PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_LOGGING_LEVEL": "WARNING"}
    env.pop("PREFECT_API_URL", None)
    log = open(home / "server.log", "w")
    server = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1",
                               "--port", str(port)], env=env, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}/api"

    try:  # a late answer on busy cores is waited through, as a refused connection is
        wait_until(answers(f"{url}/health"), 120, "the Prefect server", server)
    except NeverReady as e:
        raise AssertionError(f"{e}: {(home / 'server.log').read_text()[-2000:]}") from None
    yield {"url": url, "home": home}
    server.terminate()
    server.wait(30)
    log.close()


@pytest.fixture(scope="module")
def setup(tiny_qwen3_run, tmp_path_factory):
    root = tmp_path_factory.mktemp("unattended")
    prompts = first_prompts(tiny_qwen3_run, N_PROMPTS, root / "prompts.jsonl")
    runs = root / "runs"
    for checkpoint in tiny_qwen3_run.drafter_steps[:2]:  # step_100 and step_200 on the relay
        shutil.copytree(checkpoint, runs / "run1" / checkpoint.name)
    return {"tiny": tiny_qwen3_run, "prompts": prompts, "runs": runs, "store": root / "store", "root": root}


@pytest.fixture(scope="module")
def served(prefect_server, setup):
    """A relay over the run's checkpoints and `dflash-eval serve` watching it."""
    with RelayServer(setup["runs"], state_dir=setup["root"] / "relay_state", settle_seconds=0) as relay:
        env = {**os.environ, "PREFECT_API_URL": prefect_server["url"], "PREFECT_HOME": str(prefect_server["home"]),
               "PREFECT_LOGGING_LEVEL": "INFO"}
        log = open(setup["root"] / "serve.log", "w")
        serve = subprocess.Popen(
            [sys.executable, "-m", "dflash_eval.cli", "serve", "--target", str(setup["tiny"].target_dir),
             "--prompts", str(setup["prompts"]), "--store", str(setup["store"]), "--max-new-tokens", str(MAX_NEW),
             "--relay", relay.url, "--watch-interval", "3600", "--settle-seconds", "3", "--checkpoint-wait", "240",
             "--report-port", "0"],
            env=env, stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).parent.parent)
        try:
            with client_of(prefect_server) as client:
                def deployed():
                    assert serve.poll() is None, (setup["root"] / "serve.log").read_text()[-3000:]
                    names = {d.name for d in client.read_deployments()}
                    return {"evaluate-checkpoint", "watch-relay", *(f"rerun-{s}" for s in STAGES)} <= names

                wait_for(deployed, 120, "serve to register its deployments")
            yield {"relay": relay, "serve": serve, "log": setup["root"] / "serve.log"}
        finally:
            serve.terminate()
            serve.wait(60)
            log.close()


class client_of:
    """A synchronous Prefect client of the module's server (not the session's test harness)."""

    def __init__(self, prefect_server):
        self.url = prefect_server["url"]

    def __enter__(self):
        from prefect import get_client
        from prefect.settings import PREFECT_API_URL, temporary_settings

        self.settings = temporary_settings({PREFECT_API_URL: self.url})
        self.settings.__enter__()
        self.client = get_client(sync_client=True)
        return self.client.__enter__()

    def __exit__(self, *exc):
        self.client.__exit__(*exc)
        self.settings.__exit__(*exc)


def evaluation_runs(client) -> list:
    from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterName
    from prefect.client.schemas.sorting import FlowRunSort

    return client.read_flow_runs(deployment_filter=DeploymentFilter(name=DeploymentFilterName(any_=["evaluate-checkpoint"])),
                                 sort=FlowRunSort.EXPECTED_START_TIME_ASC)


def wait_finished(client, run_ids, log: Path, timeout=300):
    def finished():
        runs = [client.read_flow_run(i) for i in run_ids]
        failed = [r for r in runs if r.state.is_final() and not r.state.is_completed()]
        assert not failed, f"{[(r.name, r.state.message) for r in failed]}\n{log.read_text()[-4000:]}"
        return runs if all(r.state.is_completed() for r in runs) else None

    return wait_for(finished, timeout, f"flow runs {run_ids} to complete", every=2)


def test_deployments_are_served(prefect_server, served):
    with client_of(prefect_server) as client:
        names = {d.name for d in client.read_deployments()}
        assert {"evaluate-checkpoint", "watch-relay", "rerun-drafts", "rerun-features", "rerun-scores"} <= names
        evaluate = client.read_deployment_by_name("evaluate-checkpoint/evaluate-checkpoint")
        watch = client.read_deployment_by_name("watch-relay/watch-relay")
        assert watch.schedules and watch.schedules[0].schedule.interval.total_seconds() == 3600
        assert evaluate.parameters["inputs"]["max_new_tokens"] == MAX_NEW
        assert evaluate.parameters["checkpoints"]["settle_seconds"] == 3 and watch.parameters == {"relay": served["relay"].url}


def watch(prefect_server, relay_url, setup, out: Path) -> subprocess.Popen:
    """One look at the relay by `dflash-eval watch`, in its own process, as a scheduled watcher runs."""
    return subprocess.Popen(
        [sys.executable, "-m", "dflash_eval.cli", "watch", "--relay", relay_url, "--target", str(setup["tiny"].target_dir),
         "--prompts", str(setup["prompts"]), "--store", str(setup["store"]), "--max-new-tokens", str(MAX_NEW),
         "--out", str(out)],
        env={**os.environ, "PREFECT_API_URL": prefect_server["url"]}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, cwd=Path(__file__).parent.parent)


def watched(process: subprocess.Popen, out: Path) -> list[dict]:
    output, _ = process.communicate(timeout=180)
    assert process.returncode == 0, output[-3000:]
    return json.loads(out.read_text())


def test_watcher_starts_new_checkpoints_once_in_step_order(prefect_server, served, setup, tmp_path):
    # two overlapping watchers
    watchers = [watch(prefect_server, served["relay"].url, setup, tmp_path / f"watch{i}.json") for i in range(2)]
    started = [watched(w, tmp_path / f"watch{i}.json") for i, w in enumerate(watchers)]
    assert [[s["path"] for s in w] for w in started] == [["run1/step_100", "run1/step_200"]] * 2
    assert started[0] == started[1]  # the same two runs: the second watcher got the first one's back
    with client_of(prefect_server) as client:
        runs = evaluation_runs(client)
        assert [r.parameters["drafter"].rsplit("/", 1)[1] for r in runs] == ["step_100", "step_200"]
        # the deployment's settings, with what the watcher was given in their place, setting by setting: serve's
        # --checkpoint-wait stays, though the watcher gave others of its group ($DFLASH_SETTLE_SECONDS: conftest)
        assert all(r.parameters["checkpoints"]["checkpoint_wait"] == 240 for r in runs)
        assert all(r.parameters["checkpoints"]["settle_seconds"] == 0 for r in runs)
        assert all(r.parameters["inputs"]["max_new_tokens"] == MAX_NEW for r in runs)
        assert [str(r.id) for r in runs] == [s["flow_run_id"] for s in started[0]]
        finished = wait_finished(client, [r.id for r in runs], served["log"])
        # Both ran at once in the served process; their heavy stages took turns.
        assert all(r.state.name == "Completed" for r in finished)
        first, second = sorted(finished, key=lambda r: r.start_time)
        assert second.start_time < first.end_time  # the served process ran them at the same time
        # features once (the other run's is cached), drafts twice; the served process sends its logs in
        # batches, so the last ones may reach the server a moment after the runs' final states
        def all_slot_logs():
            intervals = slot_intervals(client, [r.id for r in finished])
            return intervals if len(intervals) >= 3 else None

        heavy = wait_for(all_slot_logs, 30, "the heavy-stage slot logs")
        assert len(heavy) == 3, heavy
        assert all(end <= next_start for (_, end), (next_start, _) in zip(heavy, heavy[1:])), heavy
    again = watched(watch(prefect_server, served["relay"].url, setup, tmp_path / "again.json"), tmp_path / "again.json")
    assert again == []  # both scored now
    with client_of(prefect_server) as client:
        assert len(evaluation_runs(client)) == 2


def slot_intervals(client, run_ids) -> list[tuple]:
    """(taken, released) times of the heavy-stage slots the flow runs held, from the logs the server has."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    from dflash_eval.tasks.heavy import SLOT_RELEASED, SLOT_TAKEN

    logs = client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=run_ids)))
    taken = sorted((log.timestamp, log.task_run_id) for log in logs if log.message.startswith(SLOT_TAKEN))
    released = {log.task_run_id: log.timestamp for log in logs if log.message.startswith(SLOT_RELEASED)}
    return [(at, released[task]) for at, task in taken if task in released]


def test_watcher_retries_a_failed_evaluation_a_bounded_number_of_times(prefect_server, served, setup, tmp_path):
    from dflash_eval.flows.watch import MAX_ATTEMPTS

    broken = tmp_path / "runs" / "run2" / "step_50"
    shutil.copytree(setup["tiny"].drafter_steps[0], broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "hidden_size": config["hidden_size"] + 1}))
    with RelayServer(tmp_path / "runs", state_dir=tmp_path / "relay_state", settle_seconds=0) as relay:
        attempts = []
        for look in range(MAX_ATTEMPTS + 1):
            out = tmp_path / f"look{look}.json"
            started = watched(watch(prefect_server, relay.url, setup, out), out)
            if not started:
                break
            (run,) = started
            attempts.append(run["attempt"])
            with client_of(prefect_server) as client:
                def failed():
                    state = client.read_flow_run(run["flow_run_id"]).state
                    assert not state.is_completed(), "a drafter that does not fit the target was evaluated"
                    return state.is_final()

                wait_for(failed, 120, "the broken checkpoint's evaluation to fail", every=1)
    assert attempts == list(range(1, MAX_ATTEMPTS + 1)) and not started


def test_notify_event_starts_an_evaluation(prefect_server, served, setup):
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    checkpoint = setup["tiny"].drafter_steps[2]  # step_300, a folder on this machine
    with client_of(prefect_server) as client:
        before = {r.id for r in evaluation_runs(client)}
    result = subprocess.run([sys.executable, "-m", "dflash_eval.cli", "notify", "--checkpoint", str(checkpoint),
                             "--step", "300"], env={**os.environ, "PREFECT_API_URL": prefect_server["url"]},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and "sent dflash.checkpoint.saved" in result.stdout, result.stdout + result.stderr
    assert "Still processing items" not in result.stdout + result.stderr  # delivered before "sent", not at exit
    with client_of(prefect_server) as client:
        (run,) = wait_for(lambda: [r for r in evaluation_runs(client) if r.id not in before], 90,
                          "the event's flow run")
        assert run.parameters["drafter"] == str(checkpoint)
        wait_finished(client, [run.id], served["log"])
        artifacts = client.read_artifacts(artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[run.id])))
    table = next(a.data for a in artifacts if a.key and a.key.endswith("-scores"))
    table = json.loads(table) if isinstance(table, str) else table
    tau = next(row["value"] for row in table if row["metric"] == "tau macro")
    from dflash_eval.reporting.history import history
    from dflash_eval.storage import Store

    (row,) = [r for g in history(Store(setup["store"])) for r in g.rows if r.step == 300]
    assert tau == f"{row.tau_macro:.3f}"  # the served run's scores, as the store holds them
    assert any(a.key and a.key.endswith("-summary") for a in artifacts)


WRITE_AND_NOTIFY = """
import shutil, subprocess, sys, time
source, destination, url = sys.argv[1:4]
shutil.copytree(source, destination, copy_function=shutil.copyfile)  # the trainer's save (new files) ...
saved = time.monotonic()
called = time.monotonic() - saved  # ... and its call of `dflash-eval notify` right after
notify = subprocess.run([sys.executable, "-m", "dflash_eval.cli", "notify", "--checkpoint", url, "--step", "400"],
                        capture_output=True, text=True)
print(f"notified {called:.2f} s after saving: {notify.stdout.strip()} {notify.stderr.strip()}")
"""


def test_a_checkpoint_notified_as_soon_as_it_is_saved_is_waited_for_and_evaluated(prefect_server, served, setup,
                                                                                tmp_path):
    """The trainer saves and notifies at once; the relay answers 409 until the save is 45 s old (the
    30 s default, made longer than the way from notify to fetch: the event, the runner's 10 s poll, a new
    process importing torch), and the evaluation waits for it instead of failing with "no checkpoint"."""
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    runs = tmp_path / "runs"
    runs.mkdir()
    with RelayServer(runs, state_dir=tmp_path / "relay_state", settle_seconds=45) as relay:
        url = f"{relay.url}/run3/step_400"
        with client_of(prefect_server) as client:
            before = {r.id for r in evaluation_runs(client)}
        writer = subprocess.run([sys.executable, "-c", WRITE_AND_NOTIFY, str(setup["tiny"].drafter_steps[-1]),
                                 str(runs / "run3" / "step_400"), url],
                                env={**os.environ, "PREFECT_API_URL": prefect_server["url"]}, capture_output=True,
                                text=True, timeout=60, cwd=Path(__file__).parent.parent)
        assert writer.returncode == 0 and "sent dflash.checkpoint.saved" in writer.stdout, writer.stdout + writer.stderr
        assert float(writer.stdout.split("notified ")[1].split(" s")[0]) < 1.0
        with client_of(prefect_server) as client:
            (run,) = wait_for(lambda: [r for r in evaluation_runs(client) if r.id not in before], 90, "the event's flow run")
            assert run.parameters["drafter"] == url
            wait_finished(client, [run.id], served["log"])
            logs = [log.message for log in client.read_logs(log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))]
    waits = [m for m in logs if m.startswith(f"waiting for {url}")]
    assert waits and "still being written" in waits[0], "\n".join(logs)
    assert any(m.startswith(f"{url} is finished after a wait of") for m in logs), logs


def test_notify_without_a_server_returns_at_once_with_a_warning(setup):
    port = free_port()  # nothing listens there
    for command in ([sys.executable, "-m", "dflash_eval.cli", "notify"],  # with Prefect
                    [sys.executable, "-S", "flows/notify.py"]):  # no site-packages: no Prefect, stdlib HTTP
        started = time.monotonic()
        result = subprocess.run([*command, "--checkpoint", "http://relay:8700/run1/step_9", "--step", "9"],
                                env={**os.environ, "PREFECT_API_URL": f"http://127.0.0.1:{port}/api"},
                                capture_output=True, text=True, timeout=60, cwd=Path(__file__).parent.parent)
        assert result.returncode == 0, result.stderr
        assert "warning: the Prefect server" in result.stderr and "unreachable" in result.stderr
        assert time.monotonic() - started < 30  # seconds, not a trainer-blocking wait


def test_notify_without_prefect_posts_the_event(prefect_server):
    """The standalone notify (stdlib only) delivers an event the server stores."""
    import requests

    result = subprocess.run([sys.executable, "-S", "flows/notify.py", "--checkpoint", "/nowhere/step_7", "--step", "7",
                             "--api-url", prefect_server["url"]], capture_output=True, text=True, timeout=60,
                            cwd=Path(__file__).parent.parent)
    assert result.returncode == 0 and "sent" in result.stdout, result.stderr

    def delivered():
        response = requests.post(f"{prefect_server['url']}/events/filter", timeout=10,
                                 json={"filter": {"event": {"name": ["dflash.checkpoint.saved"]}}, "limit": 50})
        response.raise_for_status()
        return [e for e in response.json()["events"] if e["payload"].get("checkpoint") == "/nowhere/step_7"]

    (event,) = wait_for(delivered, 30, "the event")
    assert event["payload"]["step"] == 7 and event["resource"]["prefect.resource.id"] == "dflash.checkpoint./nowhere/step_7"


def assert_rerun_form(deployment) -> None:
    """A rerun-<stage> deployment's form: typed choices with help, the drafter asked for, the stage fixed."""
    schema = deployment.parameter_openapi_schema
    properties = schema["properties"]
    assert "until" not in properties and "refresh" not in properties  # the form cannot turn it into another stage
    assert "until" not in deployment.parameters and "refresh" not in deployment.parameters
    assert setting_schema(schema, "compute", "dtype")["enum"] == ["auto", "float32", "bfloat16"]
    assert setting_schema(schema, "compute", "device")["enum"] == ["cpu", "cuda"]
    assert setting_schema(schema, "scoring", "sliding_semantics")["enum"] == ["causal", "non_causal"]
    assert "drafter" in schema["required"] and "drafter" not in deployment.parameters
    assert "relay URL" in properties["drafter"]["description"]


def test_served_deployments_have_typed_forms(prefect_server, served):
    with client_of(prefect_server) as client:
        evaluate = client.read_deployment_by_name("evaluate-checkpoint/evaluate-checkpoint")
        schema = evaluate.parameter_openapi_schema
        properties = schema["properties"]
        assert setting_schema(schema, "compute", "dtype")["enum"] == ["auto", "float32", "bfloat16"]
        assert properties["until"]["enum"] == list(STAGES)
        assert properties["refresh"]["anyOf"][0]["items"]["enum"] == list(STAGES)
        prompts = setting_schema(schema, "inputs", "prompts")
        assert prompts["anyOf"][0]["type"] == "string" and prompts["description"]
        for stage in STAGES:
            assert_rerun_form(client.read_deployment_by_name(f"evaluate-checkpoint/rerun-{stage}"))


def test_prefect_yaml_deploys_with_its_trigger_and_schedule(prefect_server, served, setup):
    """The work-pool route: `prefect deploy --all` from prefect.yaml (runs last: it replaces the served
    deployments of the same names with work-pool ones)."""
    import requests

    repo = Path(__file__).parent.parent
    env = {**os.environ, "PREFECT_API_URL": prefect_server["url"], "DFLASH_EVAL_DIR": str(repo),
           "DFLASH_TARGET": str(setup["tiny"].target_dir), "DFLASH_PROMPTS": str(setup["prompts"]),
           "DFLASH_STORE": str(setup["store"]), "DFLASH_RELAY": served["relay"].url}
    for command in (["work-pool", "create", "dflash-eval", "--type", "process"], ["--no-prompt", "deploy", "--all"]):
        result = subprocess.run([sys.executable, "-m", "prefect", *command], env=env, cwd=repo, capture_output=True,
                                text=True, timeout=180)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    with client_of(prefect_server) as client:
        evaluate = client.read_deployment_by_name("evaluate-checkpoint/evaluate-checkpoint")
        assert evaluate.work_pool_name == "dflash-eval"
        assert evaluate.parameters["inputs"]["target"] == str(setup["tiny"].target_dir)
        watch = client.read_deployment_by_name("watch-relay/watch-relay")
        assert watch.schedules[0].schedule.interval.total_seconds() == 300
        assert watch.parameters["relay"] == served["relay"].url
        for stage in STAGES:
            rerun = client.read_deployment_by_name(f"evaluate-checkpoint/rerun-{stage}")
            assert rerun.entrypoint == f"flows/evaluate.py:rerun_{stage}"
            assert_rerun_form(rerun)
    automations = requests.get(f"{prefect_server['url']}/automations/related-to/prefect.deployment.{evaluate.id}",
                               timeout=10).json()
    (automation,) = automations
    assert automation["trigger"]["expect"] == ["dflash.checkpoint.saved"]
    assert automation["actions"][0]["parameters"] == {"drafter": "{{ event.payload.checkpoint }}"}
