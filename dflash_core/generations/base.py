"""What a drafter generation is: a head (and any per-layer modules) on the shared DFlash backbone, and all that
differs with it. dflash_core.drafter runs the backbone; a generation's module says the rest:

- its config: the architectures (and speculators' model type) it is read for, its fields as each source format
  names them (`FIELDS`: dflash_config's names; speculators writes them at the top level under the same names),
  validated into a small record the drafter is built from (`read`);
- its modules: what wraps each layer's sublayers (`sublayer_wrappers`) and its head (`head_modules`), under the
  checkpoint's own tensor names (`KEY_RENAMES` for names other trainers save them under);
- how it drafts: `choose` turns the backbone's logits at block positions, given the token before each, into a
  `HeadChoice` (its greedy draft, and its q for sampled drafts); WALKS_FROM_ANCHOR: a draft depends on the one
  before it, so a block is drafted position by position from the anchor;
- the numbers its replay adds: with a head, the backbone's own argmax alone is replayed beside the drafts (its
  `BASE_WALK`), each draft position is counted (`COUNTS`: reached, the drafts accepted, the base argmax accepted, and
  the head's own counts from `HeadChoice.counts`), and `summary` turns them into its results section
  (dflash_core.sections).

DFlash is the backbone alone (dflash.py); DFlash2 adds convolutions and a candidate selector (dflash2.py).
"""

from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NoReturn, Protocol

import torch
from torch import nn

from ..metrics import PromptScore, bootstrap_interval, paired_difference_interval, tau_macro, tau_of, tau_pooled, whole
from ..sampling import Sampling
from ..sections import Section


class DrafterShape(Protocol):
    """What a generation builds its modules from: a DrafterConfig's (drafter_config.py, which reads configs through
    the generations) sizes and what its generation read of its own fields."""

    @property
    def hidden_size(self) -> int: ...

    @property
    def vocab_size(self) -> int | None: ...

    @property
    def generation_fields(self) -> Mapping[str, Any]: ...


class ConfigFields(Protocol):
    """The reader of one config.json, as a generation's `read` sees it: each value where the format keeps it, and
    errors that name the file and the field as the file names it."""

    def dflash(self, key: str) -> Any:
        """A field's value (dflash_config first, then the top level), None when absent."""

    def name(self, key: str) -> str:
        """How the file names a field: `dflash_config.selector_rank`, or `selector_rank` at the top level."""

    def fail(self, message: str) -> NoReturn:
        """Raise DrafterError naming the file."""

    def integer(self, key: str, value: Any, minimum: int) -> int | None:
        """`value` checked as an integer >= minimum (None stays None), else fail naming `key`."""

    def boolean(self, key: str, value: Any) -> bool | None:
        """`value` checked as true, false or None, else fail naming `key`."""


class SublayerWrapper(Protocol):
    """A module around a decoder layer's sublayer (Generation.sublayer_wrappers)."""

    def around(self, sublayer: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """The sublayer applied to x [N, B, H] (its normed input), inside this module."""


class HeadChoice(ABC):
    """A head's choice at block positions (any leading shape [...]): its greedy drafts, and the distribution q a
    sampled draft is drawn from."""

    @property
    @abstractmethod
    def tokens(self) -> torch.Tensor:
        """The greedy drafts [...]."""

    @abstractmethod
    def probabilities(self, q: Sampling, vocab_size: int) -> torch.Tensor:
        """q over the vocabulary [..., V], float32."""

    @abstractmethod
    def probability_of(self, tokens: torch.Tensor, q: Sampling) -> torch.Tensor:
        """q at `tokens` [...], float32."""

    def counts(self, tokens: torch.Tensor) -> torch.Tensor:
        """The head's own per-position counts of the reference's `tokens` [...] (Generation.COUNTS after the first
        three), [..., n] as 0/1 (or a probability)."""
        return tokens.new_zeros((*tokens.shape, 0), dtype=torch.float32)


class Generation:
    """A drafter generation (the module docstring). The defaults are the backbone alone (DFlash)."""

    NAME: ClassVar[str]
    ARCHITECTURES: ClassVar[tuple[str, ...]]  # config.json's `architectures` it is read for
    SPECULATORS_MODEL_TYPE: ClassVar[str | None] = None
    FIELDS: ClassVar[Mapping[str, str]] = {}  # its own config fields (dflash_config names) -> the module each shapes
    WHAT: ClassVar[str] = ""  # what it adds to the backbone, in a few words (messages, docs)
    KEY_RENAMES: ClassVar[Mapping[str, str]] = {}  # a tensor name other trainers save -> the published one
    HEAD: ClassVar[bool] = False  # a head chooses the drafts from the backbone's logits (`choose`)
    WALKS_FROM_ANCHOR: ClassVar[bool] = False
    BASE_WALK: ClassVar[str | None] = None  # drafts.json's name of the backbone's argmax replayed alone
    COUNTS: ClassVar[tuple[str, ...]] = ()  # per draft position: reached, drafts accepted, base accepted, the head's
    COUNTS_NAME: ClassVar[str | None] = None  # drafts.json's name of those counts
    TRAINING_ACCURACY: ClassVar[str | None] = None  # what a trainer's log calls the head's teacher-forced accuracy
    # its head's loss is the whole training loss: its drafts are the head's logits, which its trainer trains alone (the
    # tiny trainer; DFlash2's selector trains beside the backbone's own)
    HEAD_LOSS_ONLY: ClassVar[bool] = False
    TINY_FIELDS: ClassVar[Mapping[str, Any]] = {}  # its fields' values for the tiny run's drafter (hidden size 192)

    def read(self, fields: ConfigFields, hidden_size: int, vocab_size: int | None) -> dict[str, Any]:
        """Its own fields from a config, validated (ConfigFields.fail otherwise): what DrafterConfig.generation_fields
        holds and its modules are built from."""
        return {}

    def speculators_problem(self, draft_vocab_size: int | None, vocab_size: int | None) -> str | None:
        """Why a speculators save of this generation cannot be read (None when it can)."""
        return None

    def sublayer_wrappers(self, cfg: DrafterShape) -> dict[str, tuple[str, nn.Module]]:
        """Modules around a decoder layer's sublayers: {"attention" or "mlp": (tensor name, module)}; each module has
        `around(sublayer, x)`."""
        return {}

    def head_modules(self, cfg: DrafterShape) -> dict[str, nn.Module]:
        """The head's modules by tensor name (registered on the drafter)."""
        return {}

    def choose(self, drafter: nn.Module, logits: torch.Tensor, hidden: torch.Tensor,
               previous: torch.Tensor) -> HeadChoice | None:
        """The head's choice at block positions (HEAD) from the drafter's processed logits [..., V] (float32), its
        hidden states [..., H] and the token before each position [...]. Without a head the backbone's argmax and its
        processed q are the drafts."""
        raise TypeError(f"{self.NAME} has no head")

    def schedules_verification(self, cfg: DrafterShape) -> bool:
        """Whether a drafter of this config decides how many of its drafts a step verifies (DSpark's confidence head),
        so that a verify threshold applies to it."""
        return False

    def verified_drafts(self, confidence: torch.Tensor, threshold: float) -> torch.Tensor:
        """Under a verify threshold, how many of each block's drafts its step verifies [N], from the drafter's
        predictions of its drafts' acceptance [N, D] (`confidences`; schedules_verification)."""
        raise TypeError(f"{self.NAME} drafters verify every draft")

    def head_loss(self, drafter: nn.Module, hidden: torch.Tensor, logits: torch.Tensor, anchors: torch.Tensor,
                  labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Training its head (the tiny trainer): from the drafter's hidden states [N, B-1, H] and logits [N, B-1, V]
        at the labelled block positions, the blocks' anchors [N] and labels [N, B-1] (-100: none), the head's loss per
        position (0 where unlabelled) and its teacher-forced choice there, each given the label before it; None
        without a head."""
        return None

    def confidences(self, drafter: nn.Module, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor | None:
        """What the drafter predicts of each draft's acceptance (DSpark's confidence head), [...] in [0, 1], from its
        hidden states at the drafts [..., H] and the token before each [...]; None when it predicts nothing. The
        replay then measures the predictions' calibration (Replayed.calibration)."""
        return None

    def summaries(self, replayed: Sequence["Replayed"]) -> list[Section]:
        """Its results sections from the replay of the scored references (the numbers it adds)."""
        return []


def lift_over_base(drafts: Sequence[PromptScore], base: Sequence[PromptScore], positions: Sequence[Sequence[Sequence[float]]],
                   names: Sequence[str], shares: Sequence[str], base_name: str) -> dict:
    """What a head adds over its base walk (the backbone's argmax alone) on the same references, in the order a
    generation's section holds it: `{base_name}_tau_macro` with its 95% interval and `_pooled` (the tau the base would
    reach as the drafts; sampled, its own q); `lift`, the drafts' tau macro minus it, with its paired 95% interval;
    per draft position the counts `names` summed over the references (`positions`: per reference, per position, its
    COUNTS; the first, reached), each later count as a share of those reached (`shares` names them), and `overall`,
    the same over every position. drafts and base: the scored references (one step or more), in the same order."""
    counts = [[sum(p[k][c] for p in positions) for k in range(len(positions[0]))] for c in range(len(names))]
    reached = counts[0]
    pairs = [(p.prompt or p.id, tau_of(p), tau_of(b)) for p, b in zip(drafts, base)]
    return {
        f"{base_name}_tau_macro": tau_macro(base),
        f"{base_name}_tau_macro_ci95": bootstrap_interval(base, tau_macro),
        f"{base_name}_tau_pooled": tau_pooled(base),
        "lift": tau_macro(drafts) - tau_macro(base),
        "lift_ci95": paired_difference_interval(pairs),
        "position_counts": {name: [whole(c) for c in column] for name, column in zip(names, counts)},
        **{name: [v / r if r else None for v, r in zip(column, reached)] for name, column in zip(shares, counts[1:])},
        "overall": {name: sum(column) / sum(reached) if sum(reached) else None
                    for name, column in zip(shares, counts[1:])},
    }


# Equal-width bins of a predicted acceptance, as the replay counts a drafter's predictions against what happened
CALIBRATION_BINS = 20


@dataclass(frozen=True)
class Replayed:
    """One scored reference as the replay found it, for a generation's summaries: its decode steps, its base walk's
    (a head's generation), per draft position its Generation.COUNTS, and (a drafter that predicts its drafts'
    acceptance) per draft position and CALIBRATION_BINS bin of the prediction: (weight, weight x predicted,
    weight x accepted) over the positions its steps compared (with sampled drafts each weight, and each accepted,
    an expectation)."""

    drafts: PromptScore
    base: PromptScore | None = None
    counts: Sequence[Sequence[float]] | None = None
    calibration: Sequence[Sequence[Sequence[float]]] | None = None
