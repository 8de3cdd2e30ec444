"""What the commands share besides options: one-line errors, Prefect's temporary server, thread budgets, token
files, results files and the report server. Imports neither torch nor Prefect (each helper imports what it needs
when called)."""

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

import typer

from dflash_eval.services.http_server import PortInUse
from dflash_eval.services.report_server import ReportServer
from dflash_eval.services.tokens import TokenFileError, read_token_file

if TYPE_CHECKING:
    from dflash_eval.reporting.results import Results


def fail(message: str, code: int = 2) -> NoReturn:
    """One line on stderr, and the exit code (2: bad input or a condition the user must fix; nothing half done)."""
    typer.secho(f"error: {message}", err=True, fg="red")
    raise typer.Exit(code)


def local_server_needed() -> bool:
    """Whether flows in this process run against Prefect's temporary local server (no PREFECT_API_URL)."""
    from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

    return not PREFECT_API_URL.value() and PREFECT_SERVER_EPHEMERAL_ENABLED.value()


def start_local_server(wait: bool = True) -> None:
    """Start Prefect's temporary local server for this command's flows (flows/local_server.py), unless
    PREFECT_API_URL names a server: with `wait`, until it answers, or one line saying why it did not start and
    what to do (exit 2); without, only its process (a later call waits), so that it starts while this command
    does other work. A PREFECT_API_URL that names no server answering is that one line too."""
    if not local_server_needed():
        _check_api_answers()
        return
    from rich.console import Console

    # imports Prefect's server (~1 s): only to start one
    from dflash_eval.flows.local_server import LocalServerError, launch_local_server, tie_local_server

    try:
        if not wait:
            launch_local_server()
            return
        with Console(stderr=True).status("starting Prefect's temporary server (the first start after an install "
                                         "takes a minute)"):  # shows on a terminal only
            tie_local_server()
    except LocalServerError as e:
        fail(str(e))


def _check_api_answers() -> None:
    from prefect.settings import PREFECT_API_URL

    url = PREFECT_API_URL.value()
    if not url:
        return
    import requests

    try:  # any answer will do (Prefect Cloud may want a key for /health): only a server not there is refused
        requests.get(f"{url.rstrip('/')}/health", timeout=10)
    except (requests.ConnectionError, requests.Timeout) as e:
        fail(f"PREFECT_API_URL={url}: no Prefect server answers there ({type(e).__name__}). Start one (prefect "
             "server start) or unset PREFECT_API_URL: a command by hand then starts a temporary one itself.")


def open_store(store: str | None):
    """The store `--store` names (a folder or s3://BUCKET/PREFIX), or one line saying why not (exit 2)."""
    from dflash_eval.storage import Store

    try:
        return Store(store)
    except ValueError as e:
        fail(f"--store: {e}")


def open_existing_store(store: str | None):
    """open_store, for commands that only read a store: a local folder that does not exist, or is not a folder,
    is one line saying so (exit 2) instead of an empty store (a mistyped --store must not read as "all clean")."""
    opened = open_store(store)
    if opened.remote is None and not opened.root.is_dir():
        what = "is not a folder" if opened.root.exists() else "does not exist"
        fail(f"--store {opened.location} {what}: no store there. Give the folder (or s3://BUCKET/PREFIX) your "
             "evaluations write to (default $DFLASH_STORE, else ./.dflash-store).")
    if opened.remote is None and not os.access(opened.root, os.R_OK | os.X_OK):
        fail(f"--store {opened.location} cannot be read by this user (permissions): run as its owner")
    return opened


def configure_threads(threads: int | None) -> None:
    """This process's thread budget, set before anything computes (tasks/threads.py)."""
    from dflash_eval.tasks.threads import configure_threads as configure

    configure(threads)


def decoding_threads(target: str) -> int:
    """Threads for greedy decoding of `target` (one token per forward) on this machine by default."""
    from dflash_eval.tasks.threads import checkpoint_parameters, default_threads, threads_for

    return threads_for(checkpoint_parameters(target), default_threads())


def token_from_file(token_file: str | None, option: str) -> str | None:
    """The token a file given by `option` holds (None: no file given), or one line saying why not (exit 2)."""
    if token_file is None:
        return None
    try:
        return read_token_file(token_file, option)
    except TokenFileError as e:
        fail(str(e))


def write_results(results: "Results | dict | list", out: Path | None) -> None:
    """Write the results JSON to `out` (if given; a Results record as its to_json), or one line saying why not
    (exit 2)."""
    if out is None:
        return
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(results if isinstance(results, dict | list) else results.to_json(), indent=1))
    except OSError as e:  # checked up front; what is left: the disk filled, or someone changed the folder meanwhile
        stored = ("; the results are in the store: the same command with another --out writes them without "
                  "recomputing anything") if not isinstance(results, list) and "store" in results else ""
        fail(f"cannot write {out}: {e.strerror}{stored}")
    typer.echo(f"results: {out}")


def bind_report_server(folder: Path, host: str, port: int, port_option: str) -> ReportServer:
    """A ReportServer of `folder` bound to host:port, or one line saying why not (exit 2)."""
    try:
        return ReportServer(folder, host=host, port=port)
    except PortInUse as e:
        fail(f"cannot serve the report: {e.strerror}; choose another port with {port_option} (0: any free one)")
    except OSError as e:  # an address this machine does not have, a port below 1024, ...
        fail(f"cannot serve the report on {host}:{port}: {e.strerror or e}")
