"""`tiny build`: the tiny trained target and drafter run (demo, tests, smoke tests)."""

from dataclasses import replace
from pathlib import Path
from typing import Annotated

import typer

from .common import configure_threads
from .options import Arch, Threads, example

app = typer.Typer(help="The tiny trained target and drafter run (demo, tests, smoke tests).", no_args_is_help=True)


@app.command("build", epilog=example("dflash-eval tiny build --out runs/tiny"))
def tiny_build(
    out: Annotated[Path, typer.Option("--out", help="Folder to write the target and drafter run into.")],
    arch: Annotated[Arch, typer.Option(help="Target architecture: qwen3, or qwen3_5 (hybrid; also saved as a "
                                       "VLM).")] = Arch.qwen3,
    target_steps: Annotated[int | None, typer.Option(help="Target training steps (default: the "
                                                     "architecture's).")] = None,
    drafter_steps: Annotated[int | None, typer.Option(help="Drafter training steps (default 400).")] = None,
    save_every: Annotated[int | None, typer.Option(help="Save a drafter checkpoint every N steps (default "
                                                   "100).")] = None,
    threads: Threads = None,
):
    """Train a tiny target and a DFlash drafter run into OUT, and print tau per saved step."""
    from dflash_core.tiny.build import TinyBuildSettings, build_tiny

    configure_threads(threads)
    settings = TinyBuildSettings(arch=arch.value, target_steps=target_steps)
    training = settings.drafter_training
    if drafter_steps is not None:
        training = replace(training, steps=drafter_steps)
    if save_every is not None:
        training = replace(training, save_every=save_every)
    run = build_tiny(out, replace(settings, drafter_training=training), log=typer.echo)
    typer.echo(f"\nbuilt in {run.record['timings_s']['total']:.0f} s: target {run.target_dir}, "
               f"drafter run {run.root / 'drafter'}, prompts {run.prompts_file}")
    typer.echo("step      tau")
    for step, tau in zip(run.record["steps"], run.record["tau"].values()):
        typer.echo(f"{step:>6}  {tau:5.2f}")
