"""`--config FILE` values by TOML type: TOML's values are typed, and a value of a type its option does not take (a
boolean where a count is meant, a number where a path is) is one line naming the file, the key and what the option
takes, exit code 2, before anything runs; never read as another type (`samples = true` as 1, `store = 123` as the
folder ./123). A key given twice under its two spellings (`top-k`, `top_k`) is refused too.

The table is made from the commands' options and the settings' declaration (flows/settings.py), so an option or a
setting added later is covered by its rows."""

import datetime
import types
import typing

import pytest
from typer.main import get_command
from typer.testing import CliRunner

from dflash_eval.cli import app
from dflash_eval.cli.options import config_value
from dflash_eval.flows.settings import SETTINGS

# One value of each TOML type, as a file writes it and as tomllib reads it.
TOML = {
    "boolean": ("true", True),
    "integer": ("7", 7),
    "float": ("0.5", 0.5),
    "string": ('"x"', "x"),
    "array of strings": ('["x"]', ["x"]),
    "array of integers": ("[2, 4]", [2, 4]),
    "array of numbers": ("[0, 0.5]", [0, 0.5]),
    "table": ("{ a = 1 }", {"a": 1}),
    "date-time": ("1979-05-27T07:32:00Z", datetime.datetime(1979, 5, 27, 7, 32, tzinfo=datetime.UTC)),
}
COMMANDS = ("run", "stage", "serve", "watch")


def _options():
    """(command, option) for every option of the commands that take a --config, but --config itself."""
    commands = get_command(app).commands
    return [(name, p) for name in COMMANDS for p in commands[name].params
            if p.param_type_name == "option" and p.name != "config"]


def _takes(option) -> set[str]:
    """The TOML types an option takes: a declared setting's from its declared type, another option's from its own."""
    if option.name in SETTINGS:
        annotation = SETTINGS[option.name].field.annotation
        if typing.get_origin(annotation) in (typing.Union, types.UnionType):
            annotation = next(a for a in typing.get_args(annotation) if a is not type(None))
    else:
        annotation = option.type_descriptor.annotation
    if typing.get_origin(annotation) is list:
        items = typing.get_args(annotation)
        return {"string", *{(int,): ["array of integers"], (float,): ["array of integers", "array of numbers"]}.get(
            items, ["array of strings"])}
    if annotation is bool:
        return {"boolean"}
    if annotation is int:
        return {"integer"}
    if annotation is float:
        return {"integer", "float"}
    return {"string"}  # text, a path, a choice


OPTIONS = _options()


def test_every_setting_is_an_option_of_run_covered_here():
    assert set(SETTINGS) <= {option.name for command, option in OPTIONS if command == "run"}


@pytest.mark.parametrize(("command", "option"), OPTIONS, ids=[f"{c} {o.opts[0]}" for c, o in OPTIONS])
def test_each_toml_type_is_taken_or_refused_as_the_option_says(command, option, tmp_path):
    takes = _takes(option)
    config = tmp_path / "team.toml"
    key = option.opts[0].removeprefix("--")
    for kind, (written, value) in TOML.items():
        if kind in takes:
            config_value(value, option)  # taken: no ValueError
            continue
        with pytest.raises(ValueError):
            config_value(value, option)
        config.write_text(f"{key} = {written}\n")
        result = CliRunner().invoke(app, [command, "--config", str(config)])
        lines = result.output.strip().splitlines()
        assert result.exit_code == 2 and len(lines) == 1, (kind, result.output)
        assert lines[0].startswith(f"error: Invalid value for --config: {config}: {key} = ") and \
            f": {option.opts[0]} takes " in lines[0], (kind, lines[0])


@pytest.mark.parametrize(("written", "says"), [
    ("samples = true", "samples = true: --samples takes a whole number"),
    ("max_new_tokens = true", "max_new_tokens = true: --max-new-tokens takes a whole number"),
    ("store = 123", 'store = 123: --store takes text, in quotes ("...")'),
    ("temperature = \"0.6\"", 'temperature = "0.6": --temperature takes a number'),
    ("thinking = \"yes\"", 'thinking = "yes": --thinking takes true or false'),
    ("dtype = 16", "dtype = 16: --dtype takes one of auto, float32, bfloat16, in quotes"),
    ("include = [1]", "include = [1]: --include takes a list of strings (or one string)"),
    ("block-sizes = [2, true]", 'block-sizes = [2, true]: --block-sizes takes whole numbers: a list [2, 4, 8] or a '
                                'string "2,4,8"'),
    ("top-k = 5\ntop_k = 20", "'top-k' and 'top_k' both set --top-k; keep one"),
])
def test_a_bad_config_value_is_one_line_and_nothing_is_written(tmp_path, written, says):
    config = tmp_path / "team.toml"
    config.write_text(written + "\n")
    store = tmp_path / "store"
    result = CliRunner().invoke(app, ["run", "--config", str(config), "--target", "t", "--drafter", "d", "--prompts",
                                      "p", "--temperature", "0.6", "--store", str(store)])
    assert result.exit_code == 2 and result.output.strip().splitlines() == [
        f"error: Invalid value for --config: {config}: {says}"], result.output
    assert not store.exists()


@pytest.mark.parametrize(("written", "reaches"), [
    ("block-sizes = [2, 4]", "error: target t is not a directory"),  # a list of block sizes, as "2,4" is
    ('include = "*.pt"', "error: target t is not a directory"),  # one pattern: a list of one
    ("temperature = 1\nsamples = 2", "error: target t is not a directory"),  # an integer where a number is meant
])
def test_values_of_a_type_the_option_takes_reach_the_checks(tmp_path, written, reaches):
    config = tmp_path / "team.toml"
    config.write_text(written + "\n")
    result = CliRunner().invoke(app, ["run", "--config", str(config), "--target", "t", "--drafter", "d",
                                      "--prompts", "p", "--store", str(tmp_path / "store")])
    assert result.exit_code == 2 and result.output.strip().splitlines()[-1].startswith(reaches), result.output


def test_the_table_covers_every_toml_type():
    import tomllib

    for kind, (written, value) in TOML.items():
        assert tomllib.loads(f"v = {written}")["v"] == value, kind
