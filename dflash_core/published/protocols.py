"""z-lab's benchmark protocols: what changed between the versions of its benchmark code, pinned by name.

Every version formats a row the same way (benchmarks.py); they differ in which rows they take, how they template
and tokenize, where decoding stops and how drafts are drawn at a temperature:

| | zlab-2026-01 (paper tables) | zlab-2026-04 (GitHub, April) | dflash-0.1 (PyPI dflash 0.1.0) |
|---|---|---|---|
| datasets | all eleven | gsm8k, math500, humaneval, mbpp, mt-bench | the same five |
| rows | `Dataset.shuffle(seed=0).select(range(n))` with its run script's n per dataset, when the split is longer | all; with --max-samples n, the split shuffled by `random` seeded 0, first n | `random.Random(42)` over the row indices, first n (all by default) |
| template | `enable_thinking=False` | `enable_thinking` (off unless --reasoning on) | --reasoning: none (the template's default), on/off (`enable_thinking`), a level (`reasoning_effort` or `reasoning_strength`, whichever the template reads) |
| tokens | `encode(text)`: the tokenizer's special tokens (a BOS where it adds one) | the same | `encode(text, add_special_tokens=False)` |
| stop | the tokenizer's `eos_token_id` | the same | `generation_config.eos_token_id` (a list) |
| drafts at T > 0 | the drafter's argmax, accepted where the target emits it | the same | sampled and accepted by rejection sampling |

All decode up to 2048 new tokens.
"""

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from .benchmarks import BenchmarkError, Row

ProtocolName = Literal["zlab-2026-01", "zlab-2026-04", "dflash-0.1"]
FIVE = ("gsm8k", "math500", "humaneval", "mbpp", "mt-bench")
# zlab-2026-01's run script (run_benchmark.sh): prompts per dataset; lbpp is not in it, so all of its rows
PAPER_COUNTS = {"gsm8k": 128, "math500": 128, "aime24": 30, "aime25": 30, "humaneval": 164, "mbpp": 128,
                "livecodebench": 128, "swe-bench": 128, "mt-bench": 80, "alpaca": 128}


@dataclass(frozen=True)
class Protocol:
    """One version of z-lab's benchmark protocol (see the module docstring)."""

    name: str
    source: str  # where it is defined
    datasets: tuple[str, ...] | None  # None: every benchmark
    special_tokens: bool  # encode the templated text with the tokenizer's special tokens
    stop: Literal["tokenizer", "generation_config"]
    sampled_drafts: bool  # at T > 0 drafts are sampled and accepted by rejection sampling
    max_new_tokens: int = 2048

    def default_count(self, name: str) -> int | None:
        """The rows the protocol takes of benchmark `name` when --max-samples is not given (None: all)."""
        return PAPER_COUNTS.get(name) if self.name == "zlab-2026-01" else None

    def select(self, rows: Sequence[Row], max_samples: int | None) -> list[Row]:
        """The rows the protocol evaluates, in the order it runs them."""
        n = len(rows)
        if self.name == "zlab-2026-01":
            if max_samples is None or n <= max_samples:
                return list(rows)
            from datasets import Dataset  # the paper-era code shuffles a datasets.Dataset: its permutation, exactly
            order = Dataset.from_dict({"i": list(range(n))}).shuffle(seed=0).select(range(max_samples))["i"]
            return [rows[i] for i in order]
        if self.name == "zlab-2026-04":
            if max_samples is None or n <= max_samples:
                return list(rows)
            shuffled = list(rows)
            random.Random(0).shuffle(shuffled)  # `random.seed(0)` runs right before its `random.shuffle`
            return shuffled[:max_samples]
        order = list(range(n))
        random.Random(42).shuffle(order)
        return [rows[i] for i in order[:n if max_samples is None else min(max_samples, n)]]

    def template_kwargs(self, reasoning: str | None, chat_template: str | None) -> dict:
        """What the chat template is given besides the messages and `add_generation_prompt=True`."""
        if self.name == "zlab-2026-01":
            if reasoning not in (None, "off"):
                raise BenchmarkError(f"--reasoning {reasoning}: {self.name} templates with enable_thinking=False "
                                     "only; use --protocol zlab-2026-04 or dflash-0.1 to reason")
            return {"enable_thinking": False}
        if self.name == "zlab-2026-04":
            if reasoning not in (None, "on", "off"):
                raise BenchmarkError(f"--reasoning {reasoning}: {self.name} has thinking on or off only "
                                     "(--enable-thinking); use --protocol dflash-0.1 for a reasoning level")
            return {"enable_thinking": reasoning == "on"}
        if reasoning is None:
            return {}
        template = chat_template or ""
        if reasoning in ("on", "off"):
            if "enable_thinking" not in template:
                raise BenchmarkError(f"--reasoning {reasoning}: the target's chat template does not read "
                                     "enable_thinking; leave --reasoning out")
            return {"enable_thinking": reasoning == "on"}
        for key in ("reasoning_strength", "reasoning_effort"):
            if key in template:
                return {key: reasoning}
        raise BenchmarkError(f"--reasoning {reasoning}: the target's chat template reads no reasoning level "
                             "(reasoning_effort or reasoning_strength); pass --reasoning on or off")

    def stop_token_ids(self, tokenizer, generation_eos: Sequence[int]) -> list[int]:
        """Where decoding stops: the tokenizer's eos token, or the target's generation_config eos ids
        (`generation_eos`; the tokenizer's eos when it has none)."""
        if self.stop == "generation_config" and generation_eos:
            return [int(t) for t in generation_eos]
        if tokenizer.eos_token_id is None:
            raise BenchmarkError(f"{self.name} stops at the tokenizer's eos token; the target's tokenizer has none")
        return [int(tokenizer.eos_token_id)]


PROTOCOLS: dict[str, Protocol] = {p.name: p for p in (
    Protocol("zlab-2026-01", "z-lab/dflash benchmark.py, model/utils.py and run_benchmark.sh, 2026-01-05 to "
             "2026-04-06 (the paper's tables)", None, True, "tokenizer", False),
    Protocol("zlab-2026-04", "z-lab/dflash dflash/benchmark.py, 2026-04-06 to 2026-04-26 (transformers backend)",
             FIVE, True, "tokenizer", False),
    Protocol("dflash-0.1", "PyPI dflash 0.1.0, dflash/benchmark.py (transformers backend)", FIVE, False,
             "generation_config", True),
)}
DEFAULT_PROTOCOL = "zlab-2026-01"
