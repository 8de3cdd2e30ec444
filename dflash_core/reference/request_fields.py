"""The fields of a request to the reference server, read and checked: a value of the wrong type, a sampling
that is not greedy, or a parameter that would change the output and that the server does not implement is
refused with a `RequestError` (answered 400) rather than ignored. Which fields the real servers take, and
their defaults: docs/reference-servers.md, "Wire formats we follow".
"""

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
                               "(it serves plain greedy decoding only)", param=name)


def check_greedy(params: dict) -> None:
    """Greedy iff temperature < 1e-6 or top_k == 1 (both servers); an absent temperature is the
    servers' default 1.0, i.e. sampling."""
    temperature, top_k = params.get("temperature"), params.get("top_k")
    if temperature is not None and not is_number(temperature):
        raise RequestError(f"temperature must be a number, got {temperature!r}", param="temperature")
    if top_k is not None and not is_int(top_k):
        raise RequestError(f"top_k must be an integer, got {top_k!r}", param="top_k")
    if temperature is not None and temperature < 0:
        raise RequestError(f"temperature must be non-negative, got {temperature}", param="temperature")
    if top_k == 1 or (temperature is not None and temperature < GREEDY_EPS):
        return
    got = ("the request sets no temperature, and SGLang and vLLM then default to 1.0, i.e. sampling"
           if temperature is None else f"got temperature={temperature}")
    raise RequestError(f"this reference server only does greedy decoding: send temperature 0 ({got})",
                       param="temperature")


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
