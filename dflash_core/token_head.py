"""Read a target's token embedding and lm_head straight from its safetensors.

A DFlash drafter has no embedding and no lm_head of its own: it borrows the
target's. Loading a 27B target to get two [V, H] matrices would be wasteful,
and `AutoModel` on a Qwen3.5 checkpoint returns `Qwen3_5Model`, which has no
lm_head at all. So we open the checkpoint's safetensors and read exactly those
two tensors by name, whatever prefix the wrapper class gives them:

    model.embed_tokens.weight                   text-only causal LM
    model.language_model.embed_tokens.weight    Qwen3.5 / Qwen3-VL style VLM
    language_model.model.embed_tokens.weight    Gemma 3 / Llava style VLM
    language_model.embed_tokens.weight          a Qwen3_5Model (AutoModel) re-save, which has no lm_head
    backbone.embeddings.weight                  Nemotron-H (its decoder names its embedding `embeddings`)
    lm_head.weight, language_model.lm_head.weight, ...

Keys under a vision tower, projector, audio tower or multi-token-prediction
head are never candidates. `find_text_weights` says where the text decoder's
weights are (their prefix) and where the head is, from the key names alone.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from .checkpoint_files import tensor_files

# What a text decoder calls its token embedding, in the order they are looked for (Nemotron-H: `embeddings`).
EMBEDDING_NAMES = ("embed_tokens", "embeddings")

# Dotted name components (or their prefixes) of the parts of a model other than its text decoder:
# vision and audio towers, their projectors, multi-token-prediction heads. Module names (target.py)
# and checkpoint keys (here) are both matched against them.
NON_TEXT_MODULES = frozenset({
    "visual",
    "vision_tower",
    "vision_model",
    "vision_encoder",
    "multi_modal_projector",
    "mm_projector",
    "audio_tower",
    "audio_model",
    "mtp",
})
NON_TEXT_PREFIXES = ("vision", "visual", "audio", "mtp")


@dataclass
class TokenHead:
    """The target's token embedding and output head, both [V, H].

    When the head is tied, `head_weight` is the same tensor as `embed_weight`.
    """

    embed_weight: torch.Tensor
    head_weight: torch.Tensor
    tied: bool
    embed_key: str
    head_key: str | None  # None when tied to the embedding


def is_non_text_path(name: str) -> bool:
    """True if a dotted module or weight name lies under a vision, audio or MTP part of the model."""
    return any(p in NON_TEXT_MODULES or p.startswith(NON_TEXT_PREFIXES) for p in name.split("."))


def is_text_key(key: str) -> bool:
    """True if a checkpoint key can be the text decoder's embedding or head: not under a non-text part,
    nor under "layers", which excludes per-layer embeddings and heads such as DeepSeek's MTP layer
    `model.layers.61.embed_tokens.weight`."""
    return not is_non_text_path(key) and "layers" not in key.split(".")


def _find_unique_key(keys, module_name: str, target_dir: Path) -> str | None:
    """The one text-decoder key ending in `<module_name>.weight`, None if there is none."""
    suffix = f"{module_name}.weight"
    matches = sorted(k for k in keys if (k == suffix or k.endswith("." + suffix)) and is_text_key(k))
    if len(matches) > 1:
        raise ValueError(
            f"ambiguous {module_name} in {target_dir}: several candidate tensors {matches}; "
            "cannot tell which one belongs to the text decoder"
        )
    return matches[0] if matches else None


def _read_tie_flag(target_dir: Path) -> bool | None:
    """`tie_word_embeddings` from config.json (top level first, then text_config); None if unset."""
    config_path = target_dir / "config.json"
    if not config_path.is_file():
        return None
    config = json.loads(config_path.read_text())
    if "tie_word_embeddings" in config:
        return bool(config["tie_word_embeddings"])
    text_config = config.get("text_config") or {}
    if "tie_word_embeddings" in text_config:
        return bool(text_config["tie_word_embeddings"])
    return None


@dataclass(frozen=True)
class TextWeights:
    """Where a checkpoint keeps its text decoder's weights, from their names alone (nothing is read).

    `prefix` is what precedes `embed_tokens.weight`, `layers.N.*` and `norm.weight`: "model." for a
    causal LM, "model.language_model." for a Qwen3.5-style VLM, "language_model." for a `Qwen3_5Model`
    re-save, "" for a bare decoder. `head_key` is None when the head is the embedding (tied).
    """

    prefix: str
    embed_key: str
    head_key: str | None
    key_to_file: dict[str, Path]


def _looks_like_drafter(folder: Path) -> str | None:
    """What marks `folder` as a DFlash drafter (its config's dflash_config or architecture), or None."""
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    if "dflash_config" in config:
        return "its config.json has dflash_config"
    dflash = [a for a in config.get("architectures") or () if isinstance(a, str) and "dflash" in a.lower()]
    return f"its architecture is {dflash[0]}" if dflash else None


def find_text_weights(target_dir) -> TextWeights:
    """Find the text decoder's embedding and head among a checkpoint's tensor names.

    Raises ValueError when there is no embedding, or when there is no lm_head and the config does not
    tie it to the embedding (e.g. `Qwen3_5Model.save_pretrained` drops the head): the message names the
    prefix the text weights were found under. Its weight files are listed by `checkpoint_files.tensor_files`
    (WeightFilesError, a ValueError, when they cannot be).
    """
    target_dir = Path(target_dir)
    key_to_file = tensor_files(target_dir)
    # `embed_tokens` first: `embeddings` (Nemotron-H) names other tables too in models that have both
    embed_module = next((name for name in EMBEDDING_NAMES if _find_unique_key(key_to_file, name, target_dir)), None)
    embed_key = _find_unique_key(key_to_file, embed_module, target_dir) if embed_module else None
    if embed_key is None:
        drafter = _looks_like_drafter(target_dir)
        raise ValueError(f"no embedding tensor (*embed_tokens.weight or *embeddings.weight) outside the vision/audio "
                         f"parts in {target_dir}"
                         + (f": it looks like a DFlash drafter ({drafter}), not a target; pass it as the drafter and "
                            "the model it drafts for as the target" if drafter else ""))
    prefix = embed_key[: -len(f"{embed_module}.weight")]
    head_key = _find_unique_key(key_to_file, "lm_head", target_dir)
    if head_key is None and _read_tie_flag(target_dir) is False:
        # A base model (AutoModel -> Qwen3_5Model) saved on its own keeps no head; an untied one is
        # then lost, and the embedding would be a silently different head.
        hint = " (a Qwen3_5Model saved without its lm_head)" if prefix == "language_model." else ""
        raise ValueError(
            f"{target_dir} has its text weights under {prefix or '<no prefix>'}*{hint} and no lm_head.weight, "
            "while its config.json sets tie_word_embeddings=false: the output head is not in this folder; "
            "point --target at the original checkpoint (the one with lm_head.weight)"
        )
    return TextWeights(prefix=prefix, embed_key=embed_key, head_key=head_key, key_to_file=key_to_file)


def _read_tensor(path: Path, key: str) -> torch.Tensor:
    with safe_open(path, framework="pt") as f:
        return f.get_tensor(key)


def load_token_head(target_dir, dtype: torch.dtype | None = None) -> TokenHead:
    """Read only the embedding and lm_head tensors of a target checkpoint.

    Args:
        target_dir: local directory of a Hugging Face checkpoint (single-file or sharded safetensors).
        dtype: cast both tensors to this dtype; None keeps the stored dtype.

    Returns:
        TokenHead with `embed_weight` and `head_weight`, each [V, H]. The head is
        the embedding when the checkpoint stores no lm_head and the config ties them.
        Like transformers, an lm_head present in the checkpoint is used even if the
        config says tied (transformers only ties when the two are equal or one is missing).
    """
    weights = find_text_weights(target_dir)
    key_to_file, embed_key, head_key = weights.key_to_file, weights.embed_key, weights.head_key

    embed_weight = _read_tensor(key_to_file[embed_key], embed_key)
    if head_key is None:
        head_weight = embed_weight
    else:
        head_weight = _read_tensor(key_to_file[head_key], head_key)
        if head_weight.ndim != 2 or head_weight.shape[1] != embed_weight.shape[1]:
            raise ValueError(
                f"{head_key} has shape {tuple(head_weight.shape)} but {embed_key} has shape "
                f"{tuple(embed_weight.shape)}: hidden sizes differ"
            )

    if dtype is not None:
        embed_weight = embed_weight.to(dtype)
        head_weight = embed_weight if head_key is None else head_weight.to(dtype)
    return TokenHead(
        embed_weight=embed_weight,
        head_weight=head_weight,
        tied=head_key is None,
        embed_key=embed_key,
        head_key=head_key,
    )
