"""The target model as the stages see it: its content key, its compute dtype, and one loaded copy per process."""

from dataclasses import dataclass
from functools import lru_cache

from transformers import AutoTokenizer

from dflash_core.choices import AUTO_DTYPE, DEFAULT_ATTENTION, STAGE_DTYPE_NAMES
from dflash_core.target import DTYPES as TARGET_DTYPES
from dflash_core.target import Target, checkpoint_dtype, load_target
from dflash_eval.storage import Store, directory_digest

# What the stages compute in (dflash_core.choices: float16 is not one of them), by the name their store keys hold.
DTYPES = {name: TARGET_DTYPES[name] for name in STAGE_DTYPE_NAMES}
AUTO = AUTO_DTYPE  # the target checkpoint's own dtype
DTYPE_CHOICES = (AUTO, *DTYPES)


@dataclass(frozen=True)
class DtypeChoice:
    """The compute dtype of an evaluation, resolved once before any stage computes a key."""

    name: str  # a key of DTYPES: what the stages compute in and what their keys hold
    requested: str  # "auto" or the name asked for
    note: str | None = None  # why auto did not take the checkpoint's own dtype (for logs and results)


def resolve_dtype(dtype: str, target_dir) -> DtypeChoice:
    """Resolve `--dtype`: a name of DTYPES stays itself; "auto" becomes the target checkpoint's own dtype
    (config.json `dtype` / `torch_dtype`, top level, else `text_config`): bfloat16 for the published
    targets, float32 for the tiny fixtures. A float16 checkpoint computes in float32 (fp16 features
    overflow), and so does one whose config names no dtype or another one. `auto` and the name it resolves
    to give the same stage keys, so they share cache entries. Raises ValueError on an unknown name."""
    if dtype in DTYPES:
        return DtypeChoice(dtype, dtype)
    if dtype != AUTO:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {dtype!r}")
    own = checkpoint_dtype(target_dir)
    if own in DTYPES:
        return DtypeChoice(own, AUTO)
    if own == "float16":
        note = ("the target checkpoint is float16, and float16 hidden states overflow for large targets: "
                "computing in float32")
    elif own is None:
        note = "the target's config.json names no dtype: computing in float32"
    else:
        note = f"the target checkpoint is {own}, which the stages do not compute in: computing in float32"
    return DtypeChoice("float32", AUTO, note)


def target_key(target_dir: str, store: Store) -> str:
    """Content key of a target checkpoint: its files' digests (cached by path, size and mtime)."""
    return directory_digest(target_dir, cache=store.digest_cache()).key


@lru_cache(maxsize=4)
def target_tokenizer(target_dir: str):
    """The target's tokenizer, loaded once per process: a drafter config may name its mask token as a
    string, which only the target's tokenizer turns into an id."""
    return AutoTokenizer.from_pretrained(target_dir)


@lru_cache(maxsize=1)
def loaded_target(target_dir: str, dtype: str, device: str, attention: str = DEFAULT_ATTENTION) -> Target:
    """The target, loaded once per process: the references and features stages share it
    (a 27B target is ~54 GB; it is never loaded when both stages are cached)."""
    return load_target(target_dir, dtype=DTYPES[dtype], device=device, attention=attention)


def attention_identity(attention: str) -> dict[str, str]:
    """What a stage key holds of the target's attention implementation: nothing for SDPA, which every target ran
    with before the choice existed (so their entries keep their keys), else {"attention": name}. SDPA and eager
    kernels sum in other orders: their hidden states differ in the last bits, and a near-tie can flip a greedy
    token (docs/targets.md has the measurement)."""
    return {} if attention == DEFAULT_ATTENTION else {"attention": attention}
