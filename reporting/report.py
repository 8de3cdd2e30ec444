"""`dflash-eval report`: one self-contained HTML page (and the same as Markdown + PNG files) of a store's scores.

For each group of comparable scores (same target, references and sliding-layer semantics; see
reporting.history) the report shows:

- every scored checkpoint, in history order (by training step; checkpoints without one by when they were
  first scored, never by path: reporting.history): tau macro with its 95% interval, tau pooled, its tau minus the
  previous step's and minus the best other checkpoint's with the paired 95% interval of the difference
  (reporting.history.comparisons), the best step, regressions and baselines, and the speedup upper bound of the
  newest checkpoint (the last in that order);
- tau macro over training steps, with the intervals, the best step, regressions and each baseline as a
  dashed line with its interval as a band;
- for the newest `last` checkpoints and the baselines: the conditional acceptance of each draft position
  k (where inside the block the drafter loses its way) beside the cumulative curve P(positions 1..k all
  accepted), the acceptance-length histogram, and tau per prompt category;
- what the checkpoints' scores.json's sections add (dflash_core.sections; a DFlash2 drafter's candidate selector:
  the tau of its unary head alone beside tau in the table and over training steps, dashed, and for the shown
  checkpoints, per draft position, how often the selector's draft was accepted, the head's argmax would have been,
  and the reference's token was among the K candidates): their values in the table (Section.HISTORY), a line beside
  tau over training steps (BESIDE_TAU), and a table of their own for the shown checkpoints (REPORT_COLUMNS), with a
  plot by draft position (by_position);
- for a series on published benchmarks (its references record's `benchmarks`): the protocol in its heading and,
  for its newest checkpoint, tau per benchmark in z-lab's layout with the published tau beside it and the notes
  (reporting.benchmarks, the same table the command line and the Prefect summary show);
- beside each training run with a log: what the trainer logged at each evaluated step (its own number in a
  column named by its tag) and what its numbers imply, the alarm's flags, or the line saying what its checks
  found where none was raised (reporting.training_side);
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
import json
import os
import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

from jinja2 import Environment, FileSystemLoader, StrictUndefined
from markupsafe import Markup

from dflash_core.checkpoint_files import model_name
from dflash_core.published.numbers import Setting, beside_published
from dflash_core.sampling import Served
from dflash_core.sections import Column, Context, Section, Table, markdown_strong, registered, sections_of
from dflash_eval.reporting.benchmarks import Benchmarks, reasoning_of
from dflash_eval.reporting.history import (
    BEST,
    PREVIOUS_STEP,
    Comparison,
    Group,
    HistoryRow,
    comparisons,
    history,
    references_of,
    shown_beside_tau,
)
from dflash_eval.reporting.plots import (
    ablation_plot,
    acceptance_plot,
    by_position_plot,
    curve_of,
    curve_plot,
    histogram_plot,
    name_of,
    offset_plot,
    row_colors,
    tau_plot,
)
from dflash_eval.reporting.training_side import TrainingSide, logged_column, training_sides
from dflash_eval.storage import EntryMissing, Store, read_json
from dflash_eval.storage.records import write_bytes_atomic
from dflash_eval.storage.schema import (
    DIAGNOSTICS_FILE,
    DiagnosticsRecord,
    DraftsRecord,
    ReferencesRecord,
    Stage,
)

TEMPLATES = Path(__file__).parent / "templates"  # installed with the package (pyproject.toml package-data)
# Baselines keep one colour across all plots; red is left for regressions.
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
class BenchmarkTable:
    """tau per published benchmark of one checkpoint in z-lab's layout (reporting.benchmarks), with its notes."""

    row: HistoryRow  # the checkpoint
    tables: list[Table]


@dataclass(frozen=True)
class ShownSection:
    """A section's table in the report: a row per shown checkpoint whose scores hold it, and its plot by draft
    position (dflash_core.sections: REPORT_COLUMNS, report_row, by_position)."""

    title: str
    text: str  # the paragraph above the table
    columns: list[str]
    rows: list[list[str]]  # the checkpoint's name, then report_row
    plot: Plot | None  # None: the section plots nothing by draft position
    curve: Plot | None = None  # its curve against y = x (a section's curve(), CURVE_AXES); None: it draws none


@dataclass(frozen=True)
class GroupSection:
    """One group of comparable scores (reporting.history.Group), with what its section shows."""

    group: Group
    anchor: str  # "group<N>": the section's id, and the prefix of its plots' names
    n_prompts: int | None
    block_sizes: list[int]
    all_positions: bool  # some row has an all-positions tau: the table shows the column
    beside: list[Column]  # the sections' values some row holds (a DFlash2 drafter's unary head tau and lift)
    beside_texts: list[str]  # what those columns are, a paragraph per section
    newest: HistoryRow | None  # the last candidate in history order
    speedup: dict[str, float]  # speedup upper bound of the newest, {drafter cost c: tau / (1 + c)}; {}: none
    tau_plot: Plot | None  # None: no checkpoint has a training step
    acceptance_plot: Plot
    histogram_plot: Plot
    shown: list[HistoryRow]  # the newest `last` candidates and the baselines: the curves and the category table
    categories: list[CategoryTau]
    sections: list[ShownSection]  # the sections of the shown rows' scores that have a table in the report
    diagnostics: list[DiagnosticsSection]
    training: list[TrainingSide]  # each training run of the group's checkpoints with a log, beside it
    # each row's (scores key) tau minus the previous step's and the best other checkpoint's, with the paired 95%
    # interval, as table cells ("-": none): reporting.history.comparisons
    paired: dict[str, tuple[str, str]] = field(default_factory=dict)
    protocol: str | None = None  # published benchmarks: their protocol; None: other prompts
    benchmarks: BenchmarkTable | None = None  # published benchmarks: the newest checkpoint's tau on each

    @property
    def title(self) -> str:
        return self.group.title

    def beside_cells(self, row: HistoryRow) -> list[str]:
        """The row's cells of the sections' values (`beside`)."""
        return [column.cell(row.values.get(column.name)) for column in self.beside]

    def plots(self) -> list[Plot]:
        """Every plot of the section."""
        plots = [self.tau_plot, self.acceptance_plot, self.histogram_plot,
                 *(p for s in self.sections for p in (s.plot, s.curve))]
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
                    groups=[_group_section(store, group, f"group{index}", max(1, last), diagnostics,
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
                               md_cell=_markdown_cell, md_strong=markdown_strong, name=name_of, squash=_squash,
                               prose=_prose if autoescape else str)
    environment.globals.update(logged_column=logged_column)  # the training table's column of the trainer's number
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


def _group_section(store: Store, group: Group, anchor: str, last: int, diagnostics: dict[tuple[str, str, str], dict],
                   training: list[TrainingSide]) -> GroupSection:
    scores = {row.scores: read_json(row.scores_path) for row in group.rows}
    # newest = last in history order, the order the table, the curves and the artifacts use
    newest = group.candidates[-1] if group.candidates else None
    references = _published_references(store, group)
    latest = newest or group.rows[-1]
    shown = group.candidates[-last:] + group.baselines
    colors = row_colors(shown)
    stepped = any(r.step is not None for r in group.candidates)
    context = Context(sampled=group.draft_sampling is not None)
    beside = shown_beside_tau(group.rows)
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
        beside=[column for _, column in beside],
        beside_texts=[text for cls in dict.fromkeys(cls for cls, _ in beside) if (text := cls.history_text(context))],
        newest=newest,
        speedup=(scores[newest.scores].get("projected_speedup") or {}) if newest is not None else {},
        tau_plot=Plot(f"{anchor}{TAU_PLOT}", "tau macro by training step", tau_plot(group)) if stepped else None,
        acceptance_plot=Plot(f"{anchor}-position-acceptance", "acceptance by draft position",
                             acceptance_plot(shown, scores, colors)),
        histogram_plot=Plot(f"{anchor}-acceptance-lengths", "acceptance-length histogram",
                            histogram_plot(shown, scores, colors)),
        shown=shown,
        categories=_categories(shown, scores),
        sections=_shown_sections(shown, scores, colors, anchor, context),
        diagnostics=sections,
        training=training,
        paired={row.scores: _paired_cells(group, row) for row in group.rows},
        protocol=references.benchmarks["protocol"] if references and references.benchmarks else None,
        benchmarks=_benchmark_table(references, group, latest, scores[latest.scores]) if references else None,
    )


def _paired_cells(group: Group, row: HistoryRow) -> tuple[str, str]:
    """The table's cells of row's tau minus the previous step's and minus the best other checkpoint's, each with
    the 95% interval of the per-reference difference (reporting.history.comparisons); "-" where there is none."""
    found = {c.against: c for c in comparisons(group, row)}

    def cell(c: Comparison | None) -> str:
        if c is None:
            return "-"
        ci = c.difference_ci95
        return f"{c.difference:+.3f}" + (f" ({ci[0]:+.2f} to {ci[1]:+.2f})" if ci else "") + f" vs {c.other.label}"

    return cell(found.get(PREVIOUS_STEP)), cell(found.get(BEST))


def _published_references(store: Store, group: Group) -> ReferencesRecord | None:
    """The references record of a group on published benchmarks (its `benchmarks`: the protocol, template arguments
    and each benchmark's use); None for other prompts, or when the records are gone."""
    references = references_of(store, group.features)
    return references if references is not None and references.benchmarks else None


def _shown_sections(shown: list[HistoryRow], scores: dict[str, dict], colors: dict, anchor: str,
                    context: Context) -> list[ShownSection]:
    """Each section with a table in the report (REPORT_COLUMNS) that some shown row's scores hold: a row per such
    checkpoint, its plot by draft position (`<anchor>-<key>.png`) when it has series by position, and its curve
    against the diagonal (`<anchor>-<key>-curve.png`) when it draws one (plots.curve_of: a DSpark drafter's confidence
    head, its reliability curve)."""
    held: dict[type[Section], list[tuple[HistoryRow, Section]]] = {}
    for row in shown:
        for found in sections_of(scores[row.scores]):
            if found.REPORT_COLUMNS:
                held.setdefault(type(found), []).append((row, found))
    tables = []
    for cls in (cls for cls in registered() if cls in held):  # in the order the renderers show sections
        rows = held[cls]
        positioned = [(row, found) for row, found in rows if found.by_position()]
        subject = f"{cls.TITLE[:1].lower()}{cls.TITLE[1:]}"
        plot = Plot(f"{anchor}-{cls.KEY}", f"{subject} by draft position",
                    by_position_plot(cls, positioned, colors)) if positioned else None
        curved = [(row, found) for row, found in rows if curve_of(found)]
        x_axis, y_axis = getattr(cls, "CURVE_AXES", ("", ""))
        curve = Plot(f"{anchor}-{cls.KEY}-curve", f"{subject}: {y_axis} against {x_axis}",
                     curve_plot(cls, curved, colors)) if curved else None
        text = (cls.report_text(context) + (" The plot shows the same by draft position." if plot else "")
                + (" The curve shows, per bin of the prediction over every position, the share that happened against "
                   "the mean prediction: a calibrated prediction lies on the diagonal." if curve else ""))
        tables.append(ShownSection(cls.TITLE, text, ["checkpoint", *cls.REPORT_COLUMNS],
                                   [[name_of(row), *found.report_row()] for row, found in rows], plot, curve))
    return tables


def _benchmark_table(references: ReferencesRecord, group: Group, row: HistoryRow, scores: dict) -> BenchmarkTable | None:
    """The row's tau per benchmark beside the published taus (numbers.beside_published, as the run's results build
    it), in the setting the store knows: the group's target name, served setting and block size, the row's drafter,
    the references' protocol, new tokens and template arguments; None when its scores have no `by_benchmark`."""
    if "by_benchmark" not in scores or references.benchmarks is None:
        return None
    prompt_set = references.benchmarks
    served = Served.from_record(references.sampling, references.backend.get("kind") == "given",
                                group.chosen_block_size,
                                None if group.draft_sampling is None else json.loads(group.draft_sampling),
                                group.confidence_threshold)
    sampling = served.sampling
    setting = Setting(references.target_name or model_name(references.target or "target"), model_name(row.source),
                      sampling.temperature, sampling.top_p, sampling.top_k, scores["block_size"],
                      prompt_set["protocol"], references.max_new_tokens,
                      reasoning_of(prompt_set.get("template_kwargs") or {}), served.draft_sample_method)
    block = beside_published(scores["by_benchmark"], prompt_set, setting)
    return BenchmarkTable(row, Benchmarks(block).tables(Context(sampled=group.draft_sampling is not None)))


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
        ablation = Plot(f"{prefix}-ablation", "layer ablation", ablation_plot(report, tau))
    if any(p["tau_macro"] is not None for p in probe):
        offset_probe = Plot(f"{prefix}-offset-probe", "layer offset probe", offset_plot(probe, tau))
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


def _prose(text: str) -> Markup:
    """A section's paragraph in the HTML report: &, < and > escaped, quotes as they are (as the template's own text)."""
    return Markup(text.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;"))


def _squash(text: str) -> str:
    # a paragraph's template lines as one line; type(text) keeps autoescaped Markup as Markup
    return type(text)(" ").join(text.split())


def _markdown_cell(cell: str) -> str:
    return cell.replace("|", "\\|").replace("\n", " ")


def _fence(text: str) -> str:
    # a fence longer than any backtick run in the text, so the text cannot close it
    return "`" * max(3, 1 + max((len(run) for run in re.findall(r"`+", text)), default=0))


def _slug(row: HistoryRow) -> str:
    # file names stay readable (the label) and unique (the scores key)
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", row.label).strip("-") + "-" + row.scores[:8]
