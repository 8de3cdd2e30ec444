"""The reference server: a real HTTP server on loopback, checked against local greedy decoding.

The target is a tiny randomly initialised Qwen3 with the tiny target's tokenizer (conftest's `tokenizer`).
Its lm_head rows of eos and of one token are swapped so that one prompt's greedy continuation
ends with eos after a few tokens (swapping two rows only relabels two logits: greedy decoding
stays greedy decoding, now with an eos in it).
"""

import json
import os
import re
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import requests
import torch
from transformers import Qwen3ForCausalLM

from dflash_core.decoding import decode, greedy_decode
from dflash_core.sampling import Sampling
from dflash_core.target import Target, load_target
from dflash_eval.services.reference.backends import (
    API_KEY_ENV,
    BackendError,
    OpenAIBackend,
    SGLangBackend,
    open_backend,
    reference_api_key,
)
from dflash_eval.services.reference.server import ReferenceServer
from dflash_eval.tiny import target as tiny_target
from tests.tiny_models import qwen3_config
from tests.waiting import answers, wait_until

REPO = Path(__file__).resolve().parents[1]
SMALL = dict(num_hidden_layers=2, max_position_embeddings=64)  # on the test-size Qwen3 config
MAX_NEW = 12
PROMPTS = ["def add(a, b):\n    return", "import os\nimport sys\n", "class Parser:\n    def __init__(self", "for i in range("]
STALL_SECONDS = 3.0
TIMEOUT = 30  # generous: the machine is shared

pytestmark = pytest.mark.usefixtures("one_thread")


def _ends_with_eos_soon(model, tokenizer, text):
    """The position k >= 2 of a token first seen there in `text`'s greedy continuation, or None."""
    target = Target.from_model(model)
    prompt = tokenizer.encode(text)
    completion = greedy_decode(target, prompt, MAX_NEW)[len(prompt):]
    for k in range(2, MAX_NEW - 2):
        if completion[k] not in completion[:k] and tokenizer.eos_token_id not in completion[:k + 1]:
            return completion[k]
    return None


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, tokenizer):
    eos = tokenizer.eos_token_id
    for seed in range(20):
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(qwen3_config(len(tokenizer), eos, **SMALL)).eval()
        token = _ends_with_eos_soon(model, tokenizer, PROMPTS[0])
        if token is not None:
            break
    else:
        pytest.fail("no seed gives a continuation to end with eos")
    with torch.no_grad():
        head = model.lm_head.weight
        head[[eos, token]] = head[[token, eos]].clone()
    return tiny_target.save_target(model, tokenizer, tmp_path_factory.mktemp("target") / "tiny-qwen3")


@pytest.fixture(scope="module")
def local(target_dir):
    """The target loaded here, to compute what the server must answer."""
    return load_target(target_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def server(target_dir):
    with ReferenceServer(target_dir, stall_seconds=STALL_SECONDS) as server:
        yield server


def expected(local, prompt_ids, max_new=MAX_NEW, stops=None):
    stops = (local_eos(local),) if stops is None else stops
    return greedy_decode(local, prompt_ids, max_new, stop_token_ids=stops)[len(prompt_ids):]


def local_eos(local):
    return local.model.config.eos_token_id


def post(server, path, body, timeout=TIMEOUT):
    return requests.post(server.url + path, json=body, timeout=timeout)


def generate(server, body):
    response = post(server, "/generate", body)
    assert response.status_code == 200, response.text
    return response.json()


def greedy_params(**extra):
    return {"temperature": 0, "max_new_tokens": MAX_NEW, **extra}


# --- SGLang /generate


def test_generate_with_input_ids_is_greedy_decode(server, local, tokenizer):
    eos = tokenizer.eos_token_id
    finishes = []
    for text in PROMPTS:
        ids = tokenizer.encode(text)
        want = expected(local, ids)
        out = generate(server, {"input_ids": ids, "sampling_params": greedy_params()})
        assert out["output_ids"] == want
        meta = out["meta_info"]
        assert meta["prompt_tokens"] == len(ids) and meta["completion_tokens"] == len(want)
        assert re.fullmatch(r"[0-9a-f]{32}", meta["id"])
        if want[-1] == eos:
            assert meta["finish_reason"] == {"type": "stop", "matched": eos}
            assert out["text"] == tokenizer.decode(want[:-1], skip_special_tokens=True)
        else:
            assert len(want) == MAX_NEW and meta["finish_reason"] == {"type": "length", "length": MAX_NEW}
            assert out["text"] == tokenizer.decode(want, skip_special_tokens=True)
        finishes.append(meta["finish_reason"]["type"])
    assert finishes[0] == "stop" and 2 <= len(expected(local, tokenizer.encode(PROMPTS[0]))) < MAX_NEW
    assert "length" in finishes


def test_generate_with_text_tokenizes_like_the_tokenizer(server, local, tokenizer):
    for text in PROMPTS[1:3]:
        out = generate(server, {"text": text, "sampling_params": greedy_params(max_new_tokens=7)})
        ids = tokenizer.encode(text)
        assert out["output_ids"] == expected(local, ids, max_new=7)
        assert out["meta_info"]["prompt_tokens"] == len(ids)


def test_generate_ignore_eos_runs_to_max_new_tokens(server, local, tokenizer):
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode(PROMPTS[0])
    stopped = expected(local, ids)
    out = generate(server, {"input_ids": ids, "sampling_params": greedy_params(ignore_eos=True)})
    assert out["output_ids"] == expected(local, ids, stops=())
    assert len(out["output_ids"]) == MAX_NEW and out["output_ids"][:len(stopped)] == stopped
    assert out["output_ids"][len(stopped) - 1] == eos  # generated, but not a stop any more
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": MAX_NEW}


def test_generate_ignore_eos_also_ignores_stop_token_ids_like_sglang(server, local, tokenizer):
    ids = tokenizer.encode(PROMPTS[3])
    free = expected(local, ids, stops=())
    out = generate(server, {"input_ids": ids, "sampling_params": greedy_params(ignore_eos=True, stop_token_ids=[free[2]])})
    assert out["output_ids"] == free and out["meta_info"]["finish_reason"]["type"] == "length"


def test_a_stop_token_as_the_last_allowed_token(server, local, tokenizer):
    """SGLang checks the length first ("length"); current vLLM checks stop tokens first ("stop")."""
    eos = tokenizer.eos_token_id
    ids = tokenizer.encode(PROMPTS[0])
    want = expected(local, ids)
    assert want[-1] == eos
    out = generate(server, {"input_ids": ids, "sampling_params": greedy_params(max_new_tokens=len(want))})
    assert out["output_ids"] == want and out["meta_info"]["finish_reason"] == {"type": "length", "length": len(want)}
    choice = post(server, "/v1/completions", {"prompt": ids, "max_tokens": len(want), "temperature": 0,
                                              "return_token_ids": True}).json()["choices"][0]
    assert choice["token_ids"] == want and choice["finish_reason"] == "stop" and choice["stop_reason"] is None


def test_generate_stops_at_requested_stop_token(server, local, tokenizer):
    # a prompt whose continuation holds no eos, so that only the requested stop token can end it
    ids = next(ids for ids in map(tokenizer.encode, PROMPTS[1:]) if len(expected(local, ids)) == MAX_NEW)
    free = expected(local, ids)
    stop = free[3]
    cut = free.index(stop) + 1
    out = generate(server, {"input_ids": ids, "sampling_params": greedy_params(stop_token_ids=[stop])})
    assert out["output_ids"] == free[:cut] == expected(local, ids, stops=(local_eos(local), stop))
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == tokenizer.decode(free[:cut - 1], skip_special_tokens=True)


def test_generate_logprobs_are_the_targets(server, local, tokenizer):
    ids = tokenizer.encode(PROMPTS[2])
    out = generate(server, {"input_ids": ids, "sampling_params": greedy_params(max_new_tokens=5),
                            "return_logprob": True, "return_text_in_logprobs": True})
    entries = out["meta_info"]["output_token_logprobs"]
    assert [e[1] for e in entries] == out["output_ids"]
    full = torch.tensor([ids + out["output_ids"][:-1]])
    logprobs = torch.log_softmax(local.forward(full).logits[0, len(ids) - 1:].float(), dim=-1)
    for i, (value, token, text) in enumerate(entries):
        assert value == pytest.approx(float(logprobs[i].max()), abs=1e-4)  # greedy: the top token
        assert text == tokenizer.decode([token])


# --- OpenAI /v1/completions (vLLM)


def test_completions_return_token_ids(server, local, tokenizer):
    eos = tokenizer.eos_token_id
    for text in PROMPTS[:2]:
        ids = tokenizer.encode(text)
        want = expected(local, ids)
        response = post(server, "/v1/completions", {"model": "tiny-qwen3", "prompt": ids, "max_tokens": MAX_NEW,
                                                    "temperature": 0, "return_token_ids": True})
        assert response.status_code == 200, response.text
        out = response.json()
        assert out["object"] == "text_completion" and out["model"] == "tiny-qwen3" and out["id"].startswith("cmpl-")
        choice = out["choices"][0]
        assert choice["token_ids"] == want and choice["prompt_token_ids"] == ids
        stopped = want[-1] == eos
        assert choice["finish_reason"] == ("stop" if stopped else "length") and choice["stop_reason"] is None
        assert choice["text"] == tokenizer.decode(want[:-1] if stopped else want, skip_special_tokens=True)
        assert out["usage"] == {"prompt_tokens": len(ids), "completion_tokens": len(want),
                                "total_tokens": len(ids) + len(want)}


def test_completions_text_prompt_stop_token_and_logprobs(server, local, tokenizer):
    ids = tokenizer.encode(PROMPTS[3])
    free = expected(local, ids, stops=())
    stop = free[4]
    cut = free.index(stop) + 1
    out = post(server, "/v1/completions", {"prompt": PROMPTS[3], "max_tokens": MAX_NEW, "temperature": 0.0,
                                           "stop_token_ids": [stop], "ignore_eos": True, "logprobs": 2,
                                           "return_token_ids": True}).json()
    choice = out["choices"][0]
    assert choice["token_ids"] == free[:cut] and choice["prompt_token_ids"] == ids
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    logprobs = choice["logprobs"]
    assert len(logprobs["tokens"]) == cut and all(v <= 0 for v in logprobs["token_logprobs"])
    assert logprobs["tokens"] == [tokenizer.decode([t]) for t in free[:cut]]
    assert all(max(top.values()) == pytest.approx(v) for top, v in zip(logprobs["top_logprobs"], logprobs["token_logprobs"]))


def test_completions_unknown_model_is_404(server):
    response = post(server, "/v1/completions", {"model": "other", "prompt": [5, 6], "temperature": 0})
    assert response.status_code == 404
    assert response.json()["error"]["type"] == "NotFoundError"


def test_text_only_server_gives_no_ids_and_clients_must_retokenize(target_dir, local, tokenizer):
    with ReferenceServer(target_dir, return_token_ids_supported=False) as server:
        ids = tokenizer.encode(PROMPTS[1])
        want = expected(local, ids)
        choice = post(server, "/v1/completions", {"prompt": ids, "max_tokens": MAX_NEW, "temperature": 0,
                                                  "return_token_ids": True}).json()["choices"][0]
        assert "token_ids" not in choice and "prompt_token_ids" not in choice
        assert choice["text"] == tokenizer.decode(want, skip_special_tokens=True)
        # What a client falls back to: re-tokenising the text gives ids that decode to the same text,
        # which need not be the ids the target generated.
        retokenized = tokenizer.encode(choice["text"])
        assert tokenizer.decode(retokenized) == choice["text"]
        out = generate(server, {"input_ids": ids, "sampling_params": greedy_params()})
        assert "output_ids" not in out and out["text"] == choice["text"]
        assert out["meta_info"]["completion_tokens"] == len(want)


# --- refusals and errors


def sampled(local, prompt, max_new, sampling, seed):
    ids = decode(local, prompt, max_new, (), sampling, torch.Generator().manual_seed(seed))
    return ids[len(prompt):]


def test_sampled_requests_follow_their_seed(server, local):
    """SGLang's sampling_params.sampling_seed and vLLM's seed: the completion is the local sampler's with a
    generator seeded so (the same on both routes), another seed gives another one."""
    settings = {"temperature": 1.3, "top_k": 40, "top_p": 0.95, "min_p": 0.01}
    sampling = Sampling(1.3, 40, 0.95, 0.01)
    answers = {}
    for seed in (1, 2):
        out = generate(server, {"input_ids": [5, 6, 7], "sampling_params": {
            **settings, "max_new_tokens": MAX_NEW, "ignore_eos": True, "sampling_seed": seed}})
        choice = post(server, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": MAX_NEW, "ignore_eos": True,
                                                  "return_token_ids": True, "seed": seed, **settings}).json()
        assert out["output_ids"] == choice["choices"][0]["token_ids"] == sampled(local, [5, 6, 7], MAX_NEW,
                                                                                  sampling, seed)
        answers[seed] = out["output_ids"]
    assert answers[1] != answers[2]
    assert answers[1] != expected(local, [5, 6, 7], stops=()), "greedy, not sampled"


def test_absent_temperature_samples_as_real_servers_do(server, local):
    out = generate(server, {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": MAX_NEW, "ignore_eos": True,
                                                                         "sampling_seed": 3}})
    assert out["output_ids"] == sampled(local, [5, 6, 7], MAX_NEW, Sampling(1.0), 3)


@pytest.mark.parametrize("path, body, needle", [
    ("/generate", {"input_ids": [5, 6, 7], "sampling_params": {"temperature": -0.5}}, "temperature must be non-negative"),
    ("/generate", {"input_ids": [5, 6, 7], "sampling_params": {"temperature": 0.5, "top_p": 0}}, "top_p must be in"),
    ("/generate", {"input_ids": [5, 6, 7], "sampling_params": {"temperature": 0.5, "min_p": 1.0}}, "min_p must be in"),
    ("/generate", {"input_ids": [5, 6, 7], "sampling_params": {"top_k": -2}}, "top_k must be -1"),
    ("/generate", {"input_ids": [5, 6, 7], "sampling_params": {"sampling_seed": "x"}}, "sampling_seed must be an integer"),
    ("/v1/completions", {"prompt": [5, 6, 7], "temperature": "hot"}, "temperature must be a number"),
    ("/v1/completions", {"prompt": [5, 6, 7], "seed": 1.5}, "seed must be an integer"),
])
def test_bad_sampling_is_refused(server, path, body, needle):
    response = post(server, path, body)
    assert response.status_code == 400
    assert needle in response.json()["error"]["message"]


def test_top_k_1_is_greedy(server, local):
    out = generate(server, {"input_ids": [5, 6, 7], "sampling_params": {"temperature": 0.8, "top_k": 1,
                                                                         "max_new_tokens": 4}})
    assert out["output_ids"] == expected(local, [5, 6, 7], max_new=4)


@pytest.mark.parametrize("path, body, needle", [
    ("/generate", b"{not json", "not valid JSON"),
    ("/generate", [1, 2], "JSON object"),
    ("/generate", {"sampling_params": {"temperature": 0}}, "Either text or input_ids"),
    ("/generate", {"text": "a", "input_ids": [1], "sampling_params": {"temperature": 0}}, "Either text or input_ids"),
    ("/generate", {"text": ["a", "b"], "sampling_params": {"temperature": 0}}, "batch"),
    ("/generate", {"input_ids": [[1, 2], [3]], "sampling_params": {"temperature": 0}}, "batch"),
    ("/generate", {"input_ids": [1, 99999], "sampling_params": {"temperature": 0}}, "vocabulary"),
    ("/generate", {"input_ids": [1, "x"], "sampling_params": {"temperature": 0}}, "input_ids"),
    ("/generate", {"input_ids": [1], "sampling_params": {"temperature": 0, "max_new_tokens": -1}}, "max_new_tokens"),
    ("/generate", {"input_ids": [1] * 60, "sampling_params": {"temperature": 0, "max_new_tokens": 10}}, "context"),
    ("/generate", {"input_ids": [1], "sampling_params": {"temperature": 0, "stop": ["\n"]}}, "stop"),
    ("/generate", {"input_ids": [1], "stream": True, "sampling_params": {"temperature": 0}}, "stream"),
    ("/v1/completions", {"temperature": 0}, "prompt"),
    ("/v1/completions", {"prompt": [[1, 2], [3, 4]], "temperature": 0}, "batch"),
    ("/v1/completions", {"prompt": [1, 2], "temperature": 0, "n": 2}, "n=2"),
    ("/v1/completions", {"prompt": [1, 2], "temperature": 0, "ignore_eos": "yes"}, "ignore_eos"),
    ("/tokenize", {"prompt": 5}, "prompt"),
])
def test_malformed_requests_get_400(server, path, body, needle):
    if isinstance(body, bytes):
        response = requests.post(server.url + path, data=body, timeout=TIMEOUT)
    else:
        response = post(server, path, body)
    assert response.status_code == 400, response.text
    assert needle in response.json()["error"]["message"]


def test_unknown_path_and_wrong_method(server):
    response = requests.get(server.url + "/v1/chat/nothing", timeout=TIMEOUT)
    assert response.status_code == 404 and "Not Found" in response.json()["error"]["message"]
    assert post(server, "/nope", {}).status_code == 404
    assert requests.get(server.url + "/generate", timeout=TIMEOUT).status_code == 405
    assert post(server, "/health", {}).status_code == 405


# --- information endpoints


def test_health_model_info_models_tokenize(server, target_dir, tokenizer):
    health = requests.get(server.url + "/health", timeout=TIMEOUT)
    assert health.status_code == 200 and health.content == b""
    info = requests.get(server.url + "/get_model_info", timeout=TIMEOUT).json()
    assert info["model_path"] == info["tokenizer_path"] == str(target_dir)
    assert info["is_generation"] is True and info["architectures"] == ["Qwen3ForCausalLM"]
    models = requests.get(server.url + "/v1/models", timeout=TIMEOUT).json()
    assert models["object"] == "list"
    assert models["data"][0]["id"] == "tiny-qwen3" and models["data"][0]["root"] == str(target_dir)
    assert models["data"][0]["max_model_len"] == SMALL["max_position_embeddings"]
    tokenized = post(server, "/tokenize", {"model": "tiny-qwen3", "prompt": PROMPTS[0]}).json()
    ids = tokenizer.encode(PROMPTS[0])
    assert tokenized == {"tokens": ids, "count": len(ids), "max_model_len": SMALL["max_position_embeddings"]}
    assert post(server, "/v1/tokenize", {"prompt": PROMPTS[:2]}).json()["count"] == [len(ids), len(tokenizer.encode(PROMPTS[1]))]
    detokenized = post(server, "/detokenize", {"tokens": ids}).json()
    assert detokenized["text"] == detokenized["prompt"] == PROMPTS[0]
    assert requests.get(server.url + "/tokenizer_info", timeout=TIMEOUT).json()["tokenizer_class"]


def test_a_different_tokenizer_is_served(target_dir, local, corpus, tmp_path):
    other = tiny_target.train_tokenizer(corpus[0][:20_000], vocab_size=300)
    other.save_pretrained(tmp_path / "other")
    with ReferenceServer(target_dir, tokenizer_dir=tmp_path / "other") as server:
        assert requests.get(server.url + "/get_model_info", timeout=TIMEOUT).json()["tokenizer_path"] == str(tmp_path / "other")
        ids = other.encode(PROMPTS[0])
        assert post(server, "/tokenize", {"prompt": PROMPTS[0]}).json()["tokens"] == ids
        out = generate(server, {"text": PROMPTS[0], "sampling_params": greedy_params(max_new_tokens=4)})
        assert out["meta_info"]["prompt_tokens"] == len(ids)
        assert out["output_ids"] == expected(local, ids, max_new=4)


# --- faults


def test_drop_closes_the_connection_and_the_next_request_works(server, local):
    before = server.requests_served
    server.faults.put("drop")
    with pytest.raises(requests.exceptions.ConnectionError):
        post(server, "/generate", {"input_ids": [5, 6], "sampling_params": greedy_params(max_new_tokens=3)})
    out = generate(server, {"input_ids": [5, 6], "sampling_params": greedy_params(max_new_tokens=3)})
    assert out["output_ids"] == expected(local, [5, 6], max_new=3)
    assert server.requests_served == before + 2 and server.faults.empty()


def test_500_and_the_next_request_works(server, local):
    before = server.requests_served
    server.faults.put("500")
    response = post(server, "/v1/completions", {"prompt": [5, 6], "max_tokens": 3, "temperature": 0})
    assert response.status_code == 500 and "injected fault" in response.json()["error"]["message"]
    response = post(server, "/v1/completions", {"prompt": [5, 6], "max_tokens": 3, "temperature": 0,
                                                "return_token_ids": True})
    assert response.status_code == 200 and response.json()["choices"][0]["token_ids"] == expected(local, [5, 6], max_new=3)
    assert server.requests_served == before + 2
    assert requests.get(server.url + "/health", timeout=TIMEOUT).status_code == 200
    assert server.requests_served == before + 2 and server.faults.empty()  # only generation requests count


@pytest.mark.slow  # starts processes or waits on purpose
def test_stall_times_the_client_out_and_the_next_request_works(server, local):
    server.faults.put("stall")
    with pytest.raises(requests.exceptions.Timeout):
        post(server, "/generate", {"input_ids": [7, 8], "sampling_params": greedy_params(max_new_tokens=3)}, timeout=0.5)
    out = generate(server, {"input_ids": [7, 8], "sampling_params": greedy_params(max_new_tokens=3)})
    assert out["output_ids"] == expected(local, [7, 8], max_new=3)


@pytest.mark.slow  # starts processes or waits on purpose
def test_a_stalled_request_does_not_block_others_and_is_answered_after_the_stall(server, local):
    server.faults.put("stall")
    before = server.requests_served
    result = {}

    def stalled():
        start = time.monotonic()
        result["out"] = generate(server, {"input_ids": [9, 10], "sampling_params": greedy_params(max_new_tokens=3)})
        result["seconds"] = time.monotonic() - start

    thread = threading.Thread(target=stalled)
    thread.start()
    deadline = time.monotonic() + 10
    while server.requests_served == before and time.monotonic() < deadline:
        time.sleep(0.01)
    start = time.monotonic()
    out = generate(server, {"input_ids": [11, 12], "sampling_params": greedy_params(max_new_tokens=3)})
    assert time.monotonic() - start < STALL_SECONDS and "out" not in result
    assert out["output_ids"] == expected(local, [11, 12], max_new=3)
    thread.join(timeout=TIMEOUT)
    assert result["seconds"] >= STALL_SECONDS
    assert result["out"]["output_ids"] == expected(local, [9, 10], max_new=3)


def test_eight_concurrent_requests_are_all_answered_correctly(server, local, tokenizer):
    cases = [(tokenizer.encode(PROMPTS[i % len(PROMPTS)]) + [i + 20], 4 + i) for i in range(8)]
    results = [None] * len(cases)

    def run(i, ids, max_new):
        if i % 2:
            body = {"prompt": ids, "max_tokens": max_new, "temperature": 0, "return_token_ids": True}
            results[i] = post(server, "/v1/completions", body).json()["choices"][0]["token_ids"]
        else:
            results[i] = generate(server, {"input_ids": ids, "sampling_params": greedy_params(max_new_tokens=max_new)})["output_ids"]

    threads = [threading.Thread(target=run, args=(i, ids, max_new)) for i, (ids, max_new) in enumerate(cases)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=TIMEOUT)
    assert results == [expected(local, ids, max_new=max_new) for ids, max_new in cases]


# --- SGLang-style OpenAI answers, API keys (SGLang's --api-key), and the clients reading them

KEY = "test-key-7f3a9c0d51e2b84d"


def completion_choice(server, body):
    response = post(server, "/v1/completions", {"temperature": 0, "max_tokens": MAX_NEW, **body})
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def no_eos_prompt(local, tokenizer):
    """Token ids of a prompt whose greedy continuation holds no eos within MAX_NEW tokens."""
    return next(ids for ids in map(tokenizer.encode, PROMPTS[1:]) if len(expected(local, ids)) == MAX_NEW)


def test_completions_in_sglang_style_report_matched_stop(target_dir, local, tokenizer):
    eos = tokenizer.eos_token_id
    with ReferenceServer(target_dir, openai_style="sglang") as server:
        ids = tokenizer.encode(PROMPTS[0])
        want = expected(local, ids)
        assert want[-1] == eos
        # SGLang's choice: matched_stop (eos included), no stop_reason, no token ids even when asked for
        assert completion_choice(server, {"prompt": ids, "return_token_ids": True}) == {
            "index": 0, "text": tokenizer.decode(want[:-1], skip_special_tokens=True), "logprobs": None,
            "finish_reason": "stop", "matched_stop": eos}
        # a stop token as the last allowed token: SGLang checks the length first
        choice = completion_choice(server, {"prompt": ids, "max_tokens": len(want)})
        assert (choice["finish_reason"], choice["matched_stop"]) == ("length", None)
        assert choice["text"] == tokenizer.decode(want, skip_special_tokens=True)

        ids = no_eos_prompt(local, tokenizer)
        free = expected(local, ids)
        stop = free[3]
        cut = free.index(stop) + 1
        choice = completion_choice(server, {"prompt": ids, "stop_token_ids": [stop]})
        assert (choice["finish_reason"], choice["matched_stop"]) == ("stop", stop)
        assert choice["text"] == tokenizer.decode(free[:cut - 1], skip_special_tokens=True)
        # as its /generate: ignore_eos drops the requested stop tokens too
        choice = completion_choice(server, {"prompt": ids, "stop_token_ids": [stop], "ignore_eos": True})
        assert (choice["finish_reason"], choice["matched_stop"]) == ("length", None)
        assert choice["text"] == tokenizer.decode(free, skip_special_tokens=True)
    with pytest.raises(ValueError, match="openai_style"):
        ReferenceServer(target_dir, openai_style="tgi")


@pytest.mark.parametrize("style", ["sglang", "vllm"])
def test_text_only_clients_put_back_the_stop_token_the_server_names(target_dir, local, tokenizer, style):
    """SGLang names the stop token in matched_stop, vLLM in stop_reason (null for eos)."""
    eos = tokenizer.eos_token_id
    with ReferenceServer(target_dir, openai_style=style, return_token_ids_supported=False) as server:
        backend = OpenAIBackend(f"{server.url}/v1", tokenizer, retries=0)
        ids = no_eos_prompt(local, tokenizer)
        stop = expected(local, ids)[3]
        # listed after eos: only the server's answer says which one ended it
        completion = backend.generate(ids, MAX_NEW, [eos, stop])
        assert completion.token_ids[-1] == stop
        text = completion_choice(server, {"prompt": ids, "stop_token_ids": [eos, stop]})["text"]
        assert completion.token_ids[:-1] == tokenizer.encode(text, add_special_tokens=False)
        if style == "sglang":  # vLLM reports null for eos: the client can only take the first stop id
            ids = tokenizer.encode(PROMPTS[0])
            want = expected(local, ids)
            other = next(t for t in range(len(tokenizer)) if t not in want)
            assert backend.generate(ids, MAX_NEW, [other, eos]).token_ids[-1] == eos


@pytest.fixture(scope="module")
def keyed_server(target_dir):
    with ReferenceServer(target_dir, api_key=KEY) as server:
        yield server


def test_an_api_key_is_checked_as_sglang_does(keyed_server, local, tokenizer):
    url = keyed_server.url
    before = keyed_server.requests_served
    for path in ("/health", "/health_generate"):  # open: liveness probes carry no secret
        assert requests.get(url + path, timeout=TIMEOUT).status_code == 200
    refused = ({}, {"Authorization": "Bearer wrong-key"}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"},
               {"Authorization": f"Bearer {KEY}x"}, {"Authorization": f"Bearer {KEY[:-1]}"})
    # everything else, unknown paths too (the check comes before routing): 401 with SGLang's body
    for method, path in (("GET", "/v1/models"), ("GET", "/get_model_info"), ("POST", "/tokenize"),
                         ("POST", "/generate"), ("POST", "/v1/completions"), ("GET", "/nope"), ("POST", "/nope")):
        for headers in refused:
            response = requests.request(method, url + path, json={}, headers=headers, timeout=TIMEOUT)
            assert response.status_code == 401, (method, path, headers)
            assert response.json() == {"error": "Unauthorized"}
    assert keyed_server.requests_served == before  # refused before a generation is counted
    assert requests.get(url + "/nope", headers={"Authorization": f"Bearer {KEY}"}, timeout=TIMEOUT).status_code == 404

    ids = tokenizer.encode(PROMPTS[0])
    body = {"input_ids": ids, "sampling_params": greedy_params()}
    with requests.Session() as session:  # a refused body is never read: its connection closes, the session opens another
        refused = session.post(url + "/generate", json=body, timeout=TIMEOUT)
        assert refused.status_code == 401 and refused.headers["Connection"] == "close"
        out = session.post(url + "/generate", json=body, headers={"Authorization": f"bearer {KEY}"}, timeout=TIMEOUT)
        assert out.status_code == 200 and out.json()["output_ids"] == expected(local, ids)
    assert keyed_server.requests_served == before + 1
    with pytest.raises(ValueError, match="api_key"):
        ReferenceServer(keyed_server.target_dir, api_key="")


def test_backends_send_the_key_and_name_a_missing_or_wrong_one(keyed_server, local, tokenizer):
    url = keyed_server.url
    ids = tokenizer.encode(PROMPTS[1])
    for make in (lambda **kw: SGLangBackend(url, tokenizer, **kw), lambda **kw: OpenAIBackend(f"{url}/v1", tokenizer, **kw)):
        backend = make(api_key=KEY)
        sent = []
        send = backend.session.request
        backend.session.request = lambda method, to, **kw: sent.append(to) or send(method, to, **kw)
        backend.check_matches(local.vocab_size)  # /tokenize (beside /v1 for OpenAI) needs the key too
        assert backend.generate(ids, 6, [tokenizer.eos_token_id]).token_ids == expected(local, ids, max_new=6)
        assert f"{url}/tokenize" in sent  # through the backend's one session, which carries the key
        assert KEY not in json.dumps(backend.identity)

        for api_key, problem in ((None, "needs an API key"), ("wrong-key", "refused the API key sent")):
            refused = make(api_key=api_key, retries=3, backoff=30.0)
            start = time.monotonic()
            with pytest.raises(BackendError) as error:
                refused.identity  # noqa: B018
            message = str(error.value)
            assert time.monotonic() - start < 10  # not retried: a retry cannot fix it
            assert message.startswith(f"{refused.base_url} {problem}") and "401: Unauthorized" in message
            assert "--reference-api-key-file FILE" in message and f"${API_KEY_ENV}" in message
            assert KEY not in message


def test_the_api_key_comes_from_a_file_or_the_environment(keyed_server, tokenizer, tmp_path, monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    assert reference_api_key(None) is None
    assert "Authorization" not in open_backend(f"sglang+{keyed_server.url}", tokenizer).session.headers
    monkeypatch.setenv(API_KEY_ENV, f" {KEY}\n")
    assert reference_api_key(None) == KEY
    key_file = tmp_path / "key"
    key_file.write_text("from-file\n")
    assert reference_api_key(str(key_file)) == "from-file"  # the file first
    backend = open_backend(f"openai+{keyed_server.url}/v1", tokenizer, api_key_file=str(key_file))
    assert backend.session.headers["Authorization"] == "Bearer from-file"
    for content, needle in (("", "is empty"), (" \n", "is empty"), ("two words", "printable ASCII"),
                            ("clé-secrète", "printable ASCII")):
        key_file.write_text(content)
        with pytest.raises(ValueError, match=needle) as error:
            reference_api_key(str(key_file))
        assert str(key_file) in str(error.value) and (not content.strip() or content not in str(error.value))
    with pytest.raises(ValueError, match="cannot read"):
        reference_api_key(str(tmp_path / "missing"))
    monkeypatch.setenv(API_KEY_ENV, "two words")
    with pytest.raises(ValueError, match=API_KEY_ENV):
        reference_api_key(None)


# --- command line


@pytest.mark.slow  # starts processes or waits on purpose
def test_cli_serves_until_terminated(target_dir):
    command = [sys.executable, "-m", "dflash_eval.cli", "serve-reference", "--target", str(target_dir), "--port", "0",
               "--served-model-name", "ref"]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    watchdog = threading.Timer(120, process.kill)  # never hang the test run on a silent server
    watchdog.start()
    try:
        lines, match = [], None
        for line in process.stdout:  # ends if the process dies
            lines.append(line)
            match = re.search(r"listening on (http://\S+)", line)
            if match:
                break
        assert match, "".join(lines)
        url = match.group(1)
        wait_until(answers(url + "/health"), 60, "serve-reference", process)  # bound; it may answer late
        assert requests.get(url + "/v1/models", timeout=TIMEOUT).json()["data"][0]["id"] == "ref"
    finally:
        watchdog.cancel()
        process.terminate()
        process.wait(timeout=TIMEOUT)
        process.stdout.close()


def test_cli_reports_a_missing_target(tmp_path):
    from typer.testing import CliRunner

    from dflash_eval.cli import app

    result = CliRunner().invoke(app, ["serve-reference", "--target", str(tmp_path / "none"), "--port", "0"])
    assert result.exit_code == 2
    assert "does not exist" in result.output


@pytest.mark.slow  # starts processes or waits on purpose
def test_cli_serves_behind_an_api_key_file(target_dir, tmp_path):
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    command = [sys.executable, "-m", "dflash_eval.cli", "serve-reference", "--target", str(target_dir), "--port", "0",
               "--api-key-file", str(key_file)]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    watchdog = threading.Timer(120, process.kill)
    watchdog.start()
    try:
        lines, match = [], None
        for line in process.stdout:
            lines.append(line)
            match = re.search(r"listening on (http://\S+)", line)
            if match:
                break
        assert match and "API key required" in lines[-1], "".join(lines)
        url = match.group(1)
        wait_until(answers(url + "/health"), 60, "serve-reference", process)  # bound; it may answer late
        assert requests.get(url + "/v1/models", timeout=TIMEOUT).status_code == 401
        models = requests.get(url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=TIMEOUT)
        assert models.status_code == 200 and models.json()["data"][0]["id"] == "tiny-qwen3"
    finally:
        watchdog.cancel()
        process.terminate()
        output = process.communicate(timeout=TIMEOUT)[0]
    assert KEY not in "".join(lines) + output  # never logged


def test_cli_refuses_an_empty_or_missing_api_key_file(target_dir, tmp_path):
    from typer.testing import CliRunner

    from dflash_eval.cli import app

    (tmp_path / "empty").write_text("\n")
    for name, needle in (("empty", "is empty"), ("missing", "cannot read")):
        result = CliRunner().invoke(app, ["serve-reference", "--target", str(target_dir), "--port", "0",
                                          "--api-key-file", str(tmp_path / name)])
        assert result.exit_code == 2, result.output
        assert needle in result.output and name in result.output


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/detokenize", {"tokens": [10**15]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/generate", {"input_ids": [10**15], "sampling_params": greedy_params()}, "input_ids"),
    ("/v1/completions", {"prompt": [2**40], "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 2, "logprobs": 10**9}, "logprobs"),
], ids=["detokenize-huge-id", "detokenize-negative-id", "generate-huge-id", "completions-huge-id", "huge-logprobs"])
def test_requests_out_of_range_are_400_naming_the_field(server, path, body, param):
    response = post(server, path, body)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_deeply_nested_json_is_a_400(server):
    body = b"[" * 100_000 + b"]" * 100_000
    response = requests.post(server.url + "/generate", data=body, headers={"Content-Type": "application/json"},
                             timeout=TIMEOUT)
    assert response.status_code == 400 and "nested too deeply" in response.json()["error"]["message"]


def test_a_body_over_the_cap_is_a_413_before_it_is_read(server):
    from dflash_eval.services.reference.server import MAX_BODY_BYTES

    with socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])), timeout=TIMEOUT) as s:
        s.sendall(f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: {MAX_BODY_BYTES + 1}\r\n\r\n".encode())
        answer = s.recv(65536).decode()
    assert answer.startswith("HTTP/1.1 413") and "Connection: close" in answer, answer


# --- values Python's json reads but no model takes: 400 naming the field (not 500), and the server keeps serving

def raw_post(server, path: str, body: str) -> tuple[int, dict]:
    """POST `body` as it is written (JSON's NaN, a lone surrogate's escape): (status, the answer's JSON)."""
    import http.client

    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=TIMEOUT)
    try:
        connection.request("POST", path, body=body.encode(), headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def still_serves(server, local):
    assert generate(server, {"input_ids": [5, 6, 7], "sampling_params": greedy_params(max_new_tokens=2)})[
        "output_ids"] == expected(local, [5, 6, 7], max_new=2)


GENERATE = '{{"input_ids": [5, 6, 7], "sampling_params": {{"max_new_tokens": 2, {}}}}}'
COMPLETIONS = '{{"prompt": [5, 6, 7], "max_tokens": 2, {}}}'


@pytest.mark.parametrize(("path", "body", "param", "says"), [
    ("/generate", GENERATE.format('"temperature": NaN'), "temperature",
     "temperature must be a finite number >= 0, got NaN"),
    ("/v1/completions", COMPLETIONS.format('"temperature": NaN'), "temperature",
     "temperature must be a finite number >= 0, got NaN"),
    ("/generate", GENERATE.format('"temperature": Infinity'), "temperature",
     "temperature must be a finite number >= 0, got Infinity"),
    ("/v1/completions", COMPLETIONS.format('"temperature": 1e308'), "temperature",
     "temperature must be 0 (greedy) or lie in [0.01, 2], got 1e+308"),
    ("/generate", GENERATE.format('"temperature": 0.001'), "temperature",
     "temperature must be 0 (greedy) or lie in [0.01, 2], got 0.001"),
    ("/v1/completions", COMPLETIONS.format('"temperature": 1, "top_p": NaN'), "top_p",
     "top_p must be a finite number, got NaN"),
    ("/generate", GENERATE.format('"temperature": 1, "sampling_seed": -1'), "sampling_seed",
     "sampling_seed must be an integer from 0 to 2**64 - 1, got -1"),
    ("/generate", GENERATE.format(f'"temperature": 1, "sampling_seed": {2**64}'), "sampling_seed",
     f"sampling_seed must be an integer from 0 to 2**64 - 1, got {2**64}"),
    ("/v1/completions", COMPLETIONS.format('"temperature": 1, "seed": -5'), "seed",
     "seed must be an integer from 0 to 2**64 - 1, got -5"),
    ("/v1/completions", COMPLETIONS.format(f'"temperature": 0, "seed": {2**64}'), "seed",
     f"seed must be an integer from 0 to 2**64 - 1, got {2**64}"),
    ("/generate", '{"text": "a\\ud800b", "sampling_params": {"temperature": 0, "max_new_tokens": 2}}', "text",
     "text must be valid Unicode text: it holds a lone surrogate at character 1"),
    ("/v1/completions", '{"prompt": "a\\ud800b", "temperature": 0, "max_tokens": 2}', "prompt",
     "prompt must be valid Unicode text: it holds a lone surrogate at character 1"),
    ("/v1/completions", '{"prompt": ["\\udfff"], "temperature": 0, "max_tokens": 2}', "prompt",
     "prompt must be valid Unicode text: it holds a lone surrogate at character 0"),
    ("/tokenize", '{"prompt": ["ok", "\\ud800"]}', "prompt",
     "prompt must be valid Unicode text: it holds a lone surrogate at character 0"),
], ids=["generate-nan", "completions-nan", "generate-infinity", "completions-1e308", "generate-0.001",
        "completions-top-p-nan", "generate-negative-seed", "generate-seed-2**64", "completions-negative-seed",
        "completions-seed-2**64", "generate-surrogate", "completions-surrogate", "completions-surrogate-in-a-list",
        "tokenize-surrogate"])
def test_values_json_reads_but_no_model_takes_are_400_naming_the_field(server, local, path, body, param, says):
    status, answer = raw_post(server, path, body)
    assert status == 400, answer
    assert answer["error"] == {"message": says, "type": "BadRequestError", "param": param, "code": 400}
    still_serves(server, local)


def test_an_integer_too_long_for_python_is_a_400(server, local):
    status, answer = raw_post(server, "/generate", GENERATE.format('"temperature": ' + "9" * 5000))
    assert status == 400 and "not valid JSON" in answer["error"]["message"], answer
    status, answer = raw_post(server, "/generate", GENERATE.format('"temperature": 1' + "0" * 400))
    assert status == 400 and answer["error"]["param"] == "temperature", answer
    still_serves(server, local)


def test_two_different_content_lengths_are_a_400_and_the_connection_closes(server, local):
    """RFC 9112, 6.3: a request whose Content-Length headers disagree cannot be framed; the server answers 400 and
    closes the connection (what follows the first body would otherwise be read as a request of its own)."""
    body = json.dumps({"input_ids": [5, 6, 7], "sampling_params": greedy_params(max_new_tokens=2)}).encode()
    with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: %d\r\nContent-Length: 5\r\n\r\n" % len(body) + body)
        answer = b""
        while chunk := s.recv(65536):  # the server closes the connection after its answer
            answer += chunk
    head, _, payload = answer.decode().partition("\r\n\r\n")
    assert head.startswith("HTTP/1.1 400") and "Connection: close" in head, answer
    assert "Content-Length headers that disagree" in json.loads(payload)["error"]["message"]
    # the same length twice frames the body as one does
    with socket.create_connection(("127.0.0.1", server.port), timeout=TIMEOUT) as s:
        s.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nConnection: close\r\n"
                  b"Content-Length: %d\r\nContent-Length: %d\r\n\r\n" % (len(body), len(body)) + body)
        answer = b""
        while chunk := s.recv(65536):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 200"), answer
    still_serves(server, local)
