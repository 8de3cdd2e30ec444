"""`dflash-eval report`: one self-contained HTML page (and the same as Markdown + PNG files) of a store's scores.

For each group of comparable scores (same target, references and sliding-layer semantics; see
reporting.history) the report shows:

- every scored checkpoint, in history order (by training step; checkpoints without one by when they were
  first scored, never by path: reporting.history): tau macro with its 95% interval, tau pooled, the best step,
  regressions and baselines, and the speedup upper bound of the newest checkpoint (the last in that order);
- tau macro over training steps, with the intervals, the best step, regressions and each baseline as a
  dashed line with its interval as a band;
- for the newest `last` checkpoints and the baselines: the conditional acceptance of each draft position
  k (where inside the block the drafter loses its way) beside the cumulative curve P(positions 1..k all
  accepted), the acceptance-length histogram, and tau per prompt category;
- for each checkpoint with a `diagnostics` store entry: tau with each target layer's features zeroed
  (which layers the drafter relies on), tau with the target layers shifted by an offset (whether the
  drafter reads the layers it was trained on), tau with the other sliding-layer semantics, and the first
  rejected draft of some prompts as text.

The report is built once as a `Report` (typed history rows, the plots, what the diagnostics say) and
rendered by one Jinja2 template, templates/report.j2, written twice: with the HTML blocks
(templates/blocks.html.j2, autoescaped) and with the Markdown ones (templates/blocks.md.j2), so the two
files never say different things. `report.html` embeds its plots as base64 PNGs and its CSS inline: it
loads nothing, so it can be mailed or attached as it is. `report.md` shows the plots from `img/`.
"""

import base64
import functools
import io
import math
import os
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from jinja2 import Environment, FileSystemLoader, StrictUndefined
from matplotlib import colormaps
from matplotlib.artist import Artist
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.container import ErrorbarContainer
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator
from matplotlib.typing import ColorType

from dflash_eval.reporting.history import Group, HistoryRow, history
from dflash_eval.reporting.training_side import TrainingSide, training_sides
from dflash_eval.storage import EntryMissing, Store, read_json
from dflash_eval.storage.records import write_bytes_atomic
from dflash_eval.storage.schema import DIAGNOSTICS_FILE, DiagnosticsRecord, DraftsRecord, Stage

TEMPLATES = Path(__file__).parent / "templates"  # installed with the package (pyproject.toml package-data)
DPI = 110
# Baselines keep one colour across all plots; red is left for regressions.
BASELINE_COLORS = ("tab:orange", "tab:gray", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")
RUN_COLORS = ("tab:blue", "tab:green", "tab:purple")  # training runs in the tau-by-step plot
TAU_PLOT = "-tau-by-step"  # a group's tau-by-step plot: img/group<N>-tau-by-step.png


class NothingToReport(LookupError):
    """The store holds no scored checkpoint."""


@dataclass(frozen=True)
class Plot:
    """A figure: embedded in report.html, written to img/<name>.png for report.md."""

    name: str  # file name in img/, without .png
    alt: str
    png: bytes

    @property
    def file(self) -> str:
        """Its path relative to the report's folder."""
        return f"img/{self.name}.png"

    @property
    def data_uri(self) -> str:
        """The PNG as a data: URI, so that the page loads nothing."""
        return "data:image/png;base64," + base64.b64encode(self.png).decode("ascii")


@dataclass(frozen=True)
class CategoryTau:
    """One row of a group's tau-by-category table."""

    category: str
    prompts: int  # prompts of that category in the references
    taus: list[float | None]  # tau macro of each shown checkpoint, None where it has none


@dataclass(frozen=True)
class DiagnosticsSection:
    """What the report shows of one checkpoint's diagnostics.json (tasks/diagnostics.py)."""

    row: HistoryRow
    tau: float  # unmodified tau macro
    layer_ids: list[int] | None  # the target layers the drafter reads
    num_target_layers: int | None
    ablation: Plot | None  # None: no layer ablation recorded
    offset_probe: Plot | None  # None: no offset probed
    unprobed_offsets: list[int]  # offsets that would read layers outside the target
    sliding_tried: bool  # whether diagnostics.json says anything about the sliding switch ...
    sliding_switch: dict | None  # ... {"from", "to", "tau_macro"}, or None: the drafter has no sliding layers
    examples: list[dict]  # first rejected drafts: diagnostics.json's `first_divergence`
    noise_tau: float | None  # tau with noise in place of every feature (None: not recorded)
    agreement: dict[str, float]  # agreement rates by name (dflash_core.diagnostics.agreement_counts); {}: none
    findings: list[dict]  # what the diagnostics say about how the drafter was trained (dflash_core.diagnostics)


@dataclass(frozen=True)
class GroupSection:
    """One group of comparable scores (reporting.history.Group), with what its section shows."""

    group: Group
    anchor: str  # "group<N>": the section's id, and the prefix of its plots' names
    n_prompts: int | None
    block_sizes: list[int]
    all_positions: bool  # some row has an all-positions tau: the table shows the column
    newest: HistoryRow | None  # the last candidate in history order
    speedup: dict[str, float]  # speedup upper bound of the newest, {drafter cost c: tau / (1 + c)}; {}: none
    tau_plot: Plot | None  # None: no checkpoint has a training step
    acceptance_plot: Plot
    histogram_plot: Plot
    shown: list[HistoryRow]  # the newest `last` candidates and the baselines: the curves and the category table
    categories: list[CategoryTau]
    diagnostics: list[DiagnosticsSection]
    training: list[TrainingSide]  # each training run of the group's checkpoints with a log, beside it

    @property
    def title(self) -> str:
        return self.group.title

    def plots(self) -> list[Plot]:
        """Every plot of the section."""
        plots = [self.tau_plot, self.acceptance_plot, self.histogram_plot]
        plots += [p for d in self.diagnostics for p in (d.ablation, d.offset_probe)]
        return [p for p in plots if p is not None]


@dataclass(frozen=True)
class SideBySide:
    """Checkpoints evaluated at more than one setting (greedy, sampled, a block size: reporting.history groups),
    their tau macro at each: `columns` are the groups' settings, each row (checkpoint label, tau or None)."""

    columns: list[str]
    rows: list[tuple[str, list[float | None]]]


@dataclass(frozen=True)
class BlockSizeRow:
    """One checkpoint verified at one block size b."""

    checkpoint: str  # its label
    block_size: int
    tau_macro: float
    tau_macro_ci95: tuple[float, float] | None
    projected_speedup: float | None  # tau(b) / step cost(b), given --step-cost; None: no cost for b

    @property
    def tau_per_token(self) -> float:
        """Tokens emitted per token verified: what each verified position earns."""
        return self.tau_macro / self.block_size


@dataclass(frozen=True)
class BlockSweep:
    """Checkpoints scored at several block sizes on the same references (--block-sizes, --block-size)."""

    title: str  # the groups' sweep title
    rows: list[BlockSizeRow]  # by checkpoint (in history order), then block size
    costed: bool  # some row has a projected speedup: the table shows the column


@dataclass(frozen=True)
class Report:
    """What the report shows, rendered by templates/report.j2."""

    store: str  # its location: a folder, or s3://...
    written: datetime  # UTC
    groups: list[GroupSection]
    side_by_side: SideBySide | None  # None: no checkpoint was evaluated at two settings
    block_sweeps: list[BlockSweep]

    def plots(self) -> list[Plot]:
        """Every plot of the report."""
        return [p for g in self.groups for p in g.plots()]


def write_report(store: Store, out_dir: Path, last: int = 3, groups: list[Group] | None = None,
                 step_costs: dict[int, float] | None = None, training_logs: dict[str, str] | None = None,
                 training: dict[int, list[TrainingSide]] | None = None) -> Path:
    """Write `out_dir/report.html` (self-contained), `out_dir/report.md` and its plots `out_dir/img/*.png`;
    return the HTML path. `last`: how many of the newest checkpoints of each group the acceptance curves,
    histograms and category table show (with the baselines). groups: history(store), when the caller
    has it already. step_costs: {b: cost of a speculative step verifying b tokens / a plain decode step}
    (--step-cost), for the projected speedup per block size; they describe the serving box, not a
    checkpoint, so the store does not keep them. training_logs: {training run: its log folder} for runs whose
    folder is not on this machine (reporting.training_side finds local ones); training: {group index (0-based):
    its TrainingSides}, when the caller has read the logs already. Raises NothingToReport on a store without
    scores."""
    groups = history(store) if groups is None else groups
    if not groups:
        raise NothingToReport(f"no scored checkpoint in {store.location}: nothing to report")
    diagnostics = _diagnostics_by_checkpoint(store)
    report = Report(store=store.location, written=datetime.now(UTC),
                    groups=[_group_section(group, f"group{index}", max(1, last), diagnostics,
                                           training[index - 1] if training is not None
                                           else training_sides(group, training_logs))
                            for index, group in enumerate(groups, start=1)],
                    side_by_side=side_by_side(groups), block_sweeps=block_sweeps(groups, step_costs or {}))

    out_dir = Path(out_dir)
    files = {out_dir / plot.file: plot.png for plot in report.plots()}
    files[out_dir / "report.md"] = _render(report, "md").encode("utf-8")
    files[out_dir / "report.html"] = _render(report, "html").encode("utf-8")  # last: once it is there, so is the rest
    for path, data in files.items():
        write_bytes_atomic(path, data)
        os.chmod(path, 0o644)  # a report is for reading by others (the atomic write creates 0600 files)
    return out_dir / "report.html"


def side_by_side(groups: list[Group]) -> SideBySide | None:
    """Each checkpoint scored at more than one setting (groups of different `setting`: greedy or sampled, a
    chosen block size), with its tau macro in every such group (None where it was not scored), in the groups'
    order; None when there is no such checkpoint."""
    rows_of: dict[str, dict[int, HistoryRow]] = {}  # checkpoint -> {group index: its row there}
    for index, group in enumerate(groups):
        for row in group.rows:
            rows_of.setdefault(row.checkpoint, {})[index] = row
    shared = [found for found in rows_of.values() if len({groups[i].setting for i in found}) > 1]
    if not shared:
        return None
    columns = sorted({i for found in shared for i in found})
    rows = [(next(iter(found.values())).label, [found[i].tau_macro if i in found else None for i in columns])
            for found in shared]
    return SideBySide([f"{groups[i].setting} (group {i + 1})" for i in columns], rows)


def block_sweeps(groups: list[Group], step_costs: dict[int, float]) -> list[BlockSweep]:
    """For each target, references and sliding semantics scored at more than one block size: every checkpoint
    scored at two or more of them, with tau(b), tau(b)/b and, where step_costs has b, tau(b) / cost(b)."""
    sweeps = []
    for title in dict.fromkeys(g.sweep_title for g in groups):  # in the groups' order
        sized = [(g, read_json(row.scores_path)["block_size"], row) for g in groups if g.sweep_title == title
                 for row in g.rows]
        if len({b for _, b, _ in sized}) < 2:
            continue
        rows = []
        for checkpoint in dict.fromkeys(row.checkpoint for _, _, row in sized):
            mine = sorted(((b, row) for _, b, row in sized if row.checkpoint == checkpoint), key=lambda found: found[0])
            if len({b for b, _ in mine}) < 2:
                continue
            rows += [BlockSizeRow(row.label, b, row.tau_macro, row.tau_macro_ci95,
                                  row.tau_macro / step_costs[b] if b in step_costs else None) for b, row in mine]
        if rows:
            sweeps.append(BlockSweep(title, rows, costed=any(r.projected_speedup is not None for r in rows)))
    return sweeps


def _render(report: Report, form: str) -> str:
    """The report as "html" or "md" (templates/report.j2 with the blocks of that form)."""
    return _environment(form == "html").get_template("report.j2").render(report=report, blocks=f"blocks.{form}.j2")


@functools.cache
def _environment(autoescape: bool) -> Environment:
    # one per form: Jinja2 decides autoescaping per environment, and report.j2 is shared by both forms
    environment = Environment(loader=FileSystemLoader(TEMPLATES), autoescape=autoescape, undefined=StrictUndefined,
                              trim_blocks=True, lstrip_blocks=True)
    environment.filters.update(counted=_count, decimals=_decimals, percent=_percent, fence=_fence,
                               md_cell=_markdown_cell, name=_name, squash=_squash)
    return environment


def _diagnostics_by_checkpoint(store: Store) -> dict[tuple[str, str, str], dict]:
    """(features key, sliding semantics, checkpoint key) -> the diagnostics of that checkpoint in that group
    (the newest, if it was diagnosed more than once). Matched through the drafts entry, not the scores key:
    the row history keeps for a checkpoint may be another scores entry of the same drafts (all-positions mode)."""
    found: dict[tuple[str, str, str], tuple[float, dict]] = {}
    for key in store.keys(Stage.DIAGNOSTICS):
        path = store.entry(Stage.DIAGNOSTICS, key) / DIAGNOSTICS_FILE
        try:  # the diagnostics record first: reading it verifies diagnostics.json (a damaged one is left out)
            record = DiagnosticsRecord.from_record(store.read_record(Stage.DIAGNOSTICS, key, discard_damaged=False))
            drafts = DraftsRecord.from_record(store.read_record(Stage.DRAFTS, record.drafts, verify=False,
                                                                discard_damaged=False))
            written, report = path.stat().st_mtime, read_json(path)
        except (EntryMissing, KeyError, OSError, ValueError):  # removed meanwhile, damaged, or not in this format
            continue
        checkpoint = (drafts.features, drafts.sliding_semantics, drafts.checkpoint)
        if checkpoint not in found or written > found[checkpoint][0]:
            found[checkpoint] = (written, report)
    return {checkpoint: report for checkpoint, (_, report) in found.items()}


def tau_plot_path(group_number: int) -> str:
    """Where the report puts the tau-by-step plot of its group_number-th group (1-based, reporting.history order),
    relative to the report's folder."""
    return f"img/group{group_number}{TAU_PLOT}.png"


def _group_section(group: Group, anchor: str, last: int, diagnostics: dict[tuple[str, str, str], dict],
                   training: list[TrainingSide]) -> GroupSection:
    scores = {row.scores: read_json(row.scores_path) for row in group.rows}
    # newest = last in history order, the order the table, the curves and the artifacts use
    newest = group.candidates[-1] if group.candidates else None
    shown = group.candidates[-last:] + group.baselines
    colors = _colors(shown)
    stepped = any(r.step is not None for r in group.candidates)
    sections = []
    for row in group.rows:
        report = diagnostics.get((group.features, group.sliding_semantics, row.checkpoint))
        if report is not None:
            sections.append(_diagnostics_section(row, report, f"{anchor}-{_slug(row)}"))
    return GroupSection(
        group=group, anchor=anchor,
        n_prompts=scores[group.rows[0].scores].get("n_prompts"),  # the same references for every row
        block_sizes=sorted({s.get("block_size") for s in scores.values()} - {None}),
        all_positions=any(row.all_positions_tau is not None for row in group.rows),
        newest=newest,
        speedup=(scores[newest.scores].get("projected_speedup") or {}) if newest is not None else {},
        tau_plot=Plot(f"{anchor}{TAU_PLOT}", "tau macro by training step", _tau_plot(group)) if stepped else None,
        acceptance_plot=Plot(f"{anchor}-position-acceptance", "acceptance by draft position",
                             _acceptance_plot(shown, scores, colors)),
        histogram_plot=Plot(f"{anchor}-acceptance-lengths", "acceptance-length histogram",
                            _histogram_plot(shown, scores, colors)),
        shown=shown,
        categories=_categories(shown, scores),
        diagnostics=sections,
        training=training,
    )


def _categories(shown: list[HistoryRow], scores: dict[str, dict]) -> list[CategoryTau]:
    by_category = {row.scores: scores[row.scores].get("tau_by_category") or {} for row in shown}
    # every row of a group was scored on the same references: any one counts the prompts
    prompts = [p.get("category") for p in scores[shown[0].scores].get("per_prompt", [])]
    return [CategoryTau(category, prompts.count(category), [by_category[row.scores].get(category) for row in shown])
            for category in sorted({c for taus in by_category.values() for c in taus})]


def _diagnostics_section(row: HistoryRow, report: dict, prefix: str) -> DiagnosticsSection:
    tau = report.get("tau_macro", row.tau_macro)
    probe = report.get("layer_offset_probe") or []
    ablation = offset_probe = None
    if report.get("layer_ablation"):
        ablation = Plot(f"{prefix}-ablation", "layer ablation", _ablation_plot(report, tau))
    if any(p["tau_macro"] is not None for p in probe):
        offset_probe = Plot(f"{prefix}-offset-probe", "layer offset probe", _offset_plot(probe, tau))
    return DiagnosticsSection(
        row=row, tau=tau, layer_ids=report.get("layer_ids"), num_target_layers=report.get("num_target_layers"),
        ablation=ablation, offset_probe=offset_probe,
        unprobed_offsets=[p["offset"] for p in probe if p["tau_macro"] is None],
        sliding_tried="sliding_switch" in report, sliding_switch=report.get("sliding_switch"),
        examples=report.get("first_divergence") or [],
        noise_tau=report.get("noise_instead_of_features"),
        agreement={name: counts["rate"] for name, counts in (report.get("agreement") or {}).items()
                   if counts.get("rate") is not None},
        findings=report.get("findings") or [],
    )


# ------------------------------------------------------------------ template filters


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _decimals(x: float | None, digits: int) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def _percent(x: float) -> str:
    return f"{x:.0%}"


def _name(row: HistoryRow) -> str:
    """How a checkpoint is called in legends and table headers."""
    return f"{row.label} (baseline)" if row.baseline else row.label


def _squash(text: str) -> str:
    # a paragraph's template lines as one line; type(text) keeps autoescaped Markup as Markup
    return type(text)(" ").join(text.split())


def _markdown_cell(cell: str) -> str:
    return cell.replace("|", "\\|").replace("\n", " ")


def _fence(text: str) -> str:
    # a fence longer than any backtick run in the text, so the text cannot close it
    return "`" * max(3, 1 + max((len(run) for run in re.findall(r"`+", text)), default=0))


# ------------------------------------------------------------------ plots


def _slug(row: HistoryRow) -> str:
    # file names stay readable (the label) and unique (the scores key)
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", row.label).strip("-") + "-" + row.scores[:8]


def _colors(shown: list[HistoryRow]) -> dict[str, ColorType]:
    """scores key -> colour: candidates from light (older) to dark (newest), baselines their own colours."""
    candidates = [r for r in shown if not r.baseline]
    colors: dict[str, ColorType] = {}
    for i, row in enumerate(candidates):
        colors[row.scores] = colormaps["viridis"](0.8 - 0.7 * i / max(1, len(candidates) - 1))
    for i, row in enumerate(r for r in shown if r.baseline):
        colors[row.scores] = BASELINE_COLORS[i % len(BASELINE_COLORS)]
    return colors


def _legend_columns(labels: list[str], width_inches: float) -> int:
    """As many legend columns as fit across the figure: a legend wider than the figure is cut off."""
    characters = width_inches * 12  # about 12 characters of 10 pt text per inch
    return max(1, min(len(labels), int(characters // (max(map(len, labels)) + 6))))  # + the handle and the gap


def _png(fig: Figure) -> bytes:
    FigureCanvasAgg(fig)  # render with Agg, whatever backend pyplot may have been set to elsewhere
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()


def _tau_plot(group: Group) -> bytes:
    fig = Figure(figsize=(9, 4.5), dpi=DPI, layout="constrained")
    ax = fig.add_subplot()
    stepped = [r for r in group.candidates if r.step is not None]
    # checkpoints of different training runs (source folders) are separate lines, not one zigzag
    runs: dict[str, list[HistoryRow]] = {}
    for row in stepped:
        runs.setdefault(str(Path(row.source.rstrip("/")).parent), []).append(row)
    handles: list[Artist | ErrorbarContainer] = []  # in the legend's order
    for i, (run, rows) in enumerate(runs.items()):
        taus = [r.tau_macro for r in rows]
        errors = [[t - r.tau_macro_ci95[0] if r.tau_macro_ci95 else 0 for t, r in zip(taus, rows)],
                  [r.tau_macro_ci95[1] - t if r.tau_macro_ci95 else 0 for t, r in zip(taus, rows)]]
        label = "tau macro, 95% CI" if len(runs) == 1 else f"{Path(run).name}: tau macro, 95% CI"
        handles.append(ax.errorbar(_steps(rows), taus, yerr=errors, marker="o", capsize=4,
                                   color=RUN_COLORS[i % len(RUN_COLORS)], label=label))
    best = group.best
    if best is not None and best.step is not None:
        label = f"best: step {best.step} ({best.tau_macro:.2f})"
        handles.append(ax.scatter([best.step], [best.tau_macro], marker="*", s=320, color="gold",
                                  edgecolor="black", zorder=6, label=label))
    regressions = [r for r in stepped if r.regression]
    if regressions:
        handles.append(ax.scatter(_steps(regressions), [r.tau_macro for r in regressions], s=90,
                                  color="red", zorder=5, label="regression"))
    for i, row in enumerate(group.baselines):
        color = BASELINE_COLORS[i % len(BASELINE_COLORS)]
        handles.append(ax.axhline(row.tau_macro, color=color, linestyle="--",
                                  label=f"baseline {row.label} ({row.tau_macro:.2f})"))
        if row.tau_macro_ci95:
            ax.axhspan(*row.tau_macro_ci95, color=color, alpha=0.12)
    steps = sorted(set(_steps(stepped)))
    if len(steps) <= 12:
        ax.set_xticks(steps)
    ax.set_xlabel("training step")
    ax.set_ylabel("tau macro (tokens per target step)")
    ax.set_title("Acceptance length over training")
    ax.grid(alpha=0.3)
    # outside the axes: it never covers a point
    fig.legend(handles=handles, loc="outside lower center",
               ncols=min(2, _legend_columns([str(h.get_label()) for h in handles], 9)))
    return _png(fig)


def _steps(rows: list[HistoryRow]) -> list[int]:
    """The training steps of `rows`, which all have one: the filter drops nothing, it tells the type checker so."""
    return [r.step for r in rows if r.step is not None]


def _acceptance_plot(shown: list[HistoryRow], scores: dict[str, dict], colors: dict) -> bytes:
    fig = Figure(figsize=(12, 4.5), dpi=DPI, layout="constrained")
    conditional, cumulative = fig.subplots(1, 2, sharex=True)
    for row in shown:
        found = scores[row.scores]
        rates = [math.nan if p is None else p for p in found.get("position_acceptance", [])]
        # NaN (no step reached that position) propagates: the cumulative curve is unknown from there on
        together, product = [], 1.0
        for rate in rates:
            product *= rate
            together.append(product)
        positions = range(1, len(rates) + 1)
        style = dict(color=colors[row.scores], marker="o", linestyle="--" if row.baseline else "-")
        conditional.plot(positions, rates, label=_name(row), **style)
        cumulative.plot(positions, together, **style)
        # its 95% interval as a band (scores from before they were kept have none)
        intervals = [(math.nan, math.nan) if ci is None else ci for ci in found.get("position_acceptance_ci95", [])]
        if intervals:
            conditional.fill_between(positions, [lo for lo, _ in intervals], [hi for _, hi in intervals],
                                     color=colors[row.scores], alpha=0.15, linewidth=0)
    # how many blocks each rate of the newest checkpoint comes from: a rate from a handful is a guess
    reached = scores[shown[-1].scores].get("position_counts", {}).get("reached", []) if shown else []
    for k, n in enumerate(reached, start=1):
        conditional.annotate(f"{n}", (k, 0.02), ha="center", fontsize=7, color="0.35")
    if reached:
        conditional.text(0.01, 0.07, f"blocks reaching each position ({_name(shown[-1])}); bands: 95% CI",
                         transform=conditional.transAxes, fontsize=7, color="0.35")
    conditional.set(title="Conditional acceptance by draft position", xlabel="draft position k",
                    ylabel="P(k accepted | 1..k-1 accepted)", ylim=(0, 1.03))
    cumulative.set(title="Cumulative acceptance", xlabel="draft position k",
                   ylabel="P(positions 1..k all accepted)", ylim=(0, 1.03))
    for ax in (conditional, cumulative):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=16))  # every position up to block size 16
        ax.grid(alpha=0.3)
    fig.legend(loc="outside lower center", ncols=_legend_columns([_name(row) for row in shown], 12))
    return _png(fig)


def _histogram_plot(shown: list[HistoryRow], scores: dict[str, dict], colors: dict) -> bytes:
    fig = Figure(figsize=(10, 4.5), dpi=DPI, layout="constrained")
    ax = fig.add_subplot()
    width = 0.8 / len(shown)
    longest = 1
    for i, row in enumerate(shown):
        counts = {int(length): n for length, n in scores[row.scores].get("histogram", {}).items()}
        total = sum(counts.values()) or 1
        lengths = sorted(counts)
        longest = max([longest, *lengths])
        ax.bar([length - 0.4 + width * (i + 0.5) for length in lengths], [counts[n] / total for n in lengths],
               width, color=colors[row.scores], hatch="//" if row.baseline else None, edgecolor="white",
               linewidth=0.5, label=_name(row))
    ax.set_xticks(range(1, longest + 1))
    ax.set_xlabel("acceptance length (tokens emitted by one target step)")
    ax.set_ylabel("fraction of target steps")
    ax.set_title("Acceptance-length distribution")
    ax.grid(axis="y", alpha=0.3)
    fig.legend(loc="outside lower center", ncols=_legend_columns([_name(row) for row in shown], 10))
    return _png(fig)


def _ablation_plot(report: dict, tau: float) -> bytes:
    ablation = report["layer_ablation"]
    labels = ["none"] + [f"layer {a['layer_id']}" for a in ablation] + ["all layers"]
    values = [tau] + [a["tau_macro"] for a in ablation] + [report.get("all_layers_ablated", math.nan)]
    colors = ["tab:blue"] + ["tab:purple"] * len(ablation) + ["tab:red"]
    fig = Figure(figsize=(max(6, 1.1 * len(labels) + 2), 4.5), dpi=DPI, layout="constrained")
    ax = fig.add_subplot()
    known = [v is not None and not math.isnan(v) for v in values]
    bars = ax.bar(labels, [v if k else 0 for v, k in zip(values, known)], color=colors)
    ax.bar_label(bars, [f"{v:.2f}" if k else "n/a" for v, k in zip(values, known)], padding=2)
    ax.axhline(1, color="black", linestyle=":", label="tau = 1 (no draft accepted)")
    # headroom above the tallest bar keeps the legend clear of the bars and their labels
    ax.set_ylim(0, max([v for v, k in zip(values, known) if k] + [1]) * 1.3)
    ax.set_xlabel("target layer whose features are zeroed")
    ax.set_ylabel("tau macro")
    ax.set_title("Layer ablation")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(loc="upper right")
    return _png(fig)


def _offset_plot(probe: list[dict], tau: float) -> bytes:
    probed = [p for p in probe if p["tau_macro"] is not None]
    # tick labels list the layers read: give each tick room for five of them
    fig = Figure(figsize=(max(7, 1.6 * len(probed) + 1), 4.5), dpi=DPI, layout="constrained")
    ax = fig.add_subplot()
    ax.margins(x=0.1)
    ax.plot([p["offset"] for p in probed], [p["tau_macro"] for p in probed], marker="o", color="tab:blue")
    ax.scatter([0], [tau], s=160, color="tab:green", edgecolor="black", zorder=5,
               label=f"offset 0: the drafter's layers ({tau:.2f})")
    ax.set_xticks([p["offset"] for p in probed],
                  [f"{p['offset']:+d}\n{p.get('layer_ids', '')}" for p in probed])
    ax.set_xlabel("layer offset (and the target layers read)")
    ax.set_ylabel("tau macro")
    ax.set_ylim(0, max(p["tau_macro"] for p in probed) * 1.3)  # headroom for the legend
    ax.set_title("Layer offset probe")
    ax.grid(alpha=0.3)
    ax.legend(loc="upper center")
    return _png(fig)
