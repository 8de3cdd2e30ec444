"""Damaged and stale store entries through the whole flow, on the tiny trained run: each is detected,
named and recomputed, giving exactly the results of an undamaged store; never a crash for good and
never a silently different tau."""

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from dflash_eval.storage import CorruptEntryWarning

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

MAX_NEW = 64


@pytest.fixture(scope="module")
def clean(tiny, tmp_path_factory, prefect_api_url):
    """The results of the last step on an undamaged store."""
    return evaluate(tiny, tmp_path_factory.mktemp("clean") / "store")


def evaluate(tiny, store, step=-1, **kwargs) -> dict:
    from tests.evaluations import run_evaluation

    return run_evaluation(target=str(tiny.target_dir), drafter=str(tiny.drafter_steps[step]),
                               prompts=str(tiny.prompts), max_new_tokens=MAX_NEW, store=str(store), **kwargs)


def entry_dir(store, stage, key=None):
    if key is not None:
        return store / stage / key[:2] / key
    (entry,) = [p for p in store.glob(f"{stage}/*/*") if p.is_dir()]
    return entry


def zarr_dir(store):
    return entry_dir(store, "features") / "features.zarr"


def array_markers(store) -> dict[str, int]:
    """layer_i/seq_n -> mtime_ns of its zarr.json (rewritten whenever the array is)."""
    root = zarr_dir(store)
    return {str(p.parent.relative_to(root)): p.stat().st_mtime_ns for p in root.glob("layer_*/seq_*/zarr.json")}


def feature_bytes(store) -> dict[str, str]:
    return {str(p.relative_to(zarr_dir(store))): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(zarr_dir(store).rglob("*")) if p.is_file()}


def _clean_store(clean) -> Path:
    return Path(clean["store"])


def flip_signs(chunk) -> None:
    """Flip the sign bit of every float32 in a chunk file (a corruption that surely changes the drafts)."""
    values = np.fromfile(chunk, dtype=np.uint32)
    (values ^ np.uint32(0x80000000)).tofile(chunk)


def test_a_bit_flip_in_a_feature_chunk_is_extracted_again_giving_the_clean_acceptance_lengths(tiny, clean, tmp_path):
    store = tmp_path / "store"
    evaluate(tiny, store, step=0)
    before = array_markers(store)
    flip_signs(zarr_dir(store) / "layer_1" / "seq_3" / "c" / "0" / "0")

    results = evaluate(tiny, store)  # a new checkpoint: its drafts read the damaged array
    assert results["stages"]["features"] == "cached"  # markers and sizes are intact: only a verified read sees it
    assert results["per_prompt"] == clean["per_prompt"] and results["tau_macro"] == clean["tau_macro"]
    after = array_markers(store)
    assert {name for name in before if after[name] != before[name]} == {"layer_1/seq_3"}  # just that array
    assert feature_bytes(store) == feature_bytes(_clean_store(clean))


def test_a_deleted_chunk_is_extracted_again(tiny, clean, tmp_path):
    store = tmp_path / "store"
    evaluate(tiny, store, step=0)
    before = array_markers(store)
    (zarr_dir(store) / "layer_2" / "seq_5" / "c" / "0" / "0").unlink()

    results = evaluate(tiny, store)
    assert results["stages"]["features"] == "ran"
    assert results["per_prompt"] == clean["per_prompt"]
    after = array_markers(store)
    assert {name for name in before if after[name] != before[name]} == {"layer_2/seq_5"}
    assert feature_bytes(store) == feature_bytes(_clean_store(clean))


def test_a_truncated_scores_json_is_named_by_history_and_report_and_recomputed_by_the_next_run(tiny, clean, tmp_path):
    """history and report, readers, leave the damaged entry as it is and its row out, naming it and how to get the
    row back; the next run that needs it finds it, removes it and scores again, to the clean results."""
    from typer.testing import CliRunner

    from dflash_eval.cli import app

    store = tmp_path / "store"
    first = evaluate(tiny, store, step=0)
    evaluate(tiny, store)
    key = clean["keys"]["scores"]
    scores_json = entry_dir(store, "scores", key) / "scores.json"
    scores_json.write_bytes(scores_json.read_bytes()[:100])
    damaged = store_files(store)

    result = CliRunner().invoke(app, ["report", "--store", str(store), "--out", str(tmp_path / "report")])
    assert result.exit_code == 0, result.output
    assert f"warning: scores/{key} left out: damaged (scores.json: 100 bytes" in result.output
    assert "`dflash-eval verify --repair` removes the damage" in result.output
    result = CliRunner().invoke(app, ["history", "--store", str(store)])
    assert result.exit_code == 0 and f"warning: scores/{key} left out" in result.output, result.output
    assert [line.split("│")[1].strip() for line in result.output.splitlines() if "step_" in line] == ["100"]
    assert store_files(store) == damaged  # readers change nothing

    with pytest.warns(CorruptEntryWarning, match=f"scores/{key} is corrupt"):
        again = evaluate(tiny, store)  # found by the run itself
    assert again["stages"]["scores"] == "ran" and again["stages"]["drafts"] == "cached"
    assert again["tau_macro"] == clean["tau_macro"] and again["per_prompt"] == clean["per_prompt"]
    result = CliRunner().invoke(app, ["history", "--store", str(store)])
    assert [line.split("│")[1].strip() for line in result.output.splitlines() if "step_" in line] == ["100", "400"]
    assert f"{first['tau_macro']:.3f}" in result.output and f"{clean['tau_macro']:.3f}" in result.output
    assert "left out" not in result.output


def test_later_stages_follow_a_refreshed_stage_whose_content_changed_and_stay_when_it_did_not(
        tiny, clean, tmp_path, monkeypatch):
    from dflash_eval.tasks import features as features_task

    store = tmp_path / "store"
    assert evaluate(tiny, store)["tau_macro"] == clean["tau_macro"]
    for chunk in (zarr_dir(store) / "layer_1").glob("seq_*/c/0/0"):
        flip_signs(chunk)
    drafts_json = entry_dir(store, "drafts") / "drafts.json"
    clean_drafts = drafts_json.read_bytes()

    # as the tester saw it: damage that the drafts stage does not notice, then `stage drafts --refresh`
    monkeypatch.setattr(features_task, "VERIFY_READS", False)
    evaluate(tiny, store, until="drafts", refresh=["drafts"])
    assert drafts_json.read_bytes() != clean_drafts  # drafted from the damaged features
    changed = evaluate(tiny, store)
    assert changed["stages"]["scores"] == "ran"  # not the old tau from the cached scores
    assert changed["per_prompt"] != clean["per_prompt"]
    assert [p["acceptance_lengths"] for p in changed["per_prompt"]] == \
        [p["acceptance_lengths"] for p in json.loads(drafts_json.read_text())["per_prompt"]]

    # verified reads: the refresh extracts the damaged arrays again, the drafts are the clean ones again
    monkeypatch.setattr(features_task, "VERIFY_READS", True)
    evaluate(tiny, store, until="drafts", refresh=["drafts"])
    assert drafts_json.read_bytes() == clean_drafts
    fixed = evaluate(tiny, store)
    assert fixed["stages"]["scores"] == "ran"
    assert fixed["tau_macro"] == clean["tau_macro"] and fixed["per_prompt"] == clean["per_prompt"]

    # a refresh that reproduces the content leaves the later stages cached
    evaluate(tiny, store, until="drafts", refresh=["drafts"])
    same = evaluate(tiny, store)
    assert set(same["stages"].values()) == {"cached"} and same["tau_macro"] == clean["tau_macro"]
    evaluate(tiny, store, until="features", refresh=["features"])
    assert set(evaluate(tiny, store)["stages"].values()) == {"cached"}


def test_verify_names_each_damage_and_repair_makes_the_next_run_recompute_exactly_it(tiny, clean, tmp_path):
    from typer.testing import CliRunner

    from dflash_eval.cli import app

    store = tmp_path / "store"
    evaluate(tiny, store)
    keys = clean["keys"]
    references = entry_dir(store, "references")
    reference_files = {p.name: p.stat().st_mtime_ns for p in references.glob("seq_*.json")}
    arrays = array_markers(store)
    flip_signs(zarr_dir(store) / "layer_1" / "seq_3" / "c" / "0" / "0")
    (zarr_dir(store) / "layer_2" / "seq_5" / "c" / "0" / "0").unlink()
    scores_json = entry_dir(store, "scores") / "scores.json"
    scores_json.write_bytes(scores_json.read_bytes()[:100])
    seq_2 = references / "seq_2.json"
    seq_2.write_bytes(seq_2.read_bytes().replace(b'"id"', b'"ID"'))  # same size, another content
    weights = entry_dir(store, "fetch") / "checkpoint" / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-10] ^= 0x01
    weights.write_bytes(bytes(raw))

    result = CliRunner().invoke(app, ["verify", "--store", str(store)])
    assert result.exit_code == 1, result.output
    for message in (f"features/{keys['features']}: layer_1/seq_3: corrupt",
                    f"features/{keys['features']}: layer_2/seq_5: chunk 0 is missing",
                    f"scores/{keys['scores']}: scores.json: 100 bytes",
                    f"references/{keys['references']}: seq_2.json: sha256 differs",
                    f"fetch/{keys['fetch']}: checkpoint/model.safetensors: sha256 differs"):
        assert message in result.output
    assert "5 problems" in result.output

    result = CliRunner().invoke(app, ["verify", "--store", str(store), "--repair"])
    assert result.exit_code == 1 and "the next run recomputes exactly these" in result.output
    result = CliRunner().invoke(app, ["verify", "--store", str(store)])
    assert result.exit_code == 0, result.output

    again = evaluate(tiny, store)
    assert again["stages"] == {"fetch": "ran", "references": "ran", "features": "ran", "drafts": "cached",
                               "scores": "ran"}
    assert again["per_prompt"] == clean["per_prompt"] and again["tau_macro"] == clean["tau_macro"]
    after = array_markers(store)
    assert {name for name in arrays if after[name] != arrays[name]} == {"layer_1/seq_3", "layer_2/seq_5"}
    assert {name for name, mtime in reference_files.items()
            if (references / name).stat().st_mtime_ns != mtime} == {"seq_2.json"}
    assert feature_bytes(store) == feature_bytes(_clean_store(clean))
    assert CliRunner().invoke(app, ["verify", "--store", str(store)]).exit_code == 0


def test_a_damaged_checkpoint_is_named_and_fetched_again_by_the_next_run(tiny, clean, tmp_path, monkeypatch):
    from dflash_eval.storage import store as store_module

    # as for a real checkpoint: its weights are too large to hash on every read, only before drafting
    monkeypatch.setattr(store_module, "VERIFY_ON_READ_BYTES", 0)
    store = tmp_path / "store"
    evaluate(tiny, store, step=0)
    shutil.rmtree(entry_dir(store, "drafts"))  # the drafts read the checkpoint again
    weights = entry_dir(store, "fetch") / "checkpoint" / "model.safetensors"
    raw = bytearray(weights.read_bytes())
    raw[-10] ^= 0x01
    weights.write_bytes(bytes(raw))
    with pytest.warns(CorruptEntryWarning, match="checkpoint/model.safetensors: sha256 differs"):
        with pytest.raises(Exception, match="run again to fetch it again"):  # tasks.drafts.CheckpointDamaged
            evaluate(tiny, store, step=0)
    again = evaluate(tiny, store, step=0)
    assert again["stages"]["fetch"] == "ran" and again["stages"]["drafts"] == "ran"


def test_weights_are_hashed_before_drafting_only_when_the_fetch_was_a_cache_hit(tiny, tmp_path, monkeypatch):
    """A checkpoint fetched by this run had its weights hashed at commit moments before: the drafts stage
    does not hash them again. One fetched by an earlier run is hashed in full before it is drafted from."""
    from dflash_eval.storage import store as store_module

    monkeypatch.setattr(store_module, "VERIFY_ON_READ_BYTES", 0)  # weights as large as real ones
    hashed = []
    real_sha256 = store_module.file_sha256
    monkeypatch.setattr(store_module, "file_sha256", lambda path: hashed.append(Path(path).name) or real_sha256(path))
    store = tmp_path / "store"
    evaluate(tiny, store, step=0)
    assert hashed.count("model.safetensors") == 1  # at the fetch's commit
    shutil.rmtree(entry_dir(store, "drafts"))
    hashed.clear()
    again = evaluate(tiny, store, step=0)
    assert again["stages"]["fetch"] == "cached" and again["stages"]["drafts"] == "ran"
    assert hashed.count("model.safetensors") == 1  # before drafting


def _flip(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))


def _cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:len(path.read_bytes()) // 2])


DAMAGE = {"flipped": _flip, "cut": _cut, "deleted": Path.unlink}
ARRAY = "features.zarr/layer_1/seq_3"
# (stage, file in its entry, how it is damaged): every kind of file a store holds
DAMAGE_KINDS = [
    *((stage, "entry.json", how) for stage in ("fetch", "references", "features", "drafts", "scores")
      for how in ("flipped", "cut")),
    ("fetch", "checkpoint/model.safetensors", "flipped"), ("fetch", "checkpoint/model.safetensors", "cut"),
    ("fetch", "checkpoint/config.json", "flipped"), ("fetch", "checkpoint/config.json", "deleted"),
    ("references", "seq_2.json", "flipped"), ("references", "seq_2.json", "cut"), ("references", "seq_2.json", "deleted"),
    ("features", f"{ARRAY}/c/0/0", "flipped"), ("features", f"{ARRAY}/c/0/0", "cut"),
    ("features", f"{ARRAY}/c/0/0", "deleted"), ("features", f"{ARRAY}/zarr.json", "flipped"),
    ("features", f"{ARRAY}/zarr.json", "deleted"),
    ("drafts", "drafts.json", "flipped"), ("drafts", "drafts.json", "deleted"),
    ("scores", "scores.json", "cut"), ("scores", "scores.json", "deleted"),
]


def store_files(store: Path) -> dict[str, str]:
    """Every file of the store and its sha256, but the digest cache (a cache of this machine's hashing)."""
    return {str(p.relative_to(store)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(store.rglob("*")) if p.is_file() and not p.name.startswith("file-digests.json")}


@pytest.mark.parametrize(("stage", "path", "how"), DAMAGE_KINDS, ids=[f"{s}-{p.split('/')[-1]}-{h}"
                                                                      for s, p, h in DAMAGE_KINDS])
def test_verify_reports_each_damage_and_changes_nothing(clean, tmp_path, stage, path, how):
    """verify without --repair is a check: it names the damaged entry, exits 1 and leaves every file as it was;
    history, a reader, changes nothing either."""
    from typer.testing import CliRunner

    from dflash_eval.cli import app

    store = tmp_path / "store"
    shutil.copytree(_clean_store(clean), store)
    DAMAGE[how](entry_dir(store, stage, clean["keys"][stage]) / path)
    damaged = store_files(store)
    result = CliRunner().invoke(app, ["verify", "--store", str(store)])
    assert result.exit_code == 1, result.output
    named = f"{stage}/{clean['keys'][stage]}: "
    assert named in result.output and "nothing was changed" in result.output, result.output
    assert CliRunner().invoke(app, ["history", "--store", str(store)]).exit_code == 0
    assert store_files(store) == damaged


def test_repair_after_every_damage_at_once_gives_the_clean_results(tiny, clean, tmp_path):
    from typer.testing import CliRunner

    from dflash_eval.cli import app

    store = tmp_path / "store"
    shutil.copytree(_clean_store(clean), store)
    for stage, path, how in DAMAGE_KINDS:
        target = entry_dir(store, stage, clean["keys"][stage]) / path
        if target.exists():  # an entry.json cut after it was flipped, say: each file once
            DAMAGE[how](target)
    result = CliRunner().invoke(app, ["verify", "--store", str(store), "--repair"])
    assert result.exit_code == 1 and "the next run recomputes exactly these" in result.output, result.output
    assert CliRunner().invoke(app, ["verify", "--store", str(store)]).exit_code == 0
    again = evaluate(tiny, store)
    assert again["per_prompt"] == clean["per_prompt"] and again["tau_macro"] == clean["tau_macro"]
    assert CliRunner().invoke(app, ["verify", "--store", str(store)]).exit_code == 0
