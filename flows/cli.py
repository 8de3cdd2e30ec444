"""The `dflash-eval` command line."""

from dataclasses import replace
from pathlib import Path

import typer

app = typer.Typer(help="Evaluate DFlash speculative-decoding drafters offline.", no_args_is_help=True,
                  pretty_exceptions_enable=False)
tiny_app = typer.Typer(help="The tiny trained target and drafter run (demo, tests, smoke tests).", no_args_is_help=True)
app.add_typer(tiny_app, name="tiny")


@tiny_app.command("build")
def tiny_build(
    out: Path = typer.Option(..., "--out", help="Folder to write the target and drafter run into."),
    arch: str = typer.Option("qwen3", help="Target architecture: qwen3, or qwen3_5 (hybrid; also saved as a VLM)."),
    target_steps: int = typer.Option(None, help="Target training steps (default: the architecture's)."),
    drafter_steps: int = typer.Option(None, help="Drafter training steps (default 400)."),
    save_every: int = typer.Option(None, help="Save a drafter checkpoint every N steps (default 100)."),
):
    """Train a tiny target and a DFlash drafter run into OUT, and print tau per saved step.

    Example: dflash-eval tiny build --out runs/tiny
    """
    from dflash_core.tiny_build import TinyBuildSettings, build_tiny

    if arch not in ("qwen3", "qwen3_5"):
        raise typer.BadParameter(f"arch must be qwen3 or qwen3_5, got {arch!r}", param_hint="--arch")
    settings = TinyBuildSettings(arch=arch, target_steps=target_steps)
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


def main():
    app()


if __name__ == "__main__":
    main()
