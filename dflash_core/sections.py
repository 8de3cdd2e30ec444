"""Sections of an evaluation's results: each an optional part of what a run found (a DFlash2 drafter's candidate
selector, the published benchmarks, a block-size sweep, ...) that says itself how it is shown.

A section is its record (what the results JSON holds under its key, and scores.json when the scores stage computed
it) and its views, as plain data every renderer draws the same way:

- `lines` and `tables`: what the command line prints after tau, for one checkpoint; `markdown`: what the run's summary
  (a Prefect artifact) shows of it, by default the same lines and tables;
- `metrics`: (name, value) rows of the run's scores table (a Prefect table artifact);
- `scalars`: {tag: value} written at the checkpoint's step into TensorBoard and MLflow, under the series' prefix (a
  tag ending in /<k>, a series by draft position, under the by-position prefix); `charts`: how TensorBoard's
  custom-scalars dashboard groups them;
- `HISTORY` and `history`: values that stand beside tau in `dflash-eval history` (its table and `--json`), the
  report's table and the Prefect history table; `history_text`: the paragraph under the report's table that says
  what they are; `BESIDE_TAU`: one of them drawn beside tau in the report's tau-by-step plot;
- `REPORT_COLUMNS`, `report_text` and `report_row`: the report's table of this section, one row per shown
  checkpoint; `by_position` (with `POSITION_LINES`): series by draft position, which the report plots under it.

The renderers iterate over sections in ORDER (then registration order) and know none of them by name; a section class
registers itself with `section` (a class decorator). Nothing here imports Prefect, the store or a plotting library.
"""

from abc import ABC
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any, ClassVar, Self, TypeVar, cast

# ORDER from which a section tells of the evaluation around the checkpoint (a block sweep, a baseline, the series'
# comparisons, the training run, diagnostics) rather than of the checkpoint's own numbers: the run's summary puts
# the series' history between the two, the scores table its taus by category and speedups.
AROUND = 50


@dataclass(frozen=True)
class Table:
    """A table as every renderer draws it (rich on the console, a pipe table in markdown, HTML in the report)."""

    columns: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    title: str | None = None
    notes: tuple[str, ...] = ()  # lines under it
    text_columns: int = 0  # how many leading columns hold text (aligned left); the others hold numbers (right)
    strong: tuple[int, ...] = ()  # rows set apart (a group's Average): bold on the console, ** in markdown
    framed: bool = False  # the console draws its rules: a table of its own, not columns under the lines above


@dataclass(frozen=True)
class Chart:
    """One TensorBoard custom-scalars chart: the scalar tags it draws (regular expressions anchored on the series'
    prefix; one ending in /\\d+ on its by-position prefix), in the group `group`."""

    group: str
    title: str
    tags: tuple[str, ...]


@dataclass(frozen=True)
class Column:
    """A history value as the tables beside tau show it: its key in `history --json` (and Section.history), its
    heading in the report and the Prefect history table, its shorter one in `dflash-eval history`."""

    name: str
    heading: str
    short: str
    signed: bool = False  # written with its sign: a difference

    def cell(self, value: float | None) -> str:
        """The value as a table cell: three decimals, - when there is none."""
        return "-" if value is None else f"{value:+.3f}" if self.signed else f"{value:.3f}"


@dataclass(frozen=True)
class Context:
    """What a section's views need of the rest of the results."""

    sampled: bool = False  # the drafts were sampled: counts are expectations, a head alone drafts from its q
    tau_macro: float | None = None  # the checkpoint's tau macro (None: not scored, or many checkpoints)


Served = Context  # its name before it said more than how the drafts were served (modules written against it)


class Section(ABC):
    """One optional part of the results (the module docstring). Subclasses set KEY and TITLE and, by default, are
    dataclasses whose one field is their JSON (else they say their from_json and to_json); the views default to
    showing nothing but the summary's markdown, which shows `lines` and `tables`."""

    KEY: ClassVar[str]  # its key in the results JSON (and scores.json)
    TITLE: ClassVar[str]  # its heading in the report (and the legend's subject of its plot)
    ORDER: ClassVar[int] = 30  # where every renderer shows it among the others (AROUND)
    JSON: ClassVar[Any] = Any  # the type of what to_json returns (TypedDicts): the results' JSON schema says it
    WRAPS: ClassVar[bool] = True  # the console wraps its lines at the terminal's width (False: each stays one line)
    IN_SUMMARY: ClassVar[bool] = True  # the run's summary shows its markdown
    SHOWS_CATEGORIES: ClassVar[bool] = False  # its metrics stand in for the scores table's taus by prompt category
    HISTORY: ClassVar[tuple[Column, ...]] = ()  # the values of `history`, in the order the tables show them
    BESIDE_TAU: ClassVar[tuple[str, str] | None] = None  # (a HISTORY name, its legend label) drawn beside tau by step
    REPORT_COLUMNS: ClassVar[tuple[str, ...]] = ()  # the report's table of this section: its columns after the checkpoint
    REPORT_TEXT: ClassVar[str] = ""  # the paragraph above that table
    POSITION_LINES: ClassVar[Mapping[str, str]] = {}  # by_position's series, in order, each with its legend label
    POSITION_AXIS: ClassVar[str] = "share of the positions reached"  # what by_position's values are

    @classmethod
    def from_json(cls, data: Any) -> Self:
        """The section its JSON holds: by default a dataclass whose one field is that JSON."""
        return cast(Any, cls)(data)

    def to_json(self) -> Any:
        """What the results JSON holds under KEY: by default the section's one field."""
        (held,) = fields(cast(Any, self))
        return getattr(self, held.name)

    def lines(self, context: Context) -> list[str]:
        return []

    def tables(self, context: Context) -> list[Table]:
        return []

    def markdown(self, context: Context) -> list[str]:
        """The run's summary's lines of it (markdown, each block ending in an empty line): `lines`, then `tables`."""
        if not self.IN_SUMMARY:
            return []
        lines = [text for line in self.lines(context) for text in (line, "")]
        return lines + [text for table in self.tables(context) for text in markdown_table(table)]

    def metrics(self, context: Context) -> list[tuple[str, str]]:
        return []

    def scalars(self) -> dict[str, float]:
        return {}

    def charts(self) -> list[Chart]:
        return []

    def history(self) -> dict[str, float | None]:
        return {}

    @classmethod
    def history_text(cls, context: Context) -> str:
        """The paragraph under the report's table that says what its HISTORY columns are."""
        return ""

    @classmethod
    def report_text(cls, context: Context) -> str:
        """The paragraph above the report's table of this section (context.sampled: the series' drafts are)."""
        return cls.REPORT_TEXT

    def report_row(self) -> tuple[str, ...]:
        return ()

    def by_position(self) -> dict[str, list[float | None]]:
        return {}


SectionType = TypeVar("SectionType", bound=type[Section])

# every section class by its key, in registration order (the renderers show them in ORDER, then this order)
SECTIONS: dict[str, type[Section]] = {}


def section(cls: SectionType) -> SectionType:
    """Register a section class (a class decorator): every renderer then shows it where the results hold its key."""
    if not all(isinstance(column, Column) for column in cls.HISTORY):
        raise TypeError(f"{cls.__name__}.HISTORY: each value is a Column(name, heading, short heading)")
    if SECTIONS.get(cls.KEY, cls) is not cls:
        raise ValueError(f"two sections named {cls.KEY!r}: {SECTIONS[cls.KEY].__name__} and {cls.__name__}")
    SECTIONS[cls.KEY] = cls
    return cls


def registered() -> list[type[Section]]:
    """Every registered section class, in the order the renderers show them (a generation's registers when its
    module is imported: dflash_core.generations imports every registered generation's)."""
    return sorted(SECTIONS.values(), key=lambda cls: cls.ORDER)  # (sorted is stable: registration order among equals)


def sections_of(results: Mapping[str, Any]) -> list[Section]:
    """The registered sections a results (or scores.json) record holds, in the order the renderers show them."""
    return [cls.from_json(results[cls.KEY]) for cls in registered() if results.get(cls.KEY) is not None]


def in_order(sections: list[Section]) -> list[Section]:
    """Sections in the order the renderers show them."""
    order = {cls: index for index, cls in enumerate(registered())}
    return sorted(sections, key=lambda s: order.get(type(s), len(order)))


def share(x: float | None) -> str:
    """A share as the views write it: 87.5%, or - when there is none."""
    return "-" if x is None else f"{x:.1%}"


def count(n: float) -> str:
    """A count as the views write it: whole, or an expectation to one decimal."""
    return f"{n:.0f}" if float(n).is_integer() else f"{n:.1f}"


def markdown_table(table: Table) -> list[str]:
    """A Table as markdown lines: its title (then a colon), the pipe table (strong rows in bold), its notes as a
    list; an empty line after each block."""
    lines = [f"{table.title}:", ""] if table.title else []
    lines += ["| " + " | ".join(table.columns) + " |", "|" + "---|" * len(table.columns)]
    lines += ["| " + " | ".join(markdown_strong(c) if i in table.strong else c for c in row) + " |"
              for i, row in enumerate(table.rows)]
    if table.notes:
        lines += ["", *(f"- {note}" for note in table.notes)]
    return [*lines, ""]


def markdown_strong(cell: str) -> str:
    """A Markdown table cell in bold (a Table's strong row): a gap's star stays outside, empty cells stay empty."""
    text, star = (cell[:-2], " *") if cell.endswith(" *") else (cell, "")
    return f"**{text}**{star}" if text.strip() else cell
