"""`tiny build`: the tiny trained target and drafter run (demo, tests, smoke tests); BuildProgress shows how far
a build is (here and in `demo`)."""

import threading
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Self

import typer

from .common import configure_threads, fail
from .options import Arch, Threads, example

if TYPE_CHECKING:
    from rich.progress import TaskID

app = typer.Typer(help="The tiny trained target and drafter run (demo, tests, smoke tests).", no_args_is_help=True)


PLAIN_EVERY_SECONDS = 10.0  # off a terminal: a progress line per step at most this often (and at its start and end)


class BuildProgress:
    """How far the long steps of a tiny build are (the `progress` that dflash_eval.tiny.build takes). Used as a
    context manager around the build. On a terminal: a progress bar per step, added when the step starts and kept
    when it is done, the build's log lines printed above them. Elsewhere (a log file, a CI job, a pipe): plain
    lines, one when a step starts, one at most every `every_seconds` while it runs and one when it is done, each
    with the step's count, share, time so far and time left, so that a log never looks hung. Nothing shows when
    the build is cached. Safe to call from the thread that builds while another prints (`demo`)."""

    def __init__(self, every_seconds: float = PLAIN_EVERY_SECONDS, terminal: bool | None = None) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self.terminal = Console().is_terminal if terminal is None else terminal
        self.every_seconds = every_seconds
        self._bars = Progress(TextColumn("{task.description:<20}"), BarColumn(), MofNCompleteColumn(),
                              TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn())
        self._steps: dict[str, TaskID] = {}  # step -> its bar
        self._lines: dict[str, tuple[float, float]] = {}  # off a terminal: step -> (its start, its last line)
        self._lock = threading.Lock()

    def __enter__(self) -> Self:
        if self.terminal:
            self._bars.start()
        return self

    def __exit__(self, *exc_info) -> None:
        if self.terminal:
            self._bars.stop()

    def __call__(self, step: str, done: int, total: int) -> None:
        """`done` of `total` units of `step` are done."""
        if not self.terminal:
            self._line(step, done, total)
            return
        if step not in self._steps:
            self._steps[step] = self._bars.add_task(step, total=total)
        self._bars.update(self._steps[step], completed=done, total=total)

    def _line(self, step: str, done: int, total: int) -> None:
        now = time.monotonic()
        with self._lock:
            started, last = self._lines.get(step, (now, None))
            if last is not None and done < total and now - last < self.every_seconds:
                return
            self._lines[step] = (started, now)
        took = now - started
        left = f", about {took / done * (total - done):.0f} s left" if 0 < done < total and took > 0 else ""
        share = f" ({done / total:.0%})" if total else ""
        typer.echo(f"{step}: {done}/{total}{share} after {took:.0f} s{left}" + (", done" if done >= total else ""))


@app.command("build", epilog=example("dflash-eval tiny build --out runs/tiny"))
def tiny_build(
    out: Annotated[Path, typer.Option("--out", help="Folder to write the target and drafter run into.")],
    arch: Annotated[Arch, typer.Option(help="Target architecture: qwen3, or qwen3_5 (hybrid; also saved as a "
                                       "VLM).")] = Arch.qwen3,
    target_steps: Annotated[int | None, typer.Option(help="Target training steps (default: the "
                                                     "architecture's).")] = None,
    drafter_architecture: Annotated[str, typer.Option(
        metavar="ARCHITECTURE", help="The drafter: a generation's architecture (dflash_core.generations), as its own "
        "trainer saves it: DFlashDraftModel, DFlash2DraftModel (convolutions and a candidate selector) or "
        "Qwen3DSparkModel (DeepSpec's DSpark: Markov and confidence heads).")] = "DFlashDraftModel",
    drafter_steps: Annotated[int | None, typer.Option(help="Drafter training steps (default 400).")] = None,
    save_every: Annotated[int | None, typer.Option(help="Save a drafter checkpoint every N steps (default "
                                                   "100).")] = None,
    threads: Threads = None,
):
    """Train a tiny target and a drafter run (DFlash, DFlash2 or DSpark) into OUT, and print tau per saved step."""
    from dflash_eval.flows.checks import writable_problem
    from dflash_eval.tiny.build import TinyBuildSettings, build_tiny, buildable_architectures

    if problem := writable_problem(out, folder=True):
        fail(f"--out: {problem}")
    if drafter_architecture not in buildable_architectures():
        fail(f"--drafter-architecture {drafter_architecture!r}: the tiny build trains "
             f"{', '.join(buildable_architectures())}")
    configure_threads(threads)
    settings = TinyBuildSettings(arch=arch.value, target_steps=target_steps, drafter_architecture=drafter_architecture)
    training = settings.drafter_training
    if drafter_steps is not None:
        training = replace(training, steps=drafter_steps)
    if save_every is not None:
        training = replace(training, save_every=save_every)
    with BuildProgress() as progress:
        run = build_tiny(out, replace(settings, drafter_training=training), log=typer.echo, progress=progress)
    typer.echo(f"\nbuilt in {run.record['timings_s']['total']:.0f} s: target {run.target_dir}, "
               f"drafter run {run.root / 'drafter'}, prompts {run.prompts_file}")
    typer.echo("step      tau")
    for step, tau in zip(run.record["steps"], run.record["tau"].values()):
        typer.echo(f"{step:>6}  {tau:5.2f}")
