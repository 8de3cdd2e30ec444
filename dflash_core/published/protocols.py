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

A second family, DeepSpec's (`deepspec`: github deepseek-ai/DeepSpec at afdfa7c, `eval.py` and
`deepspec/eval/base_evaluator.py`, the DSpark paper's Table 1), reads its own files (benchmarks.DEEPSPEC_BENCHMARKS):
eval.py's nine tasks with its counts (`TASKS`); when a file has more rows than the count, the rows shuffled by
`random.Random(980406)` (its --seed), the first n; the first user turn only; `enable_thinking=False`;
`encode(text, add_special_tokens=False)`; stop at `generation_config.eos_token_id` (its ids once each; the
tokenizer's eos where there is none); drafts sampled and accepted by rejection sampling at its T = 1.0; 2048 new
tokens. It publishes a pooled acceptance length (`published_tau`), not z-lab's per-response mean.
"""

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from .benchmarks import BENCHMARKS, DEEPSPEC_BENCHMARKS, Benchmark, BenchmarkError, Row

ProtocolName = Literal["zlab-2026-01", "zlab-2026-04", "dflash-0.1", "deepspec"]
FIVE = ("gsm8k", "math500", "humaneval", "mbpp", "mt-bench")
# zlab-2026-01's run script (run_benchmark.sh): prompts per dataset; lbpp is not in it, so all of its rows
PAPER_COUNTS = {"gsm8k": 128, "math500": 128, "aime24": 30, "aime25": 30, "humaneval": 164, "mbpp": 128,
                "livecodebench": 128, "swe-bench": 128, "mt-bench": 80, "alpaca": 128}
# DeepSpec's eval.py TASKS: its tasks, in its order, with the rows it takes of each
DEEPSPEC_COUNTS = {"gsm8k": 500, "math500": 500, "aime25": 30, "humaneval": 164, "mbpp": 256, "livecodebench": 500,
                   "mt-bench": 80, "alpaca": 500, "arena-hard-v2": 500}
DEEPSPEC_SEED = 980406  # eval.py's --seed default: run_dataset shuffles with random.Random(seed)
# tasks DeepSpec names whose file it does not hold: refused by name, with why
DEEPSPEC_MISSING = {"alpaca": "DeepSpec's eval.py and the DSpark paper's Table 1 name it, but its eval_datasets/ holds "
                              "no alpaca.jsonl (at afdfa7c), so its rows cannot be the ones DeepSpec ran"}
COUNTS = {"zlab-2026-01": PAPER_COUNTS, "deepspec": DEEPSPEC_COUNTS}  # the protocols with counts of their own


@dataclass(frozen=True)
class Protocol:
    """One version of z-lab's benchmark protocol, or DeepSpec's (see the module docstring)."""

    name: str
    source: str  # where it is defined
    datasets: tuple[str, ...] | None  # None: every benchmark
    special_tokens: bool  # encode the templated text with the tokenizer's special tokens
    stop: Literal["tokenizer", "generation_config"]
    sampled_drafts: bool  # at T > 0 drafts are sampled and accepted by rejection sampling
    max_new_tokens: int = 2048
    temperature: float | None = None  # the temperature it samples at unless --temperature is given (None: ours)
    # how its published acceptance lengths average the steps: "macro" (per response, then over responses: z-lab's
    # tau, our tau_macro) or "pooled" (every step of every response at once: DeepSpec's, our tau_pooled)
    published_tau: Literal["macro", "pooled"] = "macro"

    @property
    def counted(self) -> bool:
        """Whether it takes a count of rows of its own from each benchmark (its run script's, eval.py's)."""
        return self.name in COUNTS

    @property
    def names(self) -> tuple[str, ...]:
        """The benchmarks it runs."""
        return self.datasets if self.datasets is not None else tuple(BENCHMARKS)

    def benchmark(self, name: str) -> Benchmark:
        """Benchmark `name` as this protocol reads it: z-lab's hub split, or DeepSpec's own file."""
        return DEEPSPEC_BENCHMARKS[name] if self.name == "deepspec" else BENCHMARKS[name]

    def refusal(self, name: str) -> str | None:
        """Why it cannot run benchmark `name` though it names it (None: it can)."""
        return DEEPSPEC_MISSING.get(name) if self.name == "deepspec" else None

    def default_count(self, name: str) -> int | None:
        """The rows the protocol takes of benchmark `name` when --max-samples is not given (None: all)."""
        return COUNTS.get(self.name, {}).get(name)

    def select(self, rows: Sequence[Row], max_samples: int | None) -> list[Row]:
        """The rows the protocol evaluates, in the order it runs them."""
        n = len(rows)
        if self.name == "deepspec":
            if max_samples is None or n <= max_samples:
                return list(rows)
            # run_dataset shuffles its list of rows in place with a fresh random.Random(seed) per task; shuffling
            # the indices instead draws the same permutation (shuffle depends on the length only)
            order = list(range(n))
            random.Random(DEEPSPEC_SEED).shuffle(order)
            return [rows[i] for i in order[:max_samples]]
        if self.name == "zlab-2026-01":
            if max_samples is None or n <= max_samples:
                return list(rows)
            import numpy as np

            # the paper-era code shuffles a datasets.Dataset with seed 0: its permutation is numpy's default
            # generator's, seeded alike (datasets' Dataset.shuffle; tests/test_published.py holds the two equal)
            picked = np.random.default_rng(0).permutation(n)[:max_samples]
            return [rows[int(i)] for i in picked]
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
        if self.name in ("zlab-2026-01", "deepspec"):  # (DeepSpec's run_dataset: enable_thinking=False)
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
            if self.name == "deepspec":  # resolve_stop_token_ids keeps each id once, in its order
                return list(dict.fromkeys(int(t) for t in generation_eos))
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
    Protocol("deepspec", "deepseek-ai/DeepSpec eval.py and deepspec/eval/base_evaluator.py at afdfa7c (the DSpark "
             "paper's Table 1)", tuple(DEEPSPEC_COUNTS), False, "generation_config", True, temperature=1.0,
             published_tau="pooled"),
)}
DEFAULT_PROTOCOL = "zlab-2026-01"
