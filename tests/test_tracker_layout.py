"""How TensorBoard shows our run beside the trainer's (reporting.tracker), on real files: the trainer's log
written by SpecForge's own tracker (tests.test_training_log.write_run) or speculators' (tests/golden/speculators,
its real event files), our run written by reporting.tracker.track into the training run's `runs/dflash-eval`,
then read back with TensorBoard's own code: the EventAccumulator for the layout we wrote, and the Custom Scalars
plugin over the whole log dir for what its chart shows (the tab's JavaScript joins a chart's regexes as
`(r1)|(r2)|...` and asks the plugin's /scalars route for each run: scalars_impl here, without the HTTP)."""

import json
import re
import shutil
from dataclasses import replace
from functools import cmp_to_key
from pathlib import Path

import pytest

from dflash_eval.reporting.tracker import (
    BY_POSITION,
    LAYOUT_TAU,
    PREFIX,
    TAU_BESIDE_TRAINER,
    track,
)
from tests.test_training_log import group_of, row, taus_around, write_run

# TensorBoard's plugins import its vendored bleach, which warns about html5lib's sanitizer
pytestmark = pytest.mark.filterwarnings("ignore:html5lib's sanitizer is deprecated:DeprecationWarning")
SPECULATORS = Path(__file__).parent / "golden" / "speculators" / "dflash"
SAMPLED = "T=0.6 top-k 20 x8"


def evaluated_run(run: Path, steps: tuple[int, ...], sampled: bool = False) -> list:
    """Groups of scored checkpoints `<run>/step_N` (a scores.json each, as the store keeps it), the greedy
    series and, if asked, a sampled one."""
    groups = []
    for setting in ("greedy", SAMPLED) if sampled else ("greedy",):
        rows = []
        for step in steps:
            scores = run.parent / "scores" / f"{setting}-{step}.json"
            scores.parent.mkdir(exist_ok=True)
            scores.write_text(json.dumps({"block_size": 4, "tau_macro_ci95": [2.0, 2.4], "tau_pooled_ci95": [2.0, 2.4],
                                          "position_acceptance": [0.8, 0.6, 0.5]}))
            rows.append(replace(row(step, taus_around(2.2, seed=step), run=str(run)), scores_path=str(scores)))
        groups.append(replace(group_of(rows), setting=setting))
    return groups


def written_layout(folder: Path):
    """The Custom Scalars layout in our run, read back with TensorBoard's EventAccumulator."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.custom_scalar import layout_pb2, metadata

    accumulator = EventAccumulator(str(folder), size_guidance={"tensors": 0})
    accumulator.Reload()
    (config,) = accumulator.Tensors(metadata.CONFIG_SUMMARY_TAG)
    layout = layout_pb2.Layout()
    layout.ParseFromString(config.tensor_proto.string_val[0])
    return layout


def custom_scalars(logdir: Path):
    """TensorBoard's Custom Scalars plugin over `logdir` (every run in it), as `tensorboard --logdir` serves it:
    (its merged layout as the tab gets it, {run: {tag: points} a multiline chart's regexes match})."""
    from tensorboard import context
    from tensorboard.backend.event_processing import data_provider, plugin_event_multiplexer
    from tensorboard.plugins import base_plugin
    from tensorboard.plugins.custom_scalar.custom_scalars_plugin import CustomScalarsPlugin
    from tensorboard.plugins.scalar.scalars_plugin import ScalarsPlugin

    multiplexer = plugin_event_multiplexer.EventMultiplexer()
    multiplexer.AddRunsFromDirectory(str(logdir))
    multiplexer.Reload()
    plugins: dict = {}
    tb = base_plugin.TBContext(logdir=str(logdir), multiplexer=multiplexer, plugin_name_to_instance=plugins,
                               data_provider=data_provider.MultiplexerDataProvider(multiplexer, str(logdir)))
    plugins["scalars"] = ScalarsPlugin(tb)
    plugin = plugins["custom_scalars"] = CustomScalarsPlugin(tb)
    ctx = context.RequestContext()

    def shown(regexes: list[str]) -> dict[str, dict[str, list]]:
        joined = "|".join(f"({r})" for r in regexes)  # what the tab asks for, per run
        answers = {run: plugin.scalars_impl(ctx, run, joined, "") for run in multiplexer.Runs()}
        assert all(a["regex_valid"] for a in answers.values())
        return {run: a["tag_to_events"] for run, a in answers.items() if a["tag_to_events"]}

    layout = plugin.layout_impl(ctx, "")  # the JSON the /layout route answers
    return json.loads(layout) if isinstance(layout, str) else layout, shown


def test_tau_and_the_specforge_trainers_acceptance_are_on_one_custom_scalars_chart_first(tmp_path):
    run = tmp_path / "run"
    write_run(run, steps=(100, 200, 300))  # SpecForge: eval/simulated_acc_len at each save, into <run>/runs
    groups = evaluated_run(run, (100, 200, 300), sampled=True)
    record, _ = track(groups, f"{run}/step_300", None, None, window=4)
    ours = run / "runs" / "dflash-eval"
    assert record["tensorboard"] == str(ours) and f"{PREFIX}/tau_macro" in record["tracker_tags"]

    layout = written_layout(ours)
    first = layout.category[0]
    assert first.title == LAYOUT_TAU and first.chart[0].title == TAU_BESIDE_TRAINER
    regexes = list(first.chart[0].multiline.tag)
    # ... and it names tags that are written: ours, and the trainer's in its own event file
    from dflash_eval.reporting.training_log import read_training_log

    trainer_tags = set(read_training_log(run).scalars)
    assert "eval/simulated_acc_len" in trainer_tags
    for tag in (f"{PREFIX}/tau_macro", f"{PREFIX}/T_0.6_top-k_20_x8/tau_macro", f"{PREFIX}/trainer_implied_acceptance",
                "eval/simulated_acc_len"):
        assert any(re.match(r, tag) for r in regexes), tag
        assert tag in trainer_tags | set(record["tracker_tags"])
    for tag in (f"{PREFIX}/tau_macro_ci95_low", f"{PREFIX}/tau_pooled", "eval/avg_acc", "train/acc",
                f"{BY_POSITION}/acceptance_at_position/1"):
        assert not any(re.match(r, tag) for r in regexes), tag  # tau and acceptance only, nothing beside

    # TensorBoard over the training run's runs/ (README: `tensorboard --logdir <training run>/runs`): the tab
    # opens on our category, its first chart draws tau from our run and simulated_acc_len from SpecForge's
    served, shown = custom_scalars(run / "runs")
    assert served["category"][0]["title"] == LAYOUT_TAU
    chart = served["category"][0]["chart"][0]
    assert chart["title"] == TAU_BESIDE_TRAINER
    lines = shown(chart["multiline"]["tag"])
    assert set(lines) == {".", "dflash-eval"}  # SpecForge's run and ours, on one chart
    assert set(lines["."]) == {"eval/simulated_acc_len"}
    assert set(lines["dflash-eval"]) == {f"{PREFIX}/{series}{name}" for series in ("", "T_0.6_top-k_20_x8/")
                                         for name in ("tau_macro", "trainer_implied_acceptance")}
    taus = {r.step: r.tau_macro for r in groups[0].rows}
    assert [(step, pytest.approx(value)) for _, step, value in lines["dflash-eval"][f"{PREFIX}/tau_macro"]] == \
        list(taus.items())
    assert [step for _, step, _ in lines["."]["eval/simulated_acc_len"]] == [100, 200, 300]

    # then tau with its interval, then acceptance by draft position, each chart showing what was written
    assert [c["title"] for c in served["category"][0]["chart"][1:]] == [
        "tau_macro with its 95% interval", "tau_macro with its 95% interval (T_0.6_top-k_20_x8)"]
    assert served["category"][0]["chart"][1]["margin"]["series"][0] == {
        "value": f"{PREFIX}/tau_macro", "lower": f"{PREFIX}/tau_macro_ci95_low", "upper": f"{PREFIX}/tau_macro_ci95_high"}
    positions = served["category"][1]
    assert positions["title"] == "dflash-eval: by draft position"
    assert set(shown(positions["chart"][0]["multiline"]["tag"])["dflash-eval"]) == {
        f"{BY_POSITION}/acceptance_at_position/{k}" for k in (1, 2, 3)}


def test_tau_and_the_speculators_trainers_eal_are_on_one_custom_scalars_chart(tmp_path):
    """speculators writes its log in <run>/logs/<name>/, not runs/: `tensorboard --logdir <run>` shows both."""
    run = tmp_path / "run"
    shutil.copytree(SPECULATORS / "logs", run / "logs")  # its real event files: val/eal_epoch at steps 4 and 8
    record, _ = track(evaluated_run(run, (4, 8)), f"{run}/step_8", None, None, window=4)
    assert record["tensorboard"] == str(run / "runs" / "dflash-eval")
    served, shown = custom_scalars(run)
    chart = served["category"][0]["chart"][0]
    assert served["category"][0]["title"] == LAYOUT_TAU and chart["title"] == TAU_BESIDE_TRAINER
    lines = shown(chart["multiline"]["tag"])
    assert set(lines) == {"logs/dflash", "runs/dflash-eval"}
    assert set(lines["logs/dflash"]) == {"val/eal_epoch", "train/eal"}
    assert [step for _, step, _ in lines["logs/dflash"]["val/eal_epoch"]] == [4, 8]
    assert set(lines["runs/dflash-eval"]) == {f"{PREFIX}/tau_macro", f"{PREFIX}/trainer_implied_acceptance"}


# ------------------------------------------------------------------ TensorBoard's default view (Time Series)


def _tensorboard_order(a: str, b: str) -> int:
    """TensorBoard's frontend order of tag names (compareTagNames, in its webfiles.zip): digit runs compare as
    numbers, "/" and digits before any other character, the rest by character code."""
    i = j = 0
    number = re.compile(r"\d+(?:\.\d*)?(?:[eE][+-]?\d+)?")
    while True:
        if i == len(a):
            return 0 if j == len(b) else -1
        if j == len(b):
            return 1
        if a[i].isdigit() and b[j].isdigit():
            x, y = number.match(a, i), number.match(b, j)
            assert x and y
            i, j = x.end(), y.end()
            if float(x.group()) != float(y.group()):
                return -1 if float(x.group()) < float(y.group()) else 1
            continue
        first_a, first_b = a[i] == "/" or a[i].isdigit(), b[j] == "/" or b[j].isdigit()
        if first_a != first_b:
            return -1 if first_a else 1
        if not first_a and a[i] != b[j]:
            return -1 if a[i] < b[j] else 1
        i, j = i + 1, j + 1


def time_series_groups(tags) -> list[tuple[str, list[str]]]:
    """The Time Series (and Scalars) dashboard's card groups: cards sorted by tag (_tensorboard_order), grouped
    by the tag's first component in that order; TensorBoard opens the first two."""
    groups: dict[str, list[str]] = {}
    for tag in sorted(tags, key=cmp_to_key(_tensorboard_order)):
        groups.setdefault(tag.split("/", 1)[0], []).append(tag)
    return list(groups.items())


def test_tensorboards_default_view_opens_on_tau_not_on_the_cards_by_position(tmp_path):
    from dflash_eval.reporting.training_log import read_training_log

    run = tmp_path / "run"
    write_run(run, steps=(100, 200))
    record, _ = track(evaluated_run(run, (100, 200)), f"{run}/step_200", None, None, window=4)
    ours = record["tracker_tags"]
    groups = time_series_groups([*ours, *read_training_log(run).scalars])
    (name, cards), (second, _) = groups[:2]
    assert name == PREFIX and cards[0] == f"{PREFIX}/tau_macro", cards[:8]
    assert not [c for c in cards if re.search(r"/\d+$", c)]  # no card by draft position before or among them
    assert second == BY_POSITION  # they follow in their own group
    assert sorted(c for c in ours if re.search(r"/\d+$", c)) == [
        f"{BY_POSITION}/acceptance_at_position/{k}" for k in (1, 2, 3)]


def test_the_tensorboard_order_is_tensorboards():
    """The order replica above, on what TensorBoard's frontend does (numbers as numbers, "/" first)."""
    assert sorted(["a/10", "a/9", "a_b/1", "a/b"], key=cmp_to_key(_tensorboard_order)) == ["a/9", "a/10", "a/b", "a_b/1"]
    assert _tensorboard_order("dflash_eval/acceptance_at_position/1", "dflash_eval/tau_macro") < 0
