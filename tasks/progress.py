"""Progress of a long stage, in the terminal (a rich bar) and in Prefect (a progress artifact and logs)."""

import sys
import time

from prefect import get_run_logger
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class StageProgress:
    """Counts `total` units of work; use as a context manager and call `update(done)`.

    Prefect shows a progress artifact (key `<stage>-progress`) updated at most once a second and a log
    line every quarter; the terminal shows a bar when stderr is one.
    """

    def __init__(self, stage: str, description: str, total: int):
        self.stage, self.description, self.total = stage, description, max(total, 1)
        self.logger = get_run_logger()
        self.bar = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TimeRemainingColumn(), disable=not sys.stderr.isatty(), transient=True,
        )
        self.bar_task = self.bar.add_task(description, total=total)
        self.artifact = create_progress_artifact(0.0, key=f"{stage}-progress", description=description)
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
        if now - self.last_push >= 1.0 or done >= self.total:
            update_progress_artifact(self.artifact, 100.0 * done / self.total)
            self.last_push = now
        quarter = 4 * done // self.total
        if quarter > self.logged_quarter:
            self.logger.info(f"{self.description}: {done}/{self.total}")
            self.logged_quarter = quarter
