"""Prefect's temporary local server, tied to the command that started it.

Without PREFECT_API_URL, Prefect starts a uvicorn subprocess on the first API call and stops it from
an atexit hook. A command killed with SIGKILL (the OOM killer, `kill -9`, a CI timeout) runs no atexit
hook, so the server outlived it, forever. Here the same server is started through a launcher that asks
Linux to SIGTERM it when its parent dies (PR_SET_PDEATHSIG, kept across exec), then execs the command
Prefect runs. SIGTERM, not SIGKILL: uvicorn shuts down cleanly and SQLite closes its database. The server runs
in a session of its own, so that Ctrl-C at a terminal stops the command, which then stops the server, not both at
once.

The death signal follows the *thread* that forked the child, not the process, and Prefect may start
the server from its events thread: `tie_local_server()` starts it from the main thread, before the
flow, and registers it where Prefect looks for its server (as `prefect_test_harness` does).

Chosen over one long-lived server per PREFECT_HOME reused across commands: that saves the start-up
(~3-4 s with an existing database, ~10 s with a fresh one, measured on 2 cores) but leaves a process
running by design, with a pid file, a lock, stale-server detection and version checks to get right;
machines that evaluate many checkpoints run `prefect server start` and set PREFECT_API_URL anyway.

The first start after an install is slower: the server compiles Prefect's server modules and creates and
migrates a new SQLite database. Measured on 2 cores with one of them busy and fresh bytecode: ~30 s to import
and ~40 s to answer, past Prefect's 20 s allowance (PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS), which
ended a first `demo` with a traceback. So the server gets STARTUP_ALLOWANCE_S unless the user set that
setting, and a start that still fails is a LocalServerError saying what to do. `launch_local_server()` starts
the process without waiting, so `demo` lets it start while it trains the tiny models.
"""

import atexit
import os
import subprocess
import sys
import threading
import time

import httpx
import prefect
from prefect.server.api.server import SubprocessASGIServer, subprocess_server_logger
from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED, get_current_settings

STARTUP_ALLOWANCE_S = 300  # seconds; ~40 s measured for a first start on a loaded 2-core machine, see above
STARTUP_TIMEOUT_SETTING = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
PORT_IN_USE_EXIT = 3  # uvicorn's exit code when the port was taken meanwhile: Prefect retries on another port

PR_SET_PDEATHSIG = 1  # linux/prctl.h

# Runs in the child: set the death signal, give up if the parent already died (the child would have been
# re-parented before prctl and never get the signal), then become the server.
_LAUNCHER = f"""\
import ctypes, os, signal, sys
parent = int(sys.argv[1])
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl({PR_SET_PDEATHSIG}, signal.SIGTERM, 0, 0, 0) != 0:
    sys.exit("prctl(PR_SET_PDEATHSIG) failed: errno %d" % ctypes.get_errno())
if os.getppid() != parent:
    sys.exit(0)
os.execv(sys.executable, [sys.executable, *sys.argv[2:]])
"""


class LocalServerError(RuntimeError):
    """Prefect's temporary server did not start; the message (one line) says why and what to do."""


def startup_allowance() -> float:
    """Seconds to wait for the temporary server to answer: PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS
    when the user set it (environment, profile), else STARTUP_ALLOWANCE_S (Prefect's default, 20 s, is too
    short for a first start on a busy machine)."""
    ephemeral = get_current_settings().server.ephemeral
    if "startup_timeout_seconds" in ephemeral.model_fields_set:
        return float(ephemeral.startup_timeout_seconds)
    return STARTUP_ALLOWANCE_S


class TiedServer(SubprocessASGIServer):
    """Prefect's SubprocessASGIServer whose uvicorn process gets SIGTERM when this process dies (Linux), which
    can be launched now and waited for later (`launch`, then `start`), and gives a start-up that fails as a
    LocalServerError."""

    _start_lock = threading.Lock()  # one waits for the server; another thread's API call waits for that one

    def launch(self) -> subprocess.Popen:
        """Start the server's process, without waiting for it to answer (nothing if it is started already); the
        process."""
        if self.server_process is not None:
            return self.server_process
        if self.port is None:
            self.port = self._free_port()
        subprocess_server_logger.info(f"Starting temporary server on {self.address}")  # as Prefect's start() does
        self.server_process = self._run_uvicorn_command()
        atexit.register(self.stop)
        return self.server_process

    def start(self, timeout: float | None = None) -> None:
        """Launch the server if not yet, and wait until it answers, at most `timeout` seconds (default:
        `startup_allowance()`). Other threads' API calls reach this too, through Prefect's registry of servers,
        and wait for the same server. A server that does not answer in time is stopped: LocalServerError."""
        with self._start_lock:
            if not self.running:
                self._wait_until_it_answers(timeout or startup_allowance())

    def _wait_until_it_answers(self, allowance: float) -> None:
        process = self.launch()
        deadline = time.monotonic() + allowance
        with httpx.Client() as client:
            while time.monotonic() < deadline:
                if process.poll() == PORT_IN_USE_EXIT:
                    self.port = self._free_port()
                    self.server_process = process = self._run_uvicorn_command()
                elif process.poll() is not None:
                    break
                try:
                    if client.get(f"{self.api_url}/health", timeout=5).status_code == 200:
                        self.running = True
                        return
                except httpx.TransportError:  # not listening yet, or too busy to answer
                    pass
                time.sleep(0.1)
        exit_code = process.poll()
        self._abandon()
        raise LocalServerError(self._failure(allowance, exit_code))

    def _free_port(self) -> int:
        """A free port for the server (Prefect tries ten in its range), or LocalServerError."""
        try:
            return self.find_available_port()
        except RuntimeError:
            low, high = self._port_range.start, self._port_range.stop - 1
            raise LocalServerError(f"no free port for Prefect's temporary server (tried ten in {low}-{high}); start a "
                                   "server once (`prefect server start`) and set "
                                   "PREFECT_API_URL=http://127.0.0.1:4200/api") from None

    def _abandon(self) -> None:
        """Stop the process that did not start and take it out of Prefect's registry, so that nothing waits on it
        any more; quietly (Prefect's stop() logs the stop of a server that ran)."""
        process, self.server_process = self.server_process, None
        if process is None:
            return
        process.terminate()
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if SubprocessASGIServer._instances.get(self._instance_key) is self:
            del SubprocessASGIServer._instances[self._instance_key]
        atexit.unregister(self.stop)

    @staticmethod
    def _failure(allowance: float, exit_code: int | None) -> str:
        """What happened and what to do, in one line."""
        home = get_current_settings().home
        if exit_code is None:
            happened = (f"Prefect's temporary server did not answer within {allowance:g} s (its first start after "
                        f"an install compiles Prefect's server and creates its database in {home}; a busy machine "
                        "slows that down)")
            fix = (f"run the command again (a later start is faster), or allow more time, e.g. "
                   f"{STARTUP_TIMEOUT_SETTING}=600")
        else:
            happened = (f"Prefect's temporary server exited with code {exit_code} while starting (its messages are "
                        f"above; its database is in {home})")
            fix = "run the command again"
        return (f"{happened}; {fix}, or start a server once (`prefect server start`) and set "
                "PREFECT_API_URL=http://127.0.0.1:4200/api")

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
        if not sys.platform.startswith("linux"):  # no PR_SET_PDEATHSIG: Prefect's own behaviour
            return super()._run_uvicorn_command()
        # a session of its own: Ctrl-C at a terminal signals the command's whole process group, and a server stopped
        # with it would leave the command's last calls (its run marked stopped) failing with tracebacks; it stops
        # when the command ends (atexit, or the death signal)
        return subprocess.Popen([sys.executable, "-c", _LAUNCHER, str(os.getpid()), *self.uvicorn_args()],
                                env=self.uvicorn_env(), start_new_session=True)


def launch_local_server() -> SubprocessASGIServer | None:
    """Start Prefect's temporary local server's process now, from the main thread, as a process that dies with
    this one, without waiting for it to answer (`tie_local_server()` waits); later API calls in this process use
    it. Returns the server (a TiedServer, or one already running in this process, e.g. for an earlier
    evaluation of `demo`), or None when there is nothing to start: PREFECT_API_URL is set (a real server, or a
    test harness) or ephemeral mode is off."""
    if PREFECT_API_URL.value() or not PREFECT_SERVER_EPHEMERAL_ENABLED.value():
        return None
    current = SubprocessASGIServer._instances.get(None)
    if current is not None and (current.running or current.server_process is not None):
        return current
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("launch_local_server() must run on the main thread: the death signal follows the thread")
    server = object.__new__(TiedServer)  # SubprocessASGIServer.__new__ would hand back a registered instance
    TiedServer.__init__(server)
    # registered first, where get_client() and the events worker look for "the" temporary server, so that
    # no other thread starts a second one meanwhile (they wait for this one in its start()); its _instance_key
    # (None) makes stop() at exit remove it
    SubprocessASGIServer._instances[None] = server
    server.launch()
    return server


def tie_local_server() -> str | None:
    """Start Prefect's temporary local server (`launch_local_server()`) if not yet, and wait until it answers,
    at most `startup_allowance()` seconds. Returns its API URL, or None when there is nothing to start (see
    `launch_local_server()`). Raises LocalServerError when the server did not start."""
    server = launch_local_server()
    if server is None:
        return None
    server.start()
    return server.api_url
