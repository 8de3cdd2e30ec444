"""Waiting for a server a test started (moto's S3, a Dask scheduler, a Prefect server, a reference or report server,
TensorBoard, MLflow) until it answers.

On busy cores a server that has bound its port may take longer to answer than a request's own timeout: the request
raises a read timeout, not a refused connection. Every such answer is "not ready yet", never a failure, until the
deadline; only a deadline passed, or the server's process gone, fails the wait:

    from tests.waiting import answers, wait_until
    wait_until(answers(f"{url}/health"), 60, "the Prefect server", process)
"""

import subprocess
import time
from collections.abc import Callable
from typing import TypeVar

import requests

T = TypeVar("T")


class NeverReady(RuntimeError):
    """A server did not answer by the deadline, or its process exited: the message names it and its last answer."""


def wait_until(ready: Callable[[], T], seconds: float, what: str, process: subprocess.Popen | None = None,
               every: float = 0.1) -> T:
    """Call `ready` until it returns something true, and return that; at most `seconds`. Whatever it raises
    meanwhile (a refused or reset connection, a read timeout, an error status) counts as not ready yet. Raises
    NeverReady naming `what` and the last answer once the deadline passes, or as soon as `process` has exited."""
    deadline = time.monotonic() + seconds
    last = "no answer"
    while True:
        try:
            if found := ready():
                return found
            last = f"answered {found!r}"
        except Exception as e:  # noqa: BLE001 - any answer short of ready is one to wait through
            last = f"{type(e).__name__}: {str(e)[:200]}"
        if process is not None and process.poll() is not None:
            raise NeverReady(f"{what} exited with code {process.returncode} before it was ready ({last})")
        if time.monotonic() >= deadline:
            raise NeverReady(f"{what} was not ready after {seconds:g} s ({last})")
        time.sleep(every)


def answers(url: str, timeout: float = 5, status: int | None = 200) -> Callable[[], bool]:
    """A probe for wait_until: a GET of `url` answers within `timeout` seconds, with `status` (None: any status)."""

    def probe() -> bool:
        answer = requests.get(url, timeout=timeout)
        if status is not None and answer.status_code != status:
            raise RuntimeError(f"HTTP {answer.status_code}")
        return True

    return probe
