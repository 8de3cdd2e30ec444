"""Where references come from: the target in this process, or a serving stack over HTTP.

    --reference local                        the target through transformers (decoding.decode)
    --reference sglang+http://host:port      SGLang's native POST /generate, token ids in and out
    --reference openai+http://host:port/v1   an OpenAI-compatible POST /v1/completions (vLLM, SGLang)

Greedy (temperature 0), or sampled (dflash_core.sampling): every request then carries its own seed
(SGLang's `sampling_params.sampling_seed`, OpenAI's `seed`; the local target seeds a generator with it),
so a completion can be asked for again. A server that ignores seeds still gives valid samples: what the
replay uses is the stored completion, whatever drew it.

Token ids, not text: prompts go to the server as ids, and completions come back as the ids the server
generated (SGLang's `output_ids`, vLLM's `return_token_ids`). A server that returns only text gets its
text re-tokenised with the target's tokenizer, and the round trip is verified (decoding the ids gives
the text back); a reference whose round trip fails is kept but marked unverified.

HTTP: a bounded pool of connections, timeouts, and urllib3's `Retry` on it: connection errors, timeouts
and 5xx answers are retried with exponential backoff (a Retry-After is waited for instead); a 4xx
answer is a clear error at once (retrying cannot fix it).
Before any work, `check_matches` compares the server's tokenizer with the target's on a probe
prompt, and the server's model identity becomes part of the references' key.

What a server reports about itself is a name: restarted with other weights at the same path it
reports the same identity. `fingerprint` is what its model does instead: its tokenization of the
probe text and its greedy continuations of a few fixed probe prompts. The references stage stores it
when it begins an entry and takes it again on resume and before commit, so references of two models
are never mixed in one entry.

API keys: a server started with `--api-key` (SGLang, vLLM) answers 401 `{"error": "Unauthorized"}`
to a request without `Authorization: Bearer <key>`. The key comes from a file
(`--reference-api-key-file FILE`) or from $DFLASH_REFERENCE_API_KEY, never from a flow parameter
(the Prefect UI shows those); the backend's session sends it with every request. It is no part of
the backend's identity: the same model behind a key gives the same references.
"""

import os
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from urllib.parse import urlsplit

import requests
import torch

from dflash_core.decoding import decode
from dflash_core.sampling import GREEDY, Sampling

from ..http_session import retrying_session

SCHEMES = ("sglang", "openai")
API_KEY_ENV = "DFLASH_REFERENCE_API_KEY"
HOW_TO_PASS_KEY = f"pass the key with --reference-api-key-file FILE (a file holding it) or ${API_KEY_ENV}"
# A fast tokenizer refuses concurrent use from several threads ("Already borrowed"): requests run in
# a thread pool, so every tokenizer call made on their behalf holds this lock.
TOKENIZER_LOCK = threading.Lock()
PROBE_TEXT = "Speculative decoding drafts 8 tokens; the target verifies them: def f(x): return x ** 2 # ünïcödé"
# The fingerprint's probe prompts: text, encoded with the target's tokenizer, so any model takes them
# (code, prose, digits). 16 greedy tokens each, eos ignored: a few dozen tokens, next to a references
# run's thousands, and long enough that two models of one tokenizer rarely agree on all of them.
FINGERPRINT_TEXTS = ("def fingerprint(model):\n    return", "The quick brown fox jumps over", "1, 2, 3, 5, 8, 13,")
FINGERPRINT_TOKENS = 16
# Generation gives the same answer however often it is asked (greedy, or sampled with the request's seed), so
# POSTs are retried too.
RETRY_METHODS = frozenset({"GET", "POST"})


class BackendError(RuntimeError):
    """A reference server that cannot be used: unreachable, refusing, or serving another model."""


class ServerModelChanged(BackendError):
    """A reference server's fingerprint differs from the one taken when the references entry was begun."""


def reference_api_key(key_file: str | None) -> str | None:
    """The reference servers' API key: from key_file, else $DFLASH_REFERENCE_API_KEY, else None.

    ValueError names the file (never the key) when it cannot be read, is empty, or holds what an
    HTTP header cannot carry."""
    if key_file:
        try:
            key = Path(key_file).read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--reference-api-key-file {key_file}: cannot read it "
                             f"({getattr(e, 'strerror', None) or type(e).__name__})") from None
        source = f"--reference-api-key-file {key_file}"
        if not key:
            raise ValueError(f"{source} is empty: it must hold the reference server's API key")
    else:
        key = os.environ.get(API_KEY_ENV, "").strip()
        source = f"${API_KEY_ENV}"
        if not key:
            return None
    if not key.isascii() or any(c.isspace() or not c.isprintable() for c in key):
        raise ValueError(f"{source}: the key must be printable ASCII without spaces (it travels in an "
                         "Authorization header)")
    return key


@dataclass(frozen=True)
class Completion:
    """The completion ids of one generation request (the stop token included, if one ended it).

    No finish reason: servers disagree about a stop token emitted as the last allowed token (SGLang
    reports "length"), so callers read it off the ids."""

    token_ids: list[int]
    verified: bool = True  # False: re-tokenised text whose round trip did not give the text back


class LocalBackend:
    """Decoding with the target in this process (the embedded default)."""

    concurrency = 1

    def __init__(self, load_target: Callable, identity: dict):
        self.load_target = load_target  # called on first use: a cached run never loads the target
        self.identity = identity

    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, stop_token_ids: Sequence[int],
                 sampling: Sampling = GREEDY, seed: int | None = None) -> Completion:
        target = self.load_target()
        generator = None if sampling.greedy else torch.Generator(device=target.device).manual_seed(seed or 0)
        ids = decode(target, list(prompt_ids), max_new_tokens, list(stop_token_ids), sampling, generator)
        return Completion(ids[len(prompt_ids):])


class HTTPBackend(ABC):
    """What the server backends share: the connection pool (one session, which carries the API key
    if there is one, for every request), retries, and the tokenizer check.

    retries: attempts after the first, for connection errors, timeouts and 5xx answers. backoff:
    urllib3's backoff factor: the first retry goes at once, the second after 2 * backoff seconds, each
    next one after twice as long.
    """

    def __init__(self, base_url: str, tokenizer, concurrency: int = 8, timeout: float = 600.0,
                 retries: int = 4, backoff: float = 0.5, api_key: str | None = None):
        self.base_url = base_url.rstrip("/")
        self.tokenizer = tokenizer
        self.concurrency = concurrency
        self.timeout = timeout
        self.retries = retries
        # one server, one connection per request in flight
        self.session = retrying_session(retries, backoff, methods=RETRY_METHODS, pool_maxsize=concurrency,
                                        pool_connections=1, bearer_token=api_key)
        self.has_api_key = bool(api_key)

    @property
    @abstractmethod
    def identity(self) -> dict:
        """The served model, as the server says it (part of the references' key)."""

    def request(self, method: str, path: str, payload: dict | None = None, base_url: str | None = None) -> dict:
        """JSON answer of the server (at base_url + path; default this backend's base URL), after the
        session's retries of what a retry can fix."""
        url = f"{base_url or self.base_url}{path}"
        try:
            response = self.session.request(method, url, json=payload, timeout=(10.0, self.timeout))
        except (requests.ConnectionError, requests.Timeout) as e:
            raise BackendError(self._failed_message(url, f"{type(e).__name__}: {e}")) from None
        if response.status_code >= 500:
            raise BackendError(self._failed_message(url, f"HTTP {response.status_code}: {_error_message(response)}"))
        if response.status_code in (401, 403):
            raise BackendError(self._refused_key_message(url, response))
        if response.status_code >= 400:
            raise BackendError(f"{url} refused the request with {response.status_code}: {_error_message(response)}")
        try:
            return response.json()
        except ValueError:
            raise BackendError(f"{url} answered {response.status_code} with a body that is not JSON: "
                               f"{response.text[:200]!r}") from None

    def _failed_message(self, url: str, problem: str) -> str:
        return (f"{url} failed {self.retries + 1} times, last: {problem}. Is the server up? Rerun the same command "
                "when it is: finished references are kept")

    def _refused_key_message(self, url: str, response: requests.Response) -> str:
        answer = f"{url} answered {response.status_code}: {_error_message(response)}"
        problem = "refused the API key sent (the key is wrong for it)" if self.has_api_key else "needs an API key"
        return f"{self.base_url} {problem} ({answer}); {HOW_TO_PASS_KEY}"

    def completion_from_text(self, text: str) -> Completion:
        """A completion the server gave only as text: re-tokenised, and verified by decoding it back."""
        with TOKENIZER_LOCK:
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            return Completion(ids, verified=self.tokenizer.decode(ids) == text)

    @abstractmethod
    def generate(self, prompt_ids: Sequence[int], max_new_tokens: int, stop_token_ids: Sequence[int],
                 sampling: Sampling = GREEDY, seed: int | None = None) -> Completion:
        """The server's completion of prompt_ids, greedy or sampled with `seed` (each kind of server has its
        own request)."""

    def tokenize(self, text: str) -> list[int]:
        """The server's own tokenization of text, without special tokens (SGLang and vLLM: POST /tokenize)."""
        answer = self.request("POST", "/tokenize", {"prompt": text, "add_special_tokens": False})
        return [int(t) for t in answer["tokens"]]

    def check_matches(self, vocab_size: int) -> None:
        """Refuse a server whose tokenizer differs from the target's (a probe prompt's ids).

        Neither SGLang nor vLLM reports its vocabulary size; the probe's ids (multi-byte characters,
        code, digits) catch another tokenizer, and must lie in the target's vocabulary."""
        expected = self.tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
        served = self.tokenize(PROBE_TEXT)
        if served != expected:
            raise BackendError(
                f"{self.base_url} tokenizes the probe text differently from the target's tokenizer "
                f"({len(served)} vs {len(expected)} tokens, first ids {served[:8]} vs {expected[:8]}): "
                f"it serves another model or tokenizer; point --reference at a server of the target"
            )
        if vocab_size and max(expected) >= vocab_size:
            raise BackendError(f"probe ids reach {max(expected)}, beyond the target's vocabulary of {vocab_size}")

    def fingerprint(self) -> dict:
        """What the served model does, not what it is called: its tokenization of the probe text and
        its greedy continuations (ids, FINGERPRINT_TOKENS each, eos ignored) of FINGERPRINT_TEXTS.

        The same weights give the same fingerprint; other weights under the same name and path almost
        surely do not. Costs one /tokenize and len(FINGERPRINT_TEXTS) short generation requests, sent
        one after another (nothing else of this client in flight to batch them with)."""
        with TOKENIZER_LOCK:
            prompts = [self.tokenizer.encode(text, add_special_tokens=False) for text in FINGERPRINT_TEXTS]
        return {"tokenizer_probe": self.tokenize(PROBE_TEXT),
                "continuations": [self.generate(ids, FINGERPRINT_TOKENS, []).token_ids for ids in prompts]}


def fingerprint_difference(before: dict, now: dict) -> str | None:
    """None when two fingerprints (HTTPBackend.fingerprint) agree, else what differs, for a message."""
    if before.get("tokenizer_probe") != now.get("tokenizer_probe"):
        return "it tokenizes the probe text differently"
    for k, (a, b) in enumerate(zip(before.get("continuations", []), now.get("continuations", []))):
        if a != b:
            at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            text = f" {FINGERPRINT_TEXTS[k]!r}" if k < len(FINGERPRINT_TEXTS) else ""
            return (f"its greedy continuation of probe prompt {k + 1}{text} differs from token {at} on "
                    f"(ids {a[at:at + 4]} before, {b[at:at + 4]} now)")
    if before != now:
        return "its probe answers differ"
    return None


class SGLangBackend(HTTPBackend):
    """SGLang's native API: POST /generate with input_ids."""

    kind = "sglang"

    @cached_property
    def identity(self) -> dict:
        """The served model, as the server reports it (part of the references' key)."""
        info = self.request("GET", "/get_model_info")
        return {"kind": self.kind, "model_path": info.get("model_path"), "tokenizer_path": info.get("tokenizer_path"),
                "weight_version": info.get("weight_version")}

    def generate(self, prompt_ids, max_new_tokens, stop_token_ids, sampling=GREEDY, seed=None) -> Completion:
        params = {**request_sampling(sampling), "max_new_tokens": max_new_tokens,
                  "stop_token_ids": list(stop_token_ids), "ignore_eos": not stop_token_ids, "skip_special_tokens": False}
        if not sampling.greedy and seed is not None:
            params["sampling_seed"] = seed
        answer = self.request("POST", "/generate", {"input_ids": list(prompt_ids), "sampling_params": params})
        if "output_ids" in answer:
            return Completion([int(t) for t in answer["output_ids"]])
        # releases before output_ids: text only, without the stop token that ended it, so put it back
        completion = self.completion_from_text(answer["text"])
        finish = answer["meta_info"].get("finish_reason") or {}
        if finish.get("type") == "stop" and isinstance(finish.get("matched"), int):
            completion = Completion(completion.token_ids + [finish["matched"]], completion.verified)
        return completion


class OpenAIBackend(HTTPBackend):
    """An OpenAI-compatible completions API (vLLM, SGLang): POST /v1/completions with token-id prompts."""

    kind = "openai"

    @cached_property
    def identity(self) -> dict:
        """The served model, as the server reports it (part of the references' key)."""
        models = self.request("GET", "/models")["data"]
        if not models:
            raise BackendError(f"{self.base_url}/models lists no model")
        return {"kind": self.kind, "model": models[0]["id"], "root": models[0].get("root")}

    def tokenize(self, text: str) -> list[int]:
        # vLLM serves /tokenize beside /v1, not under it; the same session carries the API key there
        answer = self.request("POST", "/tokenize", {"model": self.model_name(), "prompt": text,
                                                    "add_special_tokens": False},
                              base_url=self.base_url.removesuffix("/v1"))
        return [int(t) for t in answer["tokens"]]

    def model_name(self) -> str:
        return self.identity["model"]

    def generate(self, prompt_ids, max_new_tokens, stop_token_ids, sampling=GREEDY, seed=None) -> Completion:
        body = {"model": self.model_name(), "prompt": list(prompt_ids), "max_tokens": max_new_tokens,
                **request_sampling(sampling), "stop_token_ids": list(stop_token_ids),
                "ignore_eos": not stop_token_ids, "skip_special_tokens": False, "return_token_ids": True}
        if not sampling.greedy and seed is not None:
            body["seed"] = seed
        answer = self.request("POST", "/completions", body)
        choice = answer["choices"][0]
        if choice.get("token_ids") is not None:
            return Completion([int(t) for t in choice["token_ids"]])
        # text only: the stop token is not in the text (vLLM and SGLang leave it out), so put it back.
        # The token that stopped it: vLLM's stop_reason (null for eos), SGLang's matched_stop.
        completion = self.completion_from_text(choice["text"])
        stop = next((s for s in (choice.get("stop_reason"), choice.get("matched_stop")) if _is_token_id(s)), None)
        if choice.get("finish_reason") == "stop" and stop_token_ids:
            ids = completion.token_ids + [stop if stop is not None else stop_token_ids[0]]
            completion = Completion(ids, completion.verified)
        return completion


def request_sampling(sampling: Sampling) -> dict:
    """The sampling fields of a request (the same names in SGLang's sampling_params and OpenAI's body)."""
    if sampling.greedy:
        return {"temperature": 0.0}
    return {"temperature": sampling.temperature, "top_k": sampling.top_k or -1, "top_p": sampling.top_p,
            "min_p": sampling.min_p}


def parse_reference(spec: str) -> tuple[str, str | None]:
    """("local", None) or (scheme, base URL) for --reference; ValueError with the accepted forms."""
    if spec == "local":
        return "local", None
    scheme, _, url = spec.partition("+")
    parts = urlsplit(url)
    if scheme not in SCHEMES or parts.scheme not in ("http", "https") or not parts.netloc:
        raise ValueError(f"--reference {spec!r}: use local, sglang+http://HOST:PORT or openai+http://HOST:PORT/v1")
    return scheme, url


def open_backend(spec: str, tokenizer, api_key_file: str | None = None, **http_options) -> HTTPBackend:
    """The server backend for a --reference spec other than local, sending the API key of
    api_key_file (else $DFLASH_REFERENCE_API_KEY) if there is one."""
    scheme, url = parse_reference(spec)
    if url is None:
        raise ValueError(f"--reference {spec}: the local reference has no server backend")
    backend = {"sglang": SGLangBackend, "openai": OpenAIBackend}[scheme]
    return backend(url, tokenizer, api_key=reference_api_key(api_key_file), **http_options)


def _is_token_id(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _error_message(response: requests.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:300]
    error = body.get("error", body) if isinstance(body, dict) else body
    return str(error.get("message", error) if isinstance(error, dict) else error)[:300]
