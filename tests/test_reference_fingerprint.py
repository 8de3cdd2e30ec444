"""A reference server's model is fingerprinted, not only named: an entry begun with one model is never
completed, or committed, with another's references.

The scenario (found by a tester): a server restarted with other weights at the same path reports the
same identity (model path, weight_version), so a half-finished references entry was completed with the
other model's outputs and committed. Here two tiny targets share a tokenizer and differ in weights
(the trained tiny target, and the same with its weights perturbed); each is served in turn by
`ReferenceServer` from one folder on one port, so both report exactly the same identity.
"""

import itertools
import os
import shutil
import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_eval.services.reference.backends import BackendError
from dflash_eval.services.reference.server import ReferenceServer
from dflash_eval.storage import Store
from tests.tiny_models import first_prompts

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

MAX_NEW = 24  # the references' length; the fingerprint's probes are 16 tokens: the servers below tell them apart
N_PROMPTS = 12
KEPT = 5  # references the interrupted run finishes


@pytest.fixture(scope="module")
def models(tiny_qwen3_run, tmp_path_factory):
    """Weights of model A (the tiny target) and model B (A perturbed: same tokenizer, config and names),
    a prompt file, and the one folder both are served from."""
    root = tmp_path_factory.mktemp("fingerprint")
    weights = tiny_qwen3_run.target_dir / "model.safetensors"
    generator = torch.Generator().manual_seed(1)
    other = {name: t + 0.3 * t.float().std() * torch.randn(t.shape, generator=generator).to(t.dtype)
             for name, t in load_file(weights).items()}
    save_file(other, root / "b.safetensors", metadata={"format": "pt"})
    prompts = first_prompts(tiny_qwen3_run, N_PROMPTS, root / "prompts.jsonl")
    served = root / "served"
    shutil.copytree(tiny_qwen3_run.target_dir, served)
    return {"a": weights, "b": root / "b.safetensors", "prompts": prompts, "served": served,
            "target": tiny_qwen3_run.target_dir, "drafter": tiny_qwen3_run.drafter_steps[-1]}


def serve(models, weights: str, port: int = 0) -> ReferenceServer:
    """A started server of `weights` ("a" or "b") from the shared folder: same model path, same identity.
    It records every generation request's max_new_tokens in `server.lengths`."""
    # a new file put in place, as a deploy does: a server still running keeps its own (memory-mapped) weights,
    # where overwriting them in place would pull the pages from under it (SIGBUS)
    staged = models["served"] / "model.safetensors.new"
    shutil.copyfile(models[weights], staged)
    os.replace(staged, models["served"] / "model.safetensors")
    server = ReferenceServer(models["served"], port=port)
    server.lengths = []
    generate = server._generate

    def recording(prompt_ids, max_new_tokens, stop_ids, *sampling):
        server.lengths.append(max_new_tokens)
        return generate(prompt_ids, max_new_tokens, stop_ids, *sampling)

    server._generate = recording
    return server.start()


def port_of(server: ReferenceServer) -> int:
    return int(server.url.rsplit(":", 1)[1])


def references(models, store, server_or_url, refresh=False):
    """The references stage (the task's function) against a server or "local": [(id, token ids)]."""
    from dflash_eval.tasks.references import PromptChoice, ReferenceSet, generate_references, load_references

    spec = server_or_url if server_or_url == "local" else f"sglang+{server_or_url.url}"
    out = generate_references.fn(str(models["target"]), PromptChoice(str(models["prompts"])), MAX_NEW, str(store),
                                 reference=spec,
                                 concurrency=2, refresh=refresh)
    refs = out if isinstance(out, ReferenceSet) else out.result()
    return [(item.id, list(item.reference.token_ids)) for item in load_references(refs)]


def seq_files(store) -> dict:
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in Path(store).glob("references/*/*/seq_*.json")}


def committed(store) -> list:
    return list(Path(store).glob("references/*/*/entry.json"))


def reference_requests(server) -> int:
    return sum(n == MAX_NEW for n in server.lengths)


@pytest.fixture(scope="module")
def interrupted(models, tmp_path_factory):
    """A store holding a half-finished entry of model A's references: the server answered KEPT references,
    then failed every request (500) until the run gave up. (store, port)."""
    store = tmp_path_factory.mktemp("interrupted") / "store"
    server = serve(models, "a")
    generate, calls = server._generate, itertools.count()  # next() is atomic: requests arrive concurrently

    def failing_after_kept(prompt_ids, max_new_tokens, stop_ids, *sampling):
        if max_new_tokens == MAX_NEW and next(calls) >= KEPT:
            raise RuntimeError("injected: the server goes down")
        return generate(prompt_ids, max_new_tokens, stop_ids, *sampling)

    server._generate = failing_after_kept
    try:
        with pytest.raises(BackendError, match="Is the server up"):
            references(models, store, server)
    finally:
        server.stop()
    assert len(seq_files(store)) == KEPT and not committed(store)
    return store, port_of(server)


def test_a_server_restarted_with_other_weights_never_completes_the_entry(models, interrupted, tmp_path,
                                                                        prefect_api_url):
    """The tester's case: rerun against the same name, path and port, now serving model B. The run stops
    with one message (which server, that its model changed, what to do); nothing is committed, A's
    references are kept untouched, and B generated no reference. --refresh then starts anew with B."""
    from tests.evaluations import run_evaluation

    store = tmp_path / "store"
    shutil.copytree(interrupted[0], store)
    kept = seq_files(store)
    server = serve(models, "b", port=interrupted[1])
    try:
        with pytest.raises(BackendError) as stopped:
            run_evaluation(target=str(models["target"]), drafter=str(models["drafter"]),
                                prompts=str(models["prompts"]), max_new_tokens=MAX_NEW, store=str(store),
                                reference=f"sglang+{server.url}", concurrency=2, until="references")
        message = str(stopped.value)
        assert f"reference server sglang+{server.url}" in message
        assert "its model changed since this references entry was begun" in message
        assert f"model_path {models['served']}" in message  # it calls itself what it did before
        assert f"The entry's {KEPT} finished references came from the model it served then" in message
        assert "serve that model again to resume" in message and "--refresh" in message
        assert not committed(store) and seq_files(store) == kept
        assert reference_requests(server) == 0  # B generated no reference

        # the advice works: --refresh starts the entry anew, with B's references only
        refreshed = references(models, store, server, refresh=True)
        assert refreshed == references(models, tmp_path / "b-fresh", server)
    finally:
        server.stop()
    a_only = references(models, tmp_path / "a-local", "local")  # model A is the target: local greedy is A's
    assert sum(r != a for r, a in zip(refreshed, a_only)) >= N_PROMPTS // 2  # the models do differ


def test_an_unchanged_server_resumes_and_the_fingerprint_costs_six_short_requests(models, interrupted, tmp_path):
    """No false alarm: the same weights restarted resume the entry (A's KEPT references untouched), and
    the result equals local greedy decoding. The fingerprint, taken when resuming and before commit, is
    2 x 3 generation requests of 16 tokens (and 2 /tokenize), next to the references' requests."""
    from dflash_eval.services.reference.backends import FINGERPRINT_TEXTS, FINGERPRINT_TOKENS

    store = tmp_path / "store"
    shutil.copytree(interrupted[0], store)
    kept = seq_files(store)
    server = serve(models, "a", port=interrupted[1])
    try:
        resumed = references(models, store, server)
    finally:
        server.stop()
    after = seq_files(store)
    assert len(after) == N_PROMPTS and all(after[name] == kept[name] for name in kept)  # not redone
    assert resumed == references(models, tmp_path / "local", "local")
    probes = [n for n in server.lengths if n != MAX_NEW]
    assert reference_requests(server) == N_PROMPTS - KEPT
    assert probes == [FINGERPRINT_TOKENS] * (2 * len(FINGERPRINT_TEXTS)) == [16] * 6
    record = Store(store).read_record("references", committed(store)[0].parent.name)
    assert len(record["backend_fingerprint"]) == 64


def test_a_server_swapped_during_the_run_commits_nothing(models, tmp_path):
    """A swap the run does not notice (the client's retries reach the new server within seconds): the
    fingerprint taken before commit differs, so the run stops, commits nothing and removes the references
    it generated (some are A's, some B's). A rerun against B then starts anew and gives B's only."""
    store = tmp_path / "store"
    a = serve(models, "a")
    generate, calls, reached, swapped = a._generate, itertools.count(), threading.Event(), threading.Event()

    def paused_after_kept(prompt_ids, max_new_tokens, stop_ids, *sampling):
        if max_new_tokens == MAX_NEW and next(calls) >= KEPT:
            reached.set()
            swapped.wait(60)  # answered by A once B serves: the run holds references of both models
        return generate(prompt_ids, max_new_tokens, stop_ids, *sampling)

    a._generate = paused_after_kept
    failure = []

    def run():
        try:
            references(models, store, a)
        except Exception as e:  # noqa: BLE001 (handed to the test thread)
            failure.append(e)

    thread = threading.Thread(target=run)
    thread.start()
    b = None
    try:
        assert reached.wait(60)
        for _ in range(4):  # A's open connections are cut at their next request: the client reconnects, to B
            a.faults.put("drop")
        a.stop()
        b = serve(models, "b", port=port_of(a))
        swapped.set()
        thread.join(120)
        assert reference_requests(b) > 0 and reference_requests(a) > KEPT  # both models answered references
        assert failure and isinstance(failure[0], BackendError), failure
        message = str(failure[0])
        assert f"reference server sglang+{a.url}" in message and "its model changed during this run" in message
        assert "were removed and nothing was committed" in message
        assert not committed(store) and not seq_files(store)

        # B's entry, from scratch: nothing of A's is left to mix in
        assert references(models, store, b) == references(models, tmp_path / "b-fresh", b)
    finally:
        swapped.set()
        thread.join(10)
        if b is not None:
            b.stop()


def test_an_entry_begun_without_a_fingerprint_is_not_resumed_unchecked(models, interrupted, tmp_path):
    """References left by a dflash-eval that stored no fingerprint cannot be tied to a model: they are
    generated again (a warning says so) rather than completed with whatever the server now serves."""
    store = tmp_path / "store"
    shutil.copytree(interrupted[0], store)
    (fingerprint,) = Path(store).glob("references/*/*/fingerprint.json")
    fingerprint.unlink()
    server = serve(models, "a", port=interrupted[1])
    try:
        resumed = references(models, store, server)
    finally:
        server.stop()
    assert reference_requests(server) == N_PROMPTS  # none kept
    assert resumed == references(models, tmp_path / "local", "local")
    assert fingerprint.exists()
