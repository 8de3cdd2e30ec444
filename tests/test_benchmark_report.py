"""tau per published benchmark where a run's scores are shown besides the command line: the Prefect summary and
scores table of a flow run, and the store's report, each with z-lab's layout (reporting.benchmarks) and its notes.

A fast test builds the block from a published setting (numbers.beside_published) and checks the starred gap and
the note naming it. The slow test evaluates the tiny run's drafter through the real flow on gsm8k and MT-Bench rows
in the datasets' own layout (tests/published_rows.py), its target named Qwen/Qwen3-8B and its drafter saved as
Qwen3-8B-DFlash-b16 so that z-lab's published taus stand beside ours, then reads the artifacts the flow published
and the report the store gives: the report rebuilds the block from the store's records alone, and it must be the
run's.
"""

import html as escaping
import json
import re
import shutil

import pytest

from dflash_core.published.benchmarks import BENCHMARKS
from dflash_core.published.numbers import PAPER_SOURCE, Setting, beside_published
from dflash_core.published.prompt_set import BenchmarkUse
from dflash_eval.reporting.artifacts import score_table
from dflash_eval.reporting.benchmarks import benchmark_lines, benchmark_markdown, benchmark_notes, reasoning_of
from dflash_eval.reporting.report import write_report
from dflash_eval.storage import Store
from tests.published_rows import write_layout

pytestmark = [pytest.mark.usefixtures("one_thread")]


def use(name: str, prompts: int) -> dict:
    """How the references record keeps one benchmark taken as zlab-2026-01's run script takes it."""
    b = BENCHMARKS[name]
    return BenchmarkUse(name, b.title, b.group, f"hub {b.hub_id}", b.rows or prompts, b.rows, prompts, True,
                        f"the zlab-2026-01 subset: {prompts} of {b.rows} rows (hub {b.hub_id})").to_json()


def test_a_published_tau_beyond_our_interval_is_starred_and_named():
    prompt_set = {"protocol": "zlab-2026-01", "template_kwargs": {"enable_thinking": False},
                  "benchmarks": [use("gsm8k", 128), use("math500", 128)]}
    by_benchmark = {"benchmarks": {"gsm8k": {"tau": 5.0, "ci95": [4.8, 5.2], "responses": 128},
                                   "math500": {"tau": 7.9, "ci95": [7.5, 8.3], "responses": 128}},
                    "groups": {"Math": {"tau": 6.45, "ci95": [6.2, 6.7], "benchmarks": ["gsm8k", "math500"]}}}
    setting = Setting("Qwen/Qwen3-8B", "z-lab/Qwen3-8B-DFlash-b16", 0.0, 1.0, 0, 16, "zlab-2026-01", 2048,
                      reasoning_of(prompt_set["template_kwargs"]))
    block = beside_published(by_benchmark, prompt_set, setting)

    assert [line.cells() for line in benchmark_lines(block)] == [
        ["Math", "GSM8K", "5.00", "4.80-5.20", "128", "6.55", "-1.55 *"],  # 6.55 lies beyond 4.80-5.20
        ["Math", "MATH-500", "7.90", "7.50-8.30", "128", "7.87", "+0.03"],
        ["Math", "Average", "6.45", "6.20-6.70", "", "7.21", "-0.76 *"]]
    notes = benchmark_notes(block)
    assert notes == ["protocol zlab-2026-01, chat template given {'enable_thinking': False}",
                     f"published: {PAPER_SOURCE}",
                     "GSM8K: tau 5.00 is 1.55 below the published 6.55, beyond our 95% CI 4.80-5.20"]
    markdown = benchmark_markdown(block)
    assert markdown[:5] == ["| group | benchmark | tau | 95% CI | responses | published | gap |",
                            "|---|---|---|---|---|---|---|",
                            "| Math | GSM8K | 5.00 | 4.80-5.20 | 128 | 6.55 | -1.55 * |",
                            "| Math | MATH-500 | 7.90 | 7.50-8.30 | 128 | 7.87 | +0.03 |",
                            "| **Math** | **Average** | **6.45** | **6.20-6.70** |  | **7.21** | **-0.76** * |"]
    assert markdown[5:] == ["", *(f"- {note}" for note in notes)]
    # reasoning as --reasoning names it, from what the template was given
    assert [reasoning_of(k) for k in ({"enable_thinking": True}, {"reasoning_effort": "xhigh"}, {})] == \
        ["on", "xhigh", None]


# ------------------------------------------------------------------ the real flow on the tiny run


@pytest.fixture(scope="module")
def evaluated(tiny, prefect_api_url, tmp_path_factory):
    """The tiny run's last save, named as z-lab's Qwen3-8B drafter, evaluated through the flow on 3 rows each of
    gsm8k and MT-Bench (zlab-2026-04), its target named Qwen/Qwen3-8B: (results, the flow run's id, the store)."""
    from tests.evaluations import run_evaluation

    root = tmp_path_factory.mktemp("benchmark-report")
    data = ",".join(f"{name}={write_layout(name, root / 'data', count=6 if name == 'gsm8k' else 4)}"
                    for name in ("gsm8k", "mt-bench"))
    drafter = root / "z-lab" / "Qwen3-8B-DFlash-b16"
    shutil.copytree(tiny.drafter_steps[-1], drafter)
    state = run_evaluation(target=str(tiny.target_dir), target_name="Qwen/Qwen3-8B", drafter=str(drafter),
                           prompts="gsm8k,mt-bench", data=data, protocol="zlab-2026-04", max_samples=3,
                           max_new_tokens=16, store=str(root / "store"), return_state=True)
    return state.result(), str(state.state_details.flow_run_id), Store(root / "store")


def cells_of(html: str, tag: str) -> list[list[str]]:
    """Every table row of the page as its cells' texts."""
    return [[re.sub(r"<[^>]+>", "", cell) for cell in re.findall(rf"<{tag}>(.*?)</{tag}>", row)]
            for row in re.findall(r"<tr[^>]*>(.*?)</tr>", html)]


@pytest.mark.slow
def test_summary_scores_and_report_show_tau_by_benchmark(evaluated, tmp_path):
    from tests.test_served_settings import client_artifacts

    results, flow_run, store = evaluated
    block = results["benchmarks"]
    lines = benchmark_lines(block)
    assert [(line.group, line.benchmark) for line in lines] == [("Math", "GSM8K"), ("Chat", "MT-Bench")]
    # the published pair at temperature 0: z-lab's taus beside ours, with what differs from their setting
    assert [line.published for line in lines] == [6.55, 4.25]
    notes = benchmark_notes(block)
    assert notes[0] == "protocol zlab-2026-04, chat template given {'enable_thinking': False}"
    subset = "GSM8K: not the zlab-2026-04 subset: 3 of the 6 rows in --data"
    assert any(note.startswith(subset) for note in notes), notes
    assert any(note.startswith("GSM8K: not the published setting: protocol zlab-2026-04, published zlab-2026-01")
               and "block size 8, published 16" in note and "max new tokens 16, published 2048" in note
               for note in notes), notes

    # the summary the flow run published: the table and the notes right after the tau line
    artifacts = {a.key.rsplit("-", 1)[1]: a.data for a in client_artifacts(flow_run) if a.key}
    summary = artifacts["summary"]
    tau_line = next(line for line in summary.splitlines() if line.startswith(f"**tau {results['tau_macro']:.3f}**"))
    table = "\n".join(["tau by benchmark (* a gap beyond our 95% CI):", "", *benchmark_markdown(block)])
    assert f"{tau_line}\n\n{table}\n" in summary
    for line in lines:
        assert f"| {' | '.join(line.cells())} |" in summary
    # the scores table: each benchmark's tau and interval in place of the categories'
    scores = {row["metric"]: row["value"] for row in json.loads(artifacts["scores"])}
    for line, row in zip(lines, block["rows"]):
        assert scores[f"tau on {line.benchmark}"] == f"{row['tau']:.3f} (95% CI {row['ci95'][0]:.2f}-{row['ci95'][1]:.2f})"
    assert not [metric for metric in scores if metric in ("tau on gsm8k", "tau on mt-bench")]
    assert score_table(results) == json.loads(artifacts["scores"])

    # the report, from the store alone: the same table and notes, the protocol in the series' heading
    html = write_report(store, tmp_path).read_text()
    heading = re.search(r"<h2 id=\"group1\">(.*?)</h2>", html)
    assert heading and "on gsm8k,mt-bench (zlab-2026-04), 16 new tokens" in heading.group(1), heading
    assert "<h3>tau by benchmark: z-lab/Qwen3-8B-DFlash-b16</h3>" in html
    rows = cells_of(html, "td")
    for line in lines:
        assert line.cells() in rows
    assert cells_of(html, "th").count(["group", "benchmark", "tau", "95% CI", "responses", "published", "gap"]) == 1
    shown = re.findall(r"<li>(.*?)</li>", html)
    assert [escaping.unescape(note) for note in shown[-len(notes):]] == notes
    markdown = (tmp_path / "report.md").read_text()
    assert "\n".join(benchmark_markdown(block)[:len(lines) + 2]) in markdown
    assert all(f"- {note}" in markdown for note in notes)
