"""`tiny build`: the tiny trained target and drafter run (demo, tests, smoke tests); BuildProgress draws how far
a build is (here and in `demo`)."""

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Self

import typer

from .common import configure_threads, fail
from .options import Arch, DrafterArchitecture, Threads, example

if TYPE_CHECKING:
    from rich.progress import TaskID

app = typer.Typer(help="The tiny trained target and drafter run (demo, tests, smoke tests).", no_args_is_help=True)


class BuildProgress:
    """Progress bars for the long steps of a tiny build (the `progress` that dflash_eval.tiny.build takes): one
    bar per step, added when the step starts and kept when it is done. Used as a context manager around the
    build; on a terminal the bars move and the build's log lines print above them, elsewhere (a log file) the
    finished bars print once at the end. Nothing shows when the build is cached."""

    def __init__(self) -> None:
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._bars = Progress(TextColumn("{task.description:<20}"), BarColumn(), MofNCompleteColumn(),
                              TimeElapsedColumn(), TextColumn("left"), TimeRemainingColumn())
        self._steps: dict[str, TaskID] = {}  # step -> its bar

    def __enter__(self) -> Self:
        self._bars.start()
        return self

    def __exit__(self, *exc_info) -> None:
        self._bars.stop()

    def __call__(self, step: str, done: int, total: int) -> None:
        """`done` of `total` units of `step` are done."""
        if step not in self._steps:
            self._steps[step] = self._bars.add_task(step, total=total)
        self._bars.update(self._steps[step], completed=done, total=total)


@app.command("build", epilog=example("dflash-eval tiny build --out runs/tiny"))
def tiny_build(
    out: Annotated[Path, typer.Option("--out", help="Folder to write the target and drafter run into.")],
    arch: Annotated[Arch, typer.Option(help="Target architecture: qwen3, or qwen3_5 (hybrid; also saved as a "
                                       "VLM).")] = Arch.qwen3,
    target_steps: Annotated[int | None, typer.Option(help="Target training steps (default: the "
                                                     "architecture's).")] = None,
    drafter_architecture: Annotated[DrafterArchitecture, typer.Option(
        help="The drafter: DFlash, or DFlash2 (convolutions and a candidate selector).")] = (
            DrafterArchitecture.DFlashDraftModel),
    drafter_steps: Annotated[int | None, typer.Option(help="Drafter training steps (default 400).")] = None,
    save_every: Annotated[int | None, typer.Option(help="Save a drafter checkpoint every N steps (default "
                                                   "100).")] = None,
    threads: Threads = None,
):
    """Train a tiny target and a DFlash (or DFlash2) drafter run into OUT, and print tau per saved step."""
    from dflash_eval.flows.checks import writable_problem
    from dflash_eval.tiny.build import TinyBuildSettings, build_tiny

    if problem := writable_problem(out, folder=True):
        fail(f"--out: {problem}")
    configure_threads(threads)
    settings = TinyBuildSettings(arch=arch.value, target_steps=target_steps,
                                 drafter_architecture=drafter_architecture.value)
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
