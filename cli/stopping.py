"""Ctrl-C and SIGTERM during an evaluation by hand: it stops within seconds, keeps what its stages committed, and says
in one line how to resume. Imports neither torch nor Prefect until an evaluation runs."""

import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import typer

# 128 + the signal, as a shell reports a process a signal stopped
STOPPED_EXIT = {signal.SIGINT: 130, signal.SIGTERM: 143}


class Stopped(KeyboardInterrupt):
    """SIGTERM, taken as Ctrl-C is: the evaluation stops where it is."""


def stops() -> tuple[type[BaseException], ...]:
    """What stops an evaluation from outside: Ctrl-C (KeyboardInterrupt), SIGTERM (Stopped), and SIGTERM as
    Prefect's engine raises it while its own handler is installed (TerminationSignal)."""
    from prefect.exceptions import TerminationSignal

    return (KeyboardInterrupt, TerminationSignal)


@contextmanager
def stopped_by_signals() -> Iterator[None]:
    """Ctrl-C (SIGINT) and SIGTERM stop the evaluation run inside within seconds: what its stages committed stays in
    the store, one line says how to resume, and the process ends there (os._exit, exit code 130 or 143). Ending
    normally would wait for a stage's worker thread to finish its unit (a completion of thousands of tokens) and run
    Prefect's exit hooks against its server: that kept a stopped run alive for minutes. The temporary server ends
    with this process (flows/local_server.py); the stages' writes are atomic, so nothing half-written reads as
    done. Prefect's flow engine puts its own SIGTERM handler in place of ours while a flow runs, and hands the
    signal back to ours once it has marked the run crashed."""

    def terminate(signum, frame):
        raise Stopped()

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    except stops() as e:
        by = signal.SIGINT if isinstance(e, KeyboardInterrupt) and not isinstance(e, Stopped) else signal.SIGTERM
        typer.secho(f"error: stopped by {'Ctrl-C (SIGINT)' if by == signal.SIGINT else 'SIGTERM'}: what the stages "
                    "finished is kept in the store; run the same command again to resume from there", err=True,
                    fg="red")
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(STOPPED_EXIT[by])
    finally:
        signal.signal(signal.SIGTERM, previous)
