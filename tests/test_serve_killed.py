"""`dflash-eval serve` killed in the middle of a served evaluation (SIGKILL to it and its forked runs): the next
serve marks the run it left Running as Crashed, saying why, and the evaluation run again resumes from the store,
redoing none of the references the killed run finished. A real `prefect server start` of its own (one serve of
the deployments at a time: test_deployments.py has another)."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests import test_deployments
from tests.test_deployments import MAX_NEW, client_of, evaluation_runs, wait_finished, wait_for

pytestmark = pytest.mark.slow

# the same fixtures, their own instances in this module: a Prefect server and the tiny run's prompts and store
prefect_server = test_deployments.prefect_server
setup = test_deployments.setup


def start_serve(prefect_server, setup, log: Path) -> subprocess.Popen:
    env = {**os.environ, "PREFECT_API_URL": prefect_server["url"], "PREFECT_HOME": str(prefect_server["home"]),
           "PREFECT_LOGGING_LEVEL": "INFO"}
    return subprocess.Popen(
        [sys.executable, "-m", "dflash_eval.cli", "serve", "--target", str(setup["tiny"].target_dir),
         "--prompts", str(setup["prompts"]), "--store", str(setup["store"]), "--max-new-tokens", str(MAX_NEW),
         "--settle-seconds", "0", "--no-report-server"],
        env=env, stdout=log.open("a"), stderr=subprocess.STDOUT, cwd=Path(__file__).parent.parent,
        start_new_session=True)  # its own process group: the kill reaches its forked runs too


def notify(prefect_server, checkpoint) -> None:
    result = subprocess.run([sys.executable, "-m", "dflash_eval.cli", "notify", "--checkpoint", str(checkpoint),
                             "--step", "300"], env={**os.environ, "PREFECT_API_URL": prefect_server["url"]},
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_a_killed_serve_leaves_a_crashed_run_and_the_next_run_resumes(prefect_server, setup, tmp_path):
    from prefect.client.schemas.objects import StateType

    log = tmp_path / "serve.log"
    checkpoint = setup["tiny"].drafter_steps[2]
    references = setup["store"] / "references"
    serve = start_serve(prefect_server, setup, log)
    try:
        with client_of(prefect_server) as client:
            wait_for(lambda: "serving" in log.read_text(), 120, "serve to start")
            notify(prefect_server, checkpoint)
            (run,) = wait_for(lambda: evaluation_runs(client), 90, "the event's flow run")
            wait_for(lambda: list(references.glob("*/*/seq_*.json")), 120, "the first references", every=0.05)
    finally:
        os.killpg(serve.pid, signal.SIGKILL)  # mid-run: the references are being written
        serve.wait()
    finished = {p: p.stat().st_mtime_ns for p in references.glob("*/*/seq_*.json")}
    assert not list(references.glob("*/*/entry.json")), "the kill came after the references were done"
    with client_of(prefect_server) as client:
        assert client.read_flow_run(run.id).state.type == StateType.RUNNING  # nobody is left to end it

    serve = start_serve(prefect_server, setup, log)
    try:
        with client_of(prefect_server) as client:
            crashed = wait_for(lambda: (r := client.read_flow_run(run.id)).state.type == StateType.CRASHED and r,
                               120, "the orphaned run to be marked Crashed")
            assert "the process serving this run stopped before it finished" in crashed.state.message
            wait_for(lambda: f"({run.id}) was left Running" in log.read_text(), 30, "serve to say so")
            notify(prefect_server, checkpoint)
            (again,) = wait_for(lambda: [r for r in evaluation_runs(client) if r.id != run.id], 90, "the new run")
            wait_finished(client, [again.id], log)
    finally:
        serve.terminate()
        serve.wait(60)
    assert all(p.stat().st_mtime_ns == mtime for p, mtime in finished.items())  # none redone
    assert len(list(references.glob("*/*/seq_*.json"))) == len(setup["prompts"].read_text().splitlines())
