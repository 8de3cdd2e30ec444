"""A tiny *trained* target language model, built offline in about a minute on a CPU.

An evaluation harness for speculative-decoding drafters needs a target whose
greedy continuations are varied and learnable: a randomly initialised model
writes one repeated token, which no drafter can learn anything from. This
module builds such a target from text already on the machine:

1. `build_corpus`: Python standard library sources (PSF license), split into
   documents (one per top-level function, class header or method) and joined
   with `<|endoftext|>`, so the model learns to end a document.
2. `train_tokenizer`: a byte-level BPE of a few hundred tokens with ChatML and
   DFlash special tokens and a ChatML chat template.
3. `train_target`: next-token training of a Qwen3 (or hybrid Qwen3.5) model of
   a few million parameters on random windows of the first 95% of the corpus.
4. `save_target` / `save_qwen3_5_vlm`: ordinary Hugging Face checkpoint
   directories that `dflash_core.target.load_target` and `AutoTokenizer` load.
5. `prompt_snippets`: held-out prompts from the last 5% of the corpus.

Everything is deterministic for a given Python version (the corpus is read
from its standard library; its sha256 pins it) and machine (float training
is reproducible on one machine, not bit-identical across CPU kernels).

Why this module is long: these steps are one recipe (over 600 lines in one file); tiny/build.py
keys its cached run on this module's source, and about 90 lines are the list
of corpus modules.
"""

import ast
import functools
import hashlib
import itertools
import random
import sysconfig
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    PreTrainedTokenizerFast,
    Qwen3_5Config,
    Qwen3_5ForCausalLM,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5TextConfig,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from .training import Progress, learning_rate

# Top-level standard library modules the corpus is read from: general-purpose, pure-Python
# code with docstrings. Modules that later Python versions removed or turned into packages
# (cgi, pathlib, string, zipfile, ...) are left out so the list stays valid; a file that is
# still missing is skipped, and the corpus hash records the difference.
CORPUS_MODULES = (
    "argparse.py",
    "ast.py",
    "base64.py",
    "bdb.py",
    "bisect.py",
    "calendar.py",
    "cmd.py",
    "code.py",
    "codecs.py",
    "colorsys.py",
    "configparser.py",
    "contextlib.py",
    "copy.py",
    "csv.py",
    "dataclasses.py",
    "datetime.py",
    "difflib.py",
    "dis.py",
    "enum.py",
    "filecmp.py",
    "fileinput.py",
    "fnmatch.py",
    "fractions.py",
    "ftplib.py",
    "functools.py",
    "genericpath.py",
    "getopt.py",
    "gettext.py",
    "glob.py",
    "graphlib.py",
    "gzip.py",
    "hashlib.py",
    "heapq.py",
    "hmac.py",
    "imaplib.py",
    "inspect.py",
    "ipaddress.py",
    "linecache.py",
    "locale.py",
    "lzma.py",
    "mailbox.py",
    "mimetypes.py",
    "netrc.py",
    "numbers.py",
    "operator.py",
    "optparse.py",
    "os.py",
    "pickle.py",
    "platform.py",
    "plistlib.py",
    "poplib.py",
    "posixpath.py",
    "pprint.py",
    "pstats.py",
    "queue.py",
    "quopri.py",
    "random.py",
    "reprlib.py",
    "sched.py",
    "secrets.py",
    "selectors.py",
    "shelve.py",
    "shlex.py",
    "shutil.py",
    "smtplib.py",
    "socket.py",
    "socketserver.py",
    "statistics.py",
    "subprocess.py",
    "tabnanny.py",
    "tarfile.py",
    "tempfile.py",
    "textwrap.py",
    "threading.py",
    "timeit.py",
    "tokenize.py",
    "trace.py",
    "traceback.py",
    "types.py",
    "typing.py",
    "uuid.py",
    "warnings.py",
    "wave.py",
    "weakref.py",
    "zipapp.py",
)

DEFAULT_CORPUS_BYTES = 1_000_000
# Longer documents (big functions, data tables) are left out: short documents teach a tiny
# model to end one with eos, and a 64-token continuation often reaches that end.
MAX_DOCUMENT_CHARS = 2000
HELD_OUT_FRACTION = 0.05  # the tail of the corpus that training never sees

EOS_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
MASK_TOKEN = "<|mask|>"  # the DFlash drafter's mask token
# Qwen3.5 vision-language checkpoints point their config at these; we never train on them.
VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
SPECIAL_TOKENS = (EOS_TOKEN, IM_START_TOKEN, IM_END_TOKEN, MASK_TOKEN, *VISION_TOKENS)

# Qwen2/Qwen3's pre-tokenizer split: words with one leading space, single digits, runs of
# punctuation, newlines, and whitespace runs that leave the last space to the next word.
PRETOKENIZE_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# ChatML, as Qwen writes it. Qwen3 templates read `enable_thinking`; ours accepts it (Jinja
# ignores unused variables) and renders the same either way. List contents (multimodal
# messages) contribute their text parts.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}"
    "{{- message['content'] }}"
    "{%- else %}"
    "{%- for part in message['content'] %}"
    "{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- endif %}"
)


# ---------------------------------------------------------------------------
# Corpus


def _source_documents(source: str) -> list[str]:
    """Split one module's source into documents: each run of top-level statements that are not
    definitions, each top-level function, each class header (up to its first method) and each
    method. Comments and blank lines between two pieces go with the first one."""
    # ast counts lines by "\n" only; str.splitlines would also split at form feeds and the like.
    lines = source.split("\n")
    tree = ast.parse(source)
    definitions = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)

    def first_line(node):  # 0-based, decorators included
        return min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])]) - 1

    starts = [0]
    previous_is_definition = True
    for node in tree.body:
        is_definition = isinstance(node, definitions)
        if is_definition or previous_is_definition:
            starts.append(first_line(node))
        previous_is_definition = is_definition
        if isinstance(node, ast.ClassDef):
            starts.extend(
                first_line(child)
                for child in node.body
                if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
            )
    starts = sorted(set(starts)) + [len(lines)]
    documents = []
    for begin, end in itertools.pairwise(starts):
        text = "\n".join(lines[begin:end]).rstrip()
        # A special token inside a document would split it in two once tokenized.
        if text and not any(token in text for token in SPECIAL_TOKENS):
            documents.append(text + "\n")
    return documents


@functools.cache
def _stdlib_documents() -> tuple[str, ...]:
    """Documents of all `CORPUS_MODULES` in a fixed shuffled order (parsed once per process)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    documents: list[str] = []
    for name in CORPUS_MODULES:
        path = stdlib / name
        if path.is_file():
            documents.extend(
                d for d in _source_documents(path.read_text(encoding="utf-8")) if len(d) <= MAX_DOCUMENT_CHARS
            )
    if not documents:
        raise RuntimeError(f"none of the corpus modules were found in {stdlib}")
    # Shuffle so that the held-out tail holds documents from every module, not the last modules alphabetically.
    random.Random(0).shuffle(documents)
    return tuple(documents)


def build_corpus(max_bytes: int = DEFAULT_CORPUS_BYTES) -> tuple[str, str]:
    """Return (text, sha256 hex digest of text): documents from Python's standard library.

    The modules in `CORPUS_MODULES` are read from `sysconfig.get_paths()["stdlib"]`, split
    into documents by `ast` (top-level functions, class headers, methods, runs of other
    statements), shuffled with a fixed seed and joined, each followed by `<|endoftext|>`,
    until the next document would exceed `max_bytes` of UTF-8. The text depends only on the
    Python version's standard library sources; the hash pins it (compare it across machines).
    """
    pieces, size = [], 0
    for document in _stdlib_documents():
        piece = document + EOS_TOKEN
        piece_bytes = len(piece.encode("utf-8"))
        if size + piece_bytes > max_bytes:
            break
        pieces.append(piece)
        size += piece_bytes
    text = "".join(pieces)
    return text, hashlib.sha256(text.encode("utf-8")).hexdigest()


def split_corpus(text: str, held_out_fraction: float = HELD_OUT_FRACTION) -> tuple[str, str]:
    """Split the corpus into (training text, held-out text) at the first document boundary
    after `1 - held_out_fraction` of its characters."""
    cut = text.find(EOS_TOKEN, int(len(text) * (1 - held_out_fraction)))
    if cut < 0:
        raise ValueError("corpus too small to hold out a document")
    cut += len(EOS_TOKEN)
    return text[:cut], text[cut:]


# ---------------------------------------------------------------------------
# Tokenizer


def train_tokenizer(text: str, vocab_size: int = 512) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE tokenizer of `vocab_size` tokens (special tokens included) on `text`.

    Special tokens: `<|endoftext|>` (eos and pad), `<|im_start|>`, `<|im_end|>`, `<|mask|>`
    (the tokenizer's mask token, for DFlash drafters) and Qwen's four vision tokens; each is
    one id. Any text round-trips (byte-level: no unknown token). The chat template is ChatML.
    Deterministic for the same text.
    """
    min_size = 256 + len(SPECIAL_TOKENS)
    if vocab_size < min_size:
        raise ValueError(f"vocab_size must be at least {min_size} (256 bytes + special tokens)")
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_PATTERN), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, seen or not
        show_progress=False,
    )
    # Special tokens are whole documents' separators, not text to learn merges from.
    documents = [d for d in text.split(EOS_TOKEN) if d]
    tokenizer.train_from_iterator(documents, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        mask_token=MASK_TOKEN,
        extra_special_tokens=[IM_START_TOKEN, IM_END_TOKEN, *VISION_TOKENS],
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,  # exact round trip
    )


def token_id(tokenizer: PreTrainedTokenizerFast, token: str) -> int:
    """The id of one token of the vocabulary (`convert_tokens_to_ids` also takes a list, hence its union type)."""
    found = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(found, int):
        raise TypeError(f"{token!r} maps to {found!r}, not one token id")
    return found


def _decode(tokenizer: PreTrainedTokenizerFast, ids: list[int]) -> str:
    """The text of one sequence of ids (`decode` also takes a batch, hence its union type)."""
    text = tokenizer.decode(ids)
    if not isinstance(text, str):
        raise TypeError(f"decoding {ids} gave {type(text).__name__}, not a string")
    return text


def encode_documents(tokenizer: PreTrainedTokenizerFast, text: str) -> torch.Tensor:
    """Token ids of a corpus text as one 1-D int64 tensor, each document followed by the eos id.

    Documents are encoded separately (in parallel by the fast tokenizer), which gives the
    same ids as encoding the whole text: no BPE merge crosses a special token.
    """
    documents = text.split(EOS_TOKEN)
    ends_with_eos = documents[-1] == ""
    if ends_with_eos:
        documents.pop()
    encoded = tokenizer(documents, add_special_tokens=False)["input_ids"]
    ids = []
    for i, document_ids in enumerate(encoded):
        ids.extend(document_ids)
        if ends_with_eos or i < len(encoded) - 1:
            ids.append(tokenizer.eos_token_id)
    return torch.tensor(ids, dtype=torch.long)


# ---------------------------------------------------------------------------
# Target model


def qwen3_config(vocab_size: int, eos_token_id: int, **overrides) -> Qwen3Config:
    """Config of the tiny Qwen3 target (1.9M parameters with 512 tokens): 4 layers, hidden 192,
    GQA (6 query heads, 2 key/value heads, head dim 32), an untied lm_head like the larger
    Qwen3 models, 512 positions. `overrides` replace any field."""
    kwargs: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": 192,
        "intermediate_size": 576,
        "num_hidden_layers": 4,
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "max_position_embeddings": 512,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "tie_word_embeddings": False,
        "eos_token_id": eos_token_id,
        "pad_token_id": eos_token_id,
        "bos_token_id": None,
    }
    kwargs.update(overrides)
    return Qwen3Config(**kwargs)


def qwen3_5_text_config(vocab_size: int, eos_token_id: int, **overrides) -> Qwen3_5TextConfig:
    """Config of the tiny hybrid Qwen3.5 target (2.1M parameters with 512 tokens): Gated DeltaNet
    (linear attention) and full attention layers alternating over 4 layers, hidden 192, GQA in
    the full attention layers, untied lm_head, 512 positions. `overrides` replace any field.

    The published models put one full attention layer after every three linear ones; with four
    layers on a CPU budget, alternating trains faster and reaches a lower loss in the same time.
    Qwen3.5 uses mRoPE: rotary dim = head_dim * partial_rotary_factor = 32 * 0.5 = 16, i.e. 8
    frequencies split 4/2/2 over the time/height/width sections (all equal for text).
    """
    kwargs: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": 192,
        "intermediate_size": 576,
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention", "full_attention", "linear_attention", "full_attention"],
        "num_attention_heads": 6,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 32,
        "linear_value_head_dim": 32,
        "linear_num_key_heads": 3,
        "linear_num_value_heads": 6,
        "max_position_embeddings": 512,
        "rope_parameters": {
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "mrope_section": [4, 2, 2],
            "mrope_interleaved": True,
        },
        "tie_word_embeddings": False,
        "eos_token_id": eos_token_id,
        "pad_token_id": eos_token_id,
        "bos_token_id": None,
    }
    kwargs.update(overrides)
    return Qwen3_5TextConfig(**kwargs)


# Default optimisation budget per architecture, sized so that training takes about 90 s (Qwen3)
# and 60 s (Qwen3.5) on two CPU cores.
DEFAULT_STEPS = {"qwen3": 800, "qwen3_5": 350}


@dataclass
class TrainStats:
    """What `train_target` did: steps, tokens seen, losses (nats per token) and wall time."""

    steps: int
    tokens_seen: int
    num_params: int
    final_loss: float  # mean training loss over the last 10% of steps
    held_out_loss: float  # loss on held-out windows (the corpus tail), after training
    seconds: float
    loss_curve: list[float]  # mean training loss of each tenth of the steps (fewer points for < 10 steps)


def _tenths(values: list[float]) -> list[float]:
    """Means of `values` over ten consecutive, near-equal parts (one part per value if fewer)."""
    parts = min(10, len(values))
    bounds = [round(i * len(values) / parts) for i in range(parts + 1)]
    return [sum(values[a:b]) / (b - a) for a, b in itertools.pairwise(bounds)]


def _windows(ids: torch.Tensor, starts: torch.Tensor, length: int) -> torch.Tensor:
    return ids[starts[:, None] + torch.arange(length)]


@torch.no_grad()
def _held_out_loss(model, ids: torch.Tensor, seq_len: int, num_windows: int = 64) -> float:
    """Mean next-token loss on evenly spaced windows of `ids` (at least 2 ids)."""
    seq_len = min(seq_len, len(ids) - 1)
    count = min(num_windows, len(ids) - seq_len)
    starts = torch.linspace(0, len(ids) - seq_len - 1, count).long()
    batch = _windows(ids, starts, seq_len + 1)
    logits = model(input_ids=batch[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()).item()


def train_target(
    tokenizer: PreTrainedTokenizerFast,
    text: str,
    arch: str = "qwen3",
    steps: int | None = None,
    seed: int = 0,
    batch_size: int = 8,
    seq_len: int = 128,
    lr: float = 1e-3,
    progress: Progress | None = None,
    **config_overrides,
) -> tuple[Qwen3ForCausalLM | Qwen3_5ForCausalLM, TrainStats]:
    """Train a tiny float32 target on next-token prediction and return (model in eval mode, stats).

    `arch`: "qwen3" (Qwen3ForCausalLM, `qwen3_config`) or "qwen3_5" (hybrid Qwen3_5ForCausalLM,
    `qwen3_5_text_config`); `config_overrides` go to the config. The model trains on random
    windows of `seq_len + 1` tokens from the training part of `text` (see `split_corpus`;
    windows cross document boundaries, so it learns to emit eos and to start a new document
    after one), with AdamW, linear warmup and cosine decay, and gradient clipping. `steps`
    defaults to `DEFAULT_STEPS[arch]`. Initialisation and windows are fixed by `seed`. `progress` is told
    each step done.
    """
    config: Qwen3Config | Qwen3_5TextConfig
    if arch == "qwen3":
        config = qwen3_config(len(tokenizer), tokenizer.eos_token_id, **config_overrides)
    elif arch == "qwen3_5":
        config = qwen3_5_text_config(len(tokenizer), tokenizer.eos_token_id, **config_overrides)
    else:
        raise ValueError(f"arch must be 'qwen3' or 'qwen3_5', got {arch!r}")
    if seq_len > config.max_position_embeddings:
        raise ValueError(f"seq_len {seq_len} exceeds max_position_embeddings {config.max_position_embeddings}")
    steps = DEFAULT_STEPS[arch] if steps is None else steps
    if steps < 1:
        raise ValueError(f"steps must be at least 1, got {steps}")
    config._attn_implementation = "sdpa"

    started = time.perf_counter()
    train_text, held_out_text = split_corpus(text)
    train_ids = encode_documents(tokenizer, train_text)
    held_out_ids = encode_documents(tokenizer, held_out_text)
    if len(train_ids) <= seq_len + 1:
        raise ValueError(f"training text has {len(train_ids)} tokens, fewer than one window of {seq_len + 1}")

    torch.manual_seed(seed)
    model = (Qwen3ForCausalLM(config) if isinstance(config, Qwen3Config) else Qwen3_5ForCausalLM(config)).train()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.eos_token_id
    num_params = sum(p.numel() for p in model.parameters())

    # nanoGPT's split: decay matrices (projections, embedding, lm_head), not norms.
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr,
        betas=(0.9, 0.95),
    )
    warmup = max(1, steps // 20)
    generator = torch.Generator().manual_seed(seed)
    losses = []
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(step, steps, lr, warmup)
        starts = torch.randint(0, len(train_ids) - seq_len - 1, (batch_size,), generator=generator)
        batch = _windows(train_ids, starts, seq_len + 1)
        logits = model(input_ids=batch[:, :-1], use_cache=False).logits
        loss = F.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if progress:
            progress("target training", step + 1, steps)

    model.eval()
    tail = losses[-max(1, steps // 10) :]
    stats = TrainStats(
        steps=steps,
        tokens_seen=steps * batch_size * seq_len,
        num_params=num_params,
        final_loss=sum(tail) / len(tail),
        held_out_loss=_held_out_loss(model, held_out_ids, seq_len) if len(held_out_ids) > 1 else float("nan"),
        seconds=time.perf_counter() - started,
        loss_curve=_tenths(losses),
    )
    return model, stats


def prompt_snippets(tokenizer: PreTrainedTokenizerFast, text: str, n: int, length: int,
                    seed: int = 0) -> list[list[int]]:
    """`n` held-out prompts of `length` token ids each, deterministic for (text, n, length, seed).

    Each prompt is a window of one document from the held-out tail of the corpus (see
    `split_corpus`; training never sees it) that starts at a line start and holds no eos,
    so a continuation can run on in the same document and may end it with eos. Windows are
    drawn without replacement; raises ValueError when the tail has fewer than `n` of them.
    """
    _, held_out_text = split_corpus(text)
    # Line starts are token boundaries: the pre-tokenizer never joins a newline to what follows.
    ends_line = {i for i in range(len(tokenizer)) if _decode(tokenizer, [i]).endswith("\n")}
    encoded = tokenizer(held_out_text.split(EOS_TOKEN), add_special_tokens=False)["input_ids"]
    candidates = []  # (document index, token offset) of every window that starts a line
    for document_index, ids in enumerate(encoded):
        for offset in range(len(ids) - length + 1):
            if offset == 0 or ids[offset - 1] in ends_line:
                candidates.append((document_index, offset))
    if len(candidates) < n:
        raise ValueError(f"the held-out text has {len(candidates)} windows of {length} tokens, fewer than {n}")
    chosen = random.Random(seed).sample(candidates, n)
    return [encoded[d][offset : offset + length] for d, offset in chosen]


# ---------------------------------------------------------------------------
# Checkpoints


def save_target(model: Qwen3ForCausalLM | Qwen3_5ForCausalLM, tokenizer: PreTrainedTokenizerFast, path) -> Path:
    """Save `model` (safetensors) and `tokenizer` (with its chat template) as a Hugging Face
    checkpoint directory at `path` (created if needed); returns the path."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def save_qwen3_5_vlm(
    text_model: Qwen3ForCausalLM | Qwen3_5ForCausalLM, tokenizer: PreTrainedTokenizerFast, path, seed: int = 0
) -> Path:
    """Save `text_model`'s weights wrapped as a `Qwen3_5ForConditionalGeneration`, like the
    published Qwen3.5/3.6 checkpoints: keys `model.language_model.*` (identical text weights),
    `model.visual.*` (a tiny randomly initialised vision tower, seeded by `seed`, never trained)
    and `lm_head.weight`; plus the tokenizer. Returns the path. A Qwen3 model is refused (TypeError)."""
    if not isinstance(text_model, Qwen3_5ForCausalLM):
        raise TypeError(f"text_model must be a Qwen3_5ForCausalLM, got {type(text_model).__name__}")
    text_config = text_model.config
    vision_config = {
        "depth": 1,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_heads": 2,
        "patch_size": 4,
        "spatial_merge_size": 2,
        "temporal_patch_size": 2,
        "out_hidden_size": text_config.hidden_size,
        "num_position_embeddings": 16,
    }
    # the published checkpoints' text sub-config names no architecture (the wrapper's does)
    text_dict = {k: v for k, v in text_config.to_dict().items() if k != "architectures"}
    config = Qwen3_5Config(
        text_config=text_dict,
        vision_config=vision_config,
        image_token_id=token_id(tokenizer, "<|image_pad|>"),
        video_token_id=token_id(tokenizer, "<|video_pad|>"),
        vision_start_token_id=token_id(tokenizer, "<|vision_start|>"),
        vision_end_token_id=token_id(tokenizer, "<|vision_end|>"),
        tie_word_embeddings=text_config.tie_word_embeddings,
    )
    torch.manual_seed(seed)
    # transformers wraps to() with functools.wraps(nn.Module.to), which mypy reads as the unbound method
    vlm = Qwen3_5ForConditionalGeneration(config).to(text_model.dtype).eval()  # type: ignore[arg-type]
    with torch.no_grad():
        vlm.model.language_model.load_state_dict(text_model.model.state_dict())
        vlm.lm_head.load_state_dict(text_model.lm_head.state_dict())
    vlm.generation_config.eos_token_id = text_model.generation_config.eos_token_id
    vlm.generation_config.pad_token_id = text_model.generation_config.pad_token_id
    return save_target(vlm, tokenizer, path)


# ---------------------------------------------------------------------------
# Quality of the target's greedy continuations


def _loop_period(ids: list[int], max_period: int, window: int) -> int | None:
    """Smallest period <= max_period with which the last `window` ids repeat, or None."""
    tail = ids[-window:]
    if len(tail) < window:
        return None
    for period in range(1, max_period + 1):
        if all(tail[i] == tail[i - period] for i in range(period, window)):
            return period
    return None


@torch.no_grad()
def continuation_variety(model, prompts: list[list[int]], eos_token_id: int, max_new_tokens: int = 64) -> dict:
    """Greedy-continue equal-length `prompts` and describe how varied the continuations are.

    Returns: `num_prompts`; `eos_fraction` (continuations that end with eos within
    `max_new_tokens`); `mean_length` (new tokens, eos included); for the continuations that
    run to `max_new_tokens`: `mean_distinct` and `min_distinct` (distinct token ids in each),
    `short_loop_fraction` (the last 16 tokens repeat with period 1 or 2: one repeated token or
    an immediate two-token loop) and `loop_fraction` (period up to 8).
    """
    input_ids = torch.tensor(prompts, dtype=torch.long)
    output = model.generate(
        input_ids,
        attention_mask=torch.ones_like(input_ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
    )
    continuations = []
    for row in output[:, input_ids.shape[1] :].tolist():
        if eos_token_id in row:
            row = row[: row.index(eos_token_id) + 1]
        continuations.append(row)
    full = [c for c in continuations if c[-1] != eos_token_id]
    periods = [_loop_period(c, max_period=8, window=16) for c in full]
    distinct = [len(set(c)) for c in full]
    return {
        "num_prompts": len(continuations),
        "eos_fraction": (len(continuations) - len(full)) / len(continuations),
        "mean_length": sum(map(len, continuations)) / len(continuations),
        "mean_distinct": sum(distinct) / len(distinct) if distinct else float("nan"),
        "min_distinct": min(distinct) if distinct else None,
        "short_loop_fraction": sum(p is not None and p <= 2 for p in periods) / len(full) if full else 0.0,
        "loop_fraction": sum(p is not None for p in periods) / len(full) if full else 0.0,
        "continuations": continuations,
    }
