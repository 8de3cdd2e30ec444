"""A DFlash drafter's config.json: read, validated, and checked against a target.

config.json is a Qwen3 config plus DFlash fields (DFlash2 drafters add four: their convolutions' and candidate
selector's shapes). Every field that changes the drafted tokens is read, or
refused by name; the fields that do not change them are listed in IGNORED_FIELDS with the reason; any other
top-level field is warned about (Hugging Face writes many). docs/drafter-config.md is the table
of all of them.

Read top to bottom: errors, the field tables, DrafterConfig (what the model in drafter.py is built from),
read_drafter_config, check_compatible, then the validation steps DrafterConfig.from_dict runs in order.

Why this module is long: it is every field of every format a drafter config comes in (z-lab's, SpecForge's,
speculators', DeepSpec's), each read, refused or ignored by name with its reason, in one place a reader can check
against a config.json; the generations and the Gemma 4 backbone read their own fields (Generation.read).
"""

import json
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from transformers import Qwen3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from . import gemma4_backbone
from .config_values import boolean_problem, integer_problem, layer_ids_problem, number_problem, rope_problem, shown
from .generations import NOT_READ, Generation, by_architecture, generations
from .speculators_format import SPECULATORS_FIELDS, SpeculatorsConfigError, is_speculators_config, published_config


class DrafterError(ValueError):
    """A drafter checkpoint that cannot be used as it is; the message says what to fix."""


class DrafterConfigWarning(UserWarning):
    """A config.json field read with a choice the user should know about (e.g. two places disagree)."""


# ----------------------------------------------------------------------------------------------
# The fields


# Top-level fields read with their Qwen3Config meaning (plus is_causal, as z-lab's reference reads it).
READ_FIELDS = (
    "architectures", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "intermediate_size", "hidden_act", "rms_norm_eps", "attention_bias", "vocab_size", "draft_vocab_size",
    "layer_types", "sliding_window", "use_sliding_window", "max_window_layers", "rope_theta",
    "rope_scaling", "rope_parameters", "max_position_embeddings", "is_causal", "dflash_config",
)

# DFlash fields: looked up in dflash_config first, then at the top level (z-lab's reference does the
# same; older exports put block_size, mask_token_id, ... at the top). dflash_config is a small
# namespace: a key that is neither here, nor a generation's (dflash_core.generations), nor in EXTRA_MODULE_FIELDS is
# refused.
BACKBONE_FIELDS = (
    "target_layer_ids", "mask_token_id", "mask_token", "block_size", "num_target_layers", "causal",
    "use_swa", "swa_window_size", "input_embedding_scale", "output_multiplier", "final_logit_softcapping",
    "attention_sink_bias", "projector_type", "pure_draft_prefix_len", "shift_label",
)


# DeepSpec's drafter classes (its step_N/ saves: the target's config with its own fields, DFlash's at the top level;
# the target's embed_tokens and lm_head saved beside, which load_drafter checks against the target's)
DEEPSPEC_ARCHITECTURES = ("Qwen3DSparkModel", *gemma4_backbone.ARCHITECTURES)


def dflash_fields() -> tuple[str, ...]:
    """Every field dflash_config may hold: the backbone's and every registered generation's."""
    return (*BACKBONE_FIELDS, *(key for g in generations() for key in g.FIELDS))


def architectures() -> dict[str, str]:
    """The architectures read here (config.json's `architectures`), each with its generation's name."""
    return {architecture: g.NAME for g in generations() for architecture in g.ARCHITECTURES}

# Fields that switch on math drafter.py does not implement: refused unless they hold their "off"
# value (null is always off). name -> (off values, what the field does).
SWITCHES = {
    "attention_sink_bias": ((False,), "a learned attention-sink logit in every softmax (MiMo/DSpark drafters)"),
    "add_swa_attention_sink_bias": ((False,), "a learned attention-sink logit in sliding layers (MiMo)"),
    "add_full_attention_sink_bias": ((False,), "a learned attention-sink logit in full layers (MiMo)"),
    "partial_rotary_factor": ((1, 1.0), ("RoPE on part of each head only (MiMo-style drafters); "
                                         "transformers' Qwen3 RoPE, which z-lab's reference uses, ignores it")),
    "projector_type": ((), "a logits head on top of the drafter (SpecForge Domino/DSpark)"),
    "pure_draft_prefix_len": ((0,), "a prefix of the block drafted without the logits head (SpecForge Domino)"),
    "shift_label": ((False,), "block position k predicting token start+k+1 instead of start+k"),
    "quantization_config": ((), "quantized weights (dequantize the checkpoint first)"),
}

# Fields of other architectures' extra modules: refused whenever present (not null).
EXTRA_MODULE_FIELDS = {
    "emb_dim": "Domino's GRU logits head", "gru_hidden_dim": "Domino's GRU logits head",
    "hybrid_layer_pattern": "MiMo's layer pattern (this loader reads layer_types)",
    "swa_head_dim": "MiMo's separate sliding-layer shapes", "swa_v_head_dim": "MiMo's separate sliding-layer shapes",
    "swa_num_attention_heads": "MiMo's separate sliding-layer shapes",
    "swa_num_key_value_heads": "MiMo's separate sliding-layer shapes",
    "swa_rope_theta": "MiMo's separate sliding-layer RoPE", "v_head_dim": "value heads of another size than head_dim",
}

# Top-level fields that do not change the drafted tokens, and why.
IGNORED_FIELDS = {
    "model_type": "the architecture decides the forward pass, and every weight is checked by name and shape",
    "auto_map": "remote code is never run",
    **dict.fromkeys(("dtype", "torch_dtype"), "the caller chooses the compute dtype (load_drafter(dtype=...))"),
    "tie_word_embeddings": "the drafter has no embedding or head: the target's are used",
    **dict.fromkeys(("bos_token_id", "eos_token_id", "pad_token_id"),
                    "the references decide where sequences start and stop"),
    "attention_dropout": "dropout is off at inference",
    "initializer_range": "used only to initialise training",
    "num_anchors": "used only in training (the blocks drawn per sequence; DeepSpec's saves keep it)",
    "use_cache": "inference plumbing: the context keys/values are computed once per sequence anyway",
    "transformers_version": "provenance",
    "_name_or_path": "provenance",
    **dict.fromkeys(("step", "global_step"), "the training step (dflash-eval history reads it)"),
    # what transformers writes of every config when it dumps one in full (DeepSpec's Gemma 4 saves)
    **dict.fromkeys(("id2label", "label2id", "problem_type"), "transformers' classification-head fields: no such head"),
    **dict.fromkeys(("output_attentions", "output_hidden_states", "return_dict", "is_encoder_decoder",
                     "chunk_size_feed_forward"), "transformers' output and plumbing switches: the same forward"),
}


# ----------------------------------------------------------------------------------------------
# The config


@dataclass(frozen=True)
class DrafterConfig:
    """A validated drafter config.json: the shapes and settings DFlashDrafter is built from."""

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    attention_bias: bool
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    layer_ids_from_fallback: bool  # True when the config named no target_layer_ids (often wrong: warned)
    num_target_layers: int | None
    vocab_size: int | None
    layer_types: tuple[str, ...]  # "full_attention" | "sliding_attention" per layer
    sliding_window: int | None
    rope: Qwen3Config | None  # only its rope fields are used, through transformers' rope utilities (None: Gemma 4's)
    raw: dict[str, Any] = field(compare=False, repr=False)  # config.json as read, written back by save_drafter
    # None: sliding layers' causality is the caller's choice (sliding_semantics), full layers see the
    # whole block. True/False: every layer is causal / bidirectional within the block (z-lab's rule).
    is_causal: bool | None = None
    input_embedding_scale: float = 1.0  # multiplies the block's (raw) target embeddings, as z-lab does
    # the logits' transforms z-lab applies: x multiplier, then tanh(x / cap) * cap (None: none). Monotonic, so greedy
    # drafts (the argmax) ignore them; sampled drafts' distribution q is computed from the transformed logits
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None
    architecture: str = "DFlashDraftModel"  # one its generation is read for (architectures())
    # what its generation's own fields gave (Generation.read; DFlash2: its convolutions' and selector's shapes)
    generation_fields: Mapping[str, Any] = field(default_factory=dict)

    # A reduced draft vocabulary (vLLM's speculators saves): the drafter's own head over draft_vocab_size tokens and
    # their target ids (the weights' lm_head, d2t and t2d); None: the full vocabulary, through the target's head
    draft_vocab_size: int | None = None
    # speculators' sample_from_anchor: the anchor's slot drafts too (slot t predicts token start + t + 1), so a step
    # verifies block_size drafts, not block_size - 1
    drafts_from_anchor: bool = False
    # the sliding layers' semantics when the config itself fixes it (speculators' sliding_window_non_causal);
    # None: the caller's choice (DFlashDrafter's sliding_semantics)
    sliding_semantics: str | None = None
    verifier_architectures: tuple[str, ...] | None = None  # speculators: the target the drafter was trained against
    source_format: str = "published"  # "published" (z-lab's, SpecForge's exports), "speculators" or "deepspec"
    # the backbone drafter.py runs, by the architecture: "qwen3" (drafter.py's own) or "gemma4" (DeepSpec's
    # Gemma4DSparkModel: gemma4_backbone.py), and what it read of its own fields (gemma4_backbone.shape_of)
    backbone: str = "qwen3"
    backbone_fields: Mapping[str, Any] = field(default_factory=dict)

    def verified_tokens(self, block_size: int) -> int:
        """Tokens a step verifies (its acceptance length at most) for a block of `block_size` slots."""
        return block_size + self.drafts_from_anchor

    @property
    def generation(self) -> Generation:
        """The drafter generation this config is (dflash_core.generations)."""
        generation = by_architecture(self.architecture)
        assert generation is not None, "from_dict reads only the registered generations' architectures"
        return generation

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config.json", mask_token_id: int | None = None,
                  tokenizer: Any = None) -> "DrafterConfig":
        """Validate a drafter config.json (a Qwen3 config with DFlash fields); `source` names it in errors.

        mask_token_id overrides the config's; `tokenizer` (the target's transformers tokenizer) resolves a
        dflash_config.mask_token given as a string. Fields that change the math and are not implemented
        here are refused (DrafterError naming them); unknown top-level fields are warned about.
        """
        speculators = is_speculators_config(raw)
        given = raw
        if speculators:  # read as the published config it describes, with its own fields beside
            try:
                raw = published_config(raw, source, dflash_fields())
            except SpeculatorsConfigError as e:
                raise DrafterError(str(e)) from None
        fields = _Fields(raw, source, nested_in_file=not speculators)  # (speculators: DFlash fields at the top)
        _refuse_unimplemented(fields, reduced_vocabulary=speculators)
        architecture = (raw.get("architectures") or ["DFlashDraftModel"])[0]
        deepspec = not speculators and architecture in DEEPSPEC_ARCHITECTURES  # (speculators' DSpark: its own save)
        gemma4 = architecture in gemma4_backbone.ARCHITECTURES

        hidden = fields.required("hidden_size")
        num_layers = fields.required("num_hidden_layers")
        num_heads = fields.required("num_attention_heads")
        num_kv_heads = fields.integer("num_key_value_heads", raw.get("num_key_value_heads"), 1) or num_heads
        head_dim = fields.integer("head_dim", raw.get("head_dim"), 1) or hidden // num_heads
        backbone_fields: Mapping[str, Any] = {}
        if gemma4:  # its heads (global_head_dim, the global key heads), RoPE, MLP widths: gemma4_backbone
            read = gemma4_backbone.read(fields, hidden, num_layers)
            head_dim, num_kv_heads, backbone_fields = read["head_dim"], read["num_kv_heads"], read["backbone_fields"]
        if num_heads % num_kv_heads:
            fields.fail(f"num_attention_heads {num_heads} is not a multiple of num_key_value_heads {num_kv_heads}")
        block_size = fields.dflash("block_size")
        if problem := integer_problem(block_size, 2):
            fields.fail(f"{fields.name('block_size')} {problem}")

        num_target_layers = fields.integer(fields.name("num_target_layers"), fields.dflash("num_target_layers"), 1)
        layer_ids = fields.dflash("target_layer_ids")
        from_fallback = layer_ids is None
        if from_fallback:
            if num_target_layers is None:
                fields.fail("neither dflash_config.target_layer_ids nor num_target_layers is set")
            layer_ids = fallback_layer_ids(num_target_layers, num_layers)
            warnings.warn(
                f"{source} names no dflash_config.target_layer_ids; using the training fallback {layer_ids} "
                f"for {num_target_layers} target layers. It differs from the trained ids in most published "
                "checkpoints: check it against the training config.",
                stacklevel=2,
            )
        if problem := layer_ids_problem(layer_ids, 0):
            fields.fail(f"{fields.name('target_layer_ids')} {problem}")

        layer_types, window, is_causal = _attention_layout(fields, num_layers)
        rope = None if gemma4 else _rope_config(fields, hidden, num_heads, num_kv_heads, head_dim, num_layers)
        scale = fields.number("input_embedding_scale", fields.dflash("input_embedding_scale"),
                              meaning="it multiplies the block's token embeddings")
        if gemma4:
            if scale is not None:
                fields.fail(f"{fields.name('input_embedding_scale')}: a {architecture} scales the block's token "
                            "embeddings by sqrt(hidden_size), as Gemma 4's embedding does; it reads no such field")
            scale = backbone_fields["gemma4"].embed_scale
        if problem := number_problem(rms_norm_eps := raw.get("rms_norm_eps", 1e-6)):  # (null too: no default)
            fields.fail(f"rms_norm_eps {problem}")
        attention_bias = fields.boolean("attention_bias", raw.get("attention_bias"))

        known = {*READ_FIELDS, *dflash_fields(), *SWITCHES, *EXTRA_MODULE_FIELDS, *IGNORED_FIELDS,
                 *(SPECULATORS_FIELDS if speculators else ()),
                 *((*gemma4_backbone.FIELDS, *gemma4_backbone.IGNORED_FIELDS) if gemma4 else ())}
        unknown = sorted(set(raw) - known)
        if unknown:
            fields.warn(f"fields not read by dflash-eval: {unknown}. If one changes the drafter's math, this "
                        "score will not match the drafter's own implementation.")

        return cls(
            hidden_size=hidden, num_layers=num_layers, num_heads=num_heads, num_kv_heads=num_kv_heads,
            head_dim=head_dim, intermediate_size=fields.required("intermediate_size"),
            rms_norm_eps=float(rms_norm_eps), attention_bias=bool(attention_bias),
            block_size=block_size, mask_token_id=_mask_token_id(fields, mask_token_id, tokenizer),
            target_layer_ids=tuple(layer_ids), layer_ids_from_fallback=from_fallback,
            num_target_layers=num_target_layers, vocab_size=raw.get("vocab_size"), layer_types=layer_types,
            sliding_window=window, rope=rope, raw=given, is_causal=is_causal,
            input_embedding_scale=1.0 if scale is None else float(scale),
            output_multiplier=float(fields.dflash("output_multiplier") or 1.0),
            final_logit_softcapping=float(softcap) if (softcap := fields.dflash("final_logit_softcapping")) else None,
            architecture=architecture, generation_fields=_generation_fields(fields, architecture, hidden),
            draft_vocab_size=raw["draft_vocab_size"] if raw.get("draft_vocab_size") not in (None, raw.get("vocab_size"))
            else None,
            # DeepSpec's saves: every slot drafts (its block 7 is 7 drafts), as speculators' sample_from_anchor says
            drafts_from_anchor=deepspec or bool(raw.get("drafts_from_anchor", False)),
            sliding_semantics=raw.get("sliding_semantics"),
            verifier_architectures=tuple(raw["verifier_architectures"]) if raw.get("verifier_architectures") else None,
            source_format="deepspec" if deepspec else "speculators" if speculators else "published",
            backbone=gemma4_backbone.NAME if gemma4 else "qwen3", backbone_fields=backbone_fields,
        )


def read_drafter_config(path: str | Path, mask_token_id: int | None = None, tokenizer: Any = None) -> DrafterConfig:
    """Parse and validate `path/config.json` of a DFlash drafter checkpoint.

    mask_token_id overrides the config's; tokenizer (the target's, a transformers tokenizer) resolves a
    dflash_config.mask_token string (see DrafterConfig.from_dict).
    """
    config_file = Path(path) / "config.json"
    if not config_file.exists():
        raise DrafterError(f"{config_file} does not exist: a drafter checkpoint needs config.json and "
                           "model.safetensors")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise DrafterError(f"{config_file}: malformed JSON at line {e.lineno} column {e.colno}: {e.msg}") from e
    if not isinstance(raw, dict):
        raise DrafterError(f"{config_file}: expected a JSON object")
    return DrafterConfig.from_dict(raw, source=str(config_file), mask_token_id=mask_token_id, tokenizer=tokenizer)


def check_compatible(cfg: DrafterConfig, hidden_size: int, vocab_size: int, num_layers: int | None = None) -> None:
    """Refuse a drafter (its config; a loaded one's is `drafter.cfg`) that cannot run on a target of this shape, naming
    the mismatch. num_layers=None skips the layer-id checks (the features at hand already fix the layers)."""
    if cfg.hidden_size != hidden_size:
        raise DrafterError(f"drafter hidden_size {cfg.hidden_size} != target hidden_size {hidden_size}: this drafter "
                           "was trained for another target")
    if not 0 <= cfg.mask_token_id < vocab_size:
        raise DrafterError(f"drafter mask_token_id {cfg.mask_token_id} is outside the target's vocabulary of "
                           f"{vocab_size} tokens")
    if cfg.vocab_size is not None and cfg.vocab_size != vocab_size:
        raise DrafterError(f"drafter vocab_size {cfg.vocab_size} != target vocab_size {vocab_size}: this drafter was "
                           "trained for another target (its embedding and head are the target's, row for row)")
    if num_layers is None:
        return
    bad = [i for i in cfg.target_layer_ids if i >= num_layers]
    if bad:
        raise DrafterError(f"config.json target_layer_ids {list(cfg.target_layer_ids)} include {bad}, but the target's "
                           f"text model has only {num_layers} layers (0..{num_layers - 1})")
    if num_layers - 1 in cfg.target_layer_ids:
        raise DrafterError(  # (why: dflash_core.target's docstring)
            f"config.json target_layer_ids {list(cfg.target_layer_ids)} tap layer {num_layers - 1}, the target's last, "
            "which the stacks feed differently (z-lab's loop after the final norm, SGLang and vLLM before it; DeepSpec "
            "refuses it), and whose output the head reads (the fc shortcut: a drafter can copy the answer): use a "
            f"drafter trained on layers 0..{num_layers - 2}")
    if cfg.num_target_layers is not None and cfg.num_target_layers != num_layers:
        warnings.warn(f"drafter num_target_layers {cfg.num_target_layers} != target layers {num_layers}", stacklevel=2)


def check_block_size(block_size: int, drafter_block_size: int) -> int:
    """A block size to verify with (SGLang's --speculative-num-draft-tokens, vLLM's num_speculative_tokens
    + 1): 2 .. the drafter's block size; ValueError otherwise."""
    if isinstance(block_size, bool) or not isinstance(block_size, int) or not 2 <= block_size <= drafter_block_size:
        raise ValueError(f"block size {block_size!r}: use 2 .. {drafter_block_size}, the drafter's block size (a "
                         "block is the bonus token and at least one draft; the drafter was trained on blocks of "
                         f"{drafter_block_size} and drafts no more)")
    return block_size


def chosen_block_size(requested: int | None, drafter_block_size: int) -> int | None:
    """The block size a request chooses, checked (check_block_size): None, "the drafter's own", when none is
    requested or the request is the drafter's own, so that both name one setting everywhere (keys, series, tags,
    run names)."""
    return None if requested is None or check_block_size(requested, drafter_block_size) == drafter_block_size \
        else requested


def fallback_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """The layer ids DFlash training uses when a config names none: evenly from 1 to n_target - 3."""
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    span = num_target_layers - 3 - 1  # from 1 to n_target - 3
    return [round(1 + i * span / (num_draft_layers - 1)) for i in range(num_draft_layers)]


# ----------------------------------------------------------------------------------------------
# Validation: the steps of DrafterConfig.from_dict (the values' own checks: config_values.py)


class _Fields:
    """config.json as read: the DFlash lookup order, and errors/warnings that name the file."""

    def __init__(self, raw: dict[str, Any], source: str, nested_in_file: bool = True):
        self.raw, self.source, self.nested_in_file = raw, source, nested_in_file
        self.nested = raw.get("dflash_config") or {}
        if not isinstance(self.nested, dict):
            self.fail(f"'dflash_config' must be an object, got {type(self.nested).__name__}")

    def fail(self, message: str) -> NoReturn:
        raise DrafterError(f"{self.source}: {message}")

    def warn(self, message: str) -> None:
        warnings.warn(f"{self.source}: {message}", DrafterConfigWarning, stacklevel=3)

    def dflash(self, key: str) -> Any:
        """dflash_config[key], else the top-level key (null counts as absent); warns when both differ."""
        nested, top = self.nested.get(key), self.raw.get(key)
        if nested is not None and top is not None and nested != top:
            self.warn(f"dflash_config.{key} = {nested!r} and top-level {key} = {top!r} differ; using "
                      f"dflash_config's, as z-lab's reference and SGLang do")
        return top if nested is None else nested

    def name(self, key: str) -> str:
        """Where a DFlash field was found in the file, for messages."""
        return f"dflash_config.{key}" if self.nested_in_file and self.nested.get(key) is not None else key

    def required(self, key: str) -> int:
        """The top-level integer field `key` (>= 1), which every drafter config must give."""
        if key not in self.raw:
            self.fail(f"missing required field '{key}'")
        value = self.integer(key, self.raw[key], 1)
        if value is None:
            self.fail(f"{key} must be an integer >= 1, got None")
        return value

    def integer(self, key: str, value: Any, minimum: int) -> int | None:
        """`value` (read from field `key`), refused unless null or an integer >= minimum."""
        if value is not None and (problem := integer_problem(value, minimum)):
            self.fail(f"{key} {problem}")
        return value

    def number(self, key: str, value: Any, zero_allowed: bool = False, meaning: str = "") -> float | None:
        """`value` (read from field `key`, a DFlash field named where it was found), refused unless null or a finite
        number above 0 (or 0, zero_allowed); `meaning`, what the number does, ends the message."""
        if value is not None and (problem := number_problem(value, zero_allowed)):
            self.fail(f"{self.name(key) if key in dflash_fields() else key} {problem}{meaning and f' ({meaning})'}")
        return value

    def boolean(self, key: str, value: Any) -> bool | None:
        """`value` (read from field `key`), refused unless null, true or false."""
        if problem := boolean_problem(value):
            self.fail(f"{key} {problem}")
        return value


def _refuse_unimplemented(fields: _Fields, reduced_vocabulary: bool = False) -> None:
    """Refuse, by name, every field that asks for math drafter.py does not compute. reduced_vocabulary: the format
    stores a reduced vocabulary's head and token map (speculators), which drafter.py computes."""
    raw, nested = fields.raw, fields.nested
    given = raw.get("architectures")
    if given is not None and not (isinstance(given, list) and len(given) == 1 and isinstance(given[0], str)
                                  and by_architecture(given[0])):
        if "dflash_config" not in raw and isinstance(given, list) and any(
                isinstance(a, str) and a.endswith(("ForCausalLM", "ForConditionalGeneration")) for a in given):
            fields.fail(f"architectures {given!r}: this looks like a target model, not a DFlash drafter (no "
                        "dflash_config); pass it as the target and the drafter checkpoint as the drafter")
        read = [f"{architecture} ({name})" for architecture, name in architectures().items()]
        fields.fail(f"architectures {given!r}: the drafters read here are {', '.join(read[:-1])} and {read[-1]}; "
                    f"not read: {NOT_READ}. Score this checkpoint with its own reference implementation.")
    known = dflash_fields()
    unknown = sorted(set(nested) - set(known) - set(EXTRA_MODULE_FIELDS))
    if unknown:
        fields.fail(f"unknown dflash_config keys {unknown}: each may change the drafter's math, so they are not "
                    f"ignored. Known keys: {', '.join(known)}")
    for key, module in EXTRA_MODULE_FIELDS.items():
        if nested.get(key) is not None or raw.get(key) is not None:
            where = f"dflash_config.{key}" if nested.get(key) is not None else key
            fields.fail(f"{where} configures {module}, which this DFlash implementation does not have: "
                        "score this checkpoint with its own reference implementation")
    for key, (off, effect) in SWITCHES.items():
        value = fields.dflash(key) if key in known else raw.get(key)
        # off as its own type: to Python true == 1, so `partial_rotary_factor: true` would pass as 1
        if value is not None and not any(value == o and isinstance(value, bool) == isinstance(o, bool) for o in off):
            fields.fail(f"{fields.name(key)} = {shown(value)} switches on {effect}, which this DFlash implementation "
                        "does not compute; the score would be wrong. Supported: "
                        f"{' or '.join(map(shown, off)) or 'absent'}")
    # SpecForge writes draft_vocab_size into every export; only EAGLE-style drafters shrink it (d2t/t2d maps)
    vocab = fields.integer("vocab_size", raw.get("vocab_size"), 1)
    draft_vocab = fields.integer("draft_vocab_size", raw.get("draft_vocab_size"), 1)
    if draft_vocab is not None and draft_vocab != vocab and not reduced_vocabulary:
        fields.fail(f"draft_vocab_size {draft_vocab} != vocab_size {shown(vocab)}: a reduced draft "
                    "vocabulary (EAGLE-style token maps), which DFlash drafters do not have and this implementation "
                    "does not compute")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        fields.fail(f"hidden_act {act!r}: DFlash drafters use SwiGLU ('silu'); this implementation computes nothing "
                    "else")
    # Logit transforms z-lab's reference applies before its argmax or sampling (DrafterConfig reads them): a negative
    # or zero multiplier would turn the drafts around, an infinite one makes q NaN; the cap's 0 (or null) is none
    fields.number("output_multiplier", fields.dflash("output_multiplier"), meaning="the drafter's logits are scaled by it")
    fields.number("final_logit_softcapping", fields.dflash("final_logit_softcapping"), zero_allowed=True,
                  meaning="the cap of tanh(x / cap) * cap on the logits; 0 or null: no cap")


def _generation_fields(fields: _Fields, architecture: str, hidden: int) -> Mapping[str, Any]:
    """What the config's generation reads of its own fields (Generation.read: DFlash2's four shapes, each required);
    another generation's fields are refused (its weights have no such modules)."""
    generation = by_architecture(architecture)
    assert generation is not None, "_refuse_unimplemented refuses the architectures no generation is read for"
    for other in generations():
        given = [key for key in other.FIELDS if key not in generation.FIELDS and fields.dflash(key) is not None]
        if given:
            fields.fail(f"{fields.name(given[0])} configures {other.NAME}'s {other.FIELDS[given[0]]}, but the "
                        f"architecture is {architecture}: a {other.NAME} drafter's config says architectures "
                        f"{list(other.ARCHITECTURES)}. Fix the config, or drop the {other.NAME} fields if the weights "
                        f"are {generation.NAME}'s.")
    return generation.read(fields, hidden, fields.integer("vocab_size", fields.raw.get("vocab_size"), 1))


def _attention_layout(fields: _Fields, num_layers: int) -> tuple[tuple[str, ...], int | None, bool | None]:
    """(layer_types, sliding window, is_causal) as z-lab's reference and SGLang read them."""
    raw = fields.raw
    use_sliding = fields.boolean("use_sliding_window", raw.get("use_sliding_window"))
    sliding_window = fields.integer("sliding_window", raw.get("sliding_window"), 1)
    swa_window = fields.integer(fields.name("swa_window_size"), fields.dflash("swa_window_size"), 1)
    use_swa = fields.boolean(fields.name("use_swa"), fields.dflash("use_swa"))
    first_sliding = fields.integer("max_window_layers", raw.get("max_window_layers"), 0)  # (checked, read or not)

    layer_types = raw.get("layer_types")
    if layer_types is None:
        if use_swa:
            fields.fail(f"{fields.name('use_swa')} is true but the config has no layer_types: which layers use a "
                        "sliding window is ambiguous (MiMo-style loaders slide every layer, transformers none). "
                        "Add layer_types ('full_attention'/'sliding_attention' per layer).")
        # as transformers' Qwen3Config derives them (z-lab's reference and SGLang see these)
        if first_sliding is None:
            first_sliding = 28  # Qwen3Config's default
        slides = use_sliding and sliding_window is not None
        layer_types = ["sliding_attention" if slides and i >= first_sliding else "full_attention"
                       for i in range(num_layers)]
    if (not isinstance(layer_types, (list, tuple)) or len(layer_types) != num_layers
            or not all(t in ("full_attention", "sliding_attention") for t in layer_types)):
        fields.fail(f"layer_types must list 'full_attention'/'sliding_attention' once per layer ({num_layers}), "
                    f"got {layer_types!r}")
    sliding = "sliding_attention" in layer_types
    if use_swa and not sliding:
        fields.fail(f"{fields.name('use_swa')} is true but layer_types has no 'sliding_attention' layer: fix one of "
                    "them")

    window = None
    if sliding:
        window = sliding_window if sliding_window is not None else swa_window
        if window is None:
            fields.fail("sliding layers need a positive sliding_window (or dflash_config.swa_window_size), got "
                        f"{sliding_window!r}")
        if sliding_window is not None and swa_window is not None and swa_window != sliding_window:
            fields.warn(f"sliding_window {sliding_window} and {fields.name('swa_window_size')} {swa_window} differ; "
                        "using sliding_window, as SGLang does")
        if use_sliding is False and sliding_window is not None:
            fields.warn("use_sliding_window is false, so transformers (and z-lab's reference with it) drops "
                        f"sliding_window; the sliding layers here use the window {window} from the config, as "
                        "training did")

    # z-lab's reference: is_causal unset -> sliding layers causal, full ones not; set -> every layer.
    # SGLang also reads dflash_config.causal when is_causal is unset.
    is_causal = fields.boolean("is_causal", raw.get("is_causal"))
    causal = fields.boolean(fields.name("causal"), fields.dflash("causal"))
    if is_causal is not None and causal is not None and causal != is_causal:
        fields.warn(f"is_causal {is_causal} and {fields.name('causal')} {causal} differ; using is_causal, as z-lab's "
                    "reference and SGLang do")
    return tuple(layer_types), window, causal if is_causal is None else is_causal


def _rope_config(fields: _Fields, hidden: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 num_layers: int) -> Qwen3Config:
    """A Qwen3Config holding the rope fields (rope_theta/rope_scaling, or transformers 5's rope_parameters)."""
    raw = fields.raw
    names = ("rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings")
    rope_fields = {k: raw[k] for k in names if raw.get(k) is not None}
    parameters, scaling = rope_fields.get("rope_parameters"), rope_fields.get("rope_scaling")
    # transformers only warns about a NaN, negative or boolean RoPE number, and computes with it
    fields.number("rope_theta", rope_fields.get("rope_theta"), meaning="RoPE's base")
    fields.integer("max_position_embeddings", rope_fields.get("max_position_embeddings"), 1)
    for key, value in (("rope_parameters", parameters), ("rope_scaling", scaling)):
        if value is not None and not isinstance(value, dict):
            fields.fail(f"{key} must be an object or null, got {shown(value)}")
        if value is not None and (problem := rope_problem(value)):
            fields.fail(f"{key}.{problem}")
    # transformers silently prefers rope_parameters when both are given: a disagreement is a broken export
    if parameters is not None:
        theta = rope_fields.get("rope_theta")
        if theta is not None and parameters.get("rope_theta", theta) != theta:
            fields.fail(f"rope_theta {theta} and rope_parameters.rope_theta {parameters['rope_theta']} differ: "
                        "keep the one the drafter was trained with")
        differing = sorted(k for k, v in (scaling or {}).items() if k != "type" and parameters.get(k, v) != v)
        if differing:
            fields.fail(f"rope_scaling and rope_parameters differ in {differing}: keep the one the drafter was "
                        "trained with")
    for where, settings in (("rope_parameters", parameters), ("rope_scaling", scaling)):
        factor = (settings or {}).get("partial_rotary_factor")
        if factor is not None and (factor != 1 or isinstance(factor, bool)):
            effect = SWITCHES["partial_rotary_factor"][1]
            fields.fail(f"{where}.partial_rotary_factor = {shown(factor)} switches on {effect}, which this DFlash "
                        "implementation does not compute")
    try:
        rope = Qwen3Config(hidden_size=hidden, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
                           head_dim=head_dim, num_hidden_layers=num_layers, **rope_fields)
    except Exception as e:  # noqa: BLE001 -- transformers validates rope types and parameters, raising any kind
        fields.fail(f"invalid rope settings {rope_fields}: {e}")
    rope_type = (rope.rope_parameters or {}).get("rope_type", "default")
    if rope_type != "default" and rope_type not in ROPE_INIT_FUNCTIONS:
        fields.fail(f"invalid rope settings {rope_fields}: unknown rope_type {rope_type!r} "
                    f"(known: default, {', '.join(sorted(ROPE_INIT_FUNCTIONS))})")
    return rope


def _token_of(tokenizer: Any, token: str, fields: _Fields, key: str) -> int:
    """The id of `token` as ONE token of the target's tokenizer (as SGLang resolves mask_token)."""
    token_id = tokenizer.get_vocab().get(token)
    if token_id is None:
        pieces = tokenizer(token, add_special_tokens=False)["input_ids"]
        fields.fail(f"{key} {token!r} is not a single token of the target's tokenizer (it encodes to "
                    f"{len(pieces)} tokens {pieces[:8]}); give dflash_config.mask_token_id, or the tokenizer the "
                    "drafter was trained with")
    return token_id


def _mask_token_id(fields: _Fields, override: int | None, tokenizer: Any) -> int:
    """The mask token's id: the caller's override, else dflash_config's id or token string (resolved by tokenizer)."""
    if override is not None:  # the caller's id (older checkpoints relied on a '<|MASK|>' added at run time)
        if problem := integer_problem(override, 0):
            raise DrafterError(f"mask_token_id {problem}")
        return override
    key = fields.name("mask_token_id")
    token_id, token = fields.dflash("mask_token_id"), fields.dflash("mask_token")
    fields.integer(key, token_id, 0)
    if token is not None:
        token_key = fields.name("mask_token")
        if not isinstance(token, str) or not token:
            fields.fail(f"{token_key} must be a non-empty token string, got {token!r}")
        if tokenizer is not None:
            resolved = _token_of(tokenizer, token, fields, token_key)
            if token_id is not None and token_id != resolved:
                fields.fail(f"{key} {token_id} and {token_key} {token!r} disagree: the target's tokenizer gives "
                            f"{token!r} the id {resolved}. Fix the config (or pass the drafter's tokenizer).")
            token_id = resolved
        elif token_id is None:
            fields.fail(f"{token_key} is the token string {token!r}: its id comes from the target's tokenizer. Pass "
                        "tokenizer=... (a transformers tokenizer) to load_drafter / read_drafter_config, or add "
                        "dflash_config.mask_token_id")
        else:
            fields.warn(f"{token_key} {token!r} was not checked against a tokenizer (none given); using {key} "
                        f"{token_id}")
    if token_id is None:
        fields.fail("no dflash_config.mask_token_id (nor mask_token); older checkpoints used a '<|MASK|>' token "
                    "added to the tokenizer: pass its id explicitly (mask_token_id=...)")
    return token_id

