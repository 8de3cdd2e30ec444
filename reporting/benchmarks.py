"""tau on the published benchmarks as people read z-lab's tables: Math, Code and Chat groups, each benchmark with its
interval, each group with its Average, and the published tau beside ours where z-lab published one (the results'
`benchmarks`, dflash_core.published.numbers.beside_published). One table and one set of notes, which the command
line, the report and the Prefect summary all show: the results' section `Benchmarks`.

Where a published tau is pooled (DeepSpec's, the DSpark paper's Table 1), our pooled tau stands in a column of its
own beside our per-response tau, and the gap is the pooled one's: the notes say so."""

from dataclasses import dataclass
from typing import Any, ClassVar

from dflash_core.sections import Context, Section, Table, markdown_table, section

COLUMNS = ("group", "benchmark", "tau", "95% CI", "responses", "published", "gap")
# a table with a pooled publication in it: our pooled tau and its interval beside the per-response one
POOLED_COLUMNS = ("group", "benchmark", "tau", "95% CI", "pooled", "pooled 95% CI", "responses", "published", "gap")


@dataclass(frozen=True)
class BenchmarkLine:
    """One line of the table: a benchmark, or a group's Average (`average`)."""

    group: str
    benchmark: str
    tau: float
    ci95: tuple[float, float]
    responses: int | None
    published: float | None
    gap: float | None
    beyond_ci: bool
    average: bool
    pooled: float | None = None  # our pooled tau, where the scores hold it
    pooled_ci95: tuple[float, float] | None = None

    def cells(self, pooled: bool = False) -> list[str]:
        """The line's cells, in COLUMNS' order (POOLED_COLUMNS' with `pooled`); a gap beyond our interval (the
        interval of the tau it is the gap of) is starred."""
        gap = "-" if self.gap is None else f"{self.gap:+.2f}" + (" *" if self.beyond_ci else "")
        ours = [f"{self.tau:.2f}", f"{self.ci95[0]:.2f}-{self.ci95[1]:.2f}"]
        if pooled:
            ours += (["-", "-"] if self.pooled is None or self.pooled_ci95 is None else
                     [f"{self.pooled:.2f}", f"{self.pooled_ci95[0]:.2f}-{self.pooled_ci95[1]:.2f}"])
        return [self.group, self.benchmark, *ours, "" if self.responses is None else str(self.responses),
                "-" if self.published is None else f"{self.published:.2f}", gap]


def _pooled_of(r: dict) -> tuple[float | None, tuple[float, float] | None]:
    return r.get("tau_pooled"), tuple(r["pooled_ci95"]) if r.get("pooled_ci95") else None


def benchmark_lines(block: dict) -> list[BenchmarkLine]:
    """The table's lines: each group's benchmarks, then its Average (where the group has more than one)."""
    lines = []
    for group, average in block["groups"].items():
        rows = [r for r in block["rows"] if r["group"] == group]
        for r in rows:
            p = r["published"]
            lines.append(BenchmarkLine(group, r["title"], r["tau"], tuple(r["ci95"]), r["responses"],
                                       p["tau"] if p else None, p["gap"] if p else None, bool(p and p["beyond_ci"]),
                                       False, *_pooled_of(r)))
        if len(rows) > 1:
            published = average["published"]
            pooled, pooled_ci95 = _pooled_of(average)
            # the published Average beside ours of its kind: pooled (DeepSpec's) where the scores hold it
            if average.get("measure") == "pooled" and pooled is not None and pooled_ci95 is not None:
                tau, (low, high) = pooled, pooled_ci95
            else:
                tau, (low, high) = average["tau"], average["ci95"]
            gap = None if published is None else tau - published
            lines.append(BenchmarkLine(group, "Average", average["tau"], tuple(average["ci95"]), None, published,
                                       gap, published is not None and not low <= published <= high, True, pooled,
                                       pooled_ci95))
    return lines


def shows_pooled(block: dict) -> bool:
    """Whether the table has our pooled tau in it: a published tau set beside it (DeepSpec's), or the protocol's
    own publications pooled."""
    from dflash_core.published.protocols import PROTOCOLS

    protocol = PROTOCOLS.get(block["protocol"])
    return (any(r["published"] and r["published"].get("measure") == "pooled" for r in block["rows"])
            or (protocol is not None and protocol.published_tau == "pooled"))


def benchmark_notes(block: dict) -> list[str]:
    """What a reader must know besides the table: the protocol, every benchmark whose rows are not the protocol's
    subset, each published value's source and what differs from its setting, and each gap beyond our interval."""
    notes = [f"protocol {block['protocol']}" + (f", chat template given {block['template_kwargs']}"
                                                if block.get("template_kwargs") else "")]
    notes += [f"{r['title']}: {r['note']}" for r in block["rows"] if not r["protocol_subset"]]
    sources = sorted({r["published"]["source"] for r in block["rows"] if r["published"]})
    if sources:
        notes.append("published: " + "; ".join(sources))
    if shows_pooled(block):
        notes.append("tau: per response, the mean of its steps' acceptance lengths, averaged over responses (z-lab's); "
                     "pooled: every step of a benchmark at once, its tokens over its steps (DeepSpec's)"
                     + ("; a published pooled tau is set beside our pooled one, and its gap is the pooled tau's"
                        if any(r["published"] and r["published"].get("measure") == "pooled" for r in block["rows"])
                        else ""))
    for r in block["rows"]:
        p = r["published"]
        if p is None:
            continue
        if p["differs"]:
            notes.append(f"{r['title']}: not the published setting: {'; '.join(p['differs'])}")
        if p["beyond_ci"]:
            pooled = p.get("measure") == "pooled"
            name, tau, (low, high) = ("pooled tau", r["tau_pooled"], r["pooled_ci95"]) if pooled else (
                "tau", r["tau"], r["ci95"])
            notes.append(f"{r['title']}: {name} {tau:.2f} is {abs(p['gap']):.2f} {'below' if p['gap'] < 0 else 'above'}"
                         f" the published {p['tau']:.2f}, beyond our 95% CI {low:.2f}-{high:.2f}")
    return notes


def benchmark_markdown(block: dict) -> list[str]:
    """The table as Markdown lines (COLUMNS, each group's Average in bold), then the notes as a list."""
    table = benchmark_table(block)
    return markdown_table(Table(table.columns, table.rows, notes=table.notes, strong=table.strong))[:-1]


def benchmark_table(block: dict) -> Table:
    """The table with its notes, as every renderer draws it."""
    lines = benchmark_lines(block)
    pooled = shows_pooled(block)
    return Table(POOLED_COLUMNS if pooled else COLUMNS, tuple(tuple(line.cells(pooled)) for line in lines),
                 title="tau by benchmark (* a gap beyond our 95% CI)", notes=tuple(benchmark_notes(block)),
                 text_columns=2, strong=tuple(i for i, line in enumerate(lines) if line.average))


@section
@dataclass(frozen=True)
class Benchmarks(Section):
    """The results' `benchmarks`: tau per published benchmark in z-lab's layout, the published tau beside it."""

    KEY: ClassVar[str] = "benchmarks"
    TITLE: ClassVar[str] = "tau by benchmark"
    ORDER: ClassVar[int] = 10
    JSON: ClassVar[Any] = dict[str, Any]  # beside_published's {"protocol", "template_kwargs", "groups", "rows"}
    SHOWS_CATEGORIES: ClassVar[bool] = True  # each benchmark's prompts are a category of their own

    block: dict[str, Any]

    def tables(self, context: Context) -> list[Table]:
        return [benchmark_table(self.block)]

    def metrics(self, context: Context) -> list[tuple[str, str]]:
        """Each benchmark's tau and interval, and each group's Average (with the pooled tau, where it is shown)."""
        pooled = shows_pooled(self.block)
        return [(f"tau on {line.group} (average)" if line.average else f"tau on {line.benchmark}",
                 f"{line.tau:.3f} (95% CI {line.ci95[0]:.2f}-{line.ci95[1]:.2f})"
                 + (f", pooled {line.pooled:.3f} (95% CI {line.pooled_ci95[0]:.2f}-{line.pooled_ci95[1]:.2f})"
                    if pooled and line.pooled is not None and line.pooled_ci95 is not None else ""))
                for line in benchmark_lines(self.block)]


def reasoning_of(template_kwargs: dict) -> str | None:
    """How --reasoning names what a protocol gave the chat template (the references' `template_kwargs`): a level
    (reasoning_effort, reasoning_strength), "on" or "off" (enable_thinking), else None."""
    for key in ("reasoning_effort", "reasoning_strength"):
        if key in template_kwargs:
            return str(template_kwargs[key])
    if "enable_thinking" in template_kwargs:
        return "on" if template_kwargs["enable_thinking"] else "off"
    return None
