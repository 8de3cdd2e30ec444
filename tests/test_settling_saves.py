"""A training run's folder passed where a checkpoint belongs, while its saves are still being written: the refusal
names the saves, says they are still settling and when they count, instead of sending the user to pass one of
them (which would be refused, or waited for, the same way). Locally (fetch) and through a relay."""

import os
import time

import pytest

from dflash_eval.services.http_server import ErrorResponse
from dflash_eval.services.relay.local_checkpoints import LocalCheckpoints
from dflash_eval.storage.hashing import DigestCache
from dflash_eval.tasks.fetch import CheckpointError, await_checkpoint
from tests.checkpoints import write_checkpoint


def run_folder_with_fresh_saves(root, finished=()):
    """A run folder (settled itself: an old notes file, an old folder time) holding step_100 and step_200 just
    written, and `finished` saves written long ago."""
    run = root / "run1"
    for name in finished:
        write_checkpoint(run / name, {"model.safetensors": 4096})
    for name in ("step_200", "step_100"):
        write_checkpoint(run / name, {"model.safetensors": 4096}, age=0)
    (run / "notes.txt").write_text("x")
    old = time.time() - 120
    os.utime(run / "notes.txt", (old, old))
    os.utime(run, (old, old))
    return run


def test_a_run_folder_whose_saves_are_still_settling_says_so_and_when_they_count(tmp_path):
    run = run_folder_with_fresh_saves(tmp_path)
    started = time.monotonic()
    with pytest.raises(CheckpointError) as refused:
        await_checkpoint(str(run), wait_seconds=3, settle_seconds=30)
    message = str(refused.value)
    assert time.monotonic() - started < 2  # refused at once: the run folder itself never becomes a checkpoint
    assert "its saves step_100, step_200 are still being written (last change 0 s ago; they count once unchanged " \
           "for 30 s: wait and run again, or lower --settle-seconds)" in message, message
    assert "pass one of them" not in message and "do:" not in message, message

    # a finished save beside them is named as one that can be passed now
    both = run_folder_with_fresh_saves(tmp_path / "both", finished=("step_50",))
    with pytest.raises(CheckpointError, match=r"its saves step_100, step_200 are still being written .*; step_50 is "
                                              r"finished and can be passed now"):
        await_checkpoint(str(both), wait_seconds=3, settle_seconds=30)


def test_the_relay_says_the_same_of_a_run_folder_whose_saves_are_settling(tmp_path):
    run_folder_with_fresh_saves(tmp_path)
    checkpoints = LocalCheckpoints(tmp_path.resolve(), 30, DigestCache(tmp_path / "digests.json"))
    with pytest.raises(ErrorResponse) as refused:
        checkpoints.find(["run1"])
    message = refused.value.message
    assert refused.value.status == 404
    assert "its saves step_100, step_200 are still being written (last change 0 s ago; they count once unchanged " \
           "for 30 s: wait and run again, or lower the relay's --settle-seconds)" in message, message
