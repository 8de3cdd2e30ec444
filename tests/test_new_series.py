"""A run that would start a new series beside one differing in one setting only says so in one line, naming the
setting and the value that joins the series the store holds; a run that joins a series, or differs in more, says
nothing."""

import pytest
from typer.testing import CliRunner

from dflash_eval.cli import app

pytestmark = [pytest.mark.usefixtures("one_thread")]


def references(tiny, store, *extra) -> str:
    result = CliRunner().invoke(app, ["stage", "references", "--drafter", str(tiny.drafter_steps[-1]), "--target",
                                      str(tiny.target_dir), "--prompts", str(tiny.prompts), "--store", str(store),
                                      *extra])
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.slow
def test_a_run_beside_a_series_differing_in_one_setting_names_it(tiny, prefect_api_url, tmp_path):
    store = tmp_path / "store"
    first = references(tiny, store, "--max-new-tokens", "8")
    assert "note:" not in first  # nothing beside it yet
    other = references(tiny, store, "--max-new-tokens", "12")
    notes = [line for line in other.splitlines() if line.startswith("note:")]
    assert notes == ["note: the store holds this target's references on these prompts made with --max-new-tokens 8; "
                     "this run's --max-new-tokens 12 starts a new series (references and features computed anew): "
                     "give --max-new-tokens 8 to join that series"]
    joined = references(tiny, store, "--max-new-tokens", "8")
    assert "note:" not in joined  # the series the store holds
    sampled = references(tiny, store, "--max-new-tokens", "8", "--temperature", "0.7", "--samples", "2")
    assert ("note: the store holds this target's references on these prompts made with greedy; this run's "
            "temperature 0.7, top_k 0, top_p 1, min_p 0, samples 2, seed 0 starts a new series") in sampled
    # two settings apart from every series there: a new comparison, not a slip
    assert "note:" not in references(tiny, store, "--max-new-tokens", "10", "--temperature", "0.5")
