"""What a `dflash-eval run` leaves behind when it is killed or cannot write: no process (Prefect's temporary
server dies with the command), and on a full disk or an unusable store one message, exit 2, a consistent store.

The full disk is real: a 3 MB tmpfs mounted in a user and mount namespace (`unshare -rm`, no root needed where
unprivileged user namespaces are allowed; skipped elsewhere).
"""

import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.tiny_models import first_prompts

ROOT = Path(__file__).resolve().parent.parent
N_PROMPTS = 3
MAX_NEW = 16


@pytest.fixture(scope="module")
def tiny(tiny_qwen3_run, tmp_path_factory):
    """The tiny trained run with a 3-prompt file."""
    prompts = first_prompts(tiny_qwen3_run, N_PROMPTS, tmp_path_factory.mktemp("prompts") / "prompts.jsonl")
    return tiny_qwen3_run, prompts


def run_arguments(tiny, store) -> list[str]:
    run, prompts = tiny
    return ["--target", str(run.target_dir), "--drafter", str(run.drafter_steps[-1]), "--prompts", str(prompts),
            "--max-new-tokens", str(MAX_NEW), "--store", str(store)]


def processes_with(marker: str) -> set[int]:
    """Pids of this user's processes whose environment holds `marker` (e.g. PREFECT_HOME=<a unique folder>):
    a command's children and grandchildren inherit it."""
    found = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "environ").read_bytes().split(b"\0"):
                    found.add(int(entry.name))
            except OSError:  # gone meanwhile, or another user's
                pass
    return found


def test_the_tied_server_runs_the_command_prefect_runs(monkeypatch):
    """TiedServer copies the uvicorn command of Prefect's SubprocessASGIServer: this fails when a Prefect
    upgrade changes it."""
    import prefect.server.api.server as server_module

    from dflash_eval.flows.local_server import TiedServer

    launched = []
    monkeypatch.setattr(server_module.subprocess, "Popen", lambda args, **kwargs: launched.append((args, kwargs)))
    prefects = object.__new__(server_module.SubprocessASGIServer)
    ours = object.__new__(TiedServer)
    for server in (prefects, ours):
        server.__init__(port=8123)
        server._run_uvicorn_command()
    (prefect_args, prefect_kwargs), (our_args, our_kwargs) = launched
    assert prefect_args == [sys.executable, *ours.uvicorn_args()]
    assert our_args[:2] == [sys.executable, "-c"] and our_args[3:] == [str(os.getpid()), *prefect_args[1:]]
    assert prefect_kwargs == {"env": ours.uvicorn_env()}
    assert our_kwargs == {**prefect_kwargs, "start_new_session": True}  # a terminal's Ctrl-C reaches the command only


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_run_leaves_no_process_behind(tiny, tmp_path):
    """SIGKILL mid-run (after the first feature array, tests/killed_run.py), without PREFECT_API_URL: the
    temporary Prefect server the run started goes away too, within seconds."""
    home = tmp_path / "prefect-home"  # unique: marks every process this run starts
    marker = f"PREFECT_HOME={home}"
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env["PREFECT_HOME"] = str(home)
    command = [sys.executable, "-m", "tests.killed_run", "1", "run", *run_arguments(tiny, tmp_path / "store")]
    log = tmp_path / "run.log"  # not a pipe: a server that outlived the run would hold it open
    with open(log, "wb") as out:
        run = subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    started = set()
    try:
        while run.poll() is None:  # record what the run starts, until it kills itself
            started |= processes_with(marker) - {run.pid}
            time.sleep(0.2)
        output = log.read_text(errors="replace")
        assert run.returncode == -signal.SIGKILL, output
        assert started, output  # there was a server to outlive the run
        deadline = time.monotonic() + 20
        while (left := processes_with(marker)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not left, f"still running after SIGKILL of the run: {left} (the run had started {started})"
    finally:
        for pid in processes_with(marker):  # what a failing run left: never leak it into the session
            os.kill(pid, signal.SIGKILL)


def _user_namespaces_work(directory: Path) -> bool:
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                            f"mount -t tmpfs -o size=64k tmpfs {directory}"], capture_output=True)
    return probe.returncode == 0


@pytest.mark.slow
def test_a_full_disk_names_what_filled_and_keeps_the_store_consistent(tiny, tmp_path, prefect_api_url):
    """A store on a filesystem that fills up during the features stage: exit 2, one message naming the entry
    being written and saying the store is consistent, no traceback; the next run resumes (only features and
    what follows run again)."""
    mount = tmp_path / "small-disk"
    mount.mkdir()
    if shutil.which("unshare") is None or not _user_namespaces_work(mount):
        pytest.skip("no user and mount namespaces here (unshare -rm): cannot mount a small tmpfs")
    run, prompts = tiny
    weights = sum(f.stat().st_size for f in run.drafter_steps[-1].iterdir())
    size_kb = (weights + 200_000) // 1024  # room for the fetched drafter and the references, not the features
    store, after = mount / "store", tmp_path / "store-after"
    command = shlex.join([sys.executable, "-m", "dflash_eval.cli", "run", *run_arguments(tiny, store)])
    # the tmpfs lives as long as the namespace: copy the store out before leaving it
    script = (f"mount -t tmpfs -o size={size_kb}k tmpfs {shlex.quote(str(mount))} || exit 99; {command}; rc=$?; "
              f"cp -a {shlex.quote(str(store))} {shlex.quote(str(after))}; exit $rc")
    result = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script], cwd=ROOT,
                            env={**os.environ, "PREFECT_API_URL": prefect_api_url}, capture_output=True, text=True,
                            timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode == 2, output
    assert "Traceback" not in output, output
    errors = [line for line in output.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, output
    assert errors[0].startswith(f"error: no space left on the device while writing {store}/features/"), output
    assert f"The store {store} is consistent" in errors[0] and "the features entry being written" in errors[0]
    assert output.strip().splitlines()[-1] == errors[0]  # the last word is ours
    # completed entries kept, the features entry incomplete (nothing reads as complete)
    assert {p.parts[-4] for p in after.glob("*/*/*/entry.json")} == {"fetch", "references"}
    assert list(after.glob("features/*/*/features.zarr"))

    from tests.evaluations import run_evaluation

    results = run_evaluation(target=str(run.target_dir), drafter=str(run.drafter_steps[-1]), prompts=str(prompts),
                                  max_new_tokens=MAX_NEW, store=str(after))
    assert results["stages"] == {"fetch": "cached", "references": "cached", "features": "ran", "drafts": "ran",
                                 "scores": "ran"}


@pytest.mark.slow
@pytest.mark.parametrize("mode", [0o000, 0o555], ids=["unreadable", "read-only"])
def test_a_store_this_user_cannot_read_or_write_is_refused_first(mode, request):
    """A store folder without read or write permission: exit 2 naming it, before any input is read. Run as
    `nobody` in a forked child when the tests run as root (root reads and writes through permissions; forked,
    not exec'd: this user may not be able to start the interpreter)."""
    from typer.testing import CliRunner

    import dflash_eval.flows.evaluate  # noqa: F401 (imported before dropping privileges: nobody may not read the venv)
    import dflash_eval.flows.local_server  # noqa: F401
    from dflash_eval.cli import app

    base = Path(tempfile.mkdtemp(prefix="dflash-store-perm-"))  # pytest's own tmp folders are private to the user
    request.addfinalizer(lambda: shutil.rmtree(base))
    base.chmod(0o755)
    store = base / "store"
    store.mkdir()
    store.chmod(mode)
    request.addfinalizer(lambda: store.chmod(0o755))  # runs before the rmtree
    absent = str(base / "absent")  # never read: the store is checked first
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: drop to nobody, run the command, report, exit without pytest's teardown
        try:
            os.close(read)
            if os.geteuid() == 0:
                os.setgroups([])
                os.setgid(65534)
                os.setuid(65534)
            result = CliRunner().invoke(app, ["run", "--target", absent, "--drafter", absent, "--prompts", absent,
                                              "--store", str(store)])
            os.write(write, json.dumps([result.exit_code, result.output]).encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read, "rb") as pipe:
        exit_code, output = json.loads(pipe.read() or b"[null, \"the child died\"]")
    os.waitpid(pid, 0)
    assert exit_code == 2, output
    assert f"error: --store: {store} is not readable and writable" in output, output
