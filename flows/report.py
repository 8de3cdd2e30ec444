"""`dflash-eval report`: one self-contained HTML page (and the same as Markdown + PNG files) of a store's scores.

For each group of comparable scores (same target, references and sliding-layer semantics; see
flows.history) the report shows:

- every scored checkpoint, in history order (by training step; checkpoints without one by when they were
  first scored, never by path: flows.history): tau macro with its 95% interval, tau pooled, the best step,
  regressions and baselines, and the projected speedup of the newest checkpoint (the last in that order);
- tau macro over training steps, with the intervals, the best step, regressions and each baseline as a
  dashed line with its interval as a band;
- for the newest `last` checkpoints and the baselines: the conditional acceptance of each draft position
  k (where inside the block the drafter loses its way) beside the cumulative curve P(positions 1..k all
  accepted), the acceptance-length histogram, and tau per prompt category;
- for each checkpoint with a `diagnostics` store entry: tau with each target layer's features zeroed
  (which layers the drafter relies on), tau with the target layers shifted by an offset (whether the
  drafter reads the layers it was trained on), tau with the other sliding-layer semantics, and the first
  rejected draft of some prompts as text.

`report.html` embeds its plots as base64 PNGs and its CSS inline: it loads nothing, so it can be mailed
or attached as it is. `report.md` shows the same content with the plots in `img/`.
"""

import base64
import html
import io
import math
import os
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from matplotlib import colormaps
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from dflash_eval.flows.history import Group, history
from dflash_eval.storage import EntryMissing, Store, read_json
from dflash_eval.storage.records import write_bytes_atomic

DIAGNOSTICS = "diagnostics"  # store stage: one entry per diagnosed checkpoint, holding diagnostics.json
DPI = 110
# Baselines keep one colour across all plots; red is left for regressions.
BASELINE_COLORS = ("tab:orange", "tab:gray", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")
RUN_COLORS = ("tab:blue", "tab:green", "tab:purple")  # training runs in the tau-by-step plot


class NothingToReport(LookupError):
    """The store holds no scored checkpoint."""


# The report is built once as a list of blocks, then written both as HTML and as Markdown, so the two
# never say different things.

@dataclass
class Heading:
    level: int
    text: str
    anchor: str | None = None


@dataclass
class Text:
    text: str


@dataclass
class Table:
    header: list[str]
    rows: list[list[str]]
    row_classes: list[str] = field(default_factory=list)  # CSS class of each row (HTML only): best, regression, ...


@dataclass
class Plot:
    name: str  # file name in img/, without .png
    alt: str
    png: bytes


@dataclass
class Contents:
    """Links to the groups' sections."""
    links: list[tuple[str, str]]  # (title, anchor)


@dataclass
class Examples:
    """First rejected drafts: rows of diagnostics.json's `first_divergence`."""
    rows: list[dict]


def write_report(store: Store, out_dir: Path, last: int = 3, groups: list[Group] | None = None) -> Path:
    """Write `out_dir/report.html` (self-contained), `out_dir/report.md` and its plots `out_dir/img/*.png`;
    return the HTML path. `last`: how many of the newest checkpoints of each group the acceptance curves,
    histograms and category table show (with the baselines). groups: history(store), when the caller
    has it already. Raises NothingToReport on a store without scores."""
    groups = history(store) if groups is None else groups
    if not groups:
        raise NothingToReport(f"no scored checkpoint in {store.root}: nothing to report")
    diagnostics = _diagnostics_by_checkpoint(store)
    blocks = [Text(f"Store {store.root.resolve()}, written {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC. "
                   "tau is the number of tokens one target step emits (accepted drafts + the target's own token): "
                   "tau macro averages each prompt's mean, tau pooled divides all tokens by all steps. "
                   "Intervals are 95% bootstrap intervals over prompts.")]
    if len(groups) > 1:
        blocks.append(Contents([(g.title, f"group{i}") for i, g in enumerate(groups, start=1)]))
    for index, group in enumerate(groups, start=1):
        blocks += _group_blocks(group, f"group{index}", max(1, last), diagnostics)

    out_dir = Path(out_dir)
    files = {out_dir / "img" / f"{b.name}.png": b.png for b in blocks if isinstance(b, Plot)}
    files[out_dir / "report.md"] = _markdown(blocks).encode("utf-8")
    files[out_dir / "report.html"] = _html(blocks).encode("utf-8")  # last: once it is there, so is the rest
    for path, data in files.items():
        write_bytes_atomic(path, data)
        os.chmod(path, 0o644)  # a report is for reading by others (the atomic write creates 0600 files)
    return out_dir / "report.html"


def _diagnostics_by_checkpoint(store: Store) -> dict[tuple[str, str, str], dict]:
    """(features key, sliding semantics, checkpoint key) -> the diagnostics of that checkpoint in that group
    (the newest, if it was diagnosed more than once). Matched through the drafts entry, not the scores key:
    the row history keeps for a checkpoint may be another scores entry of the same drafts (all-positions mode)."""
    found: dict[tuple[str, str, str], tuple[float, dict]] = {}
    for key in store.keys(DIAGNOSTICS):
        path = store.entry(DIAGNOSTICS, key) / "diagnostics.json"
        try:  # the diagnostics record first: reading it verifies diagnostics.json (a damaged one is warned about)
            drafts = store.read_record("drafts", store.read_record(DIAGNOSTICS, key)["drafts"], verify=False)
            written, report = path.stat().st_mtime, read_json(path)
        except (EntryMissing, KeyError, OSError, ValueError):  # removed meanwhile, damaged, or not in this format
            continue
        checkpoint = (drafts["features"], drafts["sliding_semantics"], drafts["checkpoint"])
        if checkpoint not in found or written > found[checkpoint][0]:
            found[checkpoint] = (written, report)
    return {checkpoint: report for checkpoint, (_, report) in found.items()}


TAU_PLOT = "-tau-by-step"  # a group's tau-by-step plot: img/group<N>-tau-by-step.png


def tau_plot_path(group_number: int) -> str:
    """Where the report puts the tau-by-step plot of its group_number-th group (1-based, flows.history order),
    relative to the report's folder."""
    return f"img/group{group_number}{TAU_PLOT}.png"


def _group_blocks(group: Group, prefix: str, last: int, diagnostics: dict[tuple[str, str, str], dict]) -> list:
    scores = {row["scores"]: read_json(row["scores_path"]) for row in group.rows}
    n_prompts = scores[group.rows[0]["scores"]].get("n_prompts")  # the same references for every row
    block_sizes = ", ".join(str(b) for b in sorted({s.get("block_size") for s in scores.values()} - {None}))
    blocks = [Heading(2, group.title, anchor=prefix),
              Text(f"{_count(len(group.candidates), 'checkpoint')}, {_count(len(group.baselines), 'baseline')}; "
                   f"{n_prompts} prompts; block size {block_sizes}.")]
    blocks.append(_tau_table(group))

    stepped = [r for r in group.candidates if r["step"] is not None]
    # newest = last in history order, the order the table, the curves and the artifacts use
    newest = group.candidates[-1] if group.candidates else None
    if newest is not None and scores[newest["scores"]].get("projected_speedup"):
        speedups = ", ".join(f"{x:.2f}x at c = {c}" for c, x in scores[newest["scores"]]["projected_speedup"].items())
        blocks.append(Text(f"Projected speedup of the newest checkpoint, {newest['label']} (tau "
                           f"{newest['tau_macro']:.2f}), for a drafter forward costing c target forwards "
                           f"(tau / (1 + c)): {speedups}. A 5-layer drafter over a large target costs about "
                           "c = 0.05-0.1."))

    if stepped:
        blocks.append(Text("Error bars and shaded bands are 95% intervals. A regression (red) is a checkpoint "
                           "whose whole interval lies below the best earlier step's. Checkpoints without a training "
                           "step are listed by when they were first scored and never flagged: their place among "
                           "the steps is unknown."))
        blocks.append(Plot(f"{prefix}{TAU_PLOT}", "tau macro by training step", _tau_plot(group)))
    else:
        blocks.append(Text("No checkpoint has a training step: no tau-by-step plot."))

    shown = group.candidates[-last:] + group.baselines
    colors = _colors(shown)
    blocks.append(Heading(3, "Acceptance inside the block"))
    blocks.append(Text("Newest checkpoints and baselines. Left: the probability that draft position k is accepted "
                       "when every earlier position was; right: the probability that positions 1..k are all "
                       "accepted (the product of the left curve up to k). Below: how many tokens each target step "
                       "emitted, as a fraction of all steps."))
    blocks.append(Plot(f"{prefix}-position-acceptance", "acceptance by draft position",
                       _acceptance_plot(shown, scores, colors)))
    blocks.append(Plot(f"{prefix}-acceptance-lengths", "acceptance-length histogram",
                       _histogram_plot(shown, scores, colors)))
    category_table = _category_table(shown, scores)
    if category_table is not None:
        blocks += [Heading(3, "tau macro by prompt category"), category_table]

    for row in group.rows:
        report = diagnostics.get((group.features, group.sliding_semantics, row["checkpoint"]))
        if report is not None:
            blocks += _diagnostics_blocks(row, report, f"{prefix}-{_slug(row)}")
    return blocks


def _tau_table(group: Group) -> Table:
    all_positions = any(row.get("all_positions_tau") is not None for row in group.rows)
    header = ["step", "checkpoint", "tau macro", "95% CI", "tau pooled"]
    header += ["tau, all positions"] if all_positions else []
    rows, classes = [], []
    for row in group.rows:
        ci = row["tau_macro_ci95"]
        mark = "best" if row["best"] else "REGRESSION" if row["regression"] else "baseline" if row["baseline"] else ""
        step = "baseline" if row["baseline"] else "-" if row["step"] is None else str(row["step"])
        cells = [step, row["label"], f"{row['tau_macro']:.3f}", f"{ci[0]:.2f} - {ci[1]:.2f}" if ci else "-",
                 f"{row['tau_pooled']:.3f}"]
        if all_positions:
            cells.append("-" if row.get("all_positions_tau") is None else f"{row['all_positions_tau']:.3f}")
        rows.append(cells + [mark])
        classes.append(mark.lower())
    return Table(header + [""], rows, classes)


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _name(row: dict) -> str:
    """How a checkpoint is called in legends and table headers."""
    return f"{row['label']} (baseline)" if row["baseline"] else row["label"]


def _slug(row: dict) -> str:
    # file names stay readable (the label) and unique (the scores key)
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", row["label"]).strip("-") + "-" + row["scores"][:8]


def _colors(shown: list[dict]) -> dict[str, object]:
    """scores key -> colour: candidates from light (older) to dark (newest), baselines their own colours."""
    candidates = [r for r in shown if not r["baseline"]]
    colors = {}
    for i, row in enumerate(candidates):
        colors[row["scores"]] = colormaps["viridis"](0.8 - 0.7 * i / max(1, len(candidates) - 1))
    for i, row in enumerate(r for r in shown if r["baseline"]):
        colors[row["scores"]] = BASELINE_COLORS[i % len(BASELINE_COLORS)]
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
    stepped = [r for r in group.candidates if r["step"] is not None]
    # checkpoints of different training runs (source folders) are separate lines, not one zigzag
    runs: dict[str, list[dict]] = {}
    for row in stepped:
        runs.setdefault(str(Path(row["source"].rstrip("/")).parent), []).append(row)
    handles = []  # in the legend's order
    for i, (run, rows) in enumerate(runs.items()):
        taus = [r["tau_macro"] for r in rows]
        errors = [[t - r["tau_macro_ci95"][0] if r["tau_macro_ci95"] else 0 for t, r in zip(taus, rows)],
                  [r["tau_macro_ci95"][1] - t if r["tau_macro_ci95"] else 0 for t, r in zip(taus, rows)]]
        label = "tau macro, 95% CI" if len(runs) == 1 else f"{Path(run).name}: tau macro, 95% CI"
        handles.append(ax.errorbar([r["step"] for r in rows], taus, yerr=errors, marker="o", capsize=4,
                                   color=RUN_COLORS[i % len(RUN_COLORS)], label=label))
    best = group.best
    if best is not None and best["step"] is not None:
        label = f"best: step {best['step']} ({best['tau_macro']:.2f})"
        handles.append(ax.scatter([best["step"]], [best["tau_macro"]], marker="*", s=320, color="gold",
                                  edgecolor="black", zorder=6, label=label))
    regressions = [r for r in stepped if r["regression"]]
    if regressions:
        handles.append(ax.scatter([r["step"] for r in regressions], [r["tau_macro"] for r in regressions], s=90,
                                  color="red", zorder=5, label="regression"))
    for i, row in enumerate(group.baselines):
        color = BASELINE_COLORS[i % len(BASELINE_COLORS)]
        handles.append(ax.axhline(row["tau_macro"], color=color, linestyle="--",
                                  label=f"baseline {row['label']} ({row['tau_macro']:.2f})"))
        if row["tau_macro_ci95"]:
            ax.axhspan(*row["tau_macro_ci95"], color=color, alpha=0.12)
    steps = sorted({r["step"] for r in stepped})
    if len(steps) <= 12:
        ax.set_xticks(steps)
    ax.set_xlabel("training step")
    ax.set_ylabel("tau macro (tokens per target step)")
    ax.set_title("Acceptance length over training")
    ax.grid(alpha=0.3)
    # outside the axes: it never covers a point
    fig.legend(handles=handles, loc="outside lower center",
               ncols=min(2, _legend_columns([h.get_label() for h in handles], 9)))
    return _png(fig)


def _acceptance_plot(shown: list[dict], scores: dict[str, dict], colors: dict) -> bytes:
    fig = Figure(figsize=(12, 4.5), dpi=DPI, layout="constrained")
    conditional, cumulative = fig.subplots(1, 2, sharex=True)
    for row in shown:
        rates = [math.nan if p is None else p for p in scores[row["scores"]].get("position_acceptance", [])]
        # NaN (no step reached that position) propagates: the cumulative curve is unknown from there on
        together, product = [], 1.0
        for rate in rates:
            product *= rate
            together.append(product)
        positions = range(1, len(rates) + 1)
        style = dict(color=colors[row["scores"]], marker="o", linestyle="--" if row["baseline"] else "-")
        conditional.plot(positions, rates, label=_name(row), **style)
        cumulative.plot(positions, together, **style)
    conditional.set(title="Conditional acceptance by draft position", xlabel="draft position k",
                    ylabel="P(k accepted | 1..k-1 accepted)", ylim=(0, 1.03))
    cumulative.set(title="Cumulative acceptance", xlabel="draft position k",
                   ylabel="P(positions 1..k all accepted)", ylim=(0, 1.03))
    for ax in (conditional, cumulative):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, nbins=16))  # every position up to block size 16
        ax.grid(alpha=0.3)
    fig.legend(loc="outside lower center", ncols=_legend_columns([_name(row) for row in shown], 12))
    return _png(fig)


def _histogram_plot(shown: list[dict], scores: dict[str, dict], colors: dict) -> bytes:
    fig = Figure(figsize=(10, 4.5), dpi=DPI, layout="constrained")
    ax = fig.add_subplot()
    width = 0.8 / len(shown)
    longest = 1
    for i, row in enumerate(shown):
        counts = {int(length): n for length, n in scores[row["scores"]].get("histogram", {}).items()}
        total = sum(counts.values()) or 1
        lengths = sorted(counts)
        longest = max([longest, *lengths])
        ax.bar([length - 0.4 + width * (i + 0.5) for length in lengths], [counts[n] / total for n in lengths],
               width, color=colors[row["scores"]], hatch="//" if row["baseline"] else None, edgecolor="white",
               linewidth=0.5, label=_name(row))
    ax.set_xticks(range(1, longest + 1))
    ax.set_xlabel("acceptance length (tokens emitted by one target step)")
    ax.set_ylabel("fraction of target steps")
    ax.set_title("Acceptance-length distribution")
    ax.grid(axis="y", alpha=0.3)
    fig.legend(loc="outside lower center", ncols=_legend_columns([_name(row) for row in shown], 10))
    return _png(fig)


def _category_table(shown: list[dict], scores: dict[str, dict]) -> Table | None:
    by_category = {row["scores"]: scores[row["scores"]].get("tau_by_category") or {} for row in shown}
    categories = sorted({c for taus in by_category.values() for c in taus})
    if not categories:
        return None
    # every row of a group was scored on the same references: any one counts the prompts
    prompts = [p.get("category") for p in scores[shown[0]["scores"]].get("per_prompt", [])]
    rows = []
    for category in categories:
        taus = [by_category[row["scores"]].get(category) for row in shown]
        rows.append([category, str(prompts.count(category))] + [f"{t:.2f}" if t is not None else "-" for t in taus])
    return Table(["category", "prompts"] + [_name(row) for row in shown], rows)


def _diagnostics_blocks(row: dict, report: dict, prefix: str) -> list:
    tau = report.get("tau_macro", row["tau_macro"])
    blocks = [Heading(3, f"Diagnostics: {_name(row)}"),
              Text(f"Unmodified tau macro {tau:.2f}, reading target layers {report.get('layer_ids')} "
                   f"of the target's {report.get('num_target_layers')}.")]
    if report.get("layer_ablation"):
        blocks.append(Text("Layer ablation: tau with one layer's features zeroed. A layer whose ablation costs "
                           "little is one the drafter hardly uses; 'all layers' near 1 means the drafter "
                           "draws everything from the target's features."))
        blocks.append(Plot(f"{prefix}-ablation", "layer ablation", _ablation_plot(report, tau)))
    probe = report.get("layer_offset_probe") or []
    if any(p["tau_macro"] is not None for p in probe):
        blocks.append(Text("Layer offset probe: tau with every target layer id shifted by an offset. A peak "
                           "away from offset 0 means the drafter reads other layers than those it was "
                           "trained on (an off-by-one in layer numbering)."))
        blocks.append(Plot(f"{prefix}-offset-probe", "layer offset probe", _offset_plot(probe, tau)))
        outside = [f"{p['offset']:+d}" for p in probe if p["tau_macro"] is None]
        if outside:
            blocks.append(Text(f"Offsets {', '.join(outside)} would read layers outside the target: not probed."))
    if "sliding_switch" in report:
        switch = report["sliding_switch"]
        if switch is None:
            blocks.append(Text("The drafter has no sliding-window layers: no sliding-semantics switch to try."))
        else:
            blocks.append(Text(f"Sliding layers switched from {switch['from']} to {switch['to']}: tau macro "
                               f"{switch['tau_macro']:.2f} ({switch['tau_macro'] - tau:+.2f} against {tau:.2f} "
                               "unmodified)."))
    if report.get("first_divergence"):
        blocks.append(Text("First rejected draft of some prompts: the text before the block, the block the "
                           "drafter proposed, and what the target generated there."))
        blocks.append(Examples(report["first_divergence"]))
    return blocks


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


# ------------------------------------------------------------------ HTML

CSS = """
body { font-family: system-ui, -apple-system, "Segoe UI", Roboto, sans-serif; margin: 2em auto; max-width: 1300px;
       padding: 0 1em; color: #222; line-height: 1.4; }
h1 { border-bottom: 2px solid #444; }
h2 { margin-top: 2.5em; border-bottom: 1px solid #aaa; }
table { border-collapse: collapse; margin: 1em 0; }
th, td { border: 1px solid #ccc; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
th { background: #f0f0f0; }
td { font-variant-numeric: tabular-nums; }
tr.best td { background: #fff6cc; font-weight: bold; }
tr.regression td { background: #fde0e0; color: #a00; }
tr.baseline td { color: #555; font-style: italic; }
img { max-width: 100%; display: block; margin: 1em 0; }
/* break-spaces (where supported) also gives trailing spaces their width, so the shaded box shows them */
.text { font-family: ui-monospace, Menlo, Consolas, monospace; white-space: pre-wrap; white-space: break-spaces;
        background: #f4f4f4;
        padding: 0.1em 0.3em; max-width: 28em; }
"""


def _html(blocks: list) -> str:
    parts = ["<!DOCTYPE html>", '<html lang="en"><head><meta charset="utf-8">',
             "<title>DFlash drafter report</title>", f"<style>{CSS}</style>", "</head><body>",
             "<h1>DFlash drafter report</h1>"]
    for block in blocks:
        if isinstance(block, Heading):
            anchor = f' id="{html.escape(block.anchor)}"' if block.anchor else ""
            parts.append(f"<h{block.level}{anchor}>{html.escape(block.text)}</h{block.level}>")
        elif isinstance(block, Text):
            parts.append(f"<p>{html.escape(block.text)}</p>")
        elif isinstance(block, Contents):
            items = "".join(f'<li><a href="#{anchor}">{html.escape(title)}</a></li>' for title, anchor in block.links)
            parts.append(f"<ul>{items}</ul>")
        elif isinstance(block, Table):
            parts.append(_html_table(block))
        elif isinstance(block, Plot):
            data = base64.b64encode(block.png).decode("ascii")
            parts.append(f'<img src="data:image/png;base64,{data}" alt="{html.escape(block.alt)}">')
        elif isinstance(block, Examples):
            parts.append(_html_examples(block))
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def _html_table(table: Table) -> str:
    lines = ["<table>", "<tr>" + "".join(f"<th>{html.escape(h)}</th>" for h in table.header) + "</tr>"]
    for i, row in enumerate(table.rows):
        css = table.row_classes[i] if i < len(table.row_classes) and table.row_classes[i] else None
        cells = "".join(f"<td>{html.escape(cell)}</td>" for cell in row)
        lines.append(f'<tr class="{css}">{cells}</tr>' if css else f"<tr>{cells}</tr>")
    lines.append("</table>")
    return "\n".join(lines)


def _html_examples(examples: Examples) -> str:
    header = ["prompt", "category", "step", "position", "accepted", "context", "drafted", "reference"]
    lines = ["<table>", "<tr>" + "".join(f"<th>{h}</th>" for h in header) + "</tr>"]
    for example in examples.rows:
        plain = [example.get(h) for h in ("id", "category", "step", "position", "accepted")]
        texts = [example.get(h, "") for h in ("context", "drafted", "reference")]
        lines.append("<tr>" + "".join(f"<td>{html.escape(str(v if v is not None else '-'))}</td>" for v in plain)
                     + "".join(f'<td><div class="text">{html.escape(str(t))}</div></td>' for t in texts) + "</tr>")
    lines.append("</table>")
    return "\n".join(lines)


# ------------------------------------------------------------------ Markdown

def _markdown(blocks: list) -> str:
    parts = ["# DFlash drafter report"]
    for block in blocks:
        if isinstance(block, Heading):
            anchor = f'<a id="{block.anchor}"></a>\n' if block.anchor else ""
            parts.append(f"{anchor}{'#' * block.level} {block.text}")
        elif isinstance(block, Text):
            parts.append(block.text)
        elif isinstance(block, Contents):
            parts.append("\n".join(f"- [{title}](#{anchor})" for title, anchor in block.links))
        elif isinstance(block, Table):
            lines = ["| " + " | ".join(_markdown_cell(h) for h in block.header) + " |",
                     "|" + "---|" * len(block.header)]
            lines += ["| " + " | ".join(_markdown_cell(c) for c in row) + " |" for row in block.rows]
            parts.append("\n".join(lines))
        elif isinstance(block, Plot):
            parts.append(f"![{block.alt}](img/{block.name}.png)")
        elif isinstance(block, Examples):
            parts += [_markdown_example(example) for example in block.rows]
    return "\n\n".join(parts) + "\n"


def _markdown_cell(cell: str) -> str:
    return cell.replace("|", "\\|").replace("\n", " ")


def _markdown_example(example: dict) -> str:
    parts = [f"**{example.get('id')}** ({example.get('category')}): step {example.get('step')}, position "
             f"{example.get('position')}, {_count(example.get('accepted', 0), 'draft')} accepted"]
    for part in ("context", "drafted", "reference"):
        text = str(example.get(part, ""))
        # a fence longer than any backtick run in the text, so the text cannot close it
        fence = "`" * max(3, 1 + max((len(run) for run in re.findall(r"`+", text)), default=0))
        parts.append(f"{part}:\n{fence}text\n{text}\n{fence}")
    return "\n\n".join(parts)
