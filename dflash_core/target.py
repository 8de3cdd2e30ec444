"""Load a target model and run its text backbone.

A target is any Hugging Face causal LM, or a vision-language (or audio) wrapper around one (Qwen3.5/3.6, Gemma 3/4,
Kimi-K2.5, ...). We locate the text decoder by structure - the one module with a token embedding, a `layers`
ModuleList and a final norm, outside any vision or audio tower - and call it directly with token ids, so the towers
never run. The lm_head comes from the model when it has one, otherwise (e.g. `Qwen3_5Model` from `AutoModel`) from
the checkpoint's safetensors. Weights saved under a prefix the model class does not expect (a `Qwen3_5Model`
re-save keeps `language_model.*`) are renamed on load.

Attention: the text model runs with the implementation `attention_implementation` chose (ATTENTION_CHOICES): SDPA
where its class takes it, else eager (gpt-oss's attention sinks have no SDPA path); the towers, which never run,
get transformers' own default.

Feature convention: `features[i]` is Hugging Face's `hidden_states[i + 1]`, the output of decoder layer i (the
residual stream). For the last layer transformers reports the output *after* the final norm instead, and so does
z-lab's loop, which indexes `hidden_states`; SGLang and vLLM capture the residual stream before that norm. A drafter
tapping the last layer would get a different tau from each, so a drafter that does is refused
(drafter_config.check_compatible; DeepSpec's evaluator refuses it too); the stages themselves read the last layer's
final-norm output only to get the target's own next tokens (its probabilities, the diagnostics' agreement).
"""

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from huggingface_hub.errors import StrictDataclassError
from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    Cache,
    DynamicCache,
    GenerationConfig,
    PretrainedConfig,
    PreTrainedModel,
)
from transformers.utils import is_accelerate_available

from .checkpoint_files import has_safetensors
from .choices import ATTENTION_CHOICES, DTYPE_NAMES
from .token_head import EMBEDDING_NAMES, TextWeights, find_text_weights, is_non_text_path, load_token_head

# The dtypes a target loads in, by the names config files and command lines give them.
DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}

# Tried in order: a VLM checkpoint often maps to a text-only causal LM class
# (Qwen3.5 -> Qwen3_5ForCausalLM, which skips the vision weights entirely).
AUTO_CLASSES = (AutoModelForCausalLM, AutoModelForImageTextToText, AutoModel)

# What a text decoder calls its final norm (Nemotron-H: `norm_f`; its embedding: token_head.EMBEDDING_NAMES).
FINAL_NORM_NAMES = ("norm", "norm_f")


@dataclass
class TargetOutput:
    """Result of `Target.forward`.

    logits: [N, T, V] or None when not requested.
    features: layer id -> [N, T, H], equal to HF `hidden_states[layer_id + 1]`.
    """

    logits: torch.Tensor | None
    features: dict[int, torch.Tensor] = field(default_factory=dict)

    def require_logits(self) -> torch.Tensor:
        """The logits of a forward that computed them (logits=True, the default)."""
        if self.logits is None:
            raise ValueError("this forward ran with logits=False: it has no logits")
        return self.logits


class _StopForward(Exception):
    """Raised from a layer hook once every requested layer has run."""


def _named_child(module: nn.Module, names: tuple[str, ...]) -> str | None:
    """The first of `names` that is a submodule attribute of `module`."""
    return next((n for n in names if isinstance(getattr(module, n, None), nn.Module)), None)


def find_backbone(model: nn.Module) -> tuple[str, nn.Module]:
    """Return (name, module) of the text decoder: the module with a token embedding (EMBEDDING_NAMES),
    `layers` (nn.ModuleList) and a final norm (FINAL_NORM_NAMES), outside any vision/audio tower."""
    candidates = []
    for name, module in model.named_modules():
        if is_non_text_path(name):
            continue
        if (
            _named_child(module, EMBEDDING_NAMES) is not None
            and isinstance(getattr(module, "layers", None), nn.ModuleList)
            and _named_child(module, FINAL_NORM_NAMES) is not None
        ):
            candidates.append((name, module))
    if not candidates:
        raise ValueError(
            f"no text backbone found in {type(model).__name__}: no module outside the vision/audio towers "
            f"has a token embedding ({' or '.join(EMBEDDING_NAMES)}), layers (nn.ModuleList) and a final norm "
            f"({' or '.join(FINAL_NORM_NAMES)})"
        )
    if len(candidates) > 1:
        names = [name or "<root>" for name, _ in candidates]
        raise ValueError(f"ambiguous text backbone in {type(model).__name__}: candidates {names}")
    return candidates[0]


def _embedding(backbone: nn.Module) -> nn.Module:
    """The backbone's token embedding module (find_backbone chose it for having one)."""
    name = _named_child(backbone, EMBEDDING_NAMES)
    assert name is not None, "find_backbone returns modules with a token embedding"
    return backbone.get_submodule(name)


def _find_head_module(model: nn.Module) -> nn.Module | None:
    """The model's lm_head (tied or not), or None if it has none."""
    get_output_embeddings = getattr(model, "get_output_embeddings", None)
    head = get_output_embeddings() if get_output_embeddings is not None else None
    if head is None or not isinstance(getattr(head, "weight", None), torch.Tensor):
        return None
    return head


def _decoder_layers(backbone: nn.Module) -> nn.ModuleList:
    """The backbone's decoder layers (find_backbone chose it for having them as an nn.ModuleList)."""
    layers = backbone.get_submodule("layers")
    assert isinstance(layers, nn.ModuleList), "find_backbone returns modules whose layers are an nn.ModuleList"
    return layers


def _weight(module: nn.Module) -> torch.Tensor:
    """The weight matrix of an embedding or a head."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"{type(module).__name__} has no weight tensor")
    return weight


def _text_config(model: nn.Module, backbone: nn.Module) -> PretrainedConfig:
    if isinstance(backbone, PreTrainedModel):
        return backbone.config
    config = getattr(model, "config", None)
    if not isinstance(config, PretrainedConfig):
        raise TypeError(f"{type(model).__name__} has no transformers config to read the text model's settings from")
    return config.get_text_config(decoder=True)


@dataclass(eq=False)
class Target:
    """A target model reduced to what DFlash evaluation needs: its text backbone and token head."""

    model: nn.Module  # whatever was loaded
    backbone: nn.Module  # text decoder: token embedding, layers, final norm
    head_weight: torch.Tensor  # [V, H] lm_head weight (tied -> embedding weight)
    embed_weight: torch.Tensor  # [V, H] raw embedding matrix (Gemma scales it by sqrt(H) in embed_tokens)
    num_layers: int
    hidden_size: int
    vocab_size: int
    max_positions: int | None  # max_position_embeddings of the text config
    text_config: PretrainedConfig
    head_bias: torch.Tensor | None = None  # [V]; almost always None
    logit_softcap: float | None = None  # Gemma-style final_logit_softcapping

    @property
    def attention(self) -> str:
        """The attention implementation the text model runs with ("sdpa", "eager")."""
        return self.text_config._attn_implementation

    @classmethod
    def from_model(cls, model: nn.Module, checkpoint_dir=None) -> "Target":
        """Wrap an already loaded model (puts it in eval mode, without grad).

        `checkpoint_dir` is only read when the model has no lm_head (e.g. `Qwen3_5Model`);
        it defaults to the directory the model was loaded from.
        """
        model.eval().requires_grad_(False)
        _, backbone = find_backbone(model)
        embed_weight = _weight(_embedding(backbone))
        head = _find_head_module(model)
        head_weight: torch.Tensor
        head_bias: torch.Tensor | None
        if head is not None:
            head_weight, head_bias = _weight(head), getattr(head, "bias", None)
        else:
            checkpoint_dir = checkpoint_dir or getattr(model, "name_or_path", None)
            if not checkpoint_dir or not Path(checkpoint_dir).is_dir():
                raise ValueError(
                    f"{type(model).__name__} has no lm_head and no checkpoint directory to read it from; "
                    "pass checkpoint_dir"
                )
            token_head = load_token_head(checkpoint_dir)
            head_weight = token_head.head_weight.to(device=embed_weight.device, dtype=embed_weight.dtype)
            head_bias = None
            if token_head.tied:
                head_weight = embed_weight
        if head_weight.shape[1] != embed_weight.shape[1]:
            raise ValueError(
                f"lm_head hidden size {head_weight.shape[1]} != embedding hidden size {embed_weight.shape[1]}"
            )
        text_config = _text_config(model, backbone)
        return cls(
            model=model,
            backbone=backbone,
            head_weight=head_weight,
            embed_weight=embed_weight,
            num_layers=len(_decoder_layers(backbone)),
            hidden_size=embed_weight.shape[1],
            vocab_size=embed_weight.shape[0],
            max_positions=getattr(text_config, "max_position_embeddings", None),
            text_config=text_config,
            head_bias=head_bias,
            logit_softcap=getattr(text_config, "final_logit_softcapping", None),
        )

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_weight.dtype

    @property
    def device(self) -> torch.device:
        return self.embed_weight.device

    def new_cache(self) -> Cache:
        """An empty cache for incremental decoding (hybrid models get linear-attention layers).

        Note: `crop` cannot roll back the recurrent state of linear-attention layers.
        """
        return DynamicCache(config=self.text_config)

    @torch.no_grad()
    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Input embeddings as the backbone computes them (including any embedding scale). [N, T] -> [N, T, H]"""
        return _embedding(self.backbone)(self._check_input_ids(input_ids))

    @torch.no_grad()
    def apply_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """Apply the lm_head (and softcap, if the model has one) to final-norm outputs. [..., H] -> [..., V]"""
        logits = F.linear(hidden, self.head_weight, self.head_bias)
        if self.logit_softcap is not None:
            logits = torch.tanh(logits / self.logit_softcap) * self.logit_softcap
        return logits

    def check_layer_ids(self, layer_ids) -> list[int]:
        """Validate layer ids against the number of decoder layers; returns them as ints."""
        layer_ids = [int(i) for i in layer_ids]
        for i in layer_ids:
            if i < 0 or i >= self.num_layers:
                raise ValueError(
                    f"layer id {i} is out of range: the target has {self.num_layers} layers "
                    f"(ids 0..{self.num_layers - 1})"
                )
        return layer_ids

    def check_length(self, num_tokens: int) -> None:
        """Raise if `num_tokens` positions do not fit in the target's context."""
        if self.max_positions is not None and num_tokens > self.max_positions:
            raise ValueError(f"prompt of {num_tokens} tokens exceeds the target's context of {self.max_positions}")

    def _check_input_ids(self, input_ids) -> torch.Tensor:
        input_ids = torch.as_tensor(input_ids)
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [N, T], got shape {tuple(input_ids.shape)}")
        if input_ids.dtype.is_floating_point or input_ids.dtype == torch.bool:
            raise ValueError(f"input_ids must be integer token ids, got {input_ids.dtype}")
        if input_ids.numel() > 0:
            low, high = int(input_ids.min()), int(input_ids.max())
            if low < 0 or high >= self.vocab_size:
                bad = low if low < 0 else high
                raise ValueError(
                    f"token id {bad} is out of the target's vocabulary of {self.vocab_size} "
                    f"(ids 0..{self.vocab_size - 1})"
                )
        return input_ids.to(device=self.device, dtype=torch.long)

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        *,
        cache: Cache | None = None,
        attention_mask: torch.Tensor | None = None,
        layer_ids=(),
        logits: bool = True,
    ) -> TargetOutput:
        """Run the text backbone on `input_ids` [N, T].

        With a cache, continues from it: positions start at the cache length and the
        cache is updated in place. `features[i]` equals HF `hidden_states[i + 1]`.
        With `logits=False` and no cache, layers after max(layer_ids) are not run
        (a cache must see every layer, so it disables that shortcut).
        """
        input_ids = self._check_input_ids(input_ids)
        layer_ids = self.check_layer_ids(layer_ids)
        past_length = cache.get_seq_length() if cache is not None else 0
        self.check_length(past_length + input_ids.shape[1])
        if attention_mask is not None:
            attention_mask = attention_mask.to(self.device)

        last = self.num_layers - 1
        # The last layer's HF hidden state is the final-norm output, so it needs the full backbone.
        run_all = logits or cache is not None or last in layer_ids
        if not run_all and not layer_ids:
            return TargetOutput(logits=None, features={})
        stop_after = None if run_all else max(layer_ids)
        wanted = set(layer_ids) - {last}

        features: dict[int, torch.Tensor] = {}
        hooks = []

        def make_hook(layer_id):
            def hook(module, args, output):
                if layer_id in wanted:
                    features[layer_id] = output[0] if isinstance(output, tuple) else output
                if layer_id == stop_after:
                    raise _StopForward

            return hook

        for layer_id in sorted(wanted | ({stop_after} if stop_after is not None else set())):
            hooks.append(_decoder_layers(self.backbone)[layer_id].register_forward_hook(make_hook(layer_id)))
        try:
            out = self.backbone(
                input_ids=input_ids,
                attention_mask=attention_mask,
                cache=cache,
                use_cache=cache is not None,
                return_dict=True,
            )
        except _StopForward:
            out = None
        finally:
            for h in hooks:
                h.remove()

        if out is not None and last in layer_ids:
            features[last] = out.last_hidden_state
        return TargetOutput(
            logits=self.apply_head(out.last_hidden_state) if logits else None,
            features={i: features[i] for i in layer_ids},
        )

    __call__ = forward


@dataclass(frozen=True)
class TargetConfig:
    """What a target's config.json says about its text model, read without loading any weight."""

    hidden_size: int
    vocab_size: int
    num_layers: int
    max_positions: int | None
    eos_token_ids: tuple[int, ...]  # from generation_config.json, else config.json
    architectures: tuple[str, ...] = ()  # config.json's


def checkpoint_dtype(path) -> str | None:
    """The dtype a checkpoint's config.json names: `dtype` or (older transformers) `torch_dtype`, at the top
    level, else in `text_config`; e.g. "bfloat16". None when it names none."""
    config_file = Path(path) / "config.json"
    if not config_file.is_file():
        raise ValueError(f"target {path} does not exist or holds no config.json: pass a Hugging Face model folder")
    config = json.loads(config_file.read_text())
    for section in (config, config.get("text_config") or {}):
        for name in ("dtype", "torch_dtype"):
            value = section.get(name)
            if isinstance(value, str) and value:
                return value.removeprefix("torch.")
    return None


def _auto_config(path: Path) -> PretrainedConfig:
    """AutoConfig.from_pretrained, with a config transformers cannot read raised as one line naming the file: a field
    of the wrong type (e.g. "hidden_size": "64"; transformers 5 validates fields strictly, with its own exception),
    an unknown model_type, values its config class refuses (Gemma 4 sharing the KV of every layer)."""
    try:
        return AutoConfig.from_pretrained(path)
    except StrictDataclassError as e:
        cause = e.__cause__ or e
        raise ValueError(f"{path / 'config.json'}: {cause}".replace("\n", " ")) from None
    except (ValueError, KeyError, TypeError) as e:
        reason = " ".join(str(e).split())
        raise ValueError(f"{path / 'config.json'}: transformers cannot read it: {reason}") from None


def read_target_config(path) -> TargetConfig:
    """Read a target checkpoint's text config (and stop tokens) to check inputs before any work.

    When the folder holds weights, their names are checked too (nothing is read): a folder whose head is
    missing (e.g. a `Qwen3_5Model` re-save of an untied model) raises ValueError here, not after loading.
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise ValueError(f"{path} is not a Hugging Face model directory (no config.json); pass the target "
                         "checkpoint folder")
    if has_safetensors(path):
        find_text_weights(path)
    config = _auto_config(path)
    text = config.get_text_config(decoder=True)
    eos = None
    try:
        eos = GenerationConfig.from_pretrained(path).eos_token_id
    except OSError:  # no generation_config.json
        pass
    if eos is None:
        eos = getattr(config, "eos_token_id", None) or getattr(text, "eos_token_id", None)
    eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (eos,)
    return TargetConfig(
        hidden_size=text.hidden_size,
        vocab_size=text.vocab_size,
        num_layers=text.num_hidden_layers,
        max_positions=getattr(text, "max_position_embeddings", None),
        eos_token_ids=tuple(int(e) for e in eos),
        architectures=tuple(getattr(config, "architectures", None) or ()),
    )


def _model_class(config: PretrainedConfig):
    """The auto class (AUTO_CLASSES, tried in order) that builds a model of `config`; ValueError when none does."""
    auto_class = next((c for c in AUTO_CLASSES if type(config) in c._model_mapping), None)
    if auto_class is None:
        raise ValueError("transformers has no causal-LM, image-text-to-text or base model class for "
                         f"{type(config).__name__}")
    return auto_class


def _attn_argument(config: PretrainedConfig, attention: str | None) -> str | dict[str, str] | None:
    """`from_pretrained(attn_implementation=...)` for the text model (and the wrapper around it) alone: a wrapper's
    towers keep transformers' default (they never run, and an audio tower may take no SDPA). The wrapper's own key
    ("") counts too: a composite config may build a text-only class (Qwen3.5-MoE -> Qwen3_5MoeForCausalLM)."""
    if attention is None or "text_config" not in getattr(config, "sub_configs", {}):
        return attention
    return {"": attention, "text_config": attention}


def choose_attention(path, requested: str = "auto") -> str:
    """The attention implementation the target's text model runs with: `requested` ("sdpa" or "eager") when its class
    takes it, and for "auto" SDPA where it takes it, else eager (gpt-oss: its attention sinks have no SDPA path).

    Builds the model on the meta device (no memory, no weight read), so a config transformers cannot build is found
    here too: ValueError naming the config file, the class and transformers' reason.
    """
    if requested not in ATTENTION_CHOICES:
        raise ValueError(f"attention implementation {requested!r}: use one of {', '.join(ATTENTION_CHOICES)}")
    path = Path(path)
    config = _auto_config(path)
    auto_class = _model_class(config)
    try:
        with torch.device("meta"):
            skeleton = auto_class.from_config(config, attn_implementation=_attn_argument(
                config, None if requested == "auto" else requested))
    except Exception as e:  # whatever transformers raises while building: a bad shape, an unsupported attention
        name = auto_class._model_mapping[type(config)].__name__
        if requested == "sdpa" and "scaled_dot_product_attention" in str(e):
            raise ValueError(f"{path / 'config.json'}: {name} does not support SDPA attention; use "
                             "--attn-implementation eager (or auto, which chooses it)") from None
        reason = " ".join(str(e).split())
        raise ValueError(f"{path / 'config.json'}: transformers cannot build {name} from it: {reason}") from None
    _, backbone = find_backbone(skeleton)
    return _text_config(skeleton, backbone)._attn_implementation


def load_target(path, dtype: torch.dtype = torch.bfloat16, device="cpu", attention: str = "sdpa") -> Target:
    """Load a target from a local Hugging Face checkpoint directory.

    Tries AutoModelForCausalLM, then AutoModelForImageTextToText, then AutoModel, its text model with the
    `attention` implementation ("sdpa" or "eager": choose_attention picks one it takes), in eval mode without
    grad. The text weights are found by name wherever they were saved (`language_model.*` from a `Qwen3_5Model`
    re-save loads into the causal LM; its vision tower is not even loaded), and so is the lm_head. Raises
    ValueError when the directory or its config is missing, when the head is missing and not tied (naming the
    prefix found), or when the checkpoint lacks weights the text backbone or head need (they would be silently
    random otherwise).
    """
    path = Path(path)
    if not path.is_dir():
        raise ValueError(f"target directory {path} does not exist")
    if not (path / "config.json").is_file():
        raise ValueError(f"no config.json in target directory {path}")
    weights = find_text_weights(path)  # before loading anything: a missing head is an error, not a random one
    config = _auto_config(path)
    auto_class = _model_class(config)
    key_mapping = _key_mapping(auto_class, config, weights)
    device = torch.device(device)
    # Loading straight onto an accelerator needs `accelerate`; without it, load to CPU and move.
    direct = device.type != "cpu" and is_accelerate_available()
    model, info = auto_class.from_pretrained(  # (output_loading_info=True: it returns (model, info))
        path,
        config=config,
        dtype=dtype,
        device_map=str(device) if direct else None,
        attn_implementation=_attn_argument(config, attention),
        output_loading_info=True,
        key_mapping=key_mapping,
    )
    if not direct:
        model.to(device)
    target = Target.from_model(model, checkpoint_dir=path)
    missing = [k for k in info.get("missing_keys", ()) if not is_non_text_path(k)]
    if missing:
        raise ValueError(f"checkpoint {path} lacks weights the text model needs: {sorted(missing)[:8]} "
                         f"(its text weights are under {weights.prefix or '<no prefix>'}*)")
    return target


def _key_mapping(auto_class, config: PretrainedConfig, weights: TextWeights) -> dict[str, str] | None:
    """Renames (regex -> name, for `from_pretrained(key_mapping=...)`) that put the checkpoint's text weights
    where the model class expects them; None when transformers finds them by itself.

    transformers knows the prefixes its own classes save (`model.`, `model.language_model.`, legacy
    `language_model.model.`, and a bare decoder without prefix); a base model of a VLM saved on its own
    (`Qwen3_5Model` -> `language_model.*`) is not one of them, nor is a head kept under another name.
    """
    base = auto_class._model_mapping[type(config)].base_model_prefix
    foreign_prefix = weights.prefix != "" and not weights.prefix.startswith(f"{base}.")
    head_key = weights.head_key
    foreign_head = head_key not in (None, "lm_head.weight")
    if not (foreign_prefix or foreign_head):
        return None
    # The model's own names, from a skeleton on the meta device (no memory, no weights read).
    with torch.device("meta"):
        skeleton = auto_class.from_config(config)
    backbone_name, _ = find_backbone(skeleton)
    mapping = {}
    head = _find_head_module(skeleton)
    if foreign_head and head_key is not None and head is not None:
        head_name = next(name for name, module in skeleton.named_modules() if module is head)
        # first: the prefix rule below would otherwise rename a head kept under the text prefix
        mapping[f"^{re.escape(head_key)}$"] = f"{head_name}.weight"
    if foreign_prefix and weights.prefix != f"{backbone_name}.":
        mapping[f"^{re.escape(weights.prefix)}"] = f"{backbone_name}."
    return mapping or None
