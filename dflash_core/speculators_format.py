"""vLLM's `speculators` saves of DFlash-family drafters, read as the published (z-lab) config they describe.

speculators (the library vLLM's teams train with; 0.9.0) writes `architectures` like z-lab, but the rest of its
config.json is its own, told apart by `speculators_model_type` (a generation's, dflash_core.generations: dflash,
dflash2):

- the Qwen3 fields sit under `transformer_layer_config`; `block_size`, `mask_token_id` and a generation's own fields
  at the top level;
- `aux_hidden_state_layer_ids` count one higher than z-lab's `target_layer_ids`: aux id L is Hugging Face's
  `hidden_states[L]`, z-lab's id t is `hidden_states[t + 1]` (speculators' own converter writes t + 1, vLLM maps
  back with L - 1). Read as z-lab ids, every feature would be one layer off, silently;
- `draft_vocab_size` below the target's: the drafter has its own `lm_head` over that vocabulary and a `d2t` table
  (target id = draft id + d2t[draft id]; `t2d` marks the kept target tokens), as EAGLE-3 and vLLM read it. At the
  full vocabulary no head is saved and the target's is used;
- `sample_from_anchor`: the anchor's slot drafts too (slot t predicts token anchor + t + 1: a step verifies
  block_size drafts, not block_size - 1);
- `sliding_window_non_causal`: whether its sliding layers see the whole block (full layers always do);
- `speculators_config.verifier`: the target it was trained against (a hub id or a path on the trainer's machine):
  the target given to dflash-eval is used, and a verifier of another architecture is named in a warning.

`published_config` turns such a config into the published one (with two fields of dflash-eval's own,
SPECULATORS_FIELDS), so that DrafterConfig reads, checks and refuses every field as for any drafter.
"""

from collections.abc import Callable, Iterable
from typing import Any, NoReturn

from .config_values import boolean_problem, integer_problem, layer_ids_problem, shown
from .generations import by_speculators_model_type, generations


class SpeculatorsConfigError(ValueError):
    """A speculators config that cannot stand for a drafter read here (drafter_config raises it as a DrafterError)."""

# What published_config adds beside the published fields: read by DrafterConfig, never written by z-lab.
SPECULATORS_FIELDS = ("drafts_from_anchor", "sliding_semantics", "verifier_architectures")

# Top-level fields of a speculators config and what becomes of them.
TRANSLATED = ("speculators_model_type", "transformer_layer_config", "aux_hidden_state_layer_ids", "block_size",
              "mask_token_id", "draft_vocab_size", "sample_from_anchor", "sliding_window_non_causal",
              "speculators_config", "target_hidden_size")
IGNORED = {
    "architectures": "speculators_model_type says which drafter it is",
    "speculators_version": "provenance", "transformers_version": "provenance",
    "dtype": "the caller chooses the compute dtype", "torch_dtype": "the caller chooses the compute dtype",
    "auto_map": "remote code is never run",
    "tie_word_embeddings": "the drafter has no embedding: the target's is used",
}


def is_speculators_config(raw: dict[str, Any]) -> bool:
    """Whether a config.json was written by speculators."""
    return "speculators_model_type" in raw


def published_config(raw: dict[str, Any], source: str, dflash_fields: Iterable[str]) -> dict[str, Any]:
    """The published config of a speculators config.json (module docstring): the top-level fields among
    `dflash_fields` (the published dflash_config's: mask_token_id, DFlash2's four, ...) go into dflash_config.
    SpeculatorsConfigError naming `source` and the field for one it cannot stand for."""
    dflash_fields = tuple(dflash_fields)

    def fail(message: str) -> NoReturn:
        raise SpeculatorsConfigError(f"{source}: {message}")

    kind = raw.get("speculators_model_type")
    generation = by_speculators_model_type(kind) if isinstance(kind, str) else None
    if generation is None:
        read = {g.SPECULATORS_MODEL_TYPE: g.NAME for g in generations() if g.SPECULATORS_MODEL_TYPE}
        fail(f"speculators_model_type {kind!r}: the speculators drafters read here are {', '.join(read)} "
             f"({' and '.join(read.values())}); score this checkpoint with its own implementation")
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        fail("a speculators config needs transformer_layer_config (the drafter's Qwen3 fields), got "
             f"{type(layer).__name__}")
    aux: Any = raw.get("aux_hidden_state_layer_ids")
    if problem := layer_ids_problem(aux, 0):
        fail(f"aux_hidden_state_layer_ids {problem}")
    if min(aux) < 1:
        fail(f"aux_hidden_state_layer_ids {aux}: id 0 is the target's embeddings (hidden_states[0]), which "
             "dflash-eval does not extract; the ids it reads are 1 .. the target's layers")
    unknown = sorted(set(raw) - set(TRANSLATED) - set(IGNORED) - set(dflash_fields))
    if unknown:
        fail(f"speculators fields {unknown} are not read by dflash-eval: each may change the drafter's math. "
             f"Read: {', '.join(TRANSLATED)}")

    published = {key: value for key, value in layer.items() if key not in ("architectures", "dflash_config")}
    vocab = layer.get("vocab_size")
    hidden = layer.get("hidden_size")
    for key in ("target_hidden_size", "draft_vocab_size"):  # (the layer's own numbers are checked as published ones)
        if raw.get(key) is not None and (problem := integer_problem(raw[key], 1)):
            fail(f"{key} {problem}")
    if vocab is not None and (problem := integer_problem(vocab, 1)):  # (compared with draft_vocab_size below)
        fail(f"transformer_layer_config.vocab_size {problem}")
    if raw.get("target_hidden_size") not in (None, hidden):
        fail(f"target_hidden_size {raw['target_hidden_size']} differs from the drafter's hidden_size {hidden}: a "
             "drafter reading features of another width, which DFlash drafters are not")
    draft_vocab = raw.get("draft_vocab_size")
    if draft_vocab is not None and vocab is not None and draft_vocab > vocab:
        fail(f"draft_vocab_size must be an integer from 1 to transformer_layer_config.vocab_size ({vocab}), got "
             f"{draft_vocab}")
    if problem := generation.speculators_problem(draft_vocab, vocab):
        fail(problem)
    dflash = {key: raw[key] for key in dflash_fields if raw.get(key) is not None and key != "block_size"}
    dflash["target_layer_ids"] = [i - 1 for i in aux]
    non_causal = raw.get("sliding_window_non_causal")
    from_anchor = raw.get("sample_from_anchor", False)
    for key, value in (("sliding_window_non_causal", non_causal), ("sample_from_anchor", from_anchor)):
        if problem := boolean_problem(value):
            fail(f"{key} {problem}")
    verifier = _verifier(raw.get("speculators_config"), fail)
    published.update({
        "architectures": [generation.ARCHITECTURES[0]],
        "block_size": raw.get("block_size"),
        "draft_vocab_size": draft_vocab if draft_vocab is not None else vocab,
        "dflash_config": dflash,
        "drafts_from_anchor": bool(from_anchor),
        "sliding_semantics": "non_causal" if non_causal else "causal",
        "verifier_architectures": verifier.get("architectures"),
    })
    return published


def _verifier(speculators_config: Any, fail: Callable[[str], NoReturn]) -> dict[str, Any]:
    """speculators_config.verifier (the target it was trained against: only its architectures are kept), each level
    an object or null, its architectures a list of class names; {} when it names none."""
    if speculators_config is None:
        return {}
    if not isinstance(speculators_config, dict):
        fail(f"speculators_config must be an object (speculators writes its algorithm, proposal methods and verifier "
             f"there) or null, got {shown(speculators_config)}")
    verifier = speculators_config.get("verifier")
    if verifier is None:
        return {}
    if not isinstance(verifier, dict):
        fail(f"speculators_config.verifier must be an object ({{\"architectures\": [...], \"name_or_path\": ...}}) "
             f"or null, got {shown(verifier)}")
    architectures = verifier.get("architectures")
    if architectures is not None and not (isinstance(architectures, list)
                                          and all(isinstance(a, str) for a in architectures)):
        fail("speculators_config.verifier.architectures must be a list of model class names (e.g. "
             f"[\"Qwen3ForCausalLM\"]) or null, got {shown(architectures)}")
    return verifier
