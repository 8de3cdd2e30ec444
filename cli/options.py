"""The command line's options. An evaluation's settings become options from their one declaration
(flows/settings.py: `settings_options`, `setting_option`); the other commands' choices are Enums here; `--config
FILE` gives any command's options defaults. Imports neither torch nor Prefect: every command, `--help` and
`notify` included, builds these before it runs.

A value outside an option's choices, a setting out of its bounds, a rule broken between settings and a --config
value of a type its option does not take each get the one line every refused input gets (`OneLineChoiceErrors`,
`settings_options`, `config_value`). `--help` is drawn wide enough for every option's full name (`help_width`).
"""

import functools
import inspect
import json
import tomllib
import types
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union, cast, get_args, get_origin, get_type_hints

import typer
from typer._click.core import Context, ParameterSource  # typer's own click
from typer._click.exceptions import BadParameter, UsageError
from typer._click.globals import get_current_context
from typer.core import TyperCommand, TyperGroup, TyperOption
from typer.models import OptionInfo

from dflash_core.choices import AUTO_DTYPE, DTYPE_NAMES
from dflash_eval.flows.settings import GROUPS, SETTINGS, STAGES, Settings, SettingsError, flag_name

from .common import fail


# tests/test_cli.py checks these against DEFAULT_STEPS (dflash_eval.tiny.target imports torch).
class Arch(StrEnum):
    """--arch of tiny build: the keys of dflash_eval.tiny.target.DEFAULT_STEPS."""

    qwen3 = "qwen3"
    qwen3_5 = "qwen3_5"


class OneLineChoiceErrors(TyperGroup):
    """The root command group: a mistake on the command line (a value outside an option's choices or range, an
    unknown or missing option) is refused with one line and exit code 2, as the input checks refuse everything
    else (flows/checks.py), instead of typer's usage box: `error: --dtype must be one of auto, float32, bfloat16`,
    `error: Invalid value for '--port': Input should be less than or equal to 65535`."""

    def invoke(self, ctx: Context):
        try:
            return super().invoke(ctx)
        except UsageError as e:
            param = getattr(e, "param", None)
            choices = getattr(getattr(param, "type_descriptor", None), "choices", None)
            if param is not None and choices:
                name = param.opts[0] if param.param_type_name == "option" else param.metavar or param.name
                line = f"{name} must be one of {', '.join(c.value for c in choices)}"
            else:
                line = " ".join(e.format_message().split())
                if e.ctx is not None and not isinstance(e, BadParameter):
                    line += f" (see {e.ctx.command_path} --help)"
            typer.secho(f"error: {line}", err=True, fg="red")
            raise typer.Exit(2) from None


def _no_type_for_flags(display_type_rich):
    """typer shows `<bool>` beside every flag (`--diagnostics  <bool>`), as if it took a value: show nothing."""

    @functools.wraps(display_type_rich)
    def display(self, ctx):
        return None if self.is_flag else display_type_rich(self, ctx)

    return display


TyperOption.display_type_rich = _no_type_for_flags(TyperOption.display_type_rich)  # type: ignore[method-assign]

# The help's description column is never squeezed below this many characters (a word a line is unreadable).
HELP_COLUMN = 40


def _wide_enough(format_help):
    """`--help` drawn wide enough for every option's full name, at any width: rich fits its option tables to the
    console, 80 columns off a terminal (`run --help | less`, a CI log), by cutting names (`--draft-sample-m…`) and
    wrapping descriptions a word a line. The console is as wide as the terminal (or $COLUMNS, $TERMINAL_WIDTH)
    where that is wider than what the names and a readable description column need, else that: wider than a
    narrow terminal, whose lines then wrap, but never a name cut. Off a terminal without $COLUMNS, just that."""

    @functools.wraps(format_help)
    def wide(self, ctx, formatter):
        from typer import rich_utils  # (typer's consoles read their width from it, when they draw)

        given = rich_utils.MAX_WIDTH
        rich_utils.MAX_WIDTH = max(given or _console_columns(), help_width(self.get_params(ctx), ctx))
        try:
            return format_help(self, ctx, formatter)
        finally:
            rich_utils.MAX_WIDTH = given

    return wide


def _console_columns() -> int:
    """The columns help is asked to fit: $COLUMNS, else the terminal's; 0 off a terminal."""
    import os
    import shutil
    import sys

    if (columns := os.environ.get("COLUMNS", "")).isdigit():
        return int(columns)
    return shutil.get_terminal_size().columns if sys.stdout.isatty() else 0


def help_width(params, ctx) -> int:
    """The width at which rich draws every one of `params` with its full names, its type, and a description column
    of at least HELP_COLUMN characters. Rich narrows the widest wrapping columns first (the description, then the
    type), down to the next widest: with both at least as wide as any name column, no name is cut."""
    columns = [0, 0, 0, 0, 0, 0]  # required mark, long names, short names, their negations (long, short), type
    for param in params:
        names = [",".join(o for o in opts if o.startswith("--")) for opts in (param.opts, param.secondary_opts)]
        shorts = [",".join(o for o in opts if not o.startswith("--")) for opts in (param.opts, param.secondary_opts)]
        kind = param.display_type_rich(ctx=ctx) or ""
        if bounds := param._get_number_range_help_str():
            kind += f" [{bounds}]"
        for k, cell in enumerate((" " if param.required else "", names[0], shorts[0], names[1], shorts[1], kind)):
            columns[k] = max(columns[k], len(cell))
    wide = max(HELP_COLUMN, *columns[1:5])
    # the description and type columns at `wide` (the type at its own width if narrower); each column's cell
    # padding (one space either side) and the panel's border and padding
    return sum(columns[:5]) + min(columns[5], wide) + wide + 2 * 7 + 4


TyperCommand.format_help = _wide_enough(TyperCommand.format_help)  # type: ignore[method-assign]
TyperGroup.format_help = _wide_enough(TyperGroup.format_help)  # type: ignore[method-assign]


def example(*lines: str) -> str:
    """A command's epilog: an example to copy and paste (lines after the first are continuations)."""
    return "Example:\n\n" + " \\\n    ".join(lines)


CHECKPOINT_FORMS = ("a folder (a Hugging Face export: config.json + model.safetensors; a SpecForge save: "
                    "epoch_E_step_N or run-stepN, with --drafter-config when it has no config), or a relay URL "
                    "(http://RELAY:8700/RUN/step_N)")
Drafter = Annotated[str, typer.Option("--drafter", help=f"The drafter checkpoint: {CHECKPOINT_FORMS}.",
                                      rich_help_panel="Inputs")]
Drafters = Annotated[list[str], typer.Option(
    "--drafter", rich_help_panel="Inputs", help=f"The drafter checkpoint: {CHECKPOINT_FORMS}; or a training run's "
    "folder: each of its finished checkpoints, in step order. Repeat it to evaluate several in this one process "
    "(--out is then a folder: a results file per checkpoint).")]


# ---------------------------------------------------------------- the settings' options (flows/settings.py)

@functools.cache
def choice_enum(choices: tuple[str, ...], name: str = "Choice") -> type[StrEnum]:
    """The Enum typer shows and parses a choice of these names with (a Literal setting's, a command's)."""
    return cast(type[StrEnum], StrEnum(name, [(choice, choice) for choice in choices]))


# The type checker reads a choice as the str it is (a StrEnum member is one).
if TYPE_CHECKING:
    Stage = str
    ServedDtype = str
else:
    Stage = choice_enum(STAGES, "Stage")  # what `stage NAME` runs
    ServedDtype = choice_enum((AUTO_DTYPE, *DTYPE_NAMES), "ServedDtype")  # serve-reference's --dtype


def _option_type(annotation) -> tuple[Any, bool]:
    """(the type typer parses a setting's values as, whether the setting may be None)."""
    optional = get_origin(annotation) in (Union, types.UnionType) and type(None) in get_args(annotation)
    if optional:
        annotation = next(a for a in get_args(annotation) if a is not type(None))
    if get_origin(annotation) is Literal:
        return choice_enum(get_args(annotation)), optional
    if get_origin(annotation) is list and get_args(annotation) in ((int,), (float,)):
        return str, optional  # written "2,4,8" or "0,0.5" (the declaration reads it)
    return annotation, optional


def setting_option(name: str, *, evaluating: bool = False):
    """The typer option (an Annotated type) of declared setting `name`: its flag, help and, on a command that
    evaluates, its group's panel. Elsewhere (demo, history, ...) the field's bounds are typer's to check; an
    evaluating command checks every setting at once (`settings_options`)."""
    setting = SETTINGS[name]
    kind, optional = _option_type(setting.field.annotation)
    flags = [setting.flag]
    if kind is bool and setting.cli.negatable:
        flags = [f"{setting.flag}/--no-{setting.flag.removeprefix('--')}"]
    bounds = {} if evaluating else {
        bound: getattr(m, kind_) for m in setting.field.metadata for kind_, bound in (("ge", "min"), ("le", "max"))
        if hasattr(m, kind_)}
    info = typer.Option(*flags, help=setting.field.description, envvar=setting.cli.envvar,
                        metavar=setting.cli.metavar, rich_help_panel=GROUPS[setting.group].panel if evaluating else None,
                        **bounds)
    return Annotated[kind | None if optional else kind, info]


# Declared settings that other commands take too (demo, history, report, relay ls, serve-reference, tiny build),
# with the field's bounds checked by typer. The type checker reads them as their values' types.
if TYPE_CHECKING:
    Target = str
    StoreRoot = str | None
    Threads = int | None
    StepCost = str | None
    DeviceOption = str
else:
    Target, StoreRoot, Threads, StepCost, DeviceOption = (
        setting_option(name) for name in ("target", "store", "threads", "step_cost", "device"))


def _cli_default(name: str):
    setting = SETTINGS[name]
    if setting.field.is_required():
        return inspect.Parameter.empty
    default = setting.field.get_default()
    kind, _ = _option_type(setting.field.annotation)
    if isinstance(kind, type) and issubclass(kind, StrEnum) and default is not None:
        return kind(default)
    return default


def _from_cli(name: str, value):
    """An option's value as the declaration takes it: a choice by its name, an existing path absolute (flow runs may
    start in another folder)."""
    if isinstance(value, StrEnum):
        return value.value
    if SETTINGS[name].cli.path and isinstance(value, str):
        return absolute(value)
    return value


def settings_options(by_hand: bool = True):
    """Let a command take a parameter annotated `Settings`: its command line shows every declared setting as an
    option of its own, in its group's panel (without `by_hand`, those only a person running an evaluation gives
    are left out: `serve` and `watch` fix settings in deployments), and the command is called with the settings
    checked: one line and exit 2 naming the flags of what breaks a bound or a rule. What the user gave (on the
    command line, in --config, in an environment variable) is what the Settings hold as set (`model_fields_set`),
    so `watch` can pass on only that."""
    return functools.partial(_with_settings_options, by_hand=by_hand)


def _with_settings_options(command, by_hand: bool):
    hints = get_type_hints(command, include_extras=True)
    target = next(name for name, hint in hints.items() if hint is Settings)
    offered = [name for name, s in SETTINGS.items() if by_hand or not s.cli.by_hand_only]
    parameters = []
    for name, parameter in inspect.signature(command).parameters.items():
        if name == target:
            parameters += [inspect.Parameter(s, inspect.Parameter.KEYWORD_ONLY, default=_cli_default(s),
                                             annotation=setting_option(s, evaluating=True)) for s in offered]
        else:
            parameters.append(parameter.replace(kind=inspect.Parameter.KEYWORD_ONLY))
    parameters.append(inspect.Parameter("config", inspect.Parameter.KEYWORD_ONLY, default=None, annotation=ConfigFile))

    @functools.wraps(command)
    def run(**values):
        values.pop("config")  # read by its callback into the other options' defaults
        ctx = get_current_context()
        given: dict[str, dict] = {}
        for name in offered:
            value = values.pop(name)
            if ctx.get_parameter_source(name) not in (ParameterSource.DEFAULT, None):
                given.setdefault(SETTINGS[name].group, {})[name] = _from_cli(name, value)
        try:
            values[target] = Settings.checked(given, flag_name)
        except SettingsError as e:
            fail(str(e))
        return command(**values)

    panels = [group.panel for group in GROUPS.values()]

    def panel_order(parameter: inspect.Parameter) -> int:  # arguments first, then the panels in declaration order
        info = option_info(parameter.annotation)
        if info is None:
            return -1
        return panels.index(info.rich_help_panel) if info.rich_help_panel in panels else len(panels)

    parameters.sort(key=panel_order)
    run.__signature__ = inspect.Signature(parameters)  # type: ignore[attr-defined]  # what typer reads the options from
    run.__annotations__ = {p.name: p.annotation for p in parameters}
    return run


def option_info(annotation) -> OptionInfo | None:
    """The typer.Option(...) of an Annotated[..., typer.Option(...)], else None (an argument, a plain type)."""
    return next((m for m in getattr(annotation, "__metadata__", ()) if isinstance(m, OptionInfo)), None)


def read_config(ctx: typer.Context, value: Path | None) -> Path | None:
    """--config FILE: a TOML file whose keys are this command's options (`max-new-tokens` or `max_new_tokens`) and
    whose values become their defaults, so the command line overrides them, as lm-eval-harness's and Prefect's
    own settings files do. Relative paths in it are taken from where the command runs, as on the command line."""
    if value is None:
        return None
    try:
        found = tomllib.loads(value.read_text())
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise BadParameter(f"{value}: {getattr(e, 'strerror', None) or e}", param_hint="--config") from None
    # by the option's own name (--max-new-tokens: max-new-tokens or max_new_tokens), to the option it sets
    options = {opt.lstrip("-").replace("-", "_"): p for p in ctx.command.params
               if isinstance(p, TyperOption) and p.name != "config" for opt in p.opts}
    defaults: dict[str, Any] = {}
    keys: dict[str, str] = {}  # a parameter set: the key that set it
    for key, setting in found.items():
        if (option := options.get(key.replace("-", "_"))) is None:
            raise BadParameter(f"{value}: {key!r} is no option of `{ctx.command_path}` (its options: "
                               f"{', '.join(sorted(o.replace('_', '-') for o in options))})", param_hint="--config")
        name = cast(str, option.name)
        if name in keys:
            raise BadParameter(f"{value}: {keys[name]!r} and {key!r} both set {option.opts[0]}; keep one",
                               param_hint="--config")
        keys[name] = key
        try:
            defaults[name] = config_value(setting, option)
        except ValueError as e:
            raise BadParameter(f"{value}: {key} = {_toml(setting)}: {option.opts[0]} takes {e}",
                               param_hint="--config") from None
    ctx.default_map = {**(ctx.default_map or {}), **defaults}
    return value


def config_value(value: Any, option: TyperOption) -> Any:
    """A --config value as `option` takes it, or ValueError saying what it takes. TOML's values are typed, and the
    type is the user's meaning: text where a number is meant, a boolean where a count is (`samples = true`), a
    number where a path is (`store = 123`) are refused, never read as one another."""
    kind = option.type_descriptor.annotation  # the option's Python type: bool, int, float, str, Path, a choice
    if option.multiple:  # a list; one item may be given alone
        items = value if isinstance(value, list) else [value]
        if not all(isinstance(item, str) for item in items):
            raise ValueError("a list of strings (or one string)")
        return items
    if kind is str and option.name in SETTINGS and get_origin(declared := _declared_type(option.name)) is list:
        # a list setting the command line writes "2,4,8" (block_sizes; confidence_thresholds "0,0.5"): TOML's
        # [2, 4, 8] too
        numbers = (int, float) if get_args(declared) == (float,) else (int,)
        if isinstance(value, list) and all(isinstance(b, numbers) and not isinstance(b, bool) for b in value):
            return ",".join(map(str, value))
        if isinstance(value, str):
            return value
        if numbers == (int,):
            raise ValueError('whole numbers: a list [2, 4, 8] or a string "2,4,8"')
        raise ValueError('numbers: a list [0, 0.5] or a string "0,0.5"')
    if kind is bool:
        if isinstance(value, bool):
            return value
        raise ValueError("true or false")
    if kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        raise ValueError("a whole number")
    if kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ValueError("a number")
    if isinstance(value, str):  # text, a path, a choice (the option checks it)
        return value
    if isinstance(kind, type) and issubclass(kind, StrEnum):
        raise ValueError(f"one of {', '.join(choice.value for choice in kind)}, in quotes")
    raise ValueError('text, in quotes ("...")')


def _declared_type(name: str) -> Any:
    """A declared setting's value type, without None: list[int] for block_sizes."""
    annotation = SETTINGS[name].field.annotation
    if get_origin(annotation) in (Union, types.UnionType):
        annotation = next(a for a in get_args(annotation) if a is not type(None))
    return annotation


def _toml(value: Any) -> str:
    """A TOML value as the file wrote it (near enough for a message): true, 123, "text", [1, 2]."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, str):
        return json.dumps(value)
    if isinstance(value, list):
        return "[" + ", ".join(map(_toml, value)) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    return str(value)


ConfigFile = Annotated[Path | None, typer.Option(
    "--config", is_eager=True, callback=read_config, metavar="FILE", rich_help_panel="Inputs", help="A TOML file of "
    "this command's options (e.g. target, prompts, store, reference, thinking, temperature): what a team fixes once. "
    "The command line overrides it.")]


def absolute(path: str) -> str:
    """An existing file or folder as an absolute path (flow runs start in other processes); else as given
    (a suite name, a URL)."""
    return str(Path(path).resolve()) if Path(path).exists() else path
