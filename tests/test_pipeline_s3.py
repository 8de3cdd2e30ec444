"""The pipeline with its store on object storage (moto's S3 server, a process on loopback): the same acceptance
lengths as on a local store, a second machine (another process with a copy of its own) reusing what the first
one computed, and a SIGKILL during extraction resumed without rewriting a finished array."""

import subprocess
import sys
import time

import pytest

from dflash_eval.storage import Store
from dflash_eval.storage.object_storage import ObjectStorage
from tests.test_pipeline import N_PROMPTS, cli, evaluate, run_to_results

pytestmark = pytest.mark.slow


def features_objects(url: str) -> dict[str, tuple]:
    """features.zarr/... key -> (e_tag, last modified) of every object of the store's one features entry. A
    rewrite with the same bytes keeps the e_tag (an MD5), never the time: the resumed run starts seconds later."""
    storage = ObjectStorage(url)
    return {meta["path"].split("/features.zarr/", 1)[1]: (meta["e_tag"], meta["last_modified"])
            for meta in storage.objects("features/") if "/features.zarr/" in meta["path"]}


def local_arrays(store) -> dict[str, bytes]:
    """features.zarr/... key -> bytes of every chunk file of a local store's one features entry."""
    (zarr_root,) = store.glob("features/*/*/features.zarr")
    return {p.relative_to(zarr_root).as_posix(): p.read_bytes() for p in zarr_root.rglob("*/c/*/*") if p.is_file()}


def test_an_evaluation_on_object_storage_equals_the_local_one_and_a_second_machine_reuses_it(
        tiny, s3_url, tmp_path, prefect_api_url, monkeypatch):
    local, _ = evaluate(tiny, tmp_path / "local")
    monkeypatch.setenv("DFLASH_STORE_CACHE", str(tmp_path / "first-machine"))
    on_s3, _ = evaluate(tiny, s3_url)
    assert set(on_s3["stages"].values()) == {"ran"} and on_s3["store"] == s3_url
    assert on_s3["per_prompt"] == local["per_prompt"] and on_s3["tau_macro"] == local["tau_macro"]
    assert on_s3["keys"] == local["keys"]  # content keys: the same wherever the store is
    # the feature arrays are in the bucket, bit for bit the local ones, and not on the machine
    storage = ObjectStorage(s3_url)
    for name, data in local_arrays(tmp_path / "local").items():
        (path,) = [m["path"] for m in storage.objects("features/") if m["path"].endswith("/features.zarr/" + name)]
        assert storage.get(path)[0] == data, name
    assert not list((tmp_path / "first-machine").rglob("features.zarr"))

    # a second machine: another process, another copy; it scores an earlier checkpoint with the references and
    # the features the first one computed
    monkeypatch.setenv("DFLASH_STORE_CACHE", str(tmp_path / "second-machine"))
    results = run_to_results(tiny, s3_url, tmp_path / "second.json", step=-2, api_url=prefect_api_url)
    assert results["stages"] == {"fetch": "ran", "references": "cached", "features": "cached", "drafts": "ran",
                                 "scores": "ran"}
    assert results["keys"]["references"] == on_s3["keys"]["references"]
    assert results["keys"]["features"] == on_s3["keys"]["features"]
    local_earlier, _ = evaluate(tiny, tmp_path / "local", step=-2)
    assert results["per_prompt"] == local_earlier["per_prompt"]
    # what the second machine copied: the records it read, never the feature arrays
    assert (tmp_path / "second-machine").is_dir() and not list((tmp_path / "second-machine").rglob("features.zarr"))
    assert len(Store(s3_url).keys("scores")) == 2

    # the store's commands take the URL as they take a folder
    for command, expected in ((["history"], f"{results['tau_macro']:.3f}"), (["verify"], " 0 problems")):
        shown = subprocess.run([sys.executable, "-m", "dflash_eval.cli", *command, "--store", s3_url],
                               capture_output=True, text=True, timeout=120)
        assert shown.returncode == 0 and expected in shown.stdout, shown.stdout + shown.stderr


def test_a_killed_extraction_on_object_storage_resumes_without_rewriting_finished_arrays(
        tiny, s3_url, tmp_path, prefect_api_url, monkeypatch):
    monkeypatch.setenv("DFLASH_STORE_CACHE", str(tmp_path / "machine"))
    # the killed holder's lock expires after its lease: a short one, so the resumed run need not wait a minute
    monkeypatch.setenv("DFLASH_LOCK_LEASE_SECONDS", "3")
    killed = cli(tiny, s3_url, "run", runner=("-m", "tests.killed_run", "5"), api_url=prefect_api_url)
    output, _ = killed.communicate(timeout=300)
    assert killed.returncode == -9, output
    store = Store(s3_url)
    assert [(stage, complete) for stage, _, complete in store.entries() if stage == "features"] == [("features", False)]
    before = features_objects(s3_url)
    (features_key,) = [key for stage, key, _ in store.entries() if stage == "features"]
    features = store.feature_store(features_key)
    complete = [pair for pair in features.arrays() if features.has(*pair)]
    assert len(complete) == 5

    time.sleep(1.1)  # S3 keeps modification times to the second
    results = run_to_results(tiny, s3_url, tmp_path / "resumed.json", api_url=prefect_api_url)
    assert results["stages"]["references"] == "cached" and results["stages"]["features"] == "ran"
    after = features_objects(s3_url)
    for layer, n in complete:  # not rewritten: the same objects
        array = f"layer_{layer}/seq_{n}"
        assert {k: v for k, v in after.items() if k.startswith(array + "/")} == \
            {k: v for k, v in before.items() if k.startswith(array + "/")}
    assert len(features.arrays()) == len(results["layer_ids"]) * N_PROMPTS and store.is_complete("features", features_key)

    clean, _ = evaluate(tiny, tmp_path / "clean")
    assert results["per_prompt"] == clean["per_prompt"]
    for name, data in local_arrays(tmp_path / "clean").items():
        assert ObjectStorage(s3_url).get(f"features/{features_key[:2]}/{features_key}/features.zarr/{name}")[0] == data
