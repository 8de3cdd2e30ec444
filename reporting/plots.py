"""The report's plots (reporting.report): matplotlib figures rendered with Agg to PNG bytes, one function per plot,
each given what the report's sections already hold (history rows, scores.json contents, diagnostics)."""

import io
import math
from pathlib import Path

from matplotlib import colormaps
from matplotlib.artist import Artist
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.container import ErrorbarContainer
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import MaxNLocator
from matplotlib.typing import ColorType, LineStyleType

from dflash_core.sections import Section, registered
from dflash_eval.reporting.history import Group, HistoryRow

DPI = 110
BASELINE_COLORS = ("tab:orange", "tab:gray", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")
RUN_COLORS = ("tab:blue", "tab:green", "tab:purple")  # training runs in the tau-by-step plot


def name_of(row: HistoryRow) -> str:
    """How a checkpoint is called in legends and table headers."""
    return f"{row.label} (baseline)" if row.baseline else row.label



def row_colors(shown: list[HistoryRow]) -> dict[str, ColorType]:
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


def tau_plot(group: Group) -> bytes:
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
        color = RUN_COLORS[i % len(RUN_COLORS)]
        handles.append(ax.errorbar(_steps(rows), taus, yerr=errors, marker="o", capsize=4, color=color, label=label))
        # a section's value beside tau (a DFlash2 drafter's unary head alone), dashed in the run's colour
        for name, said in (cls.BESIDE_TAU for cls in registered() if cls.BESIDE_TAU):
            beside = [(r.step, r.values[name]) for r in rows if r.step is not None and r.values.get(name) is not None]
            if beside:
                label = said if len(runs) == 1 else f"{Path(run).name}: {said}"
                (line,) = ax.plot(*zip(*beside), linestyle="--", marker="o", markerfacecolor="white", color=color,
                                  alpha=0.7, label=label)
                handles.append(line)
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


def acceptance_plot(shown: list[HistoryRow], scores: dict[str, dict], colors: dict) -> bytes:
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
        conditional.plot(positions, rates, label=name_of(row), **style)
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
        conditional.text(0.01, 0.07, f"blocks reaching each position ({name_of(shown[-1])}); bands: 95% CI",
                         transform=conditional.transAxes, fontsize=7, color="0.35")
    conditional.set(title="Conditional acceptance by draft position", xlabel="draft position k",
                    ylabel="P(k accepted | 1..k-1 accepted)", ylim=(0, 1.03))
    cumulative.set(title="Cumulative acceptance", xlabel="draft position k",
                   ylabel="P(positions 1..k all accepted)", ylim=(0, 1.03))
    for ax in (conditional, cumulative):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=16))  # every position up to block size 16
        ax.grid(alpha=0.3)
    fig.legend(loc="outside lower center", ncols=_legend_columns([name_of(row) for row in shown], 12))
    return _png(fig)


# how a by-position plot draws its series, in order (Section.POSITION_LINES)
POSITION_STYLES: tuple[tuple[LineStyleType, str], ...] = (("-", "o"), ("--", "s"), (":", "^"), ("-.", "D"))


def by_position_plot(cls: type[Section], shown: list[tuple[HistoryRow, Section]], colors: dict) -> bytes:
    """A section's series by draft position (Section.by_position) for the shown checkpoints: a colour per
    checkpoint, a line style per series."""
    fig = Figure(figsize=(10, 4.5), dpi=DPI, layout="constrained")
    ax = fig.add_subplot()
    labels = cls.POSITION_LINES or {name: name for name in shown[0][1].by_position()}
    lines = list(zip(labels.items(), POSITION_STYLES * (1 + len(labels) // len(POSITION_STYLES))))
    for row, found in shown:
        series = found.by_position()
        for (name, _), (linestyle, marker) in lines:
            values = [math.nan if x is None else x for x in series[name]]  # None: no step reached k
            ax.plot(range(1, len(values) + 1), values, color=colors[row.scores], linestyle=linestyle, marker=marker)
    # the legend: a colour per checkpoint, a line style per series
    handles = [Line2D([], [], color=colors[row.scores], label=name_of(row)) for row, _ in shown]
    handles += [Line2D([], [], color="0.3", linestyle=linestyle, marker=marker, label=label)
                for (_, label), (linestyle, marker) in lines]
    ax.set(title=f"{cls.TITLE} by draft position", xlabel="draft position k", ylabel=cls.POSITION_AXIS,
           ylim=(0, 1.03))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=16))
    ax.grid(alpha=0.3)
    fig.legend(handles=handles, loc="outside lower center",
               ncols=_legend_columns([str(h.get_label()) for h in handles], 10))
    return _png(fig)


def curve_of(found: Section) -> list[tuple[float, float, float]] | None:
    """A section's curve, when it draws one (a `curve()` method and CURVE_AXES: a DSpark drafter's confidence head,
    its reliability curve): per point (x, y, weight); None when it draws none or has no point."""
    curve, axes = getattr(found, "curve", None), getattr(found, "CURVE_AXES", None)
    if not callable(curve) or not axes:
        return None
    points = curve()
    return list(points) if points else None


def curve_plot(cls: type[Section], shown: list[tuple[HistoryRow, Section]], colors: dict) -> bytes:
    """A section's curve (curve_of) for the shown checkpoints on the unit square, each point sized by its weight, with
    the diagonal y = x: a calibrated prediction lies on it (a point below: predicted more often than it happened)."""
    axes: tuple[str, str] = getattr(cls, "CURVE_AXES", ("", ""))
    fig = Figure(figsize=(6.5, 6), dpi=DPI, layout="constrained")
    ax = fig.add_subplot()
    handles: list[Artist] = [ax.plot([0, 1], [0, 1], color="0.5", linestyle=":", label="y = x (calibrated)")[0]]
    for row, found in shown:
        points = curve_of(found) or []
        xs, ys, weights = zip(*points) if points else ((), (), ())
        largest = max(weights, default=1) or 1
        (line,) = ax.plot(xs, ys, color=colors[row.scores], linestyle="--" if row.baseline else "-", marker=None,
                          label=name_of(row))
        ax.scatter(xs, ys, s=[12 + 80 * w / largest for w in weights], color=colors[row.scores], zorder=3)
        handles.append(line)
    ax.set(title=f"{cls.TITLE}: reliability", xlabel=axes[0], ylabel=axes[1], xlim=(0, 1), ylim=(0, 1.03))
    ax.set_aspect("equal", adjustable="box")
    ax.grid(alpha=0.3)
    ax.text(0.01, 0.97, "marker area: positions in the bin", transform=ax.transAxes, fontsize=7, color="0.35",
            va="top")
    fig.legend(handles=handles, loc="outside lower center",
               ncols=_legend_columns([str(h.get_label()) for h in handles], 6.5))
    return _png(fig)


def histogram_plot(shown: list[HistoryRow], scores: dict[str, dict], colors: dict) -> bytes:
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
               linewidth=0.5, label=name_of(row))
    ax.set_xticks(range(1, longest + 1))
    ax.set_xlabel("acceptance length (tokens emitted by one target step)")
    ax.set_ylabel("fraction of target steps")
    ax.set_title("Acceptance-length distribution")
    ax.grid(axis="y", alpha=0.3)
    fig.legend(loc="outside lower center", ncols=_legend_columns([name_of(row) for row in shown], 10))
    return _png(fig)


def ablation_plot(report: dict, tau: float) -> bytes:
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


def offset_plot(probe: list[dict], tau: float) -> bytes:
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
