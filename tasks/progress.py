"""Progress of a long stage, in the terminal (a rich bar) and in Prefect (a progress artifact and logs)."""

import logging
import sys
import time
from typing import cast
from uuid import UUID

from prefect import get_run_logger
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.context import FlowRunContext, TaskRunContext
from prefect.exceptions import MissingContextError
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


def in_run() -> bool:
    """Whether this code runs inside a Prefect flow or task run (logs and artifacts go to the run)."""
    return FlowRunContext.get() is not None or TaskRunContext.get() is not None


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is when a line is logged (rich and tests swap it)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):
        pass


def stage_logger() -> logging.Logger | logging.LoggerAdapter:
    """The run's logger inside a flow or task run (its lines show in the Prefect UI), else one that
    writes to stderr (input checks of the command line, before any run starts)."""
    try:
        return get_run_logger()
    except MissingContextError:
        logger = logging.getLogger("dflash_eval")
        if not logger.handlers:
            handler = _StderrHandler()
            handler.setFormatter(logging.Formatter("%(message)s"))
            logger.addHandler(handler)
            logger.setLevel(logging.INFO)
            logger.propagate = False
        return logger


class StageProgress:
    """Counts `total` units of work; use as a context manager and call `update(done)`.

    Prefect shows a progress artifact on the flow run's page, updated at most once a second (without a key: the
    Artifacts page keeps the results of each series, not the progress of every run), and a log line every
    quarter; the terminal shows a bar when stderr is one.
    """

    def __init__(self, stage: str, description: str, total: int, log_quarters: bool = True):
        self.stage, self.description, self.total = stage, description, max(total, 1)
        self.log_quarters = log_quarters
        self.logger = stage_logger()
        self.bar = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TimeRemainingColumn(), disable=not sys.stderr.isatty(), transient=True,
        )
        self.bar_task = self.bar.add_task(description, total=total)
        # outside a run (the command line's input checks) there is no run to attach an artifact to
        # cast: Prefect types its sync-or-async functions as maybe returning a coroutine; called from sync code,
        # as here, create_progress_artifact returns the artifact's id
        self.artifact = (cast(UUID, create_progress_artifact(0.0, description=f"{stage}: {description}"))
                         if in_run() else None)
        self.last_push = 0.0
        self.logged_quarter = 0

    def __enter__(self) -> "StageProgress":
        self.bar.start()
        return self

    def __exit__(self, *exc) -> None:
        self.bar.stop()

    def update(self, done: int) -> None:
        self.bar.update(self.bar_task, completed=done)
        now = time.monotonic()
        if self.artifact is not None and (now - self.last_push >= 1.0 or done >= self.total):
            update_progress_artifact(self.artifact, 100.0 * done / self.total)
            self.last_push = now
        quarter = 4 * done // self.total
        if self.log_quarters and quarter > self.logged_quarter:
            self.logger.info(f"{self.description}: {done}/{self.total}")
            self.logged_quarter = quarter
