"""`dflash-eval report`: the HTML / Markdown report of a store's scores.

The slow tests score every saved step of the tiny trained run through the real flow (and one baseline),
then read the report back as a user's browser would: tables, embedded PNGs, no outside reference. A
fast test fabricates store entries for the cases the tiny run does not produce (steps missing,
regressions, positions nobody reached, two runs and two baselines).
"""

import base64
import io
import itertools
import json
import re
import shutil
from datetime import UTC, datetime, timedelta
from html.parser import HTMLParser

import pytest
from PIL import Image
from typer.testing import CliRunner

from dflash_eval.cli import app
from dflash_eval.reporting.report import NothingToReport, write_report
from dflash_eval.storage import Store, key_of, write_json_atomic
from dflash_eval.storage.schema import (
    BaselineRecord,
    DiagnosticsRecord,
    DraftsRecord,
    FeaturesRecord,
    FetchRecord,
    ReferencesRecord,
    ScoresRecord,
    Stage,
)
from tests.tiny_models import first_prompts

N_PROMPTS = 10
MAX_NEW = 64
PAIRED = ["minus the previous step (paired 95% CI)", "minus the best other (paired 95% CI)"]  # the tau table's


class Page(HTMLParser):
    """What a report page holds: headings, tables (rows of cell texts), images, every src/href."""

    def __init__(self, text: str):
        super().__init__()
        self.headings: list[tuple[str, str]] = []  # (tag, text)
        self.tables: list[list[list[str]]] = []
        self.images: list[dict] = []
        self.references: list[str] = []  # every src and href
        self.tags: set[str] = set()
        self._heading = None
        self._cell = None
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        self.tags.add(tag)
        self.references += [attrs[a] for a in ("src", "href") if a in attrs]
        if tag == "img":
            self.images.append(attrs)
        elif tag in ("h1", "h2", "h3"):
            self._heading = (tag, "")
        elif tag == "table":
            self.tables.append([])
        elif tag == "tr":
            self.tables[-1].append([])
        elif tag in ("td", "th"):
            self._cell = ""

    def handle_endtag(self, tag):
        if tag in ("h1", "h2", "h3") and self._heading:
            self.headings.append(self._heading)
            self._heading = None
        elif tag in ("td", "th"):
            self.tables[-1][-1].append(self._cell)
            self._cell = None

    def handle_data(self, data):
        if self._heading:
            self._heading = (self._heading[0], self._heading[1] + data)
        if self._cell is not None:
            self._cell += data

    def table_after(self, heading_text: str) -> list[list[str]]:
        """The first table whose header row starts like the given one."""
        return next(t for t in self.tables if t and t[0][0] == heading_text)


def png_of(src: str) -> Image.Image:
    assert src.startswith("data:image/png;base64,"), src[:60]
    data = base64.b64decode(src.removeprefix("data:image/png;base64,"), validate=True)
    image = Image.open(io.BytesIO(data))
    image.load()
    assert image.format == "PNG"
    return image


def assert_readable_plot(image: Image.Image) -> None:
    assert image.width >= 300 and image.height >= 200, image.size
    colors = image.convert("RGB").getcolors(maxcolors=1 << 24)
    assert len(colors) > 16, "a blank or nearly blank plot"


def assert_self_contained(text: str, page: Page) -> None:
    for reference in page.references:
        assert reference.startswith(("data:image/png;base64,", "#")), reference[:80]
    assert not {"script", "link", "iframe", "object", "embed"} & page.tags
    assert "://" not in text and "url(" not in text and "@import" not in text


# ------------------------------------------------------------------ the real flow on the tiny run


@pytest.fixture(scope="module")
def scored_store(tiny_qwen3_run, prefect_api_url, tmp_path_factory):
    """A store holding the scores of every saved step of the tiny run and of one baseline drafter
    (a copy of step 200 under another name), on its first N_PROMPTS prompts."""
    from tests.evaluations import run_evaluation

    root = tmp_path_factory.mktemp("report")
    prompts = first_prompts(tiny_qwen3_run, N_PROMPTS, root / "prompts.jsonl")
    store = Store(root / "store")
    baseline = root / "z-lab" / "tiny-dflash-b8"
    shutil.copytree(tiny_qwen3_run.drafter_steps[1], baseline)
    config = json.loads((baseline / "config.json").read_text())
    (baseline / "config.json").write_text(json.dumps({**config, "note": "baseline"}))  # its own checkpoint key
    for drafter in [*tiny_qwen3_run.drafter_steps, baseline]:
        results = run_evaluation(target=str(tiny_qwen3_run.target_dir), drafter=str(drafter), prompts=str(prompts),
                                      max_new_tokens=MAX_NEW, store=str(store.root))
    store.begin(Stage.BASELINES, results["keys"]["fetch"])
    store.commit(Stage.BASELINES, results["keys"]["fetch"],
                 BaselineRecord(source=str(baseline), step=results["drafter"]["step"]).to_record())
    return store


@pytest.fixture(scope="module")
def report(scored_store, tmp_path_factory):
    out = tmp_path_factory.mktemp("report-out")
    html_path = write_report(scored_store, out)
    text = html_path.read_text()
    return out, text, Page(text)


@pytest.mark.slow
def test_tau_table_lists_the_steps_in_order_and_tau_rises_with_training(report, tiny_qwen3_run):
    out, _, page = report
    table = page.table_after("step")
    header, rows = table[0], table[1:]
    assert header == ["step", "checkpoint", "tau macro", "95% CI", "tau pooled", *PAIRED, ""]  # DFlash: no selector
    steps = [int(p.name.removeprefix("step_")) for p in tiny_qwen3_run.drafter_steps]
    assert [r[0] for r in rows] == [str(s) for s in steps] + ["baseline"]
    taus = [float(r[2]) for r in rows[:-1]]
    assert taus == sorted(taus) and taus[-1] - taus[0] > 0.5, taus
    assert rows[len(steps) - 1][-1] == "best" and rows[-1][-1] == "baseline"
    assert "REGRESSION" not in [r[-1] for r in rows]
    low, high = (float(x) for x in rows[-2][3].split(" - "))
    assert low < taus[-1] < high
    # the acceptance curves, histograms and categories show the newest 3 steps and the baseline
    categories = page.table_after("category")
    assert categories[0][2:] == [f"drafter/step_{s}" for s in steps[-3:]] + ["z-lab/tiny-dflash-b8 (baseline)"]
    assert [c[0] for c in categories[1:]] == ["code"]
    assert not any("Diagnostics" in text or "selector" in text for _, text in page.headings)


@pytest.mark.slow
def test_every_plot_is_an_embedded_png_and_nothing_is_loaded_from_outside(report):
    out, text, page = report
    assert len(page.images) == 3  # tau by step, acceptance by position, acceptance lengths
    for image in page.images:
        assert image.get("alt")
        assert_readable_plot(png_of(image["src"]))
    assert_self_contained(text, page)


@pytest.mark.slow
def test_the_markdown_shows_the_same_plots_from_files(report):
    out, _, page = report
    markdown = (out / "report.md").read_text()
    links = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", markdown)
    assert len(links) == len(page.images)
    for link in links:
        assert link.startswith("img/") and link.endswith(".png")
        assert_readable_plot(Image.open(out / link))
    # the same bytes as the page's
    assert sorted(base64.b64encode((out / link).read_bytes()).decode() for link in links) == \
        sorted(image["src"].removeprefix("data:image/png;base64,") for image in page.images)
    assert "| step | checkpoint | tau macro |" in markdown


@pytest.mark.slow
def test_a_dflash2_drafter_shows_its_unary_head_and_selector(dflash2_evaluated, tmp_path):
    """The table's unary head tau and lift, the candidate selector's table and its plot, with scores.json's values."""
    from tests.evaluations import stored_scores

    evaluated = dflash2_evaluated
    selectors = [stored_scores(evaluated.store, results)["selector"] for results in evaluated.results]
    html = write_report(Store(evaluated.store), tmp_path)
    page = Page(html.read_text())
    table = page.table_after("step")
    assert table[0] == ["step", "checkpoint", "tau macro", "95% CI", "tau pooled", "unary head tau", "selector lift",
                        *PAIRED, ""]
    assert [row[5:7] for row in table[1:]] == [[f"{s['unary_tau_macro']:.3f}", f"{s['lift']:+.3f}"]
                                              for s in selectors]
    assert ("h3", "Candidate selector") in page.headings
    shown = next(t for t in page.tables if t[0][:2] == ["checkpoint", "unary head tau"])
    expected = []
    for results, s in zip(evaluated.results, selectors):
        low, high = s["unary_tau_macro_ci95"]
        lift_low, lift_high = s["lift_ci95"]
        overall = s["overall"]
        expected.append([f"drafter/{results['drafter']['source'].rsplit('/', 1)[1]}", f"{s['unary_tau_macro']:.3f}",
                         f"{low:.2f} - {high:.2f}", f"{s['lift']:+.3f}", f"{lift_low:+.2f} to {lift_high:+.2f}",
                         str(sum(s["position_counts"]["reached"])), f"{overall['selector_accuracy']:.1%}",
                         f"{overall['argmax_accuracy']:.1%}", f"{overall['candidate_recall']:.1%}"])
    assert shown[1:] == expected
    (plot,) = [image for image in page.images if image["alt"] == "candidate selector by draft position"]
    assert_readable_plot(png_of(plot["src"]))
    markdown = (tmp_path / "report.md").read_text()
    assert "| unary head tau | selector lift |" in markdown and "](img/group1-selector.png)" in markdown


@pytest.mark.slow
def test_a_dflash2_drafter_s_run_artifacts_show_its_selector(dflash2_evaluated):
    """The summary, the scores table and the history table its flow run published, with scores.json's values."""
    from tests.evaluations import stored_scores
    from tests.test_served_settings import client_artifacts

    evaluated = dflash2_evaluated
    selectors = [stored_scores(evaluated.store, results)["selector"] for results in evaluated.results]
    selector = selectors[-1]
    artifacts = {a.key.rsplit("-", 1)[1]: a.data for a in client_artifacts(evaluated.flow_runs[-1]) if a.key}
    low, high = selector["unary_tau_macro_ci95"]
    lift_low, lift_high = selector["lift_ci95"]
    overall = selector["overall"]
    summary = artifacts["summary"]
    assert (f"Unary head alone (its argmax): tau macro {selector['unary_tau_macro']:.3f} (95% CI {low:.2f}-"
            f"{high:.2f}), pooled {selector['unary_tau_pooled']:.3f}; selector lift {selector['lift']:+.3f} (paired "
            f"95% CI {lift_low:+.2f} to {lift_high:+.2f}).") in summary
    assert (f"Of {sum(selector['position_counts']['reached'])} draft positions compared: selector's draft accepted "
            f"{overall['selector_accuracy']:.1%}, head's argmax would have been {overall['argmax_accuracy']:.1%}, "
            f"reference among the K candidates {overall['candidate_recall']:.1%}.") in summary
    for k, reached in enumerate(selector["position_counts"]["reached"], start=1):
        assert (f"| {k} | {reached} | {selector['selector_accuracy'][k - 1]:.1%} | "
                f"{selector['argmax_accuracy'][k - 1]:.1%} | {selector['candidate_recall'][k - 1]:.1%} |") in summary
    scores = {row["metric"]: row["value"] for row in json.loads(artifacts["scores"])}
    assert scores["unary head alone: tau macro"] == f"{selector['unary_tau_macro']:.3f}"
    assert scores["selector lift paired 95% CI"] == f"{lift_low:+.3f} to {lift_high:+.3f}"
    assert scores["position 1: selector's draft accepted / head's argmax would have been / reference among the K "
                  "candidates"] == (f"{selector['selector_accuracy'][0]:.1%} / {selector['argmax_accuracy'][0]:.1%} / "
                                    f"{selector['candidate_recall'][0]:.1%} "
                                    f"({selector['position_counts']['reached'][0]} reached)")
    history = json.loads(artifacts["history"])
    assert [(row["unary head tau"], row["selector lift"]) for row in history] == \
        [(f"{s['unary_tau_macro']:.3f}", f"{s['lift']:+.3f}") for s in selectors]


def diagnostics_of(tau: float) -> dict:
    """A diagnostics.json as tasks/diagnostics.py writes it, with text that HTML must not run."""
    return {
        "tau_macro": tau, "layer_ids": [1, 2], "num_target_layers": 4,
        "layer_ablation": [{"layer_id": 1, "tau_macro": 2.2}, {"layer_id": 2, "tau_macro": 1.7}],
        "all_layers_ablated": 1.03,
        "layer_offset_probe": [
            {"offset": -2, "layer_ids": [-1, 0], "tau_macro": None},
            {"offset": -1, "layer_ids": [0, 1], "tau_macro": 2.5},
            {"offset": 0, "layer_ids": [1, 2], "tau_macro": tau},
            {"offset": 1, "layer_ids": [2, 3], "tau_macro": 2.8},
            {"offset": 2, "layer_ids": [3, 4], "tau_macro": None},
        ],
        "sliding_switch": None,
        "first_divergence": [
            {"id": "tiny-003", "category": "code", "decode_step": 4, "position": 40, "acceptance_length": 3,
             "context": "def f(x):\n    return <script>alert('x')</script>", "drafted": " x + 1\n  ",
             "reference": " x & 2"},
            {"id": "tiny-007", "category": "code", "decode_step": 0, "position": 32, "acceptance_length": 1,
             "context": "import os", "drafted": "\nimport re", "reference": "\n\nfrom ```pathlib``` import Path"},
        ],
    }


@pytest.mark.slow
def test_diagnostics_of_a_checkpoint_get_their_plots_and_escaped_examples(scored_store, tmp_path):
    from dflash_eval.reporting.history import history

    store = Store(tmp_path / "store")
    shutil.copytree(scored_store.root, store.root)
    (group,) = history(store)
    row = group.candidates[-1]
    key = key_of({"diagnostics test": row.drafts})
    write_json_atomic(store.begin(Stage.DIAGNOSTICS, key) / "diagnostics.json", diagnostics_of(row.tau_macro))
    store.commit(Stage.DIAGNOSTICS, key, DiagnosticsRecord(drafts=row.drafts, scores=row.scores).to_record())

    text = write_report(store, tmp_path / "out").read_text()
    page = Page(text)
    assert ("h3", f"Diagnostics: {row.label}") in page.headings
    assert len(page.images) == 5  # the three of the group, the ablation and the offset probe
    for image in page.images:
        assert_readable_plot(png_of(image["src"]))
    assert any(image["alt"] == "layer ablation" for image in page.images)
    assert any(image["alt"] == "layer offset probe" for image in page.images)
    examples = page.table_after("prompt")
    assert examples[0] == ["prompt", "category", "decode step", "position", "acceptance length", "context", "drafted", "reference"]
    assert examples[1][5:] == ["def f(x):\n    return <script>alert('x')</script>", " x + 1\n  ", " x & 2"]
    assert "<script>" not in text and "&lt;script&gt;alert(" in text and " x &amp; 2" in text  # escaped
    assert "white-space: pre-wrap" in text
    assert "no sliding-window layers" in text and "Offsets -2, +2" in text
    assert_self_contained(text, page)

    markdown = (tmp_path / "out" / "report.md").read_text()
    assert "````text\n\n\nfrom ```pathlib``` import Path\n````" in markdown  # a fence the text cannot close
    for link in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", markdown):
        assert (tmp_path / "out" / link).is_file()


@pytest.mark.slow
def test_diagnostics_from_the_diagnostics_stage_are_shown(scored_store, tiny_qwen3_run, tmp_path):
    from tests.evaluations import run_evaluation

    store = Store(tmp_path / "store")
    shutil.copytree(scored_store.root, store.root)
    prompts = scored_store.root.parent / "prompts.jsonl"
    run_evaluation(target=str(tiny_qwen3_run.target_dir), drafter=str(tiny_qwen3_run.drafter_steps[-1]),
                        prompts=str(prompts), max_new_tokens=MAX_NEW, store=str(store.root), until="diagnostics")
    text = write_report(store, tmp_path / "out").read_text()
    page = Page(text)
    step = tiny_qwen3_run.drafter_steps[-1].name
    assert ("h3", f"Diagnostics: drafter/{step}") in page.headings
    assert [image["alt"] for image in page.images][-2:] == ["layer ablation", "layer offset probe"]
    for image in page.images:
        assert_readable_plot(png_of(image["src"]))
    examples = page.table_after("prompt")
    assert len(examples) > 1 and all(row[6] for row in examples[1:])  # each shows the drafted text


@pytest.mark.slow
def test_command_line_writes_the_report(scored_store, tmp_path):
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["report", "--store", str(scored_store.root), "--out", str(out), "--last", "2"])
    assert result.exit_code == 0, result.output
    assert (out / "report.html").is_file() and (out / "report.md").is_file()
    assert str(out / "report.html") in result.output and str(out / "report.md") in result.output
    assert len(Page((out / "report.html").read_text()).table_after("category")[0]) == 2 + 2 + 1


def test_command_line_on_an_empty_store_says_so(tmp_path):
    (tmp_path / "empty").mkdir()
    result = CliRunner().invoke(app, ["report", "--store", str(tmp_path / "empty"), "--out", str(tmp_path / "out")])
    assert result.exit_code == 1
    assert "no scored checkpoint" in result.output
    assert not (tmp_path / "out").exists()
    with pytest.raises(NothingToReport):
        write_report(Store(tmp_path / "empty"), tmp_path / "out")


# ------------------------------------------------------------------ fabricated entries: the other cases


_clock = itertools.count()  # fabricated checkpoints are scored one minute apart, in the order they are made


def fabricate(store: Store, source: str, step: int | None, tau: float, ci: tuple[float, float] | None,
              baseline: bool = False, block_size: int = 8, semantics: str = "causal", **scores) -> str:
    """Store entries as the flow writes them (fetch, references, features, drafts, scores), for a checkpoint
    that scored `tau`, a minute after the one fabricated before it; scores.json fields other than tau default
    to something plausible. Returns the scores key."""
    checkpoint, references, features = key_of({"c": source}), key_of({"r": 1}), key_of({"f": 1})
    drafts, scores_key = key_of({"d": source, "sem": semantics}), key_of({"s": source, "sem": semantics})
    records = {
        (Stage.FETCH, checkpoint): FetchRecord(files={}, source=source, step=step),
        (Stage.REFERENCES, references): ReferencesRecord(
            n_prompts=3, n=3, prompts="/suites/mixed.jsonl", backend={"kind": "transformers"}, max_new_tokens=256,
            stop_token_ids=(2,), lookahead=0, unverified=0, target="/models/Target-8B"),
        (Stage.FEATURES, features): FeaturesRecord(layer_ids=(1, 2), n=3, references=references, dtype="float32"),
        (Stage.DRAFTS, drafts): DraftsRecord(checkpoint=checkpoint, features=features, block_size=block_size,
                                             sliding_semantics=semantics, layer_ids=(1, 2)),
        (Stage.SCORES, scores_key): ScoresRecord(tau_macro=tau, tau_pooled=tau - 0.1, drafts=drafts),
    }
    if baseline:
        records[(Stage.BASELINES, checkpoint)] = BaselineRecord(source=source, step=step)
    lengths = {str(k): max(1, 60 - 8 * k + int(4 * tau)) for k in range(1, block_size + 1)}
    write_json_atomic(store.begin("scores", scores_key) / "scores.json", {
        "tau_macro": tau, "tau_macro_ci95": ci, "tau_pooled": tau - 0.1, "block_size": block_size,
        "histogram": lengths, "position_acceptance": [min(1, 0.4 + tau / 10)] * (block_size - 1),
        "tau_by_category": {"math": tau + 0.3, "chat": tau - 0.4}, "n_prompts": 3, "n_steps": sum(lengths.values()),
        "projected_speedup": {"0.05": tau / 1.05, "0.1": tau / 1.1, "0.2": tau / 1.2},
        "per_prompt": [{"id": "a", "category": "math"}, {"id": "b", "category": "math"},
                       {"id": "c", "category": "chat"}],
        **scores,
    })
    for (stage, key), record in records.items():
        store.begin(stage, key)
        store.commit(stage, key, record.to_record())
    marker = store.entry("scores", scores_key) / "entry.json"
    scored_at = datetime(2025, 1, 1, tzinfo=UTC) + timedelta(minutes=next(_clock))
    write_json_atomic(marker, {**json.loads(marker.read_text()), "committed_at": scored_at.isoformat()})
    return scores_key


def test_missing_steps_regressions_and_baselines(tmp_path):
    store = Store(tmp_path / "store")
    for step, tau in [(1000, 3.1), (2000, 3.6), (3000, 4.2), (4000, 3.0), (5000, 4.4)]:
        fabricate(store, f"/runs/a/step_{step}", step, tau, (tau - 0.2, tau + 0.2), all_positions_tau=tau + 0.5)
    fabricate(store, "/runs/b/step_2500", 2500, 3.9, (3.7, 4.1))  # another training run, same target and prompts
    fabricate(store, "/runs/a/final", None, 4.3, None)  # no training step: in the table, not on the x axis
    fabricate(store, "/hub/z-lab/Target-8B-DFlash-b16", None, 4.0, (3.8, 4.2), baseline=True, block_size=16,
              position_acceptance=[0.8, 0.7, None] + [0.5] * 12)  # positions nobody reached
    fabricate(store, "/hub/other/drafter", None, 3.5, (3.3, 3.7), baseline=True)

    out = tmp_path / "out"
    text = write_report(store, out, last=2).read_text()
    page = Page(text)
    (title,) = [t for tag, t in page.headings if tag == "h2"]
    assert title == "Target-8B on mixed.jsonl, 256 new tokens (causal sliding layers)"
    table = page.table_after("step")
    assert table[0] == ["step", "checkpoint", "tau macro", "95% CI", "tau pooled", "tau, all positions", *PAIRED, ""]
    assert [r[0] for r in table[1:]] == ["1000", "2000", "2500", "3000", "4000", "5000", "-", "baseline", "baseline"]
    assert [r[-1] for r in table[1:]] == ["", "", "", "", "REGRESSION", "best", "", "baseline", "baseline"]
    # baselines in the order they were scored, not by path
    assert [r[1] for r in table[1:]][-3:] == ["a/final", "z-lab/Target-8B-DFlash-b16", "other/drafter"]
    assert table[1][3:6] == ["2.90 - 3.30", "3.000", "3.600"] and table[7][3] == "-" and table[9][5] == "-"
    # a/final was scored after every step: the newest
    assert "Speedup upper bound of the newest checkpoint, a/final (tau 4.30)" in text
    categories = page.table_after("category")
    assert categories == [  # the newest two candidates and the baselines
        ["category", "prompts", "a/step_5000", "a/final", "z-lab/Target-8B-DFlash-b16 (baseline)",
         "other/drafter (baseline)"],
        ["chat", "1", "4.00", "3.90", "3.60", "3.10"],
        ["math", "2", "4.70", "4.60", "4.30", "3.80"],
    ]
    assert len(page.images) == 3
    for image in page.images:
        assert_readable_plot(png_of(image["src"]))
    assert_self_contained(text, page)
    assert sorted(p.name for p in (out / "img").iterdir()) == \
        ["group1-acceptance-lengths.png", "group1-position-acceptance.png", "group1-tau-by-step.png"]


def test_rows_without_any_training_step_get_no_step_plot(tmp_path):
    store = Store(tmp_path / "store")
    fabricate(store, "/hub/z-lab/drafter", None, 4.0, (3.8, 4.2), baseline=True)
    fabricate(store, "/models/mine", None, 3.0, (2.8, 3.2))
    text = write_report(store, tmp_path / "out").read_text()
    page = Page(text)
    assert "No checkpoint has a training step" in text
    assert [image["alt"] for image in page.images] == ["acceptance by draft position", "acceptance-length histogram"]
    assert [r[0] for r in page.table_after("step")[1:]] == ["-", "baseline"]



def test_each_group_has_its_section_and_plots(tmp_path):
    store = Store(tmp_path / "store")
    for semantics in ("causal", "non_causal"):  # one checkpoint scored both ways: two groups
        fabricate(store, "/runs/a/step_100", 100, 3.0, (2.8, 3.2), semantics=semantics)
        fabricate(store, "/runs/a/step_200", 200, 3.5, (3.3, 3.7), semantics=semantics)
    out = tmp_path / "out"
    text = write_report(store, out).read_text()
    page = Page(text)
    assert [t for tag, t in page.headings if tag == "h2"] == [
        "Target-8B on mixed.jsonl, 256 new tokens (causal sliding layers)",
        "Target-8B on mixed.jsonl, 256 new tokens (non_causal sliding layers)"]
    assert page.references[:2] == ["#group1", "#group2"] and 'id="group1"' in text and 'id="group2"' in text
    assert len(page.images) == 6
    assert sorted(p.name for p in (out / "img").iterdir()) == sorted(
        f"group{g}-{name}.png" for g in (1, 2) for name in ("tau-by-step", "position-acceptance", "acceptance-lengths"))


def test_checkpoints_without_a_step_are_ordered_by_scoring_time_and_never_a_regression(tmp_path):
    from dflash_eval.reporting.artifacts import summary_markdown
    from dflash_eval.reporting.history import find_group, history
    from tests.evaluations import results_of

    store = Store(tmp_path / "store")
    keys = {
        # an untrained drafter scored first; its name sorts after every other by path
        "zz-untrained": fabricate(store, "/runs/a/zz-untrained", None, 1.2, (1.1, 1.3)),
        "step_100": fabricate(store, "/runs/a/step_100", 100, 2.0, (1.9, 2.1)),
        "step_300": fabricate(store, "/runs/a/step_300", 300, 2.4, (2.3, 2.5)),  # scored before step_200
        "step_200": fabricate(store, "/runs/a/step_200", 200, 3.0, (2.9, 3.1)),
        # a final export scored last, worse than step_200 beyond doubt; its name sorts first by path
        "aa-export": fabricate(store, "/runs/a/aa-export", None, 2.5, (2.4, 2.6)),
    }
    (group,) = history(store)
    order = ["a/zz-untrained", "a/step_100", "a/step_200", "a/step_300", "a/aa-export"]
    assert [r.label for r in group.rows] == order
    assert [r.regression for r in group.rows] == [False, False, False, True, False]
    assert [r.mark for r in group.rows] == ["", "", "best", "REGRESSION", ""]
    assert group.best.label == "a/step_200"
    assert [r.scored_at for r in group.rows] == \
        [store.committed_at("scores", keys[label.split("/")[1]]) for label in order]

    text = write_report(store, tmp_path / "out", last=2).read_text()
    page = Page(text)
    assert [(r[1], r[-1]) for r in page.table_after("step")[1:]] == \
        [("a/zz-untrained", ""), ("a/step_100", ""), ("a/step_200", "best"), ("a/step_300", "REGRESSION"),
         ("a/aa-export", "")]
    assert "Speedup upper bound of the newest checkpoint, a/aa-export" in text
    assert page.table_after("category")[0] == ["category", "prompts", "a/step_300", "a/aa-export"]

    def summary(label, step):
        found = find_group(history(store), keys[label])
        results = results_of(drafter={"source": f"/runs/a/{label}", "step": step}, tau_macro=found[1].tau_macro,
                             tau_macro_ci95=found[1].tau_macro_ci95, tau_pooled=1.0, block_size=8,
                             n_scored_prompts=3, stages={"scores": "ran"}, served={"label": "greedy"})
        return summary_markdown(results, found, None)

    untrained = summary("zz-untrained", None)
    assert "REGRESSION" not in untrained and "previous step" not in untrained and "No training step" in untrained
    assert "No training step" in summary("aa-export", None)
    assert "No earlier step to compare with" in summary("step_100", 100)
    regressed = summary("step_300", 300)
    # step_200 is both the previous step and the best other checkpoint: one row says so
    assert "**REGRESSION**" in regressed and "| previous step, best other | a/step_200 | 200 |" in regressed
    assert "best other checkpoint" not in regressed
    best = summary("step_200", 200)  # its previous step and the best other checkpoint differ: two rows
    assert "| previous step | a/step_100 |" in best and "| best other checkpoint | a/aa-export |" in best

    result = CliRunner().invoke(app, ["history", "--store", str(store.root)])
    assert result.exit_code == 0, result.output
    rows = [line.split("│") for line in result.output.splitlines() if "a/" in line]
    assert [(r[2].strip(), r[-2].strip()) for r in rows] == \
        [("a/zz-untrained", ""), ("a/step_100", ""), ("a/step_200", "best"), ("a/step_300", "REGRESSION"),
         ("a/aa-export", "")]
    assert "2025-01-01 00:" in rows[0][-3]  # when it was first scored


def test_a_summary_links_a_copy_of_the_plot_that_later_runs_never_overwrite(tmp_path):
    from dflash_eval.reporting.artifacts import kept_copy

    (tmp_path / "img").mkdir()
    plot = tmp_path / "img" / "group1-tau-by-step.png"
    plot.write_bytes(b"today's plot")
    first = kept_copy(tmp_path, "img/group1-tau-by-step.png")
    plot.write_bytes(b"tomorrow's plot")  # a later run redraws the group's plot
    second = kept_copy(tmp_path, "img/group1-tau-by-step.png")
    assert first.startswith("img/tau-by-step-") and first != second
    assert (tmp_path / first).read_bytes() == b"today's plot" and (tmp_path / second).read_bytes() == b"tomorrow's plot"
    assert kept_copy(tmp_path, "img/group1-tau-by-step.png") == second  # the same picture: the same file
