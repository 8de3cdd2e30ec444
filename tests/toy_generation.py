"""A toy drafter generation, whole in this one module (what a new generation is: dflash_core/generations/base.py):
`ToyDraftModel`, the DFlash backbone with a trivial head, a learned bias per token added to the backbone's logits
(`toy_head.bias` [V]). Its greedy draft at a block position is argmax(logits + bias); a sampled one is drawn from
softmax((logits + bias) / T). No draft depends on another. Its replay keeps the backbone's argmax alone beside it
(`toy_base`), and its results section (`toy`) says the tau of that base alone and what the bias adds to it.

`registered()` registers the generation (dflash_core.generations.register) and its section, as a generation's module
in dflash_core.generations is registered for good: the checkpoint readers, the replay, the stages and every renderer
then take a ToyDraftModel checkpoint with no other edit (tests/test_toy_generation.py). It takes them out again after,
so that no other test sees a generation the package does not have.
"""

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from dflash_core.generations import GENERATIONS, Generation, HeadChoice, register
from dflash_core.generations.base import Replayed
from dflash_core.metrics import tau_macro
from dflash_core.sampling import Sampling
from dflash_core.sections import SECTIONS, Chart, Column, Context, Section, count, section


class ToyHead(nn.Module):
    """The head's one tensor: a bias per token of the vocabulary."""

    def __init__(self, vocab_size: int):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(vocab_size))


@dataclass(frozen=True)
class ToyChoice(HeadChoice):
    """The head's choice at block positions: the backbone's processed logits plus the bias, [..., V]."""

    biased: torch.Tensor

    @property
    def tokens(self) -> torch.Tensor:
        return self.biased.argmax(-1)

    def probabilities(self, q: Sampling, vocab_size: int) -> torch.Tensor:
        return (self.biased.float() / q.temperature).softmax(-1)

    def probability_of(self, tokens: torch.Tensor, q: Sampling) -> torch.Tensor:
        return self.probabilities(q, self.biased.shape[-1]).gather(-1, tokens[..., None])[..., 0]


class Toy(Generation):
    NAME = "Toy"
    ARCHITECTURES = ("ToyDraftModel",)
    WHAT = "a learned bias per token on the backbone's logits"
    HEAD = True
    BASE_WALK = "toy_base"
    COUNTS = ("reached", "toy", "base")  # per draft position: reached, the biased draft accepted, the base's
    COUNTS_NAME = "toy_positions"

    def head_modules(self, cfg) -> dict[str, nn.Module]:
        return {"toy_head": ToyHead(cfg.vocab_size)}

    def choose(self, drafter: nn.Module, logits: torch.Tensor, hidden: torch.Tensor,
               previous: torch.Tensor) -> ToyChoice:
        bias = drafter.get_submodule("toy_head").bias
        return ToyChoice(logits + bias.float())

    def summaries(self, replayed: Sequence[Replayed]) -> list[Section]:
        """Its section: the base's tau, the lift, and per draft position the shares of COUNTS."""
        bases = [r.base for r in replayed if r.base is not None]
        counts = [r.counts for r in replayed if r.counts is not None]
        if not replayed or not len(bases) == len(counts) == len(replayed):
            return []
        reached, toy, alone = ([sum(c[k][i] for c in counts) for k in range(len(counts[0]))]
                               for i in range(len(self.COUNTS)))
        drafts = [r.drafts for r in replayed]
        return [ToySection({"base_tau_macro": tau_macro(bases), "lift": tau_macro(drafts) - tau_macro(bases),
                            "reached": reached,
                            "toy_accuracy": [t / r if r else None for t, r in zip(toy, reached)],
                            "base_accuracy": [a / r if r else None for a, r in zip(alone, reached)]})]


@dataclass(frozen=True)
class ToySection(Section):
    """scores.json's `toy`: the tau of the backbone's argmax alone, the bias's lift over it, and per draft position
    how often the biased draft and the base's were accepted."""

    KEY: ClassVar[str] = "toy"
    TITLE: ClassVar[str] = "Toy head"
    HISTORY: ClassVar[tuple[Column, ...]] = (Column("toy_base_tau_macro", "toy base tau", "toy base"),
                                             Column("toy_lift", "toy lift", "toy lift", signed=True))
    BESIDE_TAU: ClassVar[tuple[str, str] | None] = ("toy_base_tau_macro", "toy base alone")
    REPORT_COLUMNS: ClassVar[tuple[str, ...]] = ("base tau", "toy lift", "positions reached")
    REPORT_TEXT: ClassVar[str] = "The toy head's bias against the backbone's argmax alone."
    POSITION_LINES: ClassVar[Mapping[str, str]] = {"toy_accuracy": "biased draft accepted",
                                                   "base_accuracy": "base would have been"}

    numbers: dict

    def lines(self, context: Context) -> list[str]:
        return [f"toy head: base alone tau macro {self.numbers['base_tau_macro']:.3f}, toy lift "
                f"{self.numbers['lift']:+.3f} over {count(sum(self.numbers['reached']))} draft positions"]

    def metrics(self, context: Context) -> list[tuple[str, str]]:
        return [("toy base alone: tau macro", f"{self.numbers['base_tau_macro']:.3f}"),
                ("toy lift", f"{self.numbers['lift']:+.3f}")]

    def scalars(self) -> dict[str, float]:
        values = {"toy/base_tau_macro": self.numbers["base_tau_macro"], "toy/lift": self.numbers["lift"]}
        for k, accuracy in enumerate(self.numbers["toy_accuracy"], start=1):
            if accuracy is not None:
                values[f"toy/toy_accuracy/{k}"] = accuracy
        return values

    def charts(self) -> list[Chart]:
        return [Chart("dflash-eval: toy head", "tau against its base alone", ("tau_macro", "toy/base_tau_macro")),
                Chart("dflash-eval: toy head", "toy accuracy by draft position", (r"toy/toy_accuracy/\d+",))]

    def history(self) -> dict[str, float | None]:
        return {"toy_base_tau_macro": self.numbers["base_tau_macro"], "toy_lift": self.numbers["lift"]}

    def report_row(self) -> tuple[str, ...]:
        return (f"{self.numbers['base_tau_macro']:.3f}", f"{self.numbers['lift']:+.3f}",
                count(sum(self.numbers["reached"])))

    def by_position(self) -> dict[str, list[float | None]]:
        return {name: list(self.numbers[name]) for name in self.POSITION_LINES}


@contextmanager
def registered() -> Iterator[Toy]:
    """The toy generation and its section registered while inside, then taken out."""
    toy = register(Toy())
    section(ToySection)
    try:
        yield toy
    finally:
        for architecture in toy.ARCHITECTURES:
            del GENERATIONS[architecture]
        del SECTIONS[ToySection.KEY]
