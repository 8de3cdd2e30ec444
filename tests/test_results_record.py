"""The results record (reporting.results.Results): its JSON is what `run --out` wrote before it was typed (the same
keys in the same order), it reads back as itself, and docs/results.schema.json is its schema, current."""

import json
from pathlib import Path

import jsonschema

from dflash_core.sections import AROUND, registered
from dflash_eval.reporting.results import JSON_ORDER, Results, json_schema
from tests.evaluations import UNREAD_EVALUATION, UNREAD_RESULTS, UNREAD_SCORES, results_of

SCHEMA = Path(__file__).parent.parent / "docs" / "results.schema.json"

SELECTOR = {"unary_tau_macro": 1.5, "unary_tau_macro_ci95": [1.4, 1.6], "unary_tau_pooled": 1.5, "lift": 0.5,
            "lift_ci95": [0.4, 0.6], "position_counts": {"reached": [4, 2], "selector": [2, 1], "argmax": [1, 1],
                                                         "in_top_k": [3, 2]},
            "selector_accuracy": [0.5, 0.5], "argmax_accuracy": [0.25, 0.5], "candidate_recall": [0.75, 1.0],
            "overall": {"selector_accuracy": 0.5, "argmax_accuracy": 1 / 3, "candidate_recall": 5 / 6}}


def every_part() -> dict:
    """A results JSON holding every section this package registers, in the order the untyped results held them."""
    scores = {**UNREAD_SCORES, "tau_drawn": {"tau_macro": 2.1, "tau_pooled": 2.0}, "selector": SELECTOR,
              "all_positions_tau": 2.5, "teacher_forced_accuracy": [0.9, None],
              "draft_sampling": {"q": {"temperature": 0.6}, "seed": 0}}
    later = {"references_file": "given.jsonl",
             "block_sweep": [{"block_size": 4, "tau_macro": 1.9, "tau_macro_ci95": [1.8, 2.0], "tau_pooled": 1.9,
                              "tau_per_token": 0.475, "projected_speedup": 1.5}],
             "threshold_sweep": [{"threshold": 0.5, "tau_macro": 1.9, "tau_macro_ci95": [1.8, 2.0], "tau_pooled": 1.9,
                                  "verified_per_step": 4.5, "tokens_per_verified_token": 0.42}],
             "replay_group": 4, "cluster": {"dask_address": "tcp://x:8786", "shards": {"features": None}},
             "baseline": {"source": "b", "key": "k", "step": None, "tau_macro": 1.8, "tau_macro_ci95": [1.7, 1.9],
                          "tau_pooled": 1.8, "tau_by_category": {}},
             "diagnostics": {"layer_ablation": []},
             "series": {"key": "s-12345678", "title": None},
             "training": {"run": "r", "log": None, "problems": [], "flags": [], "tensorboard": None},
             "comparisons": []}
    return {**dict(sorted(scores.items())), **UNREAD_EVALUATION, **later}


def test_its_json_is_the_untyped_results_key_for_key_in_order():
    data = every_part()
    results = Results.from_json(data)
    assert json.dumps(results.to_json()) == json.dumps(data)
    assert dict(results) == data and results["selector"] == SELECTOR  # it reads as its JSON
    assert [s.KEY for s in results.sections()] == [cls.KEY for cls in registered() if cls.KEY in data]
    # scores.json's sections among scores.json's keys, the evaluation's after `keys` (in JSON_ORDER: above)
    assert [s.KEY for s in results.scores.sections] == ["tau_drawn", "selector", "all_positions_tau",
                                                        "teacher_forced_accuracy"]
    assert {s.KEY for s in results.around} == set(JSON_ORDER) - {"references_file", "replay_group", "cluster",
                                                                 "series", "benchmarks"}


def test_a_section_added_later_takes_its_place_in_the_json():
    results = results_of()
    assert "comparisons" not in results
    from dflash_eval.reporting.sections import Comparisons, Training

    results.add(Comparisons([]))
    results.series = {"key": "s", "title": None}
    results.add(Training({"run": "r", "log": None, "problems": [], "flags": [], "tensorboard": None}))
    assert list(results)[-3:] == ["series", "training", "comparisons"]


def test_keys_scores_json_holds_that_this_version_does_not_know_are_kept_where_they_were():
    data = {**dict(sorted({**UNREAD_SCORES, "some_new_number": 3}.items())), **UNREAD_EVALUATION}
    results = Results.from_json(data)
    assert json.dumps(results.to_json()) == json.dumps(data) and results.scores.unknown == {"some_new_number": 3}


def test_the_sections_are_ordered_own_numbers_then_around():
    orders = {cls.KEY: cls.ORDER for cls in registered()}
    assert all(orders[key] < AROUND for key in ("benchmarks", "tau_drawn", "selector", "all_positions_tau"))
    assert all(orders[key] >= AROUND for key in ("block_sweep", "baseline", "comparisons", "training", "diagnostics"))


def test_the_committed_schema_is_current_and_holds_the_results():
    """docs/results.schema.json is what json_schema() gives; regenerate it with
    `.venv/bin/python -m dflash_eval.reporting.results > docs/results.schema.json`."""
    schema = json_schema()
    assert json.loads(SCHEMA.read_text()) == schema, \
        "docs/results.schema.json is stale: .venv/bin/python -m dflash_eval.reporting.results > docs/results.schema.json"
    jsonschema.Draft202012Validator.check_schema(schema)
    validator = jsonschema.Draft202012Validator(schema)
    assert not list(validator.iter_errors(every_part()))
    assert not list(validator.iter_errors(UNREAD_EVALUATION))  # not scored (a stage by hand)
    assert list(validator.iter_errors({k: v for k, v in UNREAD_RESULTS.items() if k != "per_prompt"}))  # half scored
