"""`--help` off a terminal (`dflash-eval run --help | less`, a CI log) and on a narrow one shows every option's full
name: rich fitted the option tables to 80 columns by cutting names (`--draft-sample-m…`) and wrapping descriptions
a word a line. Run as a user runs it: a process of its own, its output a pipe, $COLUMNS unset or small."""

import os
import subprocess
import sys

import pytest
from typer.main import get_command

from dflash_eval.cli import app

COMMANDS = (["run"], ["stage"], ["serve"], ["watch"], ["prompts"], ["demo"], ["history"], ["relay", "serve"], [])


def _names(words: list[str]) -> list[str]:
    """Every option name of the command `words` names (the root's, for none), negations included."""
    command = get_command(app)
    for word in words:
        command = command.commands[word]  # type: ignore[attr-defined]
    return [name for p in command.params for name in (*p.opts, *p.secondary_opts) if name.startswith("-")]


@pytest.mark.parametrize("columns", [None, "20", "80"], ids=["no COLUMNS", "COLUMNS=20", "COLUMNS=80"])
def test_every_option_shows_its_full_name_off_a_terminal(columns):
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "TERMINAL_WIDTH", "FORCE_COLOR")}
    if columns:
        env["COLUMNS"] = columns
    for words in COMMANDS:
        shown = subprocess.run([sys.executable, "-m", "dflash_eval.cli", *words, "--help"], env=env,
                               capture_output=True, text=True, timeout=60)
        assert shown.returncode == 0, shown.stderr
        assert "…" not in shown.stdout, (words, shown.stdout)
        missing = [name for name in _names(words) if name not in shown.stdout.split()
                   and f"{name}," not in shown.stdout and f",{name}" not in shown.stdout]
        assert not missing, (words, missing)


def test_a_wide_terminal_is_used_whole():
    env = {k: v for k, v in os.environ.items() if k not in ("TERMINAL_WIDTH",)}
    shown = subprocess.run([sys.executable, "-m", "dflash_eval.cli", "run", "--help"],
                           env={**env, "COLUMNS": "220"}, capture_output=True, text=True, timeout=60)
    assert max(len(line) for line in shown.stdout.splitlines()) == 220
