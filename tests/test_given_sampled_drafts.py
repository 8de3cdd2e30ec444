"""Sampled drafts over completions one already has (`--references FILE --temperature T ... --draft-sample-method
probabilistic`): the settings say what the target's p and the drafter's q were, the features stage stores p of each
given token at them, and the drafts stage replays the rule over the given tokens, in expectation over the acceptance
coins given the tokens: E[tau | output].

Proved on the outputs of z-lab's own loop, PyPI `dflash` 0.1.0 (tests/golden/package_outputs.json, recorded by
tests/golden/make_package_outputs_golden.py: per seeded run, the tokens it emitted and its acceptance lengths), for
the DFlash pair and DFlash2's sampled walk, at two settings. Given a run's output y, the package's own tau over that
run is a draw whose expectation is E[tau | y] (its coins are the only randomness left), so over the same runs the
mean of the package's taus is an independent estimate of the mean of our E[tau | y]: the two lie within 4 standard
errors of the package's mean given the outputs (the spread of its taus about ours, run by run). The greedy-draft rule
over the same outputs lies far outside (the test can fail)."""

import json
import math
from pathlib import Path

import numpy as np
import pytest

from dflash_core.sampling import Sampling

GOLDEN = Path(__file__).parent / "golden"
RECORDED = json.loads((GOLDEN / "package_outputs.json").read_text())
META = RECORDED["metadata"]
DRAFTERS = {"dflash": GOLDEN / "dflash010" / "drafter", "dflash2": GOLDEN / "dflash2" / "drafter"}
CASES = [(pair, i) for pair in DRAFTERS for i in range(len(RECORDED[pair]))]


def setting_id(case) -> str:
    pair, i = case
    setting = RECORDED[pair][i]
    return f"{pair}-T={setting['temperature']:g}-k{setting['top_k']}-p{setting['top_p']:g}"


def write_references(path: Path, setting: dict) -> list[tuple[str, dict]]:
    """The package's runs as a completions file, one line per run under its prompt's id (a prompt's runs are its
    samples); returns (prompt id, run) per line."""
    prompts = {p["id"]: p["input_ids"] for p in META["prompts"]}
    lines = [(row["id"], run) for row in setting["prompts"] for run in row["runs"]]
    path.write_text("".join(json.dumps({"id": pid, "input_ids": prompts[pid], "completion_ids": run["output_ids"]})
                            + "\n" for pid, run in lines))
    return lines


def macro(per_prompt: dict[str, list[float]]) -> float:
    """tau macro as results give it: the mean over every reference with a step (a prompt's samples weigh alike)."""
    return float(np.mean([value for values in per_prompt.values() for value in values]))


def standard_error(per_prompt: dict[str, list[float]]) -> float:
    """Of `macro` (prompts held fixed), from the spread of the values within each prompt."""
    n = sum(len(v) for v in per_prompt.values())
    return math.sqrt(sum(len(v) * np.var(v, ddof=1) for v in per_prompt.values())) / n


def by_prompt(lines: list[tuple[str, dict]], values: list[float | None]) -> dict[str, list[float]]:
    """Per prompt, the values of its lines that have one (a run whose first token was a stop has no step)."""
    grouped: dict[str, list[float]] = {}
    for (pid, _), value in zip(lines, values):
        if value is not None:
            grouped.setdefault(pid, []).append(value)
    return grouped


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=[setting_id(c) for c in CASES])
def test_our_tau_over_the_package_s_outputs_is_the_package_s_own_within_4_standard_errors(tmp_path, prefect_api_url,
                                                                                          case):
    from tests.evaluations import run_evaluation

    pair, i = case
    setting = RECORDED[pair][i]
    lines = write_references(tmp_path / "outputs.jsonl", setting)
    served = {"temperature": setting["temperature"], "top_k": setting["top_k"], "top_p": setting["top_p"]}

    def evaluate(**draws) -> dict:
        return run_evaluation(target=str(GOLDEN / "dflash010" / "target"), drafter=str(DRAFTERS[pair]),
                              references=str(tmp_path / "outputs.jsonl"), store=str(tmp_path / "store"),
                              settle_seconds=0, **draws)

    results = evaluate(**served, draft_sample_method="probabilistic")
    label = f"given completions, {Sampling(**served).describe()}, sampled drafts"
    assert results["served"]["label"] == label and results["series"]["title"].endswith(f"{label} (causal sliding layers)")
    ours = [p["tau"] for p in results["per_prompt"]]  # E[tau | output], line by line
    assert [p["id"].split("#")[0] for p in results["per_prompt"]] == [pid for pid, _ in lines]
    package = [float(np.mean(run["acceptance_lengths"])) if run["acceptance_lengths"] else None for _, run in lines]
    assert [t is None for t in ours] == [t is None for t in package]  # the same runs without a step

    ours_by_prompt, package_by_prompt = by_prompt(lines, ours), by_prompt(lines, package)
    assert macro(ours_by_prompt) == pytest.approx(results["tau_macro"])
    # given the outputs ours is exact, and the package's mean varies by its coins alone: the SE of the runs'
    # differences (over the outputs too, the package's own SE, as its summary gives it, is printed beside it)
    paired = standard_error(by_prompt(lines, [None if t is None else p - t for t, p in zip(ours, package)]))
    greedy = [p["tau"] for p in evaluate()["per_prompt"]]  # the greedy-draft rule over the same outputs
    greedy_paired = standard_error(by_prompt(lines, [None if t is None else p - t for t, p in zip(greedy, package)]))
    off, greedy_off = (abs(macro(by_prompt(lines, taus)) - macro(package_by_prompt)) for taus in (ours, greedy))
    print(f"{setting_id(case)}: ours {macro(ours_by_prompt):.4f}, package {macro(package_by_prompt):.4f}, SE given "
          f"the outputs {paired:.4f} ({off / paired:.2f} SE apart; the package's SE over the outputs too: "
          f"{standard_error(package_by_prompt):.4f}); greedy drafts {macro(by_prompt(lines, greedy)):.4f} "
          f"({greedy_off / greedy_paired:.1f} SE apart)")
    assert off < 4 * paired
    assert greedy_off > 4 * greedy_paired


def test_the_settings_are_keyed_and_recorded_with_the_given_completions(tmp_path):
    """The same completions at two settings are two references entries (so two features entries, each with the
    target's p at its own settings), each recording its settings; greedy drafts key them as before any setting."""
    from dflash_eval.storage import Store
    from dflash_eval.storage.schema import Stage
    from dflash_eval.tasks.references import store_given_references

    first = RECORDED["dflash"][0]["prompts"][0]
    completions = tmp_path / "outputs.jsonl"
    completions.write_text("".join(json.dumps({"id": first["id"], "input_ids": META["prompts"][0]["input_ids"],
                                               "completion_ids": run["output_ids"]}) + "\n"
                                   for run in first["runs"][:3]))
    store, target = Store(tmp_path / "store"), str(GOLDEN / "dflash010" / "target")
    served = Sampling(0.6, 20, 0.95)
    refs = {name: store_given_references(str(completions), target, store, sampling=sampling)
            for name, sampling in (("greedy", Sampling()), ("served", served), ("T=1", Sampling(1.0)))}
    assert len({r.key for r in refs.values()}) == 3
    assert refs["served"].sampling == served and refs["greedy"].sampling == Sampling()
    records = {name: store.read_entry(Stage.REFERENCES, r.key).record for name, r in refs.items()}
    assert records["served"]["sampling"] == served.identity()
    assert "sampling" not in records["greedy"]  # (greedy: the record and key as they always were)


@pytest.mark.parametrize("serving,refused", [
    ({"temperature": 0.6, "top_k": 20, "top_p": 0.95, "min_p": 0.05, "seed": 3, "draft_truncation": False,
      "draft_sample_method": "probabilistic"}, None),
    ({"temperature": 0.6}, "--temperature (and the other sampling options) apply to them only with "
                           "--draft-sample-method probabilistic"),
    ({"temperature": 0.6, "draft_sample_method": "probabilistic", "samples": 4}, "leave out --reference, --samples"),
    ({"draft_sample_method": "probabilistic"}, "--draft-sample-method probabilistic samples drafts at the served "
                                               "temperature"),
])
def test_given_completions_take_the_sampling_settings_only_where_sampled_drafts_need_them(serving, refused):
    from dflash_eval.flows.settings import Settings, SettingsError

    def flag(name: str) -> str:
        return "--" + name.replace("_", "-")

    values = {"inputs": {"target": "t", "references": "r.jsonl"}, "serving": serving}
    if refused is None:
        assert Settings.checked(values, flag).serving.draft_sample_method == "probabilistic"
        return
    with pytest.raises(SettingsError) as error:
        Settings.checked(values, flag)
    assert refused in str(error.value)
