"""The values a drafter's config.json gives, checked for type, range and finiteness before anything is built on them.

Python's JSON reader takes NaN and Infinity, and to Python `true` is the integer 1, so a config can hand the drafter
numbers no trainer wrote on purpose. Unchecked they make a tau without a word: `"output_multiplier": Infinity`
turns every sampled draft's q into NaN (tau 0), `"rope_theta": -10000` or `"input_embedding_scale": NaN` make every
draft wrong (tau 1.0), a `final_logit_softcapping` of NaN reads as no cap. So every number that is read is checked:
its type (a bool is no number here), that it is finite, and its range (positive where zero or less means nothing).

Each check returns the end of a message, "must be ..., got ...", saying what to give instead, or None when the
value is good; the readers (drafter_config.py, speculators_format.py) put the file and the field in front of it.
Values are shown as JSON spells them (NaN, Infinity, true, "text"), as the user wrote them.
"""

import json
import math
from typing import Any, TypeGuard

# RoPE parameters (rope_parameters / rope_scaling, as transformers reads them) that are positive numbers: a base, a
# scaling factor, a context length, YaRN's and Llama 3's ramp bounds. transformers only warns about bad ones.
POSITIVE_ROPE_NUMBERS = ("rope_theta", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                         "low_freq_factor", "high_freq_factor", "attention_factor")
# ... and those that may be 0 (DeepSeek's YaRN: mscale_all_dim is 0 by default)
NON_NEGATIVE_ROPE_NUMBERS = ("mscale", "mscale_all_dim")


def is_int(value: object) -> TypeGuard[int]:
    """An integer, not a bool."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> TypeGuard[int | float]:
    """An int or a float (NaN and infinities included), not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def shown(value: Any) -> str:
    """A value as the config's JSON spells it: NaN, Infinity, true, null, "text"."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def integer_problem(value: Any, minimum: int) -> str | None:
    """Why `value` is not an integer >= minimum (None when it is)."""
    if is_int(value) and value >= minimum:
        return None
    return f"must be an integer >= {minimum}, got {shown(value)}"


def number_problem(value: Any, zero_allowed: bool = False) -> str | None:
    """Why `value` is not a finite number above 0 (or at least 0, zero_allowed); None when it is."""
    if is_number(value) and math.isfinite(value) and (value > 0 or zero_allowed and value == 0):
        return None
    return f"must be a finite number {'>= 0' if zero_allowed else 'above 0'}, got {shown(value)}"


def boolean_problem(value: Any) -> str | None:
    """Why `value` is not true, false or null (None when it is)."""
    if value is None or isinstance(value, bool):
        return None
    return f"must be true, false or null, got {shown(value)}"


def layer_ids_problem(ids: Any, minimum: int) -> str | None:
    """Why `ids` is not a non-empty list of distinct layer ids >= minimum (None when it is). A repeated id would feed
    the drafter one layer twice where it was trained on two."""
    if not (isinstance(ids, (list, tuple)) and ids and all(is_int(i) and i >= minimum for i in ids)):
        return f"must be a non-empty list of layer indices >= {minimum}, got {shown(ids)}"
    repeated = sorted({i for i in ids if ids.count(i) > 1})
    if repeated:
        return (f"must name each layer once, got {shown(ids)} (layer {', '.join(map(str, repeated))} repeated): give "
                "the distinct ids the drafter was trained on")
    return None


def rope_problem(settings: dict[str, Any]) -> str | None:
    """Why a rope_parameters / rope_scaling object holds a number RoPE cannot use, as "KEY must be ..." (None when
    none): the positive ones (POSITIVE_ROPE_NUMBERS) above 0, the others finite and not negative, bools only
    where no number is meant (yarn's `truncate`), lists (longrope's factors, mrope_section) number by number."""
    for key, value in settings.items():
        if key in POSITIVE_ROPE_NUMBERS or key in NON_NEGATIVE_ROPE_NUMBERS:
            if value is not None and (problem := number_problem(value, zero_allowed=key in NON_NEGATIVE_ROPE_NUMBERS)):
                return f"{key} {problem}"
        elif isinstance(value, list):
            if bad := [v for v in value if not (is_number(v) and math.isfinite(v) and v >= 0)]:
                return f"{key} must list finite numbers >= 0, got {shown(bad[0])} in {shown(value)}"
        elif is_number(value) and not (math.isfinite(value) and value >= 0):
            return f"{key} must be a finite number >= 0, got {shown(value)}"
    return None
