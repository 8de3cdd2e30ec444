"""Integrity of the store without models: digests recorded at commit and checked on read, damaged
feature arrays, staleness of entries built on content that changed, and `dflash-eval verify`."""

import json

import pytest
import torch

from dflash_eval.storage import CorruptEntryWarning, EntryMissing, Store, key_of, write_json_atomic
from dflash_eval.storage import store as store_module
from dflash_eval.storage.feature_store import FEATURES_DIRNAME, FeatureMissing, FeatureStore
from dflash_eval.storage.integrity import entry_label, features_label, upstream_digest, upstream_digests, verify_store

KEY = key_of({"test": "integrity"})
OTHER_KEY = key_of({"test": "built on it"})


def commit_files(store: Store, stage: str, key: str, files: dict[str, bytes], record=None, **kwargs):
    directory = store.begin(stage, key)
    for name, data in files.items():
        (directory / name).parent.mkdir(parents=True, exist_ok=True)
        (directory / name).write_bytes(data)
    store.commit(stage, key, record or {}, **kwargs)
    return directory


def flip(path, offset=5):
    raw = bytearray(path.read_bytes())
    raw[offset] ^= 0x01
    path.write_bytes(bytes(raw))


# ---------------------------------------------------------------- records


def test_commit_records_every_file_but_partial_files_and_skipped_folders(tmp_path):
    store = Store(tmp_path)
    directory = commit_files(store, "features", KEY, {
        "a.json": b"{}", "sub/b.bin": b"12345", ".c.json.x1.partial": b"half", "checkpoint/.partial/w": b"..",
        f"{FEATURES_DIRNAME}/zarr.json": b"{}",
    }, {"n": 1}, upstream={"references/" + OTHER_KEY: "d1"}, skip=(FEATURES_DIRNAME,))
    marker = json.loads((directory / "entry.json").read_text())
    assert sorted(marker["files"]) == ["a.json", "sub/b.bin"]
    assert marker["files"]["sub/b.bin"]["size"] == 5
    assert marker["upstream"] == {"references/" + OTHER_KEY: "d1"}
    entry = store.read_entry("features", KEY)
    assert entry.content == marker["content"] and entry.record == {"n": 1}
    assert store.content("features", KEY) == entry.content


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "deleted"])
def test_a_damaged_record_file_is_named_removed_and_recomputed(tmp_path, damage):
    store = Store(tmp_path)
    directory = store.begin("scores", KEY)
    write_json_atomic(directory / "scores.json", {"tau_macro": 3.974, "per_prompt": list(range(50))})
    store.commit("scores", KEY, {"tau_macro": 3.974})
    scores = directory / "scores.json"
    if damage == "flipped byte":
        flip(scores, 16)
    elif damage == "truncated":
        scores.write_bytes(scores.read_bytes()[:20])
    else:
        scores.unlink()
    with pytest.warns(CorruptEntryWarning, match=f"scores/{KEY} is corrupt \\(scores.json: "):
        with pytest.raises(EntryMissing, match="damaged"):
            store.read_record("scores", KEY)
    assert not (directory / "entry.json").exists() and not scores.exists()
    assert store.get_or_compute("scores", KEY, lambda d: {"tau_macro": 3.974}).record == {"tau_macro": 3.974}


def test_a_changed_digit_in_a_record_is_caught_by_the_checksum(tmp_path):
    store = Store(tmp_path)
    directory = store.begin("scores", KEY)
    store.commit("scores", KEY, {"tau_macro": 3.974})
    marker = directory / "entry.json"
    marker.write_text(marker.read_text().replace("3.974", "3.929"))  # still valid JSON
    with pytest.warns(CorruptEntryWarning, match="checksum"):
        assert not store.is_complete("scores", KEY)


def test_only_the_damaged_files_of_a_resumable_entry_are_removed(tmp_path):
    store = Store(tmp_path)
    seqs = {f"seq_{n}.json": json.dumps({"n": n}).encode() for n in range(4)}
    directory = commit_files(store, "references", KEY, seqs)
    flip(directory / "seq_2.json", 3)
    with pytest.warns(CorruptEntryWarning, match="seq_2.json"):
        assert not store.is_complete("references", KEY)
    assert sorted(p.name for p in directory.iterdir()) == ["seq_0.json", "seq_1.json", "seq_3.json"]


def test_large_files_are_checked_by_size_on_reads_and_hashed_in_full_on_request(tmp_path, monkeypatch):
    monkeypatch.setattr(store_module, "VERIFY_ON_READ_BYTES", 10)
    store = Store(tmp_path)
    directory = commit_files(store, "fetch", KEY, {"checkpoint/model.safetensors": bytes(100), "config.json": b"{}"})
    flip(directory / "checkpoint" / "model.safetensors", 50)
    assert store.read_record("fetch", KEY) == {}  # same size: not hashed on an ordinary read
    with pytest.warns(CorruptEntryWarning, match="checkpoint/model.safetensors: sha256 differs"):
        with pytest.raises(EntryMissing):
            store.read_entry("fetch", KEY, full=True)
    assert (directory / "config.json").exists() and not (directory / "checkpoint" / "model.safetensors").exists()


def test_entries_committed_before_digests_are_read_and_their_json_checked(tmp_path):
    store = Store(tmp_path)
    directory = store.begin("scores", KEY)
    (directory / "scores.json").write_text('{"tau_macro": 3.0}')
    (directory / "entry.json").write_text(json.dumps({"format": 1, "stage": "scores", "key": KEY, "record": {"t": 1}}))
    entry = store.read_entry("scores", KEY)
    assert (entry.record, entry.files, entry.content, entry.upstream) == ({"t": 1}, None, None, None)
    (directory / "scores.json").write_text('{"tau_macro": 3.')
    with pytest.warns(CorruptEntryWarning, match="scores.json: not JSON"):
        assert not store.is_complete("scores", KEY)


# ---------------------------------------------------------------- feature arrays


def test_a_lost_or_short_chunk_makes_the_array_missing(tmp_path):
    features = FeatureStore(tmp_path / FEATURES_DIRNAME, max_chunk_bytes=40 * 8 * 4 // 3)
    for seq in range(3):
        features.write(1, seq, torch.randn(40, 8))
    chunks = tmp_path / FEATURES_DIRNAME / "layer_1"
    (chunks / "seq_0" / "c" / "1" / "0").unlink()
    short = chunks / "seq_1" / "c" / "0" / "0"
    short.write_bytes(short.read_bytes()[:-4])
    assert features.missing([1], 3) == [(1, 0), (1, 1)]
    assert "chunk 1 is missing" in features.why_missing(1, 0)
    assert "chunk 0 is missing or short" in features.why_missing(1, 1)


def test_digest_follows_the_arrays_content_and_discard_makes_them_missing(tmp_path):
    features = FeatureStore(tmp_path / FEATURES_DIRNAME)
    hidden = torch.randn(2, 12, 8)
    features.write_layers([1, 2], 0, hidden)
    digest = features.digest([1, 2], 1)
    features.write(2, 0, hidden[1].clone())
    assert features.digest([1, 2], 1) == digest  # the same content
    assert features.digest([1], 1) != digest
    features.write(2, 0, hidden[1] + 1)
    assert features.digest([1, 2], 1) != digest
    (tmp_path / FEATURES_DIRNAME / "layer_2" / "seq_0" / "zarr.json").write_text("{not json")
    features.discard(2, 0)
    assert features.missing([1, 2], 1) == [(2, 0)] and features.arrays() == [(1, 0)]
    with pytest.raises(FeatureMissing):
        features.digest([1, 2], 1)
    features.write(2, 0, hidden[1])  # extracted again: the digest it had
    assert features.digest([1, 2], 1) == digest


def test_verified_reads_catch_a_flipped_bit_and_a_marker_without_sha256(tmp_path):
    features = FeatureStore(tmp_path / FEATURES_DIRNAME)
    features.write(1, 0, torch.randn(12, 8))
    flip(tmp_path / FEATURES_DIRNAME / "layer_1" / "seq_0" / "c" / "0" / "0", 7)
    features.read_layer(1, 0)  # unverified: reads the changed bytes
    with pytest.raises(FeatureMissing, match="corrupt"):
        features.read_layer(1, 0, verify=True)
    metadata_path = tmp_path / FEATURES_DIRNAME / "layer_1" / "seq_0" / "zarr.json"
    metadata = json.loads(metadata_path.read_text())
    del metadata["attributes"]["sha256"]
    metadata_path.write_text(json.dumps(metadata))
    with pytest.raises(FeatureMissing, match="unverifiable"):
        features.read_layer(1, 0, verify=True)


# ---------------------------------------------------------------- staleness


def test_feature_labels_digest_only_the_layers_read(tmp_path):
    store = Store(tmp_path)
    features = FeatureStore.in_entry(store.begin("features", KEY))
    features.write_layers([1, 2], 0, torch.randn(2, 12, 8))
    label = features_label(KEY, [1, 2], 1)
    digest = upstream_digest(store, label)
    features.write(3, 0, torch.randn(12, 8))  # another checkpoint's layer: no change to this label
    assert upstream_digest(store, label) == digest
    features.write(2, 0, torch.randn(12, 8))
    assert upstream_digest(store, label) not in (digest, None)
    assert upstream_digest(store, features_label(KEY, [4], 1)) is None


# ---------------------------------------------------------------- verify


def _damaged_store(tmp_path) -> tuple[Store, dict[str, str], dict[str, str]]:
    """A store with references, features, drafts and scores entries, then damaged in each; returns
    the store, {stage: key} and {name: what `verify` must report}."""
    store = Store(tmp_path / "store")
    refs, feats, drafts, scores = (key_of({"k": n}) for n in range(4))
    ref_dir = commit_files(store, "references", refs, {f"seq_{n}.json": b'{"n": %d}' % n for n in range(3)}, {"n": 3})
    features = FeatureStore.in_entry(store.begin("features", feats))
    for n in range(3):
        features.write_layers([1, 2], n, torch.randn(2, 10, 8))
    store.commit("features", feats, {"layer_ids": [1, 2], "n": 3}, skip=(FEATURES_DIRNAME,),
                 upstream=upstream_digests(store, [entry_label("references", refs)]))
    commit_files(store, "drafts", drafts, {"drafts.json": b'{"per_prompt": [1, 2, 3]}'},
                 upstream=upstream_digests(store, [features_label(feats, [1, 2], 3)]))
    scores_dir = commit_files(store, "scores", scores, {"scores.json": b'{"tau_macro": 3.974}'},
                              upstream=upstream_digests(store, [entry_label("drafts", drafts)]))
    zarr = store.entry("features", feats) / FEATURES_DIRNAME
    flip(ref_dir / "seq_1.json", 2)
    flip(zarr / "layer_1" / "seq_2" / "c" / "0" / "0", 9)
    (zarr / "layer_2" / "seq_0" / "c" / "0" / "0").unlink()
    (scores_dir / "scores.json").write_bytes(b'{"tau_mac')
    features.write(2, 1, torch.randn(10, 8))  # extracted again with another content: the drafts are stale
    keys = {"references": refs, "features": feats, "drafts": drafts, "scores": scores}
    return store, keys, {
        "references": f"references/{refs}: seq_1.json: sha256 differs",
        "bit flip": f"features/{feats}: layer_1/seq_2: corrupt",
        "lost chunk": f"features/{feats}: layer_2/seq_0: chunk 0 is missing",
        "truncated": f"scores/{scores}: scores.json: 9 bytes, 20 at commit",
        "stale": f"drafts/{drafts}: {features_label(feats, [1, 2], 3)}: built on content that has changed",
    }


def test_verify_reports_each_damage_and_repair_removes_exactly_it(tmp_path):
    store, keys, expected = _damaged_store(tmp_path)
    report = verify_store(store)
    lines = [str(p) for p in report.problems]
    for name, message in expected.items():
        assert any(message in line for line in lines), (name, lines)
    assert len(lines) == len(expected) and report.entries == 4 and report.arrays == 6

    report = verify_store(store, repair=True)
    assert len(report.repaired) == len(expected) and not report.busy
    again = verify_store(store)
    assert again.problems == [] and len(again.incomplete) == 3  # references, features, scores: recomputed next
    kept = sorted(p.name for p in store.entry("references", keys["references"]).iterdir())
    assert kept == ["seq_0.json", "seq_2.json"]
    features = FeatureStore.in_entry(store.entry("features", keys["features"]))
    assert features.missing([1, 2], 3) == [(1, 2), (2, 0)]  # only the damaged arrays are extracted again
    assert not store.entry("drafts", keys["drafts"]).exists()


def test_verify_command_exits_1_on_damage_and_0_once_repaired(tmp_path):
    from typer.testing import CliRunner

    from dflash_eval.cli import app

    store, _, expected = _damaged_store(tmp_path)
    result = CliRunner().invoke(app, ["verify", "--store", str(store.root)])
    assert result.exit_code == 1, result.output
    for message in expected.values():
        assert message in result.output
    result = CliRunner().invoke(app, ["verify", "--store", str(store.root), "--repair"])
    assert result.exit_code == 1 and "the next run recomputes exactly these" in result.output
    result = CliRunner().invoke(app, ["verify", "--store", str(store.root)])
    assert result.exit_code == 0, result.output
    assert "0 problems" in result.output and "incomplete references/" in result.output
