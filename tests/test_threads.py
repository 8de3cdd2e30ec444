"""The thread budget (tasks/threads.py): its default, the rule by op size, leases shared by the threads of a
process, and `--threads` reaching torch."""

import subprocess
import sys
import threading
import time

import pytest
import torch

from dflash_eval.tasks import threads
from dflash_eval.tasks import threads as threads_module  # for code whose argument is named threads
from dflash_eval.tasks.threads import ThreadBudget, default_threads, leases_threads, threads_for


@pytest.fixture
def fresh_budget(monkeypatch, tmp_path):
    """No budget set in this process, its own runs-by-hand folder, torch's count put back afterwards (tests
    share the process)."""
    monkeypatch.setattr(threads, "_budget", None)
    monkeypatch.setattr(threads, "_registration", None)
    monkeypatch.setattr(threads, "RUNS_BY_HAND_DIR", tmp_path / "runs")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_default_is_the_cores_divided_by_the_heavy_stages_at_once(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert default_threads(1, cores=8) == 8
    assert default_threads(2, cores=8) == 4
    assert default_threads(3, cores=8) == 2
    assert default_threads(3, cores=2) == 1  # never 0
    assert default_threads(0, cores=2) == 2
    monkeypatch.setattr(threads.os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)
    assert default_threads() == 3  # the cores this process may run on


def test_omp_num_threads_is_an_explicit_choice(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert default_threads(2, cores=8) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "junk")
    assert default_threads(2, cores=8) == 4


def test_small_ops_get_one_thread_and_large_ones_the_budget():
    small = threads.SMALL_OP_WORK
    assert threads_for(1e3, budget=8) == 1
    assert threads_for(small, budget=8) == 1
    assert threads_for(2.5 * small, budget=8) == 8  # e.g. the 8 x 128-token forwards of a 125M target
    assert threads_for(1e6 * small, budget=8) == 8
    assert threads_for(1e6 * small, budget=1) == 1


def test_concurrent_leases_share_the_budget_instead_of_each_taking_all():
    budget = ThreadBudget(4)
    first_in, second_done = threading.Event(), threading.Event()
    seen = {}

    def first():
        with budget.lease(3) as n:
            seen["first"] = (n, torch.get_num_threads())
            first_in.set()
            second_done.wait(10)
            seen["first after"] = torch.get_num_threads()  # another thread's lease leaves this one's count alone

    def second():
        first_in.wait(10)
        with budget.lease(4) as n:  # wants all 4; 1 is free
            seen["second"] = (n, torch.get_num_threads())
            seen["in use"] = budget.in_use()
        second_done.set()

    workers = [threading.Thread(target=first), threading.Thread(target=second)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(20)
    assert seen["first"] == (3, 3) and seen["second"] == (1, 1) and seen["in use"] == 4
    assert seen["first after"] == 3
    assert budget.in_use() == 0


def test_a_thread_with_none_free_still_computes_on_its_own_thread():
    budget = ThreadBudget(2)
    held, release = threading.Event(), threading.Event()

    def holder():
        with budget.lease():
            held.set()
            release.wait(10)

    worker = threading.Thread(target=holder)
    worker.start()
    held.wait(10)
    try:
        with budget.lease() as n:  # nothing free: it does not wait, it runs on 1
            assert n == 1 and torch.get_num_threads() == 1
    finally:
        release.set()
        worker.join(10)


def test_nested_leases_replace_and_restore_the_count(fresh_budget):
    before = torch.get_num_threads()
    budget = ThreadBudget(2)
    with budget.lease(2):
        assert torch.get_num_threads() == 2
        with budget.lease(1):  # a stage of small ops inside a run's lease
            assert torch.get_num_threads() == 1 and budget.in_use() == 1
        assert torch.get_num_threads() == 2 and budget.in_use() == 2
    assert torch.get_num_threads() == before and budget.in_use() == 0


def test_a_flow_function_computes_on_its_threads_parameter_and_gives_the_count_back(fresh_budget):
    torch.set_num_threads(2)

    @leases_threads(invalid=LookupError)
    def run(x, threads=None):
        glue = torch.get_num_threads()  # the run's own small ops
        with threads_module.compute_threads() as n:  # a stage of large ops: all the run's threads
            return x, glue, torch.get_num_threads(), n

    assert run(7, threads=3) == (7, 1, 3, 3)
    assert torch.get_num_threads() == 2  # the caller's count is back
    assert run(7, threads=1) == (7, 1, 1, 1)
    assert threads.thread_budget().total == 1
    with pytest.raises(LookupError, match="at least 1"):
        run(7, threads=0)


def test_configure_twice_sets_the_new_budget_and_torch(fresh_budget):
    assert threads.configure_threads(1) == 1 and torch.get_num_threads() == 1
    assert threads.configure_threads(2) == 2 and torch.get_num_threads() == 2  # inter-op set once, no error
    assert threads.configure_threads(None) == 2  # None keeps what was set


def test_threads_option_reaches_torch_before_anything_computes(fresh_budget, tmp_path):
    """`dflash-eval run --threads 1` sets the budget and torch's count first (here the run then stops at its
    input check: the target is missing)."""
    from typer.testing import CliRunner

    from dflash_eval.cli import app

    torch.set_num_threads(2)
    result = CliRunner().invoke(app, ["run", "--target", str(tmp_path / "missing"), "--drafter", str(tmp_path),
                                      "--prompts", "math", "--store", str(tmp_path / "store"), "--threads", "1"])
    assert result.exit_code == 2, result.output
    assert threads.thread_budget().total == 1 and torch.get_num_threads() == 1
    result = CliRunner().invoke(app, ["run", "--target", str(tmp_path), "--drafter", str(tmp_path),
                                      "--prompts", "math", "--threads", "0"])
    assert result.exit_code != 0 and "--threads" in result.output


REGISTERED_RUN = """
import sys, time
from pathlib import Path
from dflash_eval.tasks.threads import register_run_by_hand
register_run_by_hand(Path(sys.argv[1]))
print("registered", flush=True)
time.sleep(float(sys.argv[2]))
"""


def start_run_by_hand(directory, seconds: float) -> subprocess.Popen:
    """A process registered as a run by hand in `directory` for `seconds` (returns once it is registered)."""
    process = subprocess.Popen([sys.executable, "-c", REGISTERED_RUN, str(directory), str(seconds)],
                               stdout=subprocess.PIPE, text=True)
    assert process.stdout.readline().strip() == "registered"
    return process


@pytest.mark.slow  # starts processes or waits on purpose
def test_runs_by_hand_share_the_cores_and_dead_ones_stop_counting(fresh_budget, monkeypatch, tmp_path):
    monkeypatch.setattr(threads, "machine_cores", lambda: 6)
    directory = tmp_path / "runs"
    assert threads.configure_threads(set_default=False) == 6  # alone: every core
    others = [start_run_by_hand(directory, 60), start_run_by_hand(directory, 60)]
    try:
        assert threads.runs_by_hand(directory) == 3
        assert threads.thread_budget().available() == 2  # three runs by hand: a third of the cores each
        with threads.compute_threads() as n:
            assert n == 2 and torch.get_num_threads() == 2
        others[0].kill()  # SIGKILL: its lock goes with it
        others[0].wait()
        assert threads.runs_by_hand(directory) == 2 and len(list(directory.glob("*.lock"))) == 2
        assert threads.thread_budget().available() == 3
    finally:
        for process in others:
            process.kill()
            process.wait()
    deadline = time.monotonic() + 5
    while threads.runs_by_hand(directory) != 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert threads.runs_by_hand(directory) == 1 and threads.thread_budget().available() == 6


def test_a_deployment_run_divides_by_the_heavy_stage_slots(fresh_budget, monkeypatch):
    monkeypatch.setattr(threads, "machine_cores", lambda: 8)
    assert threads.configure_threads(heavy_at_once=2, set_default=False) == 4
    assert not (threads.RUNS_BY_HAND_DIR.exists() and any(threads.RUNS_BY_HAND_DIR.iterdir()))  # not counted


def test_checkpoint_parameters_are_read_from_the_headers(tmp_path):
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(3, 4), "b": torch.zeros(5)}, str(tmp_path / "model.safetensors"))
    assert threads.checkpoint_parameters(tmp_path) == 17
    assert threads.checkpoint_parameters(tmp_path / "missing") == 0
