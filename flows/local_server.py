"""Prefect's temporary local server, tied to the command that started it.

Without PREFECT_API_URL, Prefect starts a uvicorn subprocess on the first API call and stops it from
an atexit hook. A command killed with SIGKILL (the OOM killer, `kill -9`, a CI timeout) runs no atexit
hook, so the server outlived it, forever. Here the same server is started through a launcher that asks
Linux to SIGTERM it when its parent dies (PR_SET_PDEATHSIG, kept across exec), then execs the command
Prefect runs. SIGTERM, not SIGKILL: uvicorn shuts down cleanly and SQLite closes its database.

The death signal follows the *thread* that forked the child, not the process, and Prefect may start
the server from its events thread: `tie_local_server()` starts it from the main thread, before the
flow, and registers it where Prefect looks for its server (as `prefect_test_harness` does).

Chosen over one long-lived server per PREFECT_HOME reused across commands: that saves the start-up
(~3-4 s with an existing database, ~10 s with a fresh one, measured on 2 cores) but leaves a process
running by design, with a pid file, a lock, stale-server detection and version checks to get right;
machines that evaluate many checkpoints run `prefect server start` and set PREFECT_API_URL anyway.
"""

import os
import sys
import threading

import prefect
from prefect.server.api.server import SubprocessASGIServer
from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED, get_current_settings

PR_SET_PDEATHSIG = 1  # linux/prctl.h

# Runs in the child: set the death signal, give up if the parent already died (the child would have been
# re-parented before prctl and never get the signal), then become the server.
_LAUNCHER = """\
import ctypes, os, signal, sys
parent = int(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(%d, signal.SIGTERM, 0, 0, 0) != 0:
    sys.exit("prctl(PR_SET_PDEATHSIG) failed: errno %%d" %% ctypes.get_errno())
if os.getppid() != parent:
    sys.exit(0)
os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
""" % PR_SET_PDEATHSIG


class TiedServer(SubprocessASGIServer):
    """Prefect's SubprocessASGIServer whose uvicorn process gets SIGTERM when this process dies (Linux)."""

    def uvicorn_args(self) -> list[str]:
        """The command Prefect 3.9 runs (SubprocessASGIServer._run_uvicorn_command), without the interpreter;
        tests/test_run_integrity.py checks that it still is."""
        return ["-m", "uvicorn", "--app-dir", str(prefect.__module_path__.parent), "--factory",
                "prefect.server.api.server:create_app", "--host", "127.0.0.1", "--port", str(self.port),
                "--log-level", "error", "--lifespan", "on"]

    def uvicorn_env(self) -> dict[str, str]:
        """The environment Prefect 3.9 gives its server (no UI, ephemeral mode, this process's settings)."""
        return {**os.environ, "PREFECT_UI_ENABLED": "0", "PREFECT__SERVER_EPHEMERAL": "1",
                "PREFECT__SERVER_FINAL": "1", **get_current_settings().to_environment_variables(exclude_unset=True)}

    def _run_uvicorn_command(self):
        import subprocess

        if not sys.platform.startswith("linux"):  # no PR_SET_PDEATHSIG: Prefect's own behaviour
            return super()._run_uvicorn_command()
        return subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(os.getpid()), *self.uvicorn_args()],
                                env=self.uvicorn_env())


def tie_local_server() -> str | None:
    """Start Prefect's temporary local server now, from the main thread, as a process that dies with this one;
    later API calls in this process use it. Returns its API URL, or None when there is nothing to start:
    PREFECT_API_URL is set (a real server, or a test harness), ephemeral mode is off, or a temporary server
    is already running in this process (e.g. an earlier evaluation of `demo`)."""
    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return None
    current = SubprocessASGIServer._instances.get(None)
    if current is not None and current.running:
        return None
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("tie_local_server() must run on the main thread: the death signal follows the thread")
    server = object.__new__(TiedServer)  # SubprocessASGIServer.__new__ would hand back a registered instance
    TiedServer.__init__(server)
    # registered first, where get_client() and the events worker look for "the" temporary server, so that
    # no other thread starts a second one meanwhile; its _instance_key (None) makes stop() at exit remove it
    SubprocessASGIServer._instances[None] = server
    server.start()
    return server.api_url
