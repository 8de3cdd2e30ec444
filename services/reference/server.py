"""A real HTTP server for a local Hugging Face target's completions, greedy or sampled, speaking the wire
formats of SGLang's native `/generate` and of the OpenAI-compatible `/v1/completions` (as vLLM and
SGLang implement it). For tests (a real server on loopback, with injectable faults) and for users
without a GPU serving stack. Plain stdlib `http.server`, bounded by `dflash_eval.services.http_server` (MAX_* below).

Every completion is `dflash_core.decoding.decode(target, prompt_ids, max_new_tokens, stops, sampling,
generator)`, so it is bit-identical to a local run in the same dtype and device: greedy, or sampled with
temperature, top_k, top_p and min_p from a generator seeded with the request's seed (SGLang's
`sampling_params.sampling_seed`, vLLM's `seed`; a random one when absent). Stop tokens are the
target's eos ids (`read_target_config(target_dir).eos_token_ids`) plus the request's `stop_token_ids`.

What SGLang and vLLM take and answer, which this server follows point by point, with the source file
each fact comes from: docs/reference-servers.md, "Wire formats we follow". Reading and checking the
fields of a request: `request_fields`.

Endpoints here: GET /health, /health_generate, /get_model_info (= /model_info), /get_server_info
(a small subset of SGLang's), /v1/models, /tokenizer_info; POST (SGLang also PUT) /generate,
/v1/completions, /tokenize (= /v1/tokenize), /detokenize (= /v1/detokenize; answers both "text"
and "prompt").

This server: errors are `{"error": {"message", "type", "param", "code"}}` (a superset of
SGLang's); unknown paths 404. `openai_style="sglang"` answers `/v1/completions` as SGLang does;
the default is vLLM's. With `api_key` it checks the key as SGLang does (constant-time),
before anything else: a refused request is neither routed nor counted in `requests_served`.
It does not stream or batch; parameters that would change the output and that it does not
implement (stop strings, penalties, n > 1, grammars, ...) get 400 rather than being ignored, and so do
values Python's json reads but no model takes (NaN, Infinity, a lone surrogate, a seed outside 64 bits, a
temperature outside dflash_core.sampling's range), naming the field. Stops
are the target config's eos ids (what local greedy runs use); real servers also stop on the
tokenizer's eos id, which is normally among them. Text prompts are encoded with the served tokenizer
(which `tokenizer_dir` may make a different one from the target's). Logprobs come from one
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
import math
import queue
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from dflash_core.decoding import decode
from dflash_core.sampling import Sampling
from dflash_core.target import DTYPES, choose_attention, load_target, read_target_config

from ..http_server import BackgroundServer, DeadlineRequestHandler, ErrorResponse
from .request_fields import (
    RequestError,
    check_supported,
    is_int,
    read_flag,
    read_max_tokens,
    read_sampling,
    read_stop_token_ids,
    read_token_ids,
)

logger = logging.getLogger(__name__)

FAULTS = ("drop", "500", "stall")
OPENAI_STYLES = ("vllm", "sglang")
OPEN_PATHS = ("/health", "/metrics")  # SGLang: reachable without the API key (path prefixes)
SERVER_VERSION = "dflash-eval-reference"
# a client holds one connection per request in flight (--concurrency); idle ones close after REQUEST_SECONDS
MAX_CONNECTIONS = 64
REQUEST_SECONDS = 30.0
MAX_BODY_BYTES = 8 << 20  # a prompt of a million tokens as ids is ~7 MB of JSON
MAX_LOGPROBS = 20  # vLLM's default max_logprobs
SEED_LIMIT = 2**64  # a seed is 64 bits unsigned: 0 .. 2**64 - 1 (torch.Generator.manual_seed fails above)

class ReferenceServer(BackgroundServer):
    """Serves `target_dir`'s completions (greedy or sampled) over HTTP (see the module docstring).

    Binds at construction, starts, serves and stops as every server (BackgroundServer; `port=0`
    picks a free port, `url` tells which).

    `tokenizer_dir` serves a different tokenizer than the target's (text prompts, output text).
    `return_token_ids_supported=False` answers text only: `/generate` leaves out `output_ids` and
    `/v1/completions` ignores `return_token_ids`, so clients must re-tokenise.
    `openai_style` ("vllm" or "sglang") is whose `/v1/completions` answer this server gives.
    `api_key`: every request but `/health*` and `/metrics*` must carry `Authorization: Bearer <key>`.
    At most `max_connections` connections are served at once (in all and from one client); more get 503.
    """

    def __init__(self, target_dir, host: str = "127.0.0.1", port: int = 0, dtype: str = "float32",
                 served_model_name: str | None = None, tokenizer_dir=None, *, device: str = "cpu",
                 return_token_ids_supported: bool = True, stall_seconds: float = 30.0,
                 openai_style: str = "vllm", api_key: str | None = None, max_connections: int = MAX_CONNECTIONS):
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
        # SDPA where the target's text model takes it, else eager (gpt-oss), as a run's --attn-implementation auto
        self.target = load_target(self.target_dir, dtype=DTYPES[dtype], device=device,
                                  attention=choose_attention(self.target_dir))
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
        handler = type("Handler", (_Handler,), {"reference": self})
        super().__init__(host, port, handler, max_connections, max_connections, name="reference server",
                         logger=logger)

    @property
    def requires_api_key(self) -> bool:
        return self._api_key is not None

    @property
    def requests_served(self) -> int:
        """Generation requests (/generate, /v1/completions) received so far, faulted ones included."""
        with self._lock:
            return self._requests_served

    def stop(self) -> None:
        """Release stalled requests (they are answered nothing), then stop as every server (BackgroundServer.stop)."""
        self._stopping.set()
        super().stop()

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

    def _encode(self, text: str, name: str, add_special_tokens: bool = True) -> list[int]:
        """`text` (the request's field `name`) as token ids; 400 for a lone surrogate ("\\ud800" in JSON, which
        Python's json reads), which no tokenizer takes."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise RequestError(f"{name} must be valid Unicode text: it holds a lone surrogate at character {e.start}",
                               param=name) from None
        with self._tokenizer_lock:
            return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens))

    def _in_vocabulary(self, ids: list[int], name: str) -> list[int]:
        """`ids`, or 400 when one is not a token of the target's vocabulary."""
        vocab_size = self.target.embed_weight.shape[0]
        outside = [t for t in ids if not 0 <= t < vocab_size]
        if outside:
            raise RequestError(f"{name}: token ids {outside[:3]} are outside the vocabulary (0..{vocab_size - 1})",
                               param=name)
        return ids

    def _decode(self, ids, skip_special_tokens: bool = True) -> str:
        with self._tokenizer_lock:
            text = self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)
        assert isinstance(text, str), "one sequence of ids decodes to one string"
        return text

    def _generate(self, prompt_ids: list[int], max_new_tokens: int, stop_ids, sampling: Sampling,
                  seed: int | None) -> list[int]:
        """Completion ids (the stop token kept), greedy or sampled from a generator seeded with `seed`."""
        generator = None
        if not sampling.greedy:
            generator = torch.Generator(device=self.target.device)
            generator.manual_seed(seed) if seed is not None else generator.seed()
        try:
            # One generation at a time: on CPU each one already uses every core (intra-op threads), and
            # several at once only oversubscribe them (measured: 8 concurrent requests ran at 0.46x the
            # rate of one). Requests still arrive, queue and are answered concurrently.
            with self._model_lock:
                ids = decode(self.target, prompt_ids, max_new_tokens, stop_ids, sampling, generator)
        except ValueError as e:  # empty prompt, ids outside the vocabulary, context overflow
            raise RequestError(str(e)) from None
        return ids[len(prompt_ids):]

    @torch.no_grad()
    def _logprobs(self, prompt_ids: list[int], completion: list[int]) -> torch.Tensor:
        """[len(completion), V] float32 log-probabilities of the target at each completion step."""
        if not completion:
            return torch.empty(0, self.target.vocab_size)
        ids = torch.tensor([prompt_ids + completion[:-1]])
        logits = self.target.forward(ids).require_logits()[0, len(prompt_ids) - 1:]
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
        add_special = read_flag(body, "add_special_tokens", True)
        if isinstance(prompt, str):
            tokens = self._encode(prompt, "prompt", add_special)
            result: dict[str, Any] = {"tokens": tokens, "count": len(tokens), "max_model_len": self._max_model_len()}
            if read_flag(body, "return_token_strs", False):
                with self._tokenizer_lock:
                    result["token_strs"] = self.tokenizer.convert_ids_to_tokens(tokens)
            return result
        if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
            token_lists = [self._encode(p, "prompt", add_special) for p in prompt]
            return {"tokens": token_lists, "count": [len(t) for t in token_lists],
                    "max_model_len": self._max_model_len()}
        raise RequestError("prompt must be a string or a non-empty list of strings", param="prompt")

    def detokenize(self, body: dict) -> dict:
        self._check_model(body.get("model"))
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(is_int(t) for t in tokens):
            raise RequestError("tokens must be a list of integer token ids", param="tokens")
        text = self._decode(self._in_vocabulary(tokens, "tokens"), read_flag(body, "skip_special_tokens", True))
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
        check_supported(body)
        check_supported(params)
        sampling, seed = _read_sampling(params, "sampling_seed")
        max_new = read_max_tokens(params.get("max_new_tokens"), "max_new_tokens", 128)
        stop_ids = read_stop_token_ids(params.get("stop_token_ids"))
        ignore_eos = read_flag(params, "ignore_eos", False)
        skip_special = read_flag(params, "skip_special_tokens", True)
        no_stop_trim = read_flag(params, "no_stop_trim", False)
        return_logprob = read_flag(body, "return_logprob", False)
        text_in_logprobs = read_flag(body, "return_text_in_logprobs", False)
        prompt_ids = (self._encode(text, "text") if text is not None
                      else self._in_vocabulary(read_token_ids(input_ids, "input_ids"), "input_ids"))

        start = time.monotonic()
        # SGLang checks eos and stop_token_ids only when not ignore_eos.
        stops = set() if ignore_eos else set(self.eos_token_ids) | set(stop_ids)
        completion = self._generate(prompt_ids, max_new, stops, sampling, seed)
        if len(completion) >= max_new:  # SGLang checks the length first
            finish = {"type": "length", "length": max_new}
        elif completion and completion[-1] in stops:
            finish = {"type": "stop", "matched": completion[-1]}
        else:  # not reachable with decode; kept for safety
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
        out: dict[str, Any] = {"text": self._decode(text_ids, skip_special)}
        if self.return_token_ids_supported:
            out["output_ids"] = completion
        out["meta_info"] = meta
        return out

    def completions(self, body: dict) -> dict:
        """OpenAI /v1/completions as vLLM serves it, one prompt."""
        self._check_model(body.get("model"))
        check_supported(body)
        sampling, seed = _read_sampling(body, "seed")
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt must not be empty", param="prompt")
            prompt_ids = self._encode(prompt, "prompt", read_flag(body, "add_special_tokens", True))
        elif isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
            prompt_ids = self._in_vocabulary(list(prompt), "prompt")
        elif isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
            raise RequestError("batch requests are not supported by this reference server: send one prompt per request",
                               param="prompt")
        else:
            raise RequestError("prompt must be a string or a non-empty list of token ids", param="prompt")
        # vLLM: max_tokens defaults to 16; an explicit null means "up to the end of the context".
        up_to_context = max(self.target.max_positions - len(prompt_ids), 0) if self.target.max_positions else 16
        max_new = read_max_tokens(body.get("max_tokens", 16), "max_tokens", up_to_context)
        stop_ids = read_stop_token_ids(body.get("stop_token_ids"))
        ignore_eos = read_flag(body, "ignore_eos", False)
        skip_special = read_flag(body, "skip_special_tokens", True)
        return_ids = read_flag(body, "return_token_ids", False) and self.return_token_ids_supported
        as_token_ids = read_flag(body, "return_tokens_as_token_ids", False)
        top = body.get("logprobs")
        if top is not None and (not is_int(top) or not 0 <= top <= MAX_LOGPROBS):
            raise RequestError(f"logprobs must be an integer from 0 to {MAX_LOGPROBS}, got {top!r}", param="logprobs")

        sglang = self.openai_style == "sglang"
        if sglang:  # as its /generate: ignore_eos drops stop_token_ids too; the length is checked first
            stops = set() if ignore_eos else set(self.eos_token_ids) | set(stop_ids)
        else:
            stops = (set() if ignore_eos else set(self.eos_token_ids)) | set(stop_ids)
        completion = self._generate(prompt_ids, max_new, stops, sampling, seed)
        stopped = bool(completion) and completion[-1] in stops  # current vLLM: stop before length
        if sglang:
            stopped = stopped and len(completion) < max_new
        finish = "stop" if stopped else "length"
        text_ids = completion[:-1] if stopped and not (sglang and read_flag(body, "no_stop_trim", False)) else completion
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
        return {"text_offset": offsets, "token_logprobs": token_logprobs, "tokens": tokens,
                "top_logprobs": top_logprobs}


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        return False


def _read_sampling(params: dict, seed_field: str) -> tuple[Sampling, int | None]:
    """request_fields.read_sampling, with 400s for what would otherwise fail later (a 500): a sampling number that is
    not finite (JSON's NaN and Infinity, which Python's json reads, or an integer too large for a float), a seed
    outside 64 bits, a temperature outside Sampling's range (0, or 0.01 to 2: dflash_core.sampling says why)."""
    for name in ("temperature", "top_p", "min_p"):
        value = params.get(name)
        if isinstance(value, (int, float)) and not _finite(value):  # (a bool is finite; read_sampling refuses it)
            shown = json.dumps(value) if isinstance(value, float) else "an integer too large for a float"
            raise RequestError(f"{name} must be a finite number{' >= 0' if name == 'temperature' else ''}, got {shown}",
                               param=name)
    seed = params.get(seed_field)
    if isinstance(seed, int) and not 0 <= seed < SEED_LIMIT:
        raise RequestError(f"{seed_field} must be an integer from 0 to 2**64 - 1, got {seed}", param=seed_field)
    try:
        return read_sampling(params, seed_field)
    except ValueError as e:  # the one bound read_sampling leaves to Sampling (its others are checked first)
        raise RequestError(str(e), param="temperature") from None


class _Handler(DeadlineRequestHandler):
    # keep-alive; every answer carries a Content-Length. An idle connection is closed after REQUEST_SECONDS.
    reference: ClassVar[ReferenceServer]  # the server answering: set on the subclass each ReferenceServer makes
    server_version = SERVER_VERSION
    request_timeout = REQUEST_SECONDS
    max_body_bytes = MAX_BODY_BYTES

    GET_ROUTES: ClassVar[dict[str, Callable[[ReferenceServer], dict] | None]] = {
        "/health": None, "/health_generate": None,
        "/get_model_info": ReferenceServer.model_info, "/model_info": ReferenceServer.model_info,
        "/get_server_info": ReferenceServer.server_info, "/server_info": ReferenceServer.server_info,
        "/v1/models": ReferenceServer.models, "/tokenizer_info": ReferenceServer.tokenizer_info,
    }
    POST_ROUTES: ClassVar[dict[str, Callable[[ReferenceServer, dict], dict]]] = {
        "/generate": ReferenceServer.generate, "/v1/completions": ReferenceServer.completions,
        "/tokenize": ReferenceServer.tokenize, "/v1/tokenize": ReferenceServer.tokenize,
        "/detokenize": ReferenceServer.detokenize, "/v1/detokenize": ReferenceServer.detokenize,
    }
    GENERATION: ClassVar[set[str]] = {"/generate", "/v1/completions"}

    def log_message(self, format, *args):
        logger.info("%s %s", self.address_string(), format % args)

    def _send(self, status: int, body=None) -> None:
        data = b"" if body is None else json.dumps(body).encode("utf-8")
        try:
            self.send_response(status)
            if body is not None:
                self.send_header("Content-Type", "application/json")
            if self.close_connection:  # a body left unread: the client must not send another request here
                self.send_header("Connection", "close")
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

    def _refuse_unauthorized(self, path: str, body_unread: bool = False) -> bool:
        """Answer 401 as SGLang does (True) without the server's API key; a body left unread closes the connection."""
        if self.reference._authorized(path, self.headers.get("Authorization")):
            return False
        if body_unread:
            self.close_connection = True
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
        # who asks first: an unauthorized body is never read (the connection closes instead)
        if self._refuse_unauthorized(path, body_unread=True):
            return
        try:
            raw = self.read_body()
        except ErrorResponse as e:
            return self._error(RequestError(e.message, status=e.status,
                                            type_="RequestTooLarge" if e.status == 413 else "BadRequestError"))
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
            if fault == "stall" and self.reference._stopping.wait(self.reference.stall_seconds):
                self.close_connection = True
                return
        try:
            try:
                body = json.loads(raw)
            except ValueError as e:  # JSONDecodeError, UnicodeDecodeError, an integer of more than 4300 digits
                raise RequestError(f"request body is not valid JSON: {e}") from None
            except RecursionError:
                raise RequestError("request body is nested too deeply") from None
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
    """Load the target, serve it until Ctrl+C; `log("listening on URL")` once it accepts requests.
    With `api_key`, requests must carry `Authorization: Bearer <api_key>` (SGLang's --api-key)."""
    server = ReferenceServer(target_dir, host=host, port=port, dtype=dtype, served_model_name=served_model_name,
                             tokenizer_dir=tokenizer_dir, device=device, api_key=api_key)
    log(f"listening on {server.url} (model {server.served_model_name!r}, {dtype} on {device}; "
        "SGLang /generate and OpenAI /v1/completions, greedy or sampled"
        f"{'; API key required' if server.requires_api_key else ''})")
    server.serve_forever()
