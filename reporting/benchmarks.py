"""tau on the published benchmarks as people read z-lab's tables: Math, Code and Chat groups, each benchmark with its
interval, each group with its Average, and the published tau beside ours where z-lab published one (the results'
`benchmarks`, dflash_core.published.numbers.beside_published). One table and one set of notes, which the command
line, the report and the Prefect summary all show."""

from dataclasses import dataclass

COLUMNS = ("group", "benchmark", "tau", "95% CI", "responses", "published", "gap")


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

    def cells(self) -> list[str]:
        """The line's cells, in COLUMNS' order; a gap beyond our interval is starred."""
        gap = "-" if self.gap is None else f"{self.gap:+.2f}" + (" *" if self.beyond_ci else "")
        return [self.group, self.benchmark, f"{self.tau:.2f}", f"{self.ci95[0]:.2f}-{self.ci95[1]:.2f}",
                "" if self.responses is None else str(self.responses),
                "-" if self.published is None else f"{self.published:.2f}", gap]


def benchmark_lines(block: dict) -> list[BenchmarkLine]:
    """The table's lines: each group's benchmarks, then its Average (where the group has more than one)."""
    lines = []
    for group, average in block["groups"].items():
        rows = [r for r in block["rows"] if r["group"] == group]
        for r in rows:
            p = r["published"]
            lines.append(BenchmarkLine(group, r["title"], r["tau"], tuple(r["ci95"]), r["responses"],
                                       p["tau"] if p else None, p["gap"] if p else None, bool(p and p["beyond_ci"]),
                                       False))
        if len(rows) > 1:
            published = average["published"]
            gap = None if published is None else average["tau"] - published
            low, high = average["ci95"]
            lines.append(BenchmarkLine(group, "Average", average["tau"], (low, high), None, published, gap,
                                       published is not None and not low <= published <= high, True))
    return lines


def benchmark_notes(block: dict) -> list[str]:
    """What a reader must know besides the table: the protocol, every benchmark whose rows are not the protocol's
    subset, each published value's source and what differs from its setting, and each gap beyond our interval."""
    notes = [f"protocol {block['protocol']}" + (f", chat template given {block['template_kwargs']}"
                                                if block.get("template_kwargs") else "")]
    notes += [f"{r['title']}: {r['note']}" for r in block["rows"] if not r["protocol_subset"]]
    sources = sorted({r["published"]["source"] for r in block["rows"] if r["published"]})
    if sources:
        notes.append("published: " + "; ".join(sources))
    for r in block["rows"]:
        p = r["published"]
        if p is None:
            continue
        if p["differs"]:
            notes.append(f"{r['title']}: not the published setting: {'; '.join(p['differs'])}")
        if p["beyond_ci"]:
            notes.append(f"{r['title']}: tau {r['tau']:.2f} is {abs(p['gap']):.2f} {'below' if p['gap'] < 0 else 'above'}"
                         f" the published {p['tau']:.2f}, beyond our 95% CI {r['ci95'][0]:.2f}-{r['ci95'][1]:.2f}")
    return notes


def benchmark_markdown(block: dict) -> list[str]:
    """The table as Markdown lines (COLUMNS, each group's Average in bold), then the notes as a list."""
    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    for line in benchmark_lines(block):
        lines.append("| " + " | ".join(markdown_strong(c) if line.average else c for c in line.cells()) + " |")
    return [*lines, "", *(f"- {note}" for note in benchmark_notes(block))]


def markdown_strong(cell: str) -> str:
    """A Markdown table cell in bold (an Average's): a gap's star stays outside, empty cells stay empty."""
    text, star = (cell[:-2], " *") if cell.endswith(" *") else (cell, "")
    return f"**{text}**{star}" if text.strip() else cell


def reasoning_of(template_kwargs: dict) -> str | None:
    """How --reasoning names what a protocol gave the chat template (the references' `template_kwargs`): a level
    (reasoning_effort, reasoning_strength), "on" or "off" (enable_thinking), else None."""
    for key in ("reasoning_effort", "reasoning_strength"):
        if key in template_kwargs:
            return str(template_kwargs[key])
    if "enable_thinking" in template_kwargs:
        return "on" if template_kwargs["enable_thinking"] else "off"
    return None
