"""Training steps read from a checkpoint's files, then its name (storage.checkpoint)."""

import json

from storage.checkpoint import step_from_name, training_step


def test_step_from_config_trainer_state_then_name(tmp_path):
    folder = tmp_path / "checkpoint-1200"
    folder.mkdir()
    assert training_step(folder) == 1200  # nothing in the files: the name
    (folder / "trainer_state.json").write_text(json.dumps({"global_step": 1190}))
    assert training_step(folder) == 1190  # HF Trainer's state wins over the name
    (folder / "config.json").write_text(json.dumps({"step": 1180}))
    assert training_step(folder) == 1180  # the config wins over both
    (folder / "config.json").write_text(json.dumps({"step": True, "global_step": "7"}))
    assert training_step(folder) == 1190  # not integers: ignored
    assert training_step(tmp_path / "final") is None  # no files, no number


def test_step_from_name():
    assert step_from_name("run1/step_1000") == 1000
    assert step_from_name("run1/iter42/") == 42
    assert step_from_name("run7/final") is None
