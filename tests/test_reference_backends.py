"""Reference backends against real servers on loopback: the same references from every backend,
resumption across a server restart, mismatched servers refused before any work, faults retried.

The servers are `dflash_eval.services.reference.server.ReferenceServer` (SGLang /generate and OpenAI
/v1/completions wire formats) serving the tiny trained target.
"""

import copy
import json
import os
import secrets
import socket
import subprocess
import sys
import threading
import time

import pytest
from transformers import AutoTokenizer

from dflash_core.prompts import resolve_prompts
from dflash_core.target import read_target_config
from dflash_eval.services.reference.backends import (
    API_KEY_ENV,
    FINGERPRINT_TEXTS,
    BackendError,
    OpenAIBackend,
    SGLangBackend,
)
from dflash_eval.services.reference.server import ReferenceServer
from dflash_eval.tiny import target as tiny_target
from tests.ports import free_port
from tests.tiny_models import first_prompts
from tests.waiting import answers, wait_until

pytestmark = pytest.mark.slow

MAX_NEW = 40


@pytest.fixture(scope="module")
def tiny(tiny_qwen3_run, tmp_path_factory):
    """The tiny run with a small prompt file: 5 token-id prompts and 2 two-turn conversations."""
    directory = tmp_path_factory.mktemp("backends")
    lines = tiny_qwen3_run.prompts_file.read_text().splitlines()[:5]
    lines += resolve_prompts("multiturn").read_text().splitlines()[:2]
    tiny = copy.copy(tiny_qwen3_run)  # the session's fixture stays as it is for other modules
    tiny.small_prompts = directory / "prompts.jsonl"
    tiny.small_prompts.write_text("\n".join(lines) + "\n")
    return tiny


@pytest.fixture(scope="module")
def server(tiny):
    with ReferenceServer(tiny.target_dir) as s:
        yield s


@pytest.fixture(scope="module")
def text_only_server(tiny):
    """A server that answers text only: clients re-tokenise and verify the round trip."""
    with ReferenceServer(tiny.target_dir, return_token_ids_supported=False) as s:
        yield s


def references(tiny, store, reference, lookahead=False, concurrency=8, prompts=None, **sampling):
    """Run the flow up to the references stage; read back [(id, prompt len, token ids, completion end, finish, verified)]."""
    from tests.evaluations import run_evaluation

    results = run_evaluation(target=str(tiny.target_dir), drafter=str(tiny.drafter_steps[-1]),
                                  prompts=str(prompts or tiny.small_prompts), max_new_tokens=MAX_NEW, store=str(store),
                                  reference=reference, lookahead=lookahead, concurrency=concurrency, until="references",
                                  **sampling)
    return read_references(store, results["keys"]["references"])


def read_references(store, key):
    """The stored references of `key`, as `references` returns them."""
    from dflash_eval.storage import Store
    from dflash_eval.tasks.references import ReferenceSet, load_references

    record = Store(store).read_record("references", key)
    refs = ReferenceSet(key, str(Store(store).entry("references", key)), record["n_prompts"], record["n"],
                        record["lookahead"], samples=(record.get("sampling") or {}).get("samples", 1))
    return [(i.id, i.reference.prompt_len, list(i.reference.token_ids), i.reference.end, i.finish, i.verified)
            for i in load_references(refs)]


def test_every_backend_gives_the_local_references(tiny, server, text_only_server, tmp_path, prefect_api_url):
    local = references(tiny, tmp_path / "local", "local")
    assert [r[0] for r in local][-4:] == ["multiturn-001#1", "multiturn-001#2", "multiturn-002#1", "multiturn-002#2"]
    assert {r[4] for r in local} == {"stop", "length"}  # both endings occur
    for spec in (f"sglang+{server.url}", f"openai+{server.url}/v1",
                 f"sglang+{text_only_server.url}", f"openai+{text_only_server.url}/v1"):
        assert references(tiny, tmp_path / spec.split("+")[0] / spec[-8:].replace("/", "_"), spec) == local, spec

    # the whole flow scores every turn of a conversation as its own item
    from tests.evaluations import run_evaluation

    scored = run_evaluation(target=str(tiny.target_dir), drafter=str(tiny.drafter_steps[-1]),
                                 prompts=str(tiny.small_prompts), max_new_tokens=MAX_NEW, store=str(tmp_path / "local"))
    assert [p["id"] for p in scored["per_prompt"]] == [r[0] for r in local]
    assert scored["stages"]["references"] == "cached" and scored["tau_macro"] > 1.5

    # turn 2's prompt holds the target's own answer to turn 1
    tokenizer = AutoTokenizer.from_pretrained(tiny.target_dir)
    (_, prompt_len, ids, end, _, _), (_, prompt_len_2, ids_2, _, _, _) = local[-4], local[-3]
    answer = tokenizer.decode(ids[prompt_len:end], skip_special_tokens=True).strip()
    assert answer and answer in tokenizer.decode(ids_2[:prompt_len_2])

    # lookahead: the same completions, followed by more greedy tokens, from both backends
    looked = references(tiny, tmp_path / "local-lookahead", "local", lookahead=True)
    assert references(tiny, tmp_path / "sglang-lookahead", f"sglang+{server.url}", lookahead=True) == looked
    block = json.loads((tiny.drafter_steps[-1] / "config.json").read_text())["block_size"]
    for (_, prompt_len, ids, end, finish, _), (_, _, plain, plain_end, plain_finish, _) in zip(looked, local):
        assert (ids[:end], end, finish) == (plain, plain_end, plain_finish)
        assert len(ids) == prompt_len + MAX_NEW + block - 1  # generated past the stop token


def test_every_backend_gives_the_local_sampled_references(tiny, server, tmp_path, prefect_api_url):
    """At Qwen3.6's thinking settings, 2 samples per prompt: each request carries its seed (SGLang's
    sampling_params.sampling_seed, OpenAI's seed), so the wire path gives the completions sampled here."""
    settings = dict(temperature=0.6, top_k=20, top_p=0.95, samples=2, seed=0)
    local = references(tiny, tmp_path / "local", "local", **settings)
    assert [r[0] for r in local][:2] == [f"{local[0][0].split('#')[0]}#s0", f"{local[0][0].split('#')[0]}#s1"]
    assert [r[0] for r in local][-4:] == ["multiturn-002#s0#1", "multiturn-002#s0#2", "multiturn-002#s1#1",
                                          "multiturn-002#s1#2"]
    assert len({tuple(r[2]) for r in local}) > len(local) // 2  # samples, not copies
    for spec in (f"sglang+{server.url}", f"openai+{server.url}/v1"):
        assert references(tiny, tmp_path / spec.split("+")[0], spec, **settings) == local, spec
    greedy = references(tiny, tmp_path / "greedy", "local")
    assert [r[2] for r in local[::2]][:5] != [r[2] for r in greedy][:5]


def serve_in_process(target_dir, port, *options) -> subprocess.Popen:
    """`dflash-eval serve-reference` in its own process (one torch thread), once it accepts requests."""
    process = subprocess.Popen([sys.executable, "-m", "dflash_eval.cli", "serve-reference", "--target", str(target_dir),
                                "--port", str(port), *options], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    for line in process.stdout:
        if "listening on" in line:
            # keep reading its output, or a full pipe would block the server
            threading.Thread(target=process.stdout.read, daemon=True).start()
            wait_until(answers(f"http://127.0.0.1:{port}/health"), 60, "serve-reference", process)
            return process
    raise RuntimeError(f"serve-reference exited with {process.wait()}")


@pytest.mark.parametrize("backend", ["sglang+http://127.0.0.1:{port}", "openai+http://127.0.0.1:{port}/v1"],
                         ids=["sglang", "openai"])
def test_a_server_killed_mid_run_loses_no_finished_reference(tiny, tmp_path, prefect_api_url, backend):
    prompts = first_prompts(tiny, 12, tmp_path / "prompts.jsonl")
    store = tmp_path / "store"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = backend.format(port=port)
    server = serve_in_process(tiny.target_dir, port)
    failure = []
    run = threading.Thread(target=lambda: failure.append(_raises(references, tiny, store, url, concurrency=2,
                                                                 prompts=prompts)))
    run.start()
    deadline = time.monotonic() + 120
    while len(list(store.glob("references/*/*/seq_*.json"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.005)
    server.kill()  # SIGKILL in the middle of the run
    server.wait()
    run.join(timeout=120)
    assert isinstance(failure[0], BackendError) and "Is the server up?" in str(failure[0])
    finished = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in store.glob("references/*/*/seq_*.json")}
    assert 3 <= len(finished) < 12
    assert not list(store.glob("references/*/*/entry.json"))  # nothing reads as complete

    server = serve_in_process(tiny.target_dir, port)  # restarted at the same address
    try:
        resumed = references(tiny, store, url, concurrency=2, prompts=prompts)
    finally:
        server.kill()
    after = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in store.glob("references/*/*/seq_*.json")}
    assert len(after) == 12 and all(after[name] == kept for name, kept in finished.items())  # not redone
    assert resumed == references(tiny, tmp_path / "local", "local", prompts=prompts)


def _raises(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 (handed to the test thread)
        return e
    return None


def test_a_server_of_another_tokenizer_is_refused_before_any_work(tiny, tmp_path):
    from typer.testing import CliRunner

    from dflash_eval.cli import app

    other = tiny_target.train_tokenizer("def other(corpus):\n    return corpus[::-1]\n" * 50, vocab_size=300)
    other.save_pretrained(tmp_path / "other_tokenizer")
    with ReferenceServer(tiny.target_dir, tokenizer_dir=tmp_path / "other_tokenizer") as mismatched:
        for spec in (f"sglang+{mismatched.url}", f"openai+{mismatched.url}/v1"):
            result = CliRunner().invoke(app, [
                "run", "--target", str(tiny.target_dir), "--drafter", str(tiny.drafter_steps[-1]),
                "--prompts", str(tiny.small_prompts), "--store", str(tmp_path / "store"), "--reference", spec])
            assert result.exit_code == 2, result.output
            assert "tokenizes the probe text differently from the target's tokenizer" in result.output
        assert mismatched.requests_served == 0  # no generation request was sent
    assert not (tmp_path / "store").exists()


def test_faults_are_retried_and_refusals_are_not(tiny, server):
    tokenizer = AutoTokenizer.from_pretrained(tiny.target_dir)
    stop = list(read_target_config(tiny.target_dir).eos_token_ids)
    prompt = json.loads(tiny.prompts_file.read_text().splitlines()[0])["input_ids"]
    for backend in (SGLangBackend(server.url, tokenizer, timeout=2.0, retries=3, backoff=0.01),
                    OpenAIBackend(f"{server.url}/v1", tokenizer, timeout=2.0, retries=3, backoff=0.01)):
        expected = backend.generate(prompt, 16, stop)
        before = server.requests_served
        for fault in ("drop", "500", "stall"):  # a cut connection, a server error, a server that hangs
            server.faults.put(fault)
        assert backend.generate(prompt, 16, stop) == expected
        assert server.requests_served - before == 4  # three faults, then the answer

    # a refusal (4xx) is reported at once, with the server's message: a retry cannot fix it
    backend = OpenAIBackend(f"{server.url}/v1", tokenizer, retries=3, backoff=0.01)
    before = server.requests_served
    with pytest.raises(BackendError, match="refused the request with 400"):
        backend.request("POST", "/completions", {"model": backend.model_name(), "prompt": prompt, "max_tokens": 4,
                                                 "temperature": 0.7, "top_p": 0})
    assert server.requests_served - before == 1

    # nobody listening: a clear error after the retries
    dead = SGLangBackend("http://127.0.0.1:9", tokenizer, retries=1, backoff=0.01)
    with pytest.raises(BackendError, match=r"failed 2 times.*Is the server up\? Rerun the same command"):
        dead.generate(prompt, 4, stop)


# --- reference servers behind an API key


def run_command_line(tiny, store, reference, *options, api_url, env=()):
    """`dflash-eval run` in its own process, reporting to the session's Prefect server: (exit code, output)."""
    command = [sys.executable, "-m", "dflash_eval.cli", "run", "--target", str(tiny.target_dir),
               "--drafter", str(tiny.drafter_steps[-1]), "--prompts", str(tiny.small_prompts),
               "--max-new-tokens", str(MAX_NEW), "--store", str(store), "--reference", reference, *options]
    environment = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    environment.update({"PREFECT_API_URL": api_url, "OMP_NUM_THREADS": "1", **dict(env)})
    done = subprocess.run(command, env=environment, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=600)
    return done.returncode, done.stdout


def refused_in_process(tiny, store, reference, *options, env=()):
    """`dflash-eval run` in this process, for runs its input checks refuse before any flow starts."""
    from typer.testing import CliRunner

    from dflash_eval.cli import app

    result = CliRunner().invoke(app, ["run", "--target", str(tiny.target_dir), "--drafter", str(tiny.drafter_steps[-1]),
                                      "--prompts", str(tiny.small_prompts), "--max-new-tokens", str(MAX_NEW),
                                      "--store", str(store), "--reference", reference, *options],
                                env={API_KEY_ENV: None, **dict(env)})
    return result.exit_code, result.output


def stored_bytes(store):
    return b"".join(p.read_bytes() for p in sorted(store.rglob("*")) if p.is_file())


def test_a_run_against_a_server_behind_an_api_key(tiny, tmp_path, prefect_api_url):
    """`serve-reference --api-key-file`: `dflash-eval run` with the key scores; without it, or with a
    wrong one, it exits 2 with one message (which server, that it needs the key, how to pass it)
    before anything is stored."""
    key = f"dflash-{secrets.token_hex(16)}"
    key_file = tmp_path / "key"
    key_file.write_text(key + "\n")
    (tmp_path / "empty").write_text("\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = serve_in_process(tiny.target_dir, port, "--api-key-file", str(key_file))
    try:
        refused = tmp_path / "refused"
        for reference, options, env, problem in (
            (f"sglang+{url}", (), {}, "needs an API key"),
            (f"openai+{url}/v1", (), {}, "needs an API key"),
            (f"openai+{url}/v1", (), {API_KEY_ENV: "not-the-key"}, "refused the API key sent"),
            (f"sglang+{url}", ("--reference-api-key-file", str(tmp_path / "empty")), {API_KEY_ENV: key},
             f"--reference-api-key-file {tmp_path / 'empty'} is empty"),
        ):
            code, output = refused_in_process(tiny, refused, reference, *options, env=env)
            assert code == 2, output
            errors = [line for line in output.splitlines() if line.startswith("error:")]
            assert len(errors) == 1 and problem in errors[0] and "Traceback" not in output, output
            if "API key" in problem:
                assert f"{url}" in errors[0] and "answered 401" in errors[0]
                assert f"--reference-api-key-file FILE (a file holding it) or ${API_KEY_ENV}" in errors[0]
        assert not refused.exists()

        store = tmp_path / "store"
        code, output = run_command_line(tiny, store, f"sglang+{url}", "--reference-api-key-file", str(key_file),
                                        "--out", str(tmp_path / "results.json"), api_url=prefect_api_url)
        assert code == 0, output
        results = json.loads((tmp_path / "results.json").read_text())
        assert results["stages"]["references"] == "ran" and results["tau_macro"] > 1.5
        assert len(results["per_prompt"]) == len(read_references(store, results["keys"]["references"]))
        assert key not in output + json.dumps(results) and key.encode() not in stored_bytes(store)
    finally:
        server.kill()
        server.wait()


def test_an_api_key_is_no_part_of_the_references_key(tiny, server, tmp_path, prefect_api_url, monkeypatch):
    """The same model behind a key (from a file, or from the environment) gives the references, and
    the references key, of the server without one; flow parameters and the store never hold the key."""
    from prefect import get_client

    from tests.evaluations import run_evaluation

    key = f"dflash-{secrets.token_hex(16)}"
    key_file = tmp_path / "key"
    key_file.write_text(key)
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    with ReferenceServer(tiny.target_dir, api_key=key) as keyed:
        for scheme, suffix in (("sglang", ""), ("openai", "/v1")):
            runs = {}
            for name, url, options in (("open", server.url, {}),
                                       ("keyed", keyed.url, {"reference_api_key_file": str(key_file)}
                                        if scheme == "sglang" else {})):
                if name == "keyed" and scheme == "openai":
                    monkeypatch.setenv(API_KEY_ENV, key)
                store = tmp_path / scheme / name
                state = run_evaluation(target=str(tiny.target_dir), drafter=str(tiny.drafter_steps[-1]),
                                            prompts=str(tiny.small_prompts), max_new_tokens=MAX_NEW, store=str(store),
                                            reference=f"{scheme}+{url}{suffix}", until="references", return_state=True,
                                            **options)
                results = state.result()
                refs_key = results["keys"]["references"]
                runs[name] = (refs_key, read_references(store, refs_key))
                with get_client(sync_client=True) as client:
                    parameters = client.read_flow_run(state.state_details.flow_run_id).parameters
                assert key not in json.dumps(parameters) + json.dumps(results.to_json())
                assert key.encode() not in stored_bytes(store)
            assert (parameters.get("generation") or {}).get("reference_api_key_file") == \
                options.get("reference_api_key_file")
            assert runs["keyed"] == runs["open"], scheme
            monkeypatch.delenv(API_KEY_ENV, raising=False)
        # every reference was generated by the keyed server (+ each run's fingerprint: when begun and before commit)
        assert keyed.requests_served == len(runs["open"][1]) * 2 + 2 * 2 * len(FINGERPRINT_TEXTS)
