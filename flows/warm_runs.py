"""Served flow runs start from a process that has already imported torch, transformers and the flow.

`dflash-eval serve` runs each flow run in a child process (Prefect's runner). Prefect starts that child
with multiprocessing's "spawn", so every run imports torch, transformers, Prefect and this package
again: about 4 s on the eval box, more than the drafts and scores stages of a small drafter take. A
forkserver imports them once, before any run; each run's process is then a fork of it, imports
nothing, and starts in tens of milliseconds. Each run remains its own process, as Prefect's runner
expects: its own threads, memory, cancellation and crash handling.

Forking is safe here because the forkserver only imports: it runs no torch op, so no thread pool
exists to be copied.
"""

import multiprocessing
import types

import prefect.flow_engine

# What the served flows import (the report's matplotlib included); the forkserver imports it once.
PRELOAD = ["dflash_eval.flows.evaluate", "dflash_eval.flows.watch", "dflash_eval.reporting.report"]


def _forkserver_context(method: str | None = None):
    # run_flow_in_subprocess asks for "spawn"; any request gets the preloaded forkserver instead
    return multiprocessing.get_context("forkserver")


def start_flow_runs_from_forkserver(preload: list[str] = PRELOAD) -> None:
    """Make Prefect start this process's flow runs as forks of a forkserver that imported `preload`.

    Call once, before serving. Prefect 3.9 creates the run's process with
    `multiprocessing.get_context("spawn")` inside `prefect.flow_engine.run_flow_in_subprocess`; its module
    sees a copy of `multiprocessing` whose get_context returns the forkserver's context.
    """
    multiprocessing.set_forkserver_preload(preload)
    shim = types.ModuleType("multiprocessing")
    shim.__dict__.update(vars(multiprocessing))
    setattr(shim, "get_context", _forkserver_context)  # noqa: B010 (a module object's attribute)
    prefect.flow_engine.multiprocessing = shim
