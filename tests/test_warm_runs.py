"""Served flow runs are forks of a forkserver that imported the flows (flows/warm_runs.py), through
Prefect's own subprocess start (`run_flow_in_subprocess`, which `dflash-eval serve`'s runner calls)."""

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # starts Prefect flow runs in new processes

PROBE = textwrap.dedent('''
    import json, os, sys
    from prefect import flow
    from prefect.flow_engine import run_flow_in_subprocess

    from dflash_eval.flows.warm_runs import start_flow_runs_from_forkserver

    @flow
    def probe(out: str):
        # what this run's process had imported before its flow started, and whose child it is
        json.dump({"pid": os.getpid(), "parent": os.getppid(), "modules": sorted(sys.modules)}, open(out, "w"))

    if __name__ == "__main__":
        warm = sys.argv[1] == "warm"
        if warm:
            start_flow_runs_from_forkserver(["dflash_eval.reporting.report"])
        runs = []
        for n in range(2):
            process = run_flow_in_subprocess(probe, parameters={"out": f"{sys.argv[2]}.{n}"})
            process.join()
            runs.append({"kind": type(process).__name__, "exitcode": process.exitcode})
        print(json.dumps({"server": os.getpid(), "runs": runs}))
''')


def run_probe(tmp_path: Path, mode: str, api_url: str) -> tuple[dict, list[dict]]:
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = {**os.environ, "PREFECT_API_URL": api_url, "OMP_NUM_THREADS": "1"}
    result = subprocess.run([sys.executable, str(script), mode, str(tmp_path / mode)], env=env, capture_output=True,
                            text=True, timeout=300, cwd=Path(__file__).parent.parent)
    assert result.returncode == 0, result.stderr[-3000:]
    parent = json.loads(result.stdout.strip().splitlines()[-1])
    return parent, [json.loads((tmp_path / f"{mode}.{n}").read_text()) for n in range(2)]


def test_flow_runs_fork_from_a_process_that_imported_the_flows(tmp_path, prefect_api_url):
    parent, children = run_probe(tmp_path, "warm", prefect_api_url)
    assert [r["kind"] for r in parent["runs"]] == ["ForkServerProcess"] * 2
    assert [r["exitcode"] for r in parent["runs"]] == [0, 0]
    for child in children:
        assert child["parent"] != parent["server"]  # a fork of the forkserver, not a child spawned by us
        assert "dflash_eval.reporting.report" in child["modules"] and "matplotlib" in child["modules"]  # preloaded
    assert children[0]["parent"] == children[1]["parent"]  # one forkserver serves every run
    assert children[0]["pid"] != children[1]["pid"]  # each run is still its own process


def test_without_it_prefect_spawns_each_run_afresh(tmp_path, prefect_api_url):
    # the control: Prefect's default start imports nothing beyond what the flow needs
    parent, children = run_probe(tmp_path, "cold", prefect_api_url)
    assert [r["kind"] for r in parent["runs"]] == ["SpawnProcess"] * 2
    for child in children:
        assert child["parent"] == parent["server"]
        assert "dflash_eval.reporting.report" not in child["modules"]
