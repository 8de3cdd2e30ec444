"""The `dflash-eval` command line, one module per group of commands:

  evaluation   run, stage, demo             evaluations by hand (stopping.py: Ctrl-C and SIGTERM during one)
  prompts      prompts                      what a run feeds the target
  serving      serve, watch, notify         unattended: deployments, a relay watcher, trainers' events
  reference    serve-reference              a reference server of our own
  store        history, report, verify      what the store holds
  relay        relay serve, relay ls        checkpoints over HTTP
  tiny         tiny build                   the tiny trained run

options.py defines the options they share (once) and their choices; common.py what else they share.
Importing this package imports neither torch nor Prefect: each command imports what it uses.
"""

import os
from typing import Annotated

import typer

from . import evaluation, prompts, reference, relay, serving, store, tiny
from .options import OneLineChoiceErrors

# This tool runs offline: Prefect's temporary server must not try to send telemetry.
os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")

app = typer.Typer(cls=OneLineChoiceErrors, help="Evaluate DFlash speculative-decoding drafters offline.",
                  no_args_is_help=True, pretty_exceptions_enable=False)
for commands in (evaluation.app, prompts.app, serving.app, reference.app, store.app):
    app.add_typer(commands)  # no name: their commands are top-level ones
app.add_typer(tiny.app, name="tiny")
app.add_typer(relay.app, name="relay")


def _print_version(asked: bool) -> None:
    if asked:
        from importlib.metadata import version

        typer.echo(f"dflash-eval {version('dflash-eval')}")
        raise typer.Exit()


@app.callback()
def _options(
    _version: Annotated[bool, typer.Option("--version", callback=_print_version, is_eager=True,
                                           help="Print the version and exit.")] = False,
) -> None:
    """Evaluate DFlash speculative-decoding drafters offline."""


def main():
    """The `dflash-eval` console script."""
    from dflash_eval.storage.object_storage import ObjectStorageError

    try:
        app()
    except ObjectStorageError as e:  # the store's server went away (or refused us) mid-command: one line
        typer.secho(f"error: {e}", err=True, fg="red")
        raise SystemExit(2) from None
    finally:
        # The command is done. The interpreter's last garbage collection would walk the millions of objects
        # torch, transformers and Prefect leave (1.5 s on 2 cores, after every other exit hook) to free memory
        # the process is about to return anyway; frozen objects are left out of it. atexit hooks (Prefect's
        # server shutdown, log flushing) still run, and so do destructors of objects freed by reference count.
        import gc

        gc.freeze()
