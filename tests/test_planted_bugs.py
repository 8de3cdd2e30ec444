"""The seed project's bugs, each planted in a drafter trained on the tiny target (tests.planted):
the train/eval alarm or a diagnostics detector names every one with its cause, and the clean twin, trained
the same way without a bug, raises nothing.

Each run is evaluated through the flow with its training log found in its run folder, scored with
--all-positions (the teacher-forced accuracy per position beside the trainer's) and diagnosed.
"""

import pytest

from tests.planted import PLANTED, planted_run
from tests.test_pipeline import MAX_NEW

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

EXPECTED = {  # bug -> (flag or finding kind, words its message must hold)
    "leaked_block": ("train/eval gap", "Most likely a leak"),
    "shifted_label": ("labels one position off", "one position later"),
    "noisy_features": ("hardly changed under noise", "noisy or missing features"),
    "noisy_logits": ("agrees with the target on neither", "noisy target logits"),
}


@pytest.fixture(scope="module")
def evaluated(tiny, tmp_path_factory, prefect_api_url):
    """Each planted run's last save and the clean twin's, evaluated into one store: {bug: results}."""
    from tests.evaluations import run_evaluation

    root = tmp_path_factory.mktemp("planted")
    found = {}
    for bug in (None, *PLANTED):
        run = planted_run(tiny, bug, log=None)
        # our TensorBoard run beside the test's store, not in the cached run folder
        found[bug] = run_evaluation(target=str(tiny.target_dir), drafter=str(run / "step_200"),
                                         prompts=str(tiny.prompts), max_new_tokens=MAX_NEW, store=str(root / "store"),
                                         until="diagnostics", all_positions=True,
                                         tensorboard=str(root / f"tensorboard-{bug or 'clean'}"))
    return found


def named(results: dict) -> list[dict]:
    return results["training"]["flags"] + results["diagnostics"]["findings"]


def test_the_clean_twin_raises_nothing(evaluated):
    clean = evaluated[None]
    assert clean["training"]["log"] and clean["training"]["problems"] == []
    assert clean["training"]["at_step"]["per_position_accuracy"], "the training log holds no per-position accuracy"
    assert named(clean) == [], named(clean)


@pytest.mark.parametrize("bug", PLANTED)
def test_each_planted_bug_is_named_with_its_cause(evaluated, bug):
    kind, words = EXPECTED[bug]
    matching = [n for n in named(evaluated[bug]) if n["kind"] == kind]
    assert matching, f"{bug}: nothing named {kind!r}; named {named(evaluated[bug])}"
    assert words in matching[0]["message"]
