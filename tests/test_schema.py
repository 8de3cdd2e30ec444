"""storage/schema.py: each record is the JSON object its stage has always committed, and older entries still parse."""

import json

import pytest

from dflash_eval.storage import Store, key_of
from dflash_eval.storage.schema import (
    BaselineRecord,
    DiagnosticsRecord,
    DraftShardRecord,
    DraftsRecord,
    FeaturesRecord,
    FetchRecord,
    ReferencesRecord,
    ScoresRecord,
    Stage,
)

KEY = key_of({"schema": 1})


def test_records_are_the_json_objects_the_stages_commit():
    local = dict(files={"config.json": "ab", "model.safetensors": "cd"}, source="/runs/a/step_2", step=2,
                 layout="hf", config_source="checkpoint")
    assert FetchRecord(**local).to_record() == local  # no weights_from key unless there is one
    specforge = FetchRecord(**{**local, "layout": "specforge"}, weights_from="training_state.pt: draft_state_dict")
    assert specforge.to_record()["weights_from"] == "training_state.pt: draft_state_dict"
    references = dict(n_prompts=2, n=3, prompts="mixed", target="/models/t", backend={"kind": "transformers"},
                      max_new_tokens=64, stop_token_ids=[2], lookahead=0, unverified=0)
    record = ReferencesRecord(**{**references, "stop_token_ids": (2,)}).to_record()
    assert record == references and isinstance(record["stop_token_ids"], list)
    assert ReferencesRecord(**{**references, "stop_token_ids": (2,)},
                            backend_fingerprint="f" * 64).to_record()["backend_fingerprint"] == "f" * 64
    assert FeaturesRecord(layer_ids=(1, 2), n=3, references=KEY, dtype="float32").to_record() == \
        {"layer_ids": [1, 2], "n": 3, "references": KEY, "dtype": "float32"}
    assert DraftsRecord(checkpoint=KEY, features=KEY, block_size=8, sliding_semantics="causal",
                        layer_ids=(1, 2)).to_record() == \
        {"checkpoint": KEY, "features": KEY, "block_size": 8, "sliding_semantics": "causal", "layer_ids": [1, 2]}
    assert ScoresRecord(tau_macro=3.5, tau_pooled=3.4, drafts=KEY).to_record() == \
        {"tau_macro": 3.5, "tau_pooled": 3.4, "drafts": KEY}
    assert DiagnosticsRecord(drafts=KEY, scores=KEY).to_record() == {"drafts": KEY, "scores": KEY}
    assert BaselineRecord(source="/hub/z-lab/d", step=None).to_record() == {"source": "/hub/z-lab/d", "step": None}


def test_a_committed_record_reads_back_as_itself(tmp_path):
    store = Store(tmp_path / "store")
    drafts = DraftsRecord(checkpoint=KEY, features=KEY, block_size=16, sliding_semantics="non_causal", layer_ids=(3, 7))
    store.begin(Stage.DRAFTS, KEY)
    store.commit(Stage.DRAFTS, KEY, drafts.to_record())
    assert (tmp_path / "store" / "drafts" / KEY[:2] / KEY / "entry.json").is_file()  # the stage's folder is its name
    assert json.loads((store.entry(Stage.DRAFTS, KEY) / "entry.json").read_text())["stage"] == "drafts"
    assert DraftsRecord.from_record(store.read_record("drafts", KEY)) == drafts


def test_older_records_take_the_defaults_and_a_missing_required_key_is_a_key_error():
    fetched = FetchRecord.from_record({"files": {}, "source": "/runs/a/step_2", "step": 2, "unknown": 1})
    assert (fetched.layout, fetched.config_source, fetched.weights_from) == ("hf", "checkpoint", None)
    references = ReferencesRecord.from_record({"n_prompts": 1, "n": 1, "prompts": "p", "backend": {}, "lookahead": 0,
                                               "max_new_tokens": 8, "stop_token_ids": [2], "unverified": 0})
    assert references.target is None and references.stop_token_ids == (2,)
    with pytest.raises(KeyError, match="tau_pooled"):
        ScoresRecord.from_record({"tau_macro": 3.0, "drafts": KEY})


def test_shards_are_recorded_only_when_a_cluster_computed_them():
    shard = {"prompts": [0, 8], "worker": "tcp://10.0.0.2:4011", "host": "w2", "pid": 7, "seconds": 1.5}
    drafts = dict(checkpoint=KEY, features=KEY, block_size=8, sliding_semantics="causal", layer_ids=[1, 2])
    assert DraftsRecord(**{**drafts, "layer_ids": (1, 2)}).to_record() == drafts  # no shards key: as before
    on_cluster = DraftsRecord(**{**drafts, "layer_ids": (1, 2)}, shards=(shard,))
    assert on_cluster.to_record() == {**drafts, "shards": [shard]}
    assert DraftsRecord.from_record(on_cluster.to_record()) == on_cluster
    features = FeaturesRecord(layer_ids=(1,), n=8, references=KEY, dtype="float32",
                              shards=({"sequences": [0, 1], "arrays": 2, "worker": "tcp://10.0.0.2:4011"},))
    assert FeaturesRecord.from_record(features.to_record()).shards == features.shards
    piece = DraftShardRecord(drafts=KEY, start=0, stop=8, worker="tcp://10.0.0.2:4011", host="w2", pid=7, seconds=1.5)
    assert DraftShardRecord.from_record(piece.to_record()) == piece and piece.shard() == shard
    assert Stage.DRAFT_SHARDS == "draft-shards"
