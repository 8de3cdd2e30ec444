"""The fields of a request to the reference server, read and checked: a value of the wrong type, a sampling
setting out of range, or a parameter that would change the output and that the server does not implement is
refused with a `RequestError` (answered 400) rather than ignored. Which fields the real servers take, and
their defaults: docs/reference-servers.md, "Wire formats we follow".
"""

from dflash_core.sampling import GREEDY, Sampling

GREEDY_EPS = 1e-6  # SGLang: temperature below this is greedy (vLLM's threshold is 1e-5)

# Parameters that change the output, with the values under which they do not: anything else is
# refused (this server implements none of them).
NEUTRAL_VALUES: dict[str, tuple[object, ...]] = {
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
        """The JSON body of the answer (vLLM's error shape, a superset of SGLang's)."""
        return {"error": {"message": str(self), "type": self.type, "param": self.param, "code": self.status}}


def is_int(x) -> bool:
    """Whether `x` is a JSON integer (not a bool, which Python counts as one)."""
    return isinstance(x, int) and not isinstance(x, bool)


def is_number(x) -> bool:
    """Whether `x` is a JSON number (not a bool)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def read_token_ids(value, name: str) -> list[int]:
    """The field `name` as a non-empty list of token ids."""
    if not isinstance(value, list) or not value or not all(is_int(t) for t in value):
        raise RequestError(f"{name} must be a non-empty list of integer token ids", param=name)
    return list(value)


def read_flag(params: dict, name: str, default: bool) -> bool:
    """`params[name]` as a bool; `default` when absent or null."""
    value = params.get(name)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise RequestError(f"{name} must be true or false, got {value!r}", param=name)
    return value


def _is_neutral(value, neutral) -> bool:
    return any(value is v or (type(value) is type(v) and value == v) for v in neutral)


def check_supported(params: dict) -> None:
    """Refuse any parameter of NEUTRAL_VALUES set to a value that would change the output."""
    for name, neutral in NEUTRAL_VALUES.items():
        if name in params and not _is_neutral(params[name], neutral):
            raise RequestError(f"{name}={params[name]!r} is not supported by this reference server "
                               "(it serves plain decoding, greedy or sampled, only)", param=name)


def read_sampling(params: dict, seed_field: str) -> tuple[Sampling, int | None]:
    """The request's sampling and its seed (`seed_field`: SGLang's `sampling_seed`, vLLM's `seed`; None
    when absent). As both servers: an absent temperature is 1.0; top_k -1 or 0 is off; greedy iff
    temperature < 1e-6 or top_k == 1."""
    def number(name: str, default: float) -> float:
        value = params.get(name)
        if value is None:
            return default
        if not is_number(value):
            raise RequestError(f"{name} must be a number, got {value!r}", param=name)
        return float(value)

    temperature, top_p, min_p = number("temperature", 1.0), number("top_p", 1.0), number("min_p", 0.0)
    top_k, seed = params.get("top_k"), params.get(seed_field)
    if top_k is not None and not is_int(top_k):
        raise RequestError(f"top_k must be an integer, got {top_k!r}", param="top_k")
    if seed is not None and not is_int(seed):
        raise RequestError(f"{seed_field} must be an integer, got {seed!r}", param=seed_field)
    if temperature < 0:
        raise RequestError(f"temperature must be non-negative, got {temperature}", param="temperature")
    if not 0 < top_p <= 1:
        raise RequestError(f"top_p must be in (0, 1], got {top_p}", param="top_p")
    if not 0 <= min_p < 1:
        raise RequestError(f"min_p must be in [0, 1), got {min_p}", param="min_p")
    if top_k is not None and top_k < -1:
        raise RequestError(f"top_k must be -1 (off) or more, got {top_k}", param="top_k")
    if top_k == 1 or temperature < GREEDY_EPS:
        return GREEDY, seed
    return Sampling(temperature, max(0, top_k or 0), top_p, min_p), seed


def read_max_tokens(value, name: str, default: int) -> int:
    """A token budget field (`name` for the message): a non-negative integer; `default` when absent."""
    if value is None:
        return default
    if not is_int(value) or value < 0:
        raise RequestError(f"{name} must be a non-negative integer, got {value!r}", param=name)
    return value


def read_stop_token_ids(value) -> list[int]:
    """The request's `stop_token_ids` (none when absent)."""
    if value is None:
        return []
    if not isinstance(value, list) or not all(is_int(t) for t in value):
        raise RequestError(f"stop_token_ids must be a list of integer token ids, got {value!r}", param="stop_token_ids")
    return list(value)
