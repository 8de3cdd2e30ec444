"""A real HTTP server for a local Hugging Face target's GREEDY completions, speaking the wire
formats of SGLang's native `/generate` and of the OpenAI-compatible `/v1/completions` (as vLLM and
SGLang implement it). For tests (a real server on loopback, with injectable faults) and for users
without a GPU serving stack. Plain stdlib `http.server`, one thread per connection.

Every completion is `dflash_core.decoding.greedy_decode(target, prompt_ids, max_new_tokens, stops)`,
so it is bit-identical to a local greedy run in the same dtype and device. Stop tokens are the
target's eos ids (`read_target_config(target_dir).eos_token_ids`) plus the request's
`stop_token_ids`. Only greedy decoding is served: a request whose sampling is not greedy gets 400.

Facts about the real servers this follows (stored public sources; "SGLang" = sgl-project/sglang,
"vLLM" = vllm-project/vllm):

- SGLang `/generate` request (`python/sglang/srt/managers/io_struct.py` GenerateReqInput): one of
  `text` or `input_ids` (a list of them is a batch), `sampling_params`, `return_logprob`,
  `return_text_in_logprobs`. Text is tokenized with `tokenizer.encode(text)` (special tokens added).
- SGLang sampling params (`python/sglang/srt/sampling/sampling_params.py`): `max_new_tokens`
  default 128, `temperature` default 1.0 (so a client MUST send 0 for greedy), `top_k == 1` or
  `temperature < 1e-6` is greedy, `stop_token_ids`, `ignore_eos` (it disables eos AND
  `stop_token_ids`: both are checked under `if not ignore_eos`, `managers/schedule_batch.py`
  `Req.check_finished`), `skip_special_tokens` default True, `no_stop_trim` default False.
- SGLang `/generate` response (`managers/tokenizer_manager.py` `_handle_batch_output`, tokenizer
  initialised server): `{"text", "output_ids", "meta_info"}`. `output_ids` are the COMPLETION ids
  only, the matched stop/eos token included (`detokenizer_manager.py` passes the untrimmed
  `decode_ids`; only the text is trimmed by `trim_matched_stop`). Older releases (whose BatchStrOut
  had no ids) sent only text + meta_info. `meta_info` holds `id`, `finish_reason`, `prompt_tokens`,
  `completion_tokens`, `cached_tokens`, `e2e_latency`, ...; `finish_reason` is
  `{"type": "stop", "matched": <token id>}` or `{"type": "length", "length": <max_new_tokens>}`
  (`schedule_batch.py` FINISH_MATCHED_TOKEN / FINISH_LENGTH). The length check runs first: a stop
  token emitted as the last allowed token reports "length". With `return_logprob`,
  `meta_info["output_token_logprobs"]` is a list of `[logprob, token_id, text-or-null]`
  (`detokenize_logprob_tokens`; text only with `return_text_in_logprobs`).
- SGLang errors: `{"error": {"message": ...}}` with HTTP 400 (`entrypoints/http_server.py`
  `_create_error_response`). `GET /health` is an empty 200. `GET /get_model_info` (newer:
  `/model_info`) returns `model_path`, `tokenizer_path`, `is_generation`,
  `preferred_sampling_params` (+ `weight_version`, `model_type`, `architectures` in newer ones).
- Tokenizer endpoints: SGLang `POST /tokenize` = `/v1/tokenize` (`entrypoints/openai/
  serving_tokenize.py`): `{"prompt": str | [str], "add_special_tokens": true}` ->
  `{"tokens", "count", "max_model_len"}`; `/detokenize` `{"tokens"}` -> `{"text"}`. vLLM `POST
  /tokenize` (`vllm/entrypoints/openai/protocol.py` TokenizeCompletionRequest/TokenizeResponse):
  `{"model", "prompt", "add_special_tokens"}` -> `{"count", "max_model_len", "tokens",
  "token_strs"}`; `/detokenize` `{"tokens"}` -> `{"prompt"}`; opt-in `GET /tokenizer_info`
  (`--enable-tokenizer-info-endpoint`) returns the tokenizer config with `tokenizer_class`. No
  endpoint of either server reports the model's vocabulary size; `/tokenize` shows the tokenizer.
- vLLM `/v1/completions` (`vllm/entrypoints/openai/engine/protocol.py` CompletionRequest,
  `completion/serving.py`): `prompt` is str | [int] | [str] | [[int]]; `max_tokens` default 16;
  `temperature` default None -> 1.0 (or the model's generation config); `stop_token_ids`,
  `ignore_eos` (drops eos only), `logprobs` (int), `return_token_ids` (then each choice carries
  `token_ids` = completion ids with the stop token, and `prompt_token_ids`), `skip_special_tokens`.
  Response: `id` "cmpl-...", `object` "text_completion", `created`, `model`, `choices[{index, text,
  logprobs, finish_reason "stop"|"length", stop_reason (the stop token id, null for eos),
  token_ids, prompt_token_ids}]`, `usage{prompt_tokens, completion_tokens, total_tokens}`. The text
  leaves out the stop token (`v1/engine/detokenizer.py` skips it but keeps it in `token_ids`).
  Current vLLM checks stop tokens before the length cap (older v1 checked length first).
- vLLM `/v1/models`: `{"object": "list", "data": [{id, object "model", created, owned_by, root,
  parent, max_model_len, permission}]}`; an unknown `model` gets 404 `NotFoundError`. vLLM errors
  are `{"error": {"message", "type", "param", "code"}}`.
- SGLang `/v1/completions` (`entrypoints/openai/serving_completions.py`, `protocol.py`
  CompletionResponseChoice): each choice is `{index, text, logprobs, finish_reason, matched_stop}`,
  where `finish_reason` is the `/generate` finish type ("stop" | "length", the length checked first)
  and `matched_stop` its `matched` (the stop token id, eos included; a stop string; null after
  "length"). No `stop_reason`, no token ids (`return_token_ids` is not a field: ignored). As on
  `/generate`, `ignore_eos` drops `stop_token_ids` too, the text leaves the stop token out unless
  `no_stop_trim`.
- API keys. SGLang `--api-key` (`add_api_key_middleware`, installed by `entrypoints/http_server.py`;
  `srt/utils.py`, newer releases `srt/utils/auth.py`): a middleware before routing lets through
  OPTIONS and every path starting with `/health` or `/metrics` (so `/health_generate` too); any other
  request, unknown paths included, without `Authorization: Bearer <key>` gets 401 with the body
  `{"error": "Unauthorized"}` (a string, unlike SGLang's other errors). Newer releases take the
  scheme in any case, compare in constant time, and add `--admin-api-key` for admin routes (403).
  vLLM `--api-key` (or `VLLM_API_KEY`; `entrypoints/openai/api_server.py`): the same header and the
  same 401 body; older releases guard only paths under `/v1` (`/tokenize` stays open), newer ones
  every route but `/health`, `/ping`, `/load`, `/version`, `/metrics` and the API docs.

Endpoints here: GET /health, /health_generate, /get_model_info (= /model_info), /get_server_info
(a small subset of SGLang's), /v1/models, /tokenizer_info; POST (SGLang also PUT) /generate,
/v1/completions, /tokenize (= /v1/tokenize), /detokenize (= /v1/detokenize; answers both "text"
and "prompt").

This server: errors are `{"error": {"message", "type", "param", "code"}}` (a superset of
SGLang's); unknown paths 404. `openai_style="sglang"` answers `/v1/completions` as SGLang does
(above); the default is vLLM's. With `api_key` it checks the key as SGLang does (constant-time),
before anything else: a refused request is neither routed nor counted in `requests_served`.
It does not stream, batch or sample; parameters that would change the output and that it does not
implement (stop strings, penalties, n > 1, grammars, ...) get 400
rather than being ignored. Stops are the target config's eos ids (what local greedy runs use);
real servers also stop on the tokenizer's eos id, which is normally among them. Text prompts are encoded with the served tokenizer (which
`tokenizer_dir` may make a different one from the target's). Logprobs come from one
teacher-forced forward over prompt + completion.

Fault injection (generation requests only, one fault each, in order): put "drop" (close the
connection without a response), "500" (HTTP 500 with an error body) or "stall" (wait
`stall_seconds`, then answer) into `server.faults`. `server.requests_served` counts generation
requests received, faulted ones included, so tests can count retries.
"""

from __future__ import annotations

import hmac
import json
import logging
import queue
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch
import torch.nn.functional as F

from ..decoding import greedy_decode
from ..target import DTYPES, load_target, read_target_config

logger = logging.getLogger(__name__)

FAULTS = ("drop", "500", "stall")
OPENAI_STYLES = ("vllm", "sglang")
OPEN_PATHS = ("/health", "/metrics")  # SGLang: reachable without the API key (path prefixes)
GREEDY_EPS = 1e-6  # SGLang: temperature below this is greedy (vLLM's threshold is 1e-5)
SERVER_VERSION = "dflash-eval-reference"

# Parameters that change the output, with the values under which they do not: anything else is
# refused (this server implements none of them).
_NEUTRAL = {
    "n": (None, 1),
    "stream": (None, False),
    "stop": (None, "", []),
    "stop_regex": (None, "", []),
    "min_new_tokens": (None, 0),
    "min_tokens": (None, 0),
    "frequency_penalty": (None, 0, 0.0),
    "presence_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0),
    "logit_bias": (None, {}),
    "regex": (None,),
    "json_schema": (None,),
    "ebnf": (None,),
    "structural_tag": (None,),
    "response_format": (None,),
    "structured_outputs": (None,),
    "allowed_token_ids": (None,),
    "use_beam_search": (None, False),
    "best_of": (None, 1),
    "echo": (None, False),
    "suffix": (None, ""),
    "prompt_logprobs": (None,),
    "top_logprobs_num": (None, 0),
    "token_ids_logprob": (None,),
    "input_embeds": (None,),
    "prompt_embeds": (None,),
    "image_data": (None,),
}


class RequestError(Exception):
    """An error answered to the client as {"error": {...}} with an HTTP status."""

    def __init__(self, message: str, status: int = 400, type_: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status, self.type, self.param = status, type_, param

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.status}}


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _token_ids(value, name: str) -> list[int]:
    if not isinstance(value, list) or not value or not all(_is_int(t) for t in value):
        raise RequestError(f"{name} must be a non-empty list of integer token ids", param=name)
    return list(value)


def _flag(params: dict, name: str, default: bool) -> bool:
    value = params.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, got {value!r}", param=name)
    return value


def _is_neutral(value, neutral) -> bool:
    return any(value is v or (type(value) is type(v) and value == v) for v in neutral)


def _check_supported(params: dict) -> None:
    for name, neutral in _NEUTRAL.items():
        if name in params and not _is_neutral(params[name], neutral):
            raise RequestError(f"{name}={params[name]!r} is not supported by this reference server "
                               "(it serves plain greedy decoding only)", param=name)


def _check_greedy(params: dict) -> None:
    """Greedy iff temperature < 1e-6 or top_k == 1 (both servers); an absent temperature is the
    servers' default 1.0, i.e. sampling."""
    temperature, top_k = params.get("temperature"), params.get("top_k")
    if temperature is not None and not _is_number(temperature):
        raise RequestError(f"temperature must be a number, got {temperature!r}", param="temperature")
    if top_k is not None and not _is_int(top_k):
        raise RequestError(f"top_k must be an integer, got {top_k!r}", param="top_k")
    if temperature is not None and temperature < 0:
        raise RequestError(f"temperature must be non-negative, got {temperature}", param="temperature")
    if top_k == 1 or (temperature is not None and temperature < GREEDY_EPS):
        return
    got = ("the request sets no temperature, and SGLang and vLLM then default to 1.0, i.e. sampling"
           if temperature is None else f"got temperature={temperature}")
    raise RequestError(f"this reference server only does greedy decoding: send temperature 0 ({got})",
                       param="temperature")


def _max_tokens(value, name: str, default: int | None) -> int | None:
    if value is None:
        return default
    if not _is_int(value) or value < 0:
        raise RequestError(f"{name} must be a non-negative integer, got {value!r}", param=name)
    return value


def _stop_token_ids(value) -> list[int]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(_is_int(t) for t in value):
        raise RequestError(f"stop_token_ids must be a list of integer token ids, got {value!r}", param="stop_token_ids")
    return list(value)


class ReferenceServer:
    """Serves `target_dir`'s greedy completions over HTTP (see the module docstring).

    Binds at construction (`port=0` picks a free port; `url` tells which). `start()` serves in a
    daemon thread, `serve_forever()` in this one; `stop()` shuts down. A context manager starts
    and stops it.

    `tokenizer_dir` serves a different tokenizer than the target's (text prompts, output text).
    `return_token_ids_supported=False` answers text only: `/generate` leaves out `output_ids` and
    `/v1/completions` ignores `return_token_ids`, so clients must re-tokenise.
    `openai_style` ("vllm" or "sglang") is whose `/v1/completions` answer this server gives.
    `api_key`: every request but `/health*` and `/metrics*` must carry `Authorization: Bearer <key>`.
    """

    def __init__(self, target_dir, host: str = "127.0.0.1", port: int = 0, dtype: str = "float32",
                 served_model_name: str | None = None, tokenizer_dir=None, *, device: str = "cpu",
                 return_token_ids_supported: bool = True, stall_seconds: float = 30.0,
                 openai_style: str = "vllm", api_key: str | None = None):
        from transformers import AutoTokenizer

        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
        if openai_style not in OPENAI_STYLES:
            raise ValueError(f"openai_style must be one of {', '.join(OPENAI_STYLES)}, got {openai_style!r}")
        if api_key is not None and not api_key:
            raise ValueError("api_key must not be empty (None serves without a key)")
        self.target_dir = Path(target_dir)
        self.tokenizer_dir = Path(tokenizer_dir) if tokenizer_dir is not None else self.target_dir
        self.dtype, self.device = dtype, device
        self.target = load_target(self.target_dir, dtype=DTYPES[dtype], device=device)
        self.tokenizer = AutoTokenizer.from_pretrained(self.tokenizer_dir)
        self.eos_token_ids = tuple(read_target_config(self.target_dir).eos_token_ids)
        self.served_model_name = served_model_name or self.target_dir.name
        self.return_token_ids_supported = return_token_ids_supported
        self.openai_style = openai_style
        self._api_key = api_key.encode("utf-8") if api_key else None
        self.stall_seconds = float(stall_seconds)
        self.faults: queue.Queue[str] = queue.Queue()
        self.created = int(time.time())

        self._lock = threading.Lock()
        self._model_lock = threading.Lock()
        self._tokenizer_lock = threading.Lock()  # fast tokenizers refuse concurrent use ("Already borrowed")
        self._requests_served = 0
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._serving = False
        self._httpd = _HTTPServer((host, port), _Handler)
        self._httpd.reference = self

    # --- lifecycle

    @property
    def url(self) -> str:
        host, port = self._httpd.server_address[:2]
        return f"http://{host}:{port}"

    @property
    def requires_api_key(self) -> bool:
        return self._api_key is not None

    @property
    def requests_served(self) -> int:
        """Generation requests (/generate, /v1/completions) received so far, faulted ones included."""
        with self._lock:
            return self._requests_served

    def start(self) -> "ReferenceServer":
        if self._thread is None:
            self._serving = True
            self._thread = threading.Thread(target=self._httpd.serve_forever, name="reference-server", daemon=True)
            self._thread.start()
        return self

    def serve_forever(self) -> None:
        self._serving = True
        try:
            self._httpd.serve_forever()
        finally:
            self._serving = False

    def stop(self) -> None:
        """Stop serving and close the socket; stalled requests are released and answered nothing."""
        self._stopping.set()
        if self._serving:
            self._httpd.shutdown()
            self._serving = False
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        self._httpd.server_close()

    def __enter__(self) -> "ReferenceServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # --- helpers used by the handler

    def _authorized(self, path: str, authorization: str | None) -> bool:
        """SGLang's rule: without a key, or on an open path, anything; else `Bearer <key>` (the
        scheme in any case), compared in constant time."""
        if self._api_key is None or path.startswith(OPEN_PATHS):
            return True
        scheme, _, token = (authorization or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(token.encode("utf-8"), self._api_key)

    def _take_fault(self) -> str | None:
        with self._lock:  # count and take together: whoever is counted first gets the first fault
            self._requests_served += 1
            try:
                fault = self.faults.get_nowait()
            except queue.Empty:
                return None
        if fault not in FAULTS:
            raise ValueError(f"unknown fault {fault!r}: use one of {FAULTS}")
        return fault

    def _encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        with self._tokenizer_lock:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def _decode(self, ids, skip_special_tokens: bool = True) -> str:
        with self._tokenizer_lock:
            return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def _generate(self, prompt_ids: list[int], max_new_tokens: int, stop_ids) -> list[int]:
        """Completion ids (the stop token kept) of greedy decoding."""
        try:
            # One generation at a time: on CPU each one already uses every core (intra-op threads), and
            # several at once only oversubscribe them (measured: 8 concurrent requests ran at 0.46x the
            # rate of one). Requests still arrive, queue and are answered concurrently.
            with self._model_lock:
                ids = greedy_decode(self.target, prompt_ids, max_new_tokens, stop_token_ids=stop_ids)
        except ValueError as e:  # empty prompt, ids outside the vocabulary, context overflow
            raise RequestError(str(e)) from None
        return ids[len(prompt_ids):]

    @torch.no_grad()
    def _logprobs(self, prompt_ids: list[int], completion: list[int]) -> torch.Tensor:
        """[len(completion), V] float32 log-probabilities of the target at each completion step."""
        if not completion:
            return torch.empty(0, self.target.vocab_size)
        ids = torch.tensor([prompt_ids + completion[:-1]])
        logits = self.target.forward(ids).logits[0, len(prompt_ids) - 1:]
        return F.log_softmax(logits.float(), dim=-1).cpu()

    def _max_model_len(self) -> int:
        return self.target.max_positions if self.target.max_positions is not None else -1

    def _check_model(self, model) -> None:
        if model is not None and model not in (self.served_model_name, str(self.target_dir)):
            raise RequestError(f"The model `{model}` does not exist.", status=404, type_="NotFoundError", param="model")

    # --- endpoints (each returns a JSON-serialisable body, or raises RequestError)

    def model_info(self) -> dict:
        config = self.target.model.config
        return {
            "model_path": str(self.target_dir),
            "tokenizer_path": str(self.tokenizer_dir),
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": "default",
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": getattr(config, "model_type", None),
            "architectures": getattr(config, "architectures", None),
        }

    def server_info(self) -> dict:
        return {
            "model_path": str(self.target_dir),
            "tokenizer_path": str(self.tokenizer_dir),
            "served_model_name": self.served_model_name,
            "context_length": self.target.max_positions,
            "dtype": self.dtype,
            "device": self.device,
            "skip_tokenizer_init": False,
            "version": SERVER_VERSION,
        }

    def models(self) -> dict:
        return {"object": "list", "data": [{
            "id": self.served_model_name, "object": "model", "created": self.created, "owned_by": SERVER_VERSION,
            "root": str(self.target_dir), "parent": None, "max_model_len": self.target.max_positions,
            "permission": [],
        }]}

    def tokenizer_info(self) -> dict:
        info = {"tokenizer_class": type(self.tokenizer).__name__}
        for key, value in getattr(self.tokenizer, "init_kwargs", {}).items():
            try:
                json.dumps(value)
            except (TypeError, ValueError):
                continue
            info[key] = value
        return info

    def tokenize(self, body: dict) -> dict:
        self._check_model(body.get("model"))
        prompt = body.get("prompt")
        add_special = _flag(body, "add_special_tokens", True)
        if isinstance(prompt, str):
            tokens = self._encode(prompt, add_special)
            result = {"tokens": tokens, "count": len(tokens), "max_model_len": self._max_model_len()}
            if _flag(body, "return_token_strs", False):
                with self._tokenizer_lock:
                    result["token_strs"] = self.tokenizer.convert_ids_to_tokens(tokens)
            return result
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            tokens = [self._encode(p, add_special) for p in prompt]
            return {"tokens": tokens, "count": [len(t) for t in tokens], "max_model_len": self._max_model_len()}
        raise RequestError("prompt must be a string or a non-empty list of strings", param="prompt")

    def detokenize(self, body: dict) -> dict:
        self._check_model(body.get("model"))
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(_is_int(t) for t in tokens):
            raise RequestError("tokens must be a list of integer token ids", param="tokens")
        text = self._decode(tokens, _flag(body, "skip_special_tokens", True))
        return {"text": text, "prompt": text}  # SGLang's key and vLLM's

    def generate(self, body: dict) -> dict:
        """SGLang native /generate, one prompt."""
        text, input_ids = body.get("text"), body.get("input_ids")
        if (text is None) == (input_ids is None):
            raise RequestError("Either text or input_ids should be provided (exactly one).")
        if isinstance(text, list) or (isinstance(input_ids, list) and input_ids and isinstance(input_ids[0], list)):
            raise RequestError("batch requests are not supported by this reference server: send one prompt per request")
        if text is not None and not isinstance(text, str):
            raise RequestError("text must be a string", param="text")
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise RequestError("sampling_params must be an object", param="sampling_params")
        _check_supported(body)
        _check_supported(params)
        _check_greedy(params)
        max_new = _max_tokens(params.get("max_new_tokens"), "max_new_tokens", 128)
        stop_ids = _stop_token_ids(params.get("stop_token_ids"))
        ignore_eos = _flag(params, "ignore_eos", False)
        skip_special = _flag(params, "skip_special_tokens", True)
        no_stop_trim = _flag(params, "no_stop_trim", False)
        return_logprob = _flag(body, "return_logprob", False)
        text_in_logprobs = _flag(body, "return_text_in_logprobs", False)
        prompt_ids = self._encode(text) if text is not None else _token_ids(input_ids, "input_ids")

        start = time.monotonic()
        # SGLang checks eos and stop_token_ids only when not ignore_eos.
        stops = set() if ignore_eos else set(self.eos_token_ids) | set(stop_ids)
        completion = self._generate(prompt_ids, max_new, stops)
        if len(completion) >= max_new:  # SGLang checks the length first
            finish = {"type": "length", "length": max_new}
        elif completion and completion[-1] in stops:
            finish = {"type": "stop", "matched": completion[-1]}
        else:  # not reachable with greedy_decode; kept for safety
            finish = {"type": "length", "length": max_new}
        text_ids = completion[:-1] if finish["type"] == "stop" and not no_stop_trim else completion
        meta = {
            "id": uuid.uuid4().hex,
            "finish_reason": finish,
            "prompt_tokens": len(prompt_ids),
            "weight_version": "default",
            "completion_tokens": len(completion),
            "cached_tokens": 0,
            "e2e_latency": time.monotonic() - start,
        }
        if return_logprob:
            logprobs = self._logprobs(prompt_ids, completion)
            meta["output_token_logprobs"] = [
                [float(logprobs[i, t]), t, self._decode([t], False) if text_in_logprobs else None]
                for i, t in enumerate(completion)
            ]
        out = {"text": self._decode(text_ids, skip_special)}
        if self.return_token_ids_supported:
            out["output_ids"] = completion
        out["meta_info"] = meta
        return out

    def completions(self, body: dict) -> dict:
        """OpenAI /v1/completions as vLLM serves it, one prompt."""
        self._check_model(body.get("model"))
        _check_supported(body)
        _check_greedy(body)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt must not be empty", param="prompt")
            prompt_ids = self._encode(prompt, _flag(body, "add_special_tokens", True))
        elif isinstance(prompt, list) and prompt and all(_is_int(t) for t in prompt):
            prompt_ids = list(prompt)
        elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            raise RequestError("batch requests are not supported by this reference server: send one prompt per request",
                               param="prompt")
        else:
            raise RequestError("prompt must be a string or a non-empty list of token ids", param="prompt")
        # vLLM: max_tokens defaults to 16; an explicit null means "up to the end of the context".
        up_to_context = max(self.target.max_positions - len(prompt_ids), 0) if self.target.max_positions else 16
        max_new = _max_tokens(body.get("max_tokens", 16), "max_tokens", up_to_context)
        stop_ids = _stop_token_ids(body.get("stop_token_ids"))
        ignore_eos = _flag(body, "ignore_eos", False)
        skip_special = _flag(body, "skip_special_tokens", True)
        return_ids = _flag(body, "return_token_ids", False) and self.return_token_ids_supported
        as_token_ids = _flag(body, "return_tokens_as_token_ids", False)
        top = body.get("logprobs")
        if top is not None and (not _is_int(top) or top < 0):
            raise RequestError(f"logprobs must be a non-negative integer, got {top!r}", param="logprobs")

        sglang = self.openai_style == "sglang"
        if sglang:  # as its /generate: ignore_eos drops stop_token_ids too; the length is checked first
            stops = set() if ignore_eos else set(self.eos_token_ids) | set(stop_ids)
        else:
            stops = (set() if ignore_eos else set(self.eos_token_ids)) | set(stop_ids)
        completion = self._generate(prompt_ids, max_new, stops)
        stopped = bool(completion) and completion[-1] in stops  # current vLLM: stop before length
        if sglang:
            stopped = stopped and len(completion) < max_new
        finish = "stop" if stopped else "length"
        text_ids = completion[:-1] if stopped and not (sglang and _flag(body, "no_stop_trim", False)) else completion
        choice = {"index": 0, "text": self._decode(text_ids, skip_special), "logprobs": None, "finish_reason": finish}
        if sglang:
            choice["matched_stop"] = completion[-1] if stopped else None
        else:
            choice["stop_reason"] = completion[-1] if stopped and completion[-1] in stop_ids and (
                ignore_eos or completion[-1] not in self.eos_token_ids) else None
        if top is not None:
            choice["logprobs"] = self._completion_logprobs(prompt_ids, completion, top, as_token_ids)
        if return_ids and not sglang:  # SGLang's completions carry no token ids
            choice["token_ids"] = completion
            choice["prompt_token_ids"] = prompt_ids
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.served_model_name,
            "choices": [choice],
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": len(completion),
                      "total_tokens": len(prompt_ids) + len(completion)},
        }

    def _completion_logprobs(self, prompt_ids, completion, top: int, as_token_ids: bool) -> dict:
        logprobs = self._logprobs(prompt_ids, completion)

        def name(t: int) -> str:
            return f"token_id:{t}" if as_token_ids else self._decode([t], False)

        tokens, token_logprobs, top_logprobs, offsets, offset = [], [], [], [], 0
        for i, t in enumerate(completion):
            tokens.append(name(t))
            token_logprobs.append(max(float(logprobs[i, t]), -9999.0))
            values, ids = logprobs[i].topk(max(top, 1))
            entries = {tokens[-1]: token_logprobs[-1]}
            for v, j in zip(values.tolist(), ids.tolist()):
                entries.setdefault(name(j), max(v, -9999.0))
            top_logprobs.append(entries)
            offsets.append(offset)
            offset += len(tokens[-1])
        return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens, "top_logprobs": top_logprobs}


class _HTTPServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False
    reference: ReferenceServer


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive; every answer carries a Content-Length
    server_version = SERVER_VERSION
    timeout = 120  # idle keep-alive connections are closed after this

    GET_ROUTES = {
        "/health": None, "/health_generate": None,
        "/get_model_info": ReferenceServer.model_info, "/model_info": ReferenceServer.model_info,
        "/get_server_info": ReferenceServer.server_info, "/server_info": ReferenceServer.server_info,
        "/v1/models": ReferenceServer.models, "/tokenizer_info": ReferenceServer.tokenizer_info,
    }
    POST_ROUTES = {
        "/generate": ReferenceServer.generate, "/v1/completions": ReferenceServer.completions,
        "/tokenize": ReferenceServer.tokenize, "/v1/tokenize": ReferenceServer.tokenize,
        "/detokenize": ReferenceServer.detokenize, "/v1/detokenize": ReferenceServer.detokenize,
    }
    GENERATION = {"/generate", "/v1/completions"}

    @property
    def reference(self) -> ReferenceServer:
        return self.server.reference

    def log_message(self, format, *args):
        logger.info("%s %s", self.address_string(), format % args)

    def _send(self, status: int, body=None) -> None:
        data = b"" if body is None else json.dumps(body).encode("utf-8")
        try:
            self.send_response(status)
            if body is not None:
                self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):  # the client gave up (a stall, a timeout)
            self.close_connection = True

    def _error(self, error: RequestError) -> None:
        self._send(error.status, error.body())

    def _path(self) -> str:
        return self.path.split("?", 1)[0]

    def _refuse_unauthorized(self, path: str) -> bool:
        """Answer 401 as SGLang does (True) when the request lacks the server's API key."""
        if self.reference._authorized(path, self.headers.get("Authorization")):
            return False
        self._send(401, {"error": "Unauthorized"})
        return True

    def do_GET(self):
        path = self._path()
        if self._refuse_unauthorized(path):
            return
        if path in self.GET_ROUTES:
            route = self.GET_ROUTES[path]
            self._send(200, None if route is None else route(self.reference))
        elif path in self.POST_ROUTES:
            self._error(RequestError("Method Not Allowed", status=405, type_="MethodNotAllowed"))
        else:
            self._error(RequestError(f"Not Found: {path}", status=404, type_="NotFoundError"))

    def do_POST(self):
        path = self._path()
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if length < 0:
            self.close_connection = True
            return self._error(RequestError("bad Content-Length"))
        raw = self.rfile.read(length) if length else b""  # read before any answer: the connection is kept alive
        if self._refuse_unauthorized(path):
            return
        if path not in self.POST_ROUTES:
            status, type_ = (405, "MethodNotAllowed") if path in self.GET_ROUTES else (404, "NotFoundError")
            return self._error(RequestError(f"{'Method Not Allowed' if status == 405 else 'Not Found'}: {path}",
                                            status=status, type_=type_))
        if path in self.GENERATION:
            fault = self.reference._take_fault()
            if fault == "drop":
                self.close_connection = True  # no response at all; the client sees the connection close
                return
            if fault == "500":
                return self._error(RequestError("injected fault: internal server error", status=500,
                                                type_="InternalServerError"))
            if fault == "stall":
                if self.reference._stopping.wait(self.reference.stall_seconds):
                    self.close_connection = True
                    return
        try:
            try:
                body = json.loads(raw)
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                raise RequestError(f"request body is not valid JSON: {e}") from None
            if not isinstance(body, dict):
                raise RequestError("request body must be a JSON object")
            self._send(200, self.POST_ROUTES[path](self.reference, body))
        except RequestError as e:
            self._error(e)
        except Exception as e:  # a bug or a model failure: answer 500, keep serving
            logger.exception("request to %s failed", path)
            self._error(RequestError(f"internal server error: {type(e).__name__}: {e}", status=500,
                                     type_="InternalServerError"))

    do_PUT = do_POST  # SGLang also takes PUT /generate


def serve_reference(target_dir, host: str = "127.0.0.1", port: int = 30000, dtype: str = "float32",
                    served_model_name: str | None = None, tokenizer_dir=None, device: str = "cpu",
                    log=print, api_key: str | None = None) -> None:
    """Load the target, serve it until interrupted; `log("listening on URL")` once it accepts requests.
    With `api_key`, requests must carry `Authorization: Bearer <api_key>` (SGLang's --api-key)."""
    server = ReferenceServer(target_dir, host=host, port=port, dtype=dtype, served_model_name=served_model_name,
                             tokenizer_dir=tokenizer_dir, device=device, api_key=api_key)
    log(f"listening on {server.url} (model {server.served_model_name!r}, {dtype} on {device}; "
        "SGLang /generate and OpenAI /v1/completions, greedy only"
        f"{'; API key required' if server.requires_api_key else ''})")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
