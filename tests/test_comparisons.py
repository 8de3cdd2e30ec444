"""Comparing checkpoints: a save compared against with --baseline stays a step of its run's curve, whichever was
scored first; the paired difference (this checkpoint's tau minus another's, with the 95% interval of the
per-reference difference) against the baseline, the previous step and the best, wherever tau is shown; the
trainer's own number beside tau, and the no-flag line saying what the alarm checked.

Fast tests fabricate store entries as the flow writes them (tests/test_report.py's `fabricate`) beside a training
log SpecForge's own tracker wrote (tests/test_training_log.py's `write_run`); one slow test runs `dflash-eval run
--drafter step_400 --baseline step_200` on the tiny trained run, in both orders.
"""

import json
import random
import shutil

import pytest
from typer.testing import CliRunner

from dflash_core.metrics import paired_difference_interval
from dflash_eval.cli import app
from dflash_eval.storage import Store, key_of
from dflash_eval.storage.schema import BaselineRecord, Stage
from tests.test_report import Page, fabricate

N_REFERENCES = 30


def per_prompt(tau: float, seed: int) -> list[dict]:
    """Per-reference taus around `tau` (the same references for every checkpoint: noise shared by seed 0, plus a
    little of the checkpoint's own), in scores.json's layout."""
    shared, own = random.Random(0), random.Random(seed)
    return [{"id": f"r{i}", "category": "math", "tau": tau + shared.uniform(-0.8, 0.8) + own.uniform(-0.1, 0.1)}
            for i in range(N_REFERENCES)]


def scored(store: Store, source: str, step: int | None, tau: float, seed: int, baseline: bool = False,
           block_size: int = 8) -> str:
    """A checkpoint scored at about `tau` on the shared references (fabricate); returns its scores key."""
    references = per_prompt(tau, seed)
    mean = sum(p["tau"] for p in references) / len(references)
    return fabricate(store, source, step, mean, (mean - 0.3, mean + 0.3), baseline=baseline, block_size=block_size,
                     per_prompt=references)


def mark_baseline(store: Store, source: str, step: int | None) -> None:
    """The baselines entry `dflash-eval run --baseline <source>` writes (tasks/baselines.py)."""
    key = key_of({"c": source})  # fabricate's checkpoint key
    store.begin(Stage.BASELINES, key)
    store.commit(Stage.BASELINES, key, BaselineRecord(source=source, step=step).to_record())


def history_json(store: Store, *options: str) -> dict:
    result = CliRunner().invoke(app, ["history", "--store", str(store.root), "--json", *options])
    assert result.exit_code == 0, result.output
    return json.loads(result.stdout)


# ------------------------------------------------------------------ 1. a save compared against stays on the curve


def test_a_save_compared_against_stays_a_step_of_its_runs_curve_in_either_order(tmp_path):
    """`run --drafter runs/x/step_300 --baseline runs/x/step_200`, with step_200 scored as the drafter before or
    after: step_200 stays a step of the curve. A published drafter (no step, outside the run) and a save of another
    run compared against stay baseline rows, after the others."""
    orders = {}
    for order in ("baseline first", "drafter first"):
        store = Store(tmp_path / order.replace(" ", "-"))
        if order == "baseline first":  # compared against, then evaluated itself
            scored(store, "/runs/x/step_100", 100, 2.0, 1)
            scored(store, "/runs/x/step_200", 200, 2.6, 2, baseline=True)
            scored(store, "/runs/x/step_300", 300, 3.0, 3)
        else:  # evaluated, then compared against
            scored(store, "/runs/x/step_100", 100, 2.0, 1)
            scored(store, "/runs/x/step_200", 200, 2.6, 2)
            scored(store, "/runs/x/step_300", 300, 3.0, 3)
            mark_baseline(store, "/runs/x/step_200", 200)
        scored(store, "/hub/z-lab/Target-8B-DFlash-b8", None, 2.8, 4, baseline=True)
        scored(store, "/runs/old/step_5000", 5000, 3.5, 5, baseline=True)  # the best of an earlier run
        orders[order] = store

    for order, store in orders.items():
        listed = history_json(store)
        (series,) = listed["series"]
        rows = [(r["checkpoint"], r["step"], r["baseline"], r["best"]) for r in series["rows"]]
        assert rows == [("x/step_100", 100, False, False), ("x/step_200", 200, False, False),
                        ("x/step_300", 300, False, True), ("z-lab/Target-8B-DFlash-b8", None, True, False),
                        ("old/step_5000", 5000, True, False)], order
        table = CliRunner().invoke(app, ["history", "--store", str(store.root)])
        assert table.exit_code == 0, table.output
        firsts = [line.split("│")[1].strip() for line in table.output.splitlines() if "│" in line]
        assert firsts == ["100", "200", "300", "baseline", "baseline"], (order, table.output)
        # the report's table says the same
        page = Page(_report(store, tmp_path / f"{order}-report"))
        assert [r[0] for r in page.table_after("step")[1:]] == ["100", "200", "300", "baseline", "baseline"]


def _report(store: Store, out) -> str:
    from dflash_eval.reporting.report import write_report

    return write_report(store, out).read_text()


# ------------------------------------------------------------------ 2. the paired comparison, wherever tau is shown


def expected_interval(store: Store, ours: str, theirs: str) -> tuple[float, float]:
    """The paired 95% interval of ours minus theirs (scores keys), from their scores.json alone."""
    from dflash_eval.storage import read_json

    def taus(key):
        return {p["id"]: p["tau"] for p in read_json(store.entry(Stage.SCORES, key) / "scores.json")["per_prompt"]}

    a, b = taus(ours), taus(theirs)
    return paired_difference_interval([(ref, a[ref], b[ref]) for ref in a])


def test_the_paired_difference_against_the_baseline_the_previous_step_and_the_best_is_shown_everywhere(tmp_path,
                                                                                                     monkeypatch):
    from dflash_eval.reporting.history import find_group, history

    store = Store(tmp_path / "store")
    keys = {"100": scored(store, "/runs/x/step_100", 100, 2.0, 1),
            "200": scored(store, "/runs/x/step_200", 200, 3.1, 2),
            "300": scored(store, "/runs/x/step_300", 300, 2.9, 3),
            "published": scored(store, "/hub/z-lab/Target-8B-DFlash-b8", None, 2.5, 4, baseline=True)}
    (group,) = history(store)
    tau = {name: next(r.tau_macro for r in group.rows if r.scores == key) for name, key in keys.items()}
    low, high = expected_interval(store, keys["300"], keys["200"])
    assert high < 0  # step_300 is worse than step_200 beyond noise, though their own intervals overlap

    # history --json: each row against the previous step and the best other checkpoint, or null
    rows = {r["step"] if r["step"] is not None else "published": r for r in history_json(store)["series"][0]["rows"]}
    assert all("vs_previous_step" in row and "vs_best" in row for row in rows.values()), rows[300].keys()
    assert rows[100]["vs_previous_step"] is None
    assert rows[300]["vs_previous_step"]["checkpoint"] == "x/step_200"
    assert rows[300]["vs_previous_step"]["difference"] == pytest.approx(tau["300"] - tau["200"])
    assert rows[300]["vs_previous_step"]["difference_ci95"] == [pytest.approx(low), pytest.approx(high)]
    assert rows[200]["vs_best"]["checkpoint"] == "x/step_300"  # the best's best other
    assert rows[200]["vs_previous_step"]["difference_ci95"] == \
        [pytest.approx(x) for x in expected_interval(store, keys["200"], keys["100"])]
    assert rows["published"]["vs_previous_step"] is None and rows["published"]["vs_best"]["checkpoint"] == "x/step_200"

    # the report's table: a column against the previous step and one against the best other
    table = Page(_report(store, tmp_path / "report")).table_after("step")
    assert table[0][-3:] == ["minus the previous step (paired 95% CI)", "minus the best other (paired 95% CI)", ""]
    cells = {r[1]: r[-3:-1] for r in table[1:]}
    assert cells["x/step_300"] == [f"{tau['300'] - tau['200']:+.3f} ({low:+.2f} to {high:+.2f}) vs x/step_200"] * 2
    assert cells["x/step_100"][0] == "-"

    def entry(against, name, label, step):
        entry_low, entry_high = expected_interval(store, keys["300"], keys[name])
        source = {"200": "/runs/x/step_200", "published": "/hub/z-lab/Target-8B-DFlash-b8"}[name]
        return {"against": against, "checkpoint": label, "source": source, "checkpoint_key": key_of({"c": source}),
                "step": step, "tau_macro": tau[name], "difference": pytest.approx(tau["300"] - tau[name]),
                "difference_ci95": [pytest.approx(entry_low), pytest.approx(entry_high)]}

    # the run's results (--out), as the flow completes them once the history is read (publish): step_300 with
    # --baseline step_200, so step_200 is the baseline, the previous step and the best other checkpoint
    from dflash_eval.reporting.artifacts import add_history, summary_markdown
    from tests.evaluations import results_of

    found = find_group(history(store), keys["300"])
    results = results_of(drafter={"source": "/runs/x/step_300", "step": 300}, tau_macro=tau["300"],
                         tau_macro_ci95=[tau["300"] - 0.3, tau["300"] + 0.3], tau_pooled=1.0, block_size=8,
                         n_scored_prompts=N_REFERENCES, stages={"scores": "ran"}, served={"label": "greedy"},
                         baseline={"source": "/runs/x/step_200", "key": key_of({"c": "/runs/x/step_200"}), "step": 200})
    add_history(results, found, None)
    assert json.loads(json.dumps(results.to_json()))["comparisons"] == [  # JSON as it is
        entry("previous step", "200", "x/step_200", 200), entry("best", "200", "x/step_200", 200),
        entry("baseline", "200", "x/step_200", 200), entry("baseline", "published", "z-lab/Target-8B-DFlash-b8", None)]

    # the command line after the run: one line per checkpoint, named by every role it holds
    from dflash_eval.cli.evaluation import _print_results

    monkeypatch.setenv("COLUMNS", "200")  # rich's width where stdout is no terminal
    printed = _printed(_print_results, results_of(**{**results, "stages": {}, "keys": {}, "tau_macro_ci95": (1.0, 2.0),
                                                     "tau_pooled": 1.0, "n_steps": 10, "clipped_last_steps": 0,
                                                     "sliding_semantics": "causal",
                                                     "served": {"label": "greedy", "draft_sample_method": "greedy"},
                                                     "baseline": {**results["baseline"], "tau_macro": tau["200"],
                                                                  "tau_macro_ci95": [1.0, 2.0]}}))
    assert ("paired differences: this checkpoint's tau macro minus another's, with the 95% CI of the per-reference "
            "difference") in printed
    assert (f"  previous step, best other, baseline: x/step_200 (step 200, tau macro {tau['200']:.3f}): "
            f"{tau['300'] - tau['200']:+.3f} (paired 95% CI {low:+.3f} to {high:+.3f}); worse\n") in printed
    published_low, published_high = expected_interval(store, keys["300"], keys["published"])
    assert (f"  baseline: z-lab/Target-8B-DFlash-b8 (tau macro {tau['published']:.3f}): "
            f"{tau['300'] - tau['published']:+.3f} (paired 95% CI {published_low:+.3f} to {published_high:+.3f})"
            in printed)

    # the Prefect summary: the same numbers
    summary = summary_markdown(results, found, None)
    assert (f"| previous step, best other, baseline | x/step_200 | 200 | {tau['200']:.3f} | "
            f"{tau['200'] - 0.3:.2f}-{tau['200'] + 0.3:.2f} | {tau['300'] - tau['200']:+.3f} ({low:+.2f} to "
            f"{high:+.2f}) |") in summary


def _printed(function, *args) -> str:
    """What a function printing with rich prints to stdout."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        function(*args)
    return out.getvalue()


# ------------------------------------------------------------------ 4. the trainer's own number, the no-flag line


def test_history_shows_the_trainers_own_number_and_says_what_the_alarm_checked(tmp_path, monkeypatch):
    """The trainer's `eval/simulated_acc_len` beside tau in `history` (a column named by it), `history --json`
    (`trainer_logged`), the report; where no flag is raised, one line naming each check, its numbers and its
    threshold, in `history`, the report, the Prefect summary and the command line."""
    from dflash_eval.reporting.history import find_group, history
    from dflash_eval.reporting.training_log import read_training_log
    from dflash_eval.reporting.training_side import training_sides
    from tests.test_training_log import write_run

    run = tmp_path / "run"
    steps = (100, 200, 300, 400)
    write_run(run, steps=steps, best=400, accuracy=lambda step: 0.5 + step / 1000)
    store = Store(tmp_path / "store")
    for i, step in enumerate(steps):
        scored(store, str(run / f"step_{step}"), step, 2.2 + step / 500, seed=10 + i)
    log = read_training_log(run)
    logged = {step: [v for s, v in log.scalars["eval/simulated_acc_len"] if s <= step][-1] for step in steps}

    output = CliRunner().invoke(app, ["history", "--store", str(store.root)])
    assert output.exit_code == 0, output.output
    header = next(line for line in output.output.splitlines() if "tau pooled" in line)
    assert "trainer eval/simulated_acc_len" in header and "trainer implies" in header
    columns = [cell.strip() for cell in header.split("┃")]
    rows = [[cell.strip() for cell in line.split("│")] for line in output.output.splitlines() if "run/step_" in line]
    at = columns.index("trainer eval/simulated_acc_len")
    assert [r[at] for r in rows] == [f"{logged[s]:.3f}" for s in steps]

    listed = history_json(store)["series"][0]
    assert [r.get("trainer_logged") for r in listed["rows"]] == \
        [{"tag": "eval/simulated_acc_len", "value": pytest.approx(logged[s])} for s in steps]
    no_flag = next((line for line in output.output.splitlines() if line.startswith("No flag")), None)
    assert no_flag is not None and "No alarm" not in output.output, output.output

    (group,) = history(store)
    (side,) = training_sides(group)
    assert side.flags == []
    line = side.no_flag_line()
    top = group.rows[-1]
    implied = side.implied(top)[0]
    assert line.startswith(f"No flag: the trainer's best, step 400 (by eval/simulated_acc_len, in "
                           f"{run}/run.best_meta.json), is the best by tau ({top.tau_macro:.3f}); ")
    assert "the trainer's train/acc and tau rise together over steps 100-400" in line
    assert (f"the gap between tau and what the trainer implies ({implied - top.tau_macro:.2f} tokens at step 400, "
            f"the nearest the alarm: {implied:.2f} implied") in line
    assert "is within the alarm's margin of 25%" in line
    # no checkpoint scored with --all-positions: the per-position check says it could not run
    assert "the per-position check could not run" in line and "No alarm" not in line
    assert " ".join(line.split()) in " ".join(output.output.split())

    assert [r["trainer_implies"] for r in listed["rows"]] == [pytest.approx(side.implied(r)[0]) for r in group.rows]
    assert {(c["kind"], c["ran"]) for c in listed["checks"]} == \
        {("best mismatch", True), ("diverging", True), ("train/eval gap", True)}

    report = _report(store, tmp_path / "report")
    training = next(t for t in Page(report).tables if t[0][:4] == ["step", "checkpoint", "tau macro",
                                                                    "trainer eval/simulated_acc_len"])
    assert [r[3] for r in training[1:]] == [f"{logged[s]:.3f}" for s in steps]
    assert " ".join(line.split()) in " ".join(report.split()).replace("&#39;", "'")

    # the Prefect summary and the command line after a run of step 400: the same line
    from dflash_eval.reporting.artifacts import add_history, summary_markdown
    from tests.evaluations import results_of

    found = find_group(history(store), top.scores)
    results = results_of(drafter={"source": top.source, "step": 400}, tau_macro=top.tau_macro,
                         tau_macro_ci95=list(top.tau_macro_ci95), tau_pooled=1.0, block_size=8, n_scored_prompts=3,
                         stages={}, keys={}, served={"label": "greedy", "draft_sample_method": "greedy"},
                         n_steps=10, clipped_last_steps=0, sliding_semantics="causal",
                         training={"run": str(run), "log": str(run), "problems": [], "flags": [], "tensorboard": None,
                                   "at_step": {**side.point(top).as_dict(), "implied": implied, "implied_from": "x"}})
    add_history(results, found, side)
    assert results["training"]["trainer_logged"] == {"tag": "eval/simulated_acc_len", "value": logged[400]}
    assert results["training"]["no_flag"] == line
    summary = summary_markdown(results, found, None)
    assert line in summary and "No alarm" not in summary

    from dflash_eval.cli.evaluation import _print_results

    monkeypatch.setenv("COLUMNS", "200")
    printed = _printed(_print_results, results)
    assert line in printed and f"the trainer logged eval/simulated_acc_len {logged[400]:.3f}" in printed


def test_a_check_that_cannot_run_says_so(tmp_path):
    """Two saves evaluated: the divergence check needs four; the trainer's best, step 300, was not evaluated, so it
    cannot be compared. `history` says both where it raises no flag."""
    from tests.test_training_log import write_run

    run = tmp_path / "run"
    write_run(run, steps=(100, 200, 300), best=300, accuracy=lambda step: 0.3)
    store = Store(tmp_path / "store")
    for step in (100, 200):
        scored(store, str(run / f"step_{step}"), step, 2.0 + step / 1000, seed=step)
    result = CliRunner().invoke(app, ["history", "--store", str(store.root)])
    assert result.exit_code == 0, result.output
    shown = " ".join(result.output.split())
    assert (f"No flag: the best-mismatch check could not run: the trainer's best, step 300 (by eval/simulated_acc_len, "
            f"in {run}/run.best_meta.json), was not evaluated; the divergence check could not run: it fits slopes over "
            "the last 4 saves with per-reference taus, and 2 of this run were evaluated; ") in shown, shown
    checks = history_json(store)["series"][0]["checks"]
    assert [(c["kind"], c["ran"]) for c in checks] == \
        [("best mismatch", False), ("diverging", False), ("train/eval gap", True)]


# ------------------------------------------------------------------ through the flow, both orders


@pytest.mark.slow
@pytest.mark.usefixtures("one_thread")
def test_run_with_a_save_of_the_same_run_as_baseline(tiny, tmp_path, prefect_api_url):
    """`dflash-eval run --drafter run/step_400 --baseline run/step_200 --out`: the paired differences in the output
    and the results, step_200 a step of the curve in `history` whether it was evaluated itself before or after;
    the trainer's number and the no-flag line beside tau."""
    from dflash_eval.reporting.history import history, paired_interval
    from tests.test_pipeline import MAX_NEW
    from tests.test_training_log import write_run

    run = tmp_path / "run"
    for step, save in ((200, tiny.drafter_steps[1]), (400, tiny.drafter_steps[-1])):
        shutil.copytree(save, run / f"step_{step}")
    write_run(run, steps=(200, 400), best=400, accuracy=lambda step: 0.3)  # implies far less than tau: no gap

    def evaluate(store, drafter, *extra):
        out = tmp_path / f"{store.name}-{drafter}.json"
        result = CliRunner().invoke(app, ["run", "--target", str(tiny.target_dir), "--drafter", str(run / drafter),
                                          "--prompts", str(tiny.prompts), "--max-new-tokens", str(MAX_NEW),
                                          "--store", str(store), "--out", str(out), *extra],
                                   env={"COLUMNS": "200"})
        assert result.exit_code == 0, result.output
        return json.loads(out.read_text()), result.output

    def curve(store):
        return [(r["checkpoint"], r["step"], r["baseline"]) for r in history_json(Store(store))["series"][0]["rows"]]

    # compared first, evaluated itself after
    store = tmp_path / "compared-first"
    results, output = evaluate(store, "step_400", "--baseline", str(run / "step_200"))
    expected = [("run/step_200", 200, False), ("run/step_400", 400, False)]
    assert curve(store) == expected
    (group,) = history(Store(store))
    ours, theirs = group.rows[1], group.rows[0]
    low, high = paired_interval(ours, theirs)
    against = {c["against"]: c for c in results["comparisons"]}
    assert set(against) == {"baseline", "previous step", "best"}
    for c in against.values():
        assert (c["checkpoint"], c["step"]) == ("run/step_200", 200)
        assert c["difference"] == pytest.approx(results["tau_macro"] - results["baseline"]["tau_macro"])
        assert c["difference_ci95"] == [pytest.approx(low), pytest.approx(high)]
    assert (f"  previous step, best other, baseline: run/step_200 (step 200, tau macro {theirs.tau_macro:.3f}): "
            f"{ours.tau_macro - theirs.tau_macro:+.3f} (paired 95% CI {low:+.3f} to {high:+.3f})") in output
    # the trainer's number and what the alarm checked
    assert results["training"]["trainer_logged"]["tag"] == "eval/simulated_acc_len"
    no_flag = results["training"]["no_flag"]
    assert no_flag.startswith("No flag: the trainer's best, step 400") and no_flag in output
    assert "the divergence check could not run" in no_flag
    evaluate(store, "step_200")
    assert curve(store) == expected

    # evaluated first, compared after
    store = tmp_path / "evaluated-first"
    evaluate(store, "step_200")
    assert curve(store) == expected[:1]
    evaluate(store, "step_400", "--baseline", str(run / "step_200"))
    assert curve(store) == expected
