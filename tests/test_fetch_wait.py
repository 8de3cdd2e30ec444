"""Save, notify, evaluate: a checkpoint that is not there yet, or still being written, is waited for
(bounded), locally and through a relay; one that is broken or is no checkpoint fails at once."""

import os
import shutil
import threading
import time

import pytest

from dflash_eval.services.relay.server import RelayServer
from dflash_eval.tasks.fetch import CheckpointError, await_checkpoint
from tests.checkpoints import write_checkpoint


def write_later(directory, delay: float) -> threading.Thread:
    """A trainer that starts saving `delay` seconds from now."""
    thread = threading.Thread(target=lambda: (time.sleep(delay), write_checkpoint(directory, {"model.safetensors": 4096},
                                                                                age=0)))
    thread.start()
    return thread


@pytest.mark.slow  # starts processes or waits on purpose
def test_a_local_folder_that_appears_and_settles_is_waited_for(tmp_path, capfd):
    folder = tmp_path / "run1" / "step_5"
    folder.parent.mkdir()  # the run's folder exists before its first save
    writer = write_later(folder, 1.0)
    started = time.monotonic()
    ready = await_checkpoint(str(folder), wait_seconds=30, settle_seconds=1.0)
    waited = time.monotonic() - started
    writer.join()
    assert waited >= 2.0  # it appeared after 1 s, then had to stay untouched for 1 s
    assert ready.local is not None and ready.step == 5 and sorted(ready.local.files) == ["config.json", "model.safetensors"]
    err = capfd.readouterr().err
    assert f"waiting for {folder}" in err and "is finished after a wait of" in err


@pytest.mark.slow  # starts processes or waits on purpose
def test_a_local_folder_that_never_appears_fails_naming_it_and_the_wait(tmp_path):
    started = time.monotonic()
    with pytest.raises(CheckpointError, match=r"no folder .*/step_1 \(yet\); gave up after waiting 1 s \(--checkpoint-wait 1\)"):
        await_checkpoint(str(tmp_path / "step_1"), wait_seconds=1, settle_seconds=0)
    assert time.monotonic() - started < 10
    # a folder in a run folder that does not exist either is a wrong path: not waited for
    with pytest.raises(CheckpointError, match="nowhere/step_1 is not a folder, and neither is .*nowhere"):
        await_checkpoint(str(tmp_path / "nowhere" / "step_1"), wait_seconds=60, settle_seconds=0)
    assert time.monotonic() - started < 10


@pytest.mark.slow  # starts processes or waits on purpose
def test_a_folder_that_keeps_changing_never_settles(tmp_path):
    folder = write_checkpoint(tmp_path / "step_6", {"model.safetensors": 4096}, age=0)
    stop = threading.Event()

    def trainer():  # still writing optimizer state next to the weights
        while not stop.wait(0.2):
            (folder / "optimizer.pt").write_bytes(b"x" * 100)

    thread = threading.Thread(target=trainer)
    thread.start()
    try:
        with pytest.raises(CheckpointError, match="changed .* s ago.*gave up after waiting 2 s"):
            await_checkpoint(str(folder), wait_seconds=2, settle_seconds=1)
    finally:
        stop.set()
        thread.join()


def test_broken_weights_and_run_folders_fail_at_once(tmp_path):
    folder = write_checkpoint(tmp_path / "run1" / "step_7", {"model.safetensors": 4096})
    data = (folder / "model.safetensors").read_bytes()
    (folder / "model.safetensors").write_bytes(data[:1000])
    os.utime(folder / "model.safetensors", (time.time() - 120, time.time() - 120))
    started = time.monotonic()
    with pytest.raises(CheckpointError, match="broken.*model.safetensors has 1000 bytes where its header describes 4096"):
        await_checkpoint(str(folder), wait_seconds=60, settle_seconds=30)
    write_checkpoint(tmp_path / "run1" / "step_8", {"model.safetensors": 4096})
    (tmp_path / "run1" / "notes.txt").write_text("x")
    os.utime(tmp_path / "run1" / "notes.txt", (time.time() - 120, time.time() - 120))
    with pytest.raises(CheckpointError, match=r"holds no drafter weights.*sub-folders \['step_7', 'step_8'\] do"):
        await_checkpoint(str(tmp_path / "run1"), wait_seconds=60, settle_seconds=30)
    assert time.monotonic() - started < 10  # neither was waited for


@pytest.mark.slow  # starts processes or waits on purpose
def test_a_relay_checkpoint_still_being_written_is_waited_for(tmp_path, capfd):
    runs = tmp_path / "runs"
    runs.mkdir()
    with RelayServer(runs, state_dir=tmp_path / "state", settle_seconds=3) as relay:
        url = f"{relay.url}/run1/step_9"
        writer = write_later(runs / "run1" / "step_9", 0.5)
        started = time.monotonic()
        ready = await_checkpoint(url, wait_seconds=30)
        waited = time.monotonic() - started
        writer.join()
        assert waited >= 3 and ready.manifest["path"] == "run1/step_9" and ready.step == 9
        err = capfd.readouterr().err
        assert f"waiting for {url}: not on the relay (yet)" in err  # first absent (404) ...
        assert "still being written" in err  # ... then 409 while settling

        with pytest.raises(CheckpointError, match=rf"{url.replace('step_9', 'step_10')}: not on the relay.*"
                                                  r"gave up after waiting 1 s"):
            await_checkpoint(url.replace("step_9", "step_10"), wait_seconds=1)


def test_a_relay_serves_a_linked_folder_as_the_folder_it_points_to(tmp_path):
    runs = tmp_path / "runs"
    write_checkpoint(runs / "run1-step3", {"model.safetensors": 4096})
    (runs / "run1-latest").symlink_to("run1-step3", target_is_directory=True)
    shutil.copytree(runs / "run1-step3", tmp_path / "elsewhere")
    (runs / "outside").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with RelayServer(runs, state_dir=tmp_path / "state", settle_seconds=0) as relay:
        assert [c["path"] for c in relay.list_checkpoints()] == ["run1-step3"]
        latest = await_checkpoint(f"{relay.url}/run1-latest", wait_seconds=0)
        assert latest.manifest["path"] == "run1-step3" and latest.step == 3
        assert latest.manifest["key"] == await_checkpoint(f"{relay.url}/run1-step3", wait_seconds=0).manifest["key"]
        with pytest.raises(CheckpointError, match="not on the relay"):  # a link out of the served folder
            await_checkpoint(f"{relay.url}/outside", wait_seconds=0)
