"""Ctrl-C and SIGTERM stop a long evaluation within seconds (many samples per prompt: thousands of completions
queued), keep every completion it finished, say in one line how to resume, and leave no server behind; the same
command then resumes. A real `dflash-eval run` in a process (and session) of its own, as a terminal runs it, with
Prefect's temporary server; the signals are real: Ctrl-C at a terminal signals the command's whole process group."""

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.waiting import wait_until

pytestmark = pytest.mark.slow  # processes, a server, and waits on purpose

RESUME = "what the stages finished is kept in the store; run the same command again to resume from there"


def _start(tiny, store: Path, log: Path) -> subprocess.Popen:
    """The long run: 1000 sampled completions of each prompt, its output into `log`."""
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}  # Prefect's temporary server
    env.update(OMP_NUM_THREADS="1", PREFECT_LOGGING_LEVEL="INFO", COLUMNS="200")
    return subprocess.Popen(
        [sys.executable, "-m", "dflash_eval.cli", "run", "--target", str(tiny.target_dir), "--drafter",
         str(tiny.drafter_steps[-1]), "--prompts", str(tiny.prompts), "--temperature", "0.6", "--samples", "1000",
         "--max-new-tokens", "64", "--store", str(store)],
        stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
        start_new_session=True,  # a process group of its own, as a terminal's foreground job
        # Ctrl-C reaches it even when the tests run as a background job, whose shell ignores SIGINT (an ignored
        # signal stays ignored across exec)
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _stop(process: subprocess.Popen, store: Path, send, stored: int = 0) -> tuple[float, dict[str, bytes]]:
    """Once the run has stored completions (3 more than `stored`), signal it with `send`; (seconds it took to exit,
    the completions stored)."""
    finished = lambda: list(store.glob("references/*/*/seq_*.json"))  # noqa: E731
    wait_until(lambda: len(finished()) >= stored + 3, 300, "completions stored", process, every=0.2)
    sent = time.monotonic()
    send()
    process.wait(timeout=120)
    return time.monotonic() - sent, {p.name: p.read_bytes() for p in finished()}


def _server_port(output: str) -> int:
    return int(re.search(r"Starting temporary server on http://127\.0\.0\.1:(\d+)", output).group(1))


def _answers(port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(1)
        return probe.connect_ex(("127.0.0.1", port)) == 0


def test_ctrl_c_and_sigterm_stop_within_seconds_keep_what_was_finished_and_the_run_resumes(tiny, tmp_path):
    store, log = tmp_path / "store", tmp_path / "first.log"
    run = _start(tiny, store, log)
    took, kept = _stop(run, store, lambda: os.killpg(run.pid, signal.SIGINT))  # Ctrl-C at a terminal
    output = log.read_text()
    assert run.returncode == 130 and took < 20, (took, output)
    assert output.strip().splitlines()[-1] == f"error: stopped by Ctrl-C (SIGINT): {RESUME}", output
    assert "Traceback" not in output, output
    assert not list(store.glob("references/*/*/entry.json"))  # nothing reads as complete
    wait_until(lambda: not _answers(_server_port(output)), 30, "the temporary server to stop")

    log = tmp_path / "second.log"
    run = _start(tiny, store, log)  # the same command: resumes from the completions kept
    took, now = _stop(run, store, lambda: run.send_signal(signal.SIGTERM), stored=len(kept))
    output = log.read_text()
    assert run.returncode == 143 and took < 20, (took, output)
    assert output.strip().splitlines()[-1] == f"error: stopped by SIGTERM: {RESUME}", output
    assert "Traceback" not in output and "incomplete (no entry.json): computing it" in output, output
    assert {name: now[name] for name in kept} == kept and len(now) > len(kept)  # kept as they were, and more
    wait_until(lambda: not _answers(_server_port(output)), 30, "the temporary server to stop")
