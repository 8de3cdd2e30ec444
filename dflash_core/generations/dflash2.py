"""DFlash2 (z-lab's `DFlash2DraftModel`, `dflash` 0.1.0; served by SGLang and vLLM): the DFlash backbone with a
grouped dynamic convolution around every attention and MLP sublayer, within the block, and a candidate selector.

The selector keeps the head's top K tokens at each block position and scores each candidate c given the token p
before it (the anchor at position 1, then the token drafted at the position before):

    score(c) = logit(c) + < predecessor_codebook[p] * hidden_projection(h), successor_codebook[c] >

so a block's drafts are a walk from the anchor: the best-scoring candidate (greedy), or a draw from
softmax(score / T) over the K (sampled; its q never takes top-k or top-p: z-lab's reference, SGLang and vLLM draw
it so). While the drafts match the reference, the token before each is the reference's: scoring a position given
the reference's token before it is what the walk drafts there, which keeps the replay exact and batched.

Beside its tau the replay gives what trainers' accuracies cannot (they read the head's argmax): the tau of the unary
head alone (its argmax as the drafts; sampled, its own q), the selector's lift over it with a paired interval, and
per draft position how often the selector's draft, the head's argmax and the K candidates held the reference's token
(`SelectorSection`, scores.json's `selector`).

Config fields (dflash_config first, then the top level, as z-lab's `_draft_value` reads them; speculators writes them
at the top level): conv_kernel_size, conv_group_size, selector_rank, selector_top_k, each required. Tensors:
`layers.N.{attention_conv,mlp_conv}.{base_kernel,kernel_projection.weight}`, `candidate_selector.hidden_projection.
weight` and the codebooks `candidate_selector.{predecessor,successor}_codebook`, bare (nn.Embedding's `.weight`
names, as a PyTorch module or a trainer saves them, are read too).
"""

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, cast

import torch
import torch.nn.functional as F
from torch import nn
from typing_extensions import TypedDict  # (pydantic reads it for the results' schema on Python 3.11)

from ..metrics import PromptScore
from ..sampling import Sampling
from ..sections import Chart, Column, Context, Section, Table, count, section, share
from .base import ConfigFields, Generation, HeadChoice, Replayed, lift_over_base

CONV_FIELDS = ("conv_kernel_size", "conv_group_size")
SELECTOR_FIELDS = ("selector_rank", "selector_top_k")


@dataclass(frozen=True)
class DFlash2Shapes:
    """DFlash2's four shape fields: the convolutions' taps per channel and channels per group (one dynamic tap per
    group), the selector's low rank and how many of the head's top tokens it chooses among."""

    conv_kernel_size: int
    conv_group_size: int
    selector_rank: int
    selector_top_k: int


class DynamicConv(nn.Module):
    """The grouped dynamic causal convolution around one sublayer, within the block. Two convolutions, one on the
    sublayer's (normed) input and one on its output, each

        out[t, c] = sum_{o < kernel} (base[o, c] + dynamic[t, o, c // group]) * x[t - o, c]

    with x[t - o] = 0 before the block's first position: the taps never reach past the block (the context enters
    through attention only). base taps are per channel (base_kernel[0] before the sublayer, [1] after it); the
    dynamic taps, one per group of `group_size` channels, both come from the sublayer's input.
    """

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int):
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden_size // group_size
        # the identity until trained (a tap of 1 at offset 0), as DFlash2 recipes start it
        self.base_kernel = nn.Parameter(F.pad(torch.ones(2, 1, hidden_size), (0, 0, 0, kernel_size - 1)))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def around(self, sublayer: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
        """sublayer wrapped in the two convolutions; x [N, B, H] its normed input."""
        N, B, _ = x.shape
        dynamic = self.kernel_projection(x).view(N, B, 2, self.kernel_size, self.groups)
        y = sublayer(self.convolve(x, dynamic[:, :, 0], self.base_kernel[0]))
        return self.convolve(y, dynamic[:, :, 1], self.base_kernel[1])

    def convolve(self, x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """x [N, B, H], dynamic [N, B, kernel, groups], base [kernel, H] -> [N, B, H]. The terms are added in the order
        z-lab's reference adds them (base, then dynamic, offset by offset), so bf16 rounds as it does."""
        N, B, H = x.shape
        x = x.view(N, B, self.groups, self.group_size)
        out = torch.zeros_like(x)
        for offset in range(self.kernel_size):
            # x[t - offset]: zeros for the first `offset` positions of the block
            past = torch.cat([x.new_zeros(N, min(offset, B), self.groups, self.group_size), x[:, :B - offset]], 1)
            out = out + base[offset].view(self.groups, self.group_size).to(x.dtype) * past
            out = torch.addcmul(out, dynamic[:, :, offset, :, None], past)
        return out.view(N, B, H)


class CandidateSelector(nn.Module):
    """The selector's scores of the head's top K candidates (the module docstring). The codebooks [V, rank] are bare
    tensors, as checkpoints store them."""

    def __init__(self, hidden_size: int, vocab_size: int, shapes: DFlash2Shapes):
        super().__init__()
        self.top_k, self.rank = shapes.selector_top_k, shapes.selector_rank
        self.hidden_projection = nn.Linear(hidden_size, self.rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.randn(vocab_size, self.rank))  # (as nn.Embedding starts them)
        self.successor_codebook = nn.Parameter(torch.randn(vocab_size, self.rank))

    def forward(self, logits: torch.Tensor, hidden: torch.Tensor,
                previous: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits [..., V] (the drafter's, float32), hidden [..., H], previous [...] -> the candidates [..., K] (the top
        K tokens, most likely first: a tied score goes to the likelier one) and their scores [..., K], in the
        drafter's dtype as z-lab's reference computes them."""
        unary, candidates = logits.topk(self.top_k, dim=-1)
        query = self.predecessor_codebook[previous] * self.hidden_projection(hidden)  # [..., rank]
        keys = self.successor_codebook[candidates]  # [..., K, rank]
        pairing = torch.einsum("nr,nkr->nk", query.reshape(-1, self.rank), keys.reshape(-1, self.top_k, self.rank))
        return candidates, unary.to(query.dtype) + pairing.view(candidates.shape)


@dataclass(frozen=True)
class SelectorChoice(HeadChoice):
    """The selector's choice at block positions: the head's top K candidates [..., K] and their scores [..., K]."""

    candidates: torch.Tensor
    scores: torch.Tensor

    @property
    def tokens(self) -> torch.Tensor:
        return self.candidates.gather(-1, self.scores.argmax(-1, keepdim=True))[..., 0]

    def probabilities(self, q: Sampling, vocab_size: int) -> torch.Tensor:
        probs = self.candidates.new_zeros((*self.candidates.shape[:-1], vocab_size), dtype=torch.float32)
        return probs.scatter_(-1, self.candidates, self._q(q))

    def probability_of(self, tokens: torch.Tensor, q: Sampling) -> torch.Tensor:
        return (self._q(q) * (self.candidates == tokens[..., None])).sum(-1)

    def counts(self, tokens: torch.Tensor) -> torch.Tensor:
        """Whether the reference's token was among the K candidates (the selector's ceiling): [..., 1]."""
        return (self.candidates == tokens[..., None]).any(-1, keepdim=True).float()

    def _q(self, q: Sampling) -> torch.Tensor:
        return (self.scores.float() / q.temperature).softmax(-1)


class DFlash2(Generation):
    NAME = "DFlash2"
    ARCHITECTURES = ("DFlash2DraftModel",)
    SPECULATORS_MODEL_TYPE = "dflash2"
    FIELDS = {**dict.fromkeys(CONV_FIELDS, "convolutions"), **dict.fromkeys(SELECTOR_FIELDS, "candidate selector")}
    WHAT = "grouped dynamic convolutions and a candidate selector"
    # nn.Embedding's names for the codebooks (z-lab's PyTorch module, a trainer's save of it) -> the published ones
    KEY_RENAMES = {f"candidate_selector.{name}.weight": f"candidate_selector.{name}"
                   for name in ("predecessor_codebook", "successor_codebook")}
    HEAD = True
    WALKS_FROM_ANCHOR = True
    BASE_WALK = "unary"
    COUNTS = ("reached", "selector", "argmax", "in_top_k")
    COUNTS_NAME = "selector_positions"
    TRAINING_ACCURACY = "selector_acc"
    # the published Qwen3.8-27B drafter's convolutions (2 taps, groups of 16 channels) and top 16 candidates, with a
    # selector rank to suit a hidden size of 192 (the published one is 256)
    TINY_FIELDS = {"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 32, "selector_top_k": 16}

    def read(self, fields: ConfigFields, hidden_size: int, vocab_size: int | None) -> dict[str, Any]:
        """The four shape fields, each required, as z-lab's reference reads them with no default."""
        values = {key: fields.dflash(key) for key in self.FIELDS}
        for key, value in values.items():
            if value is None:
                fields.fail(f"a DFlash2DraftModel needs dflash_config.{key} (its {', '.join(self.FIELDS)} have no "
                            "default): add the value the drafter was trained with")
            fields.integer(fields.name(key), value, 1)
        if hidden_size % values["conv_group_size"]:
            fields.fail(f"{fields.name('conv_group_size')} {values['conv_group_size']} does not divide hidden_size "
                        f"{hidden_size}: the convolutions' dynamic taps are one per group of that many channels")
        if vocab_size is None:
            fields.fail("a DFlash2DraftModel needs vocab_size: its selector's codebooks have one row per token")
        if values["selector_top_k"] > vocab_size:
            fields.fail(f"{fields.name('selector_top_k')} {values['selector_top_k']} exceeds vocab_size {vocab_size}")
        return {"shapes": DFlash2Shapes(**values)}

    def speculators_problem(self, draft_vocab_size: int | None, vocab_size: int | None) -> str | None:
        if draft_vocab_size is not None and draft_vocab_size != vocab_size:
            return (f"draft_vocab_size {draft_vocab_size} < vocab_size {vocab_size}: a DFlash2 selector chooses among "
                    "the full vocabulary's tokens (speculators refuses to train this too)")
        return None

    def sublayer_wrappers(self, cfg) -> dict[str, tuple[str, nn.Module]]:
        shapes = shapes_of(cfg)
        return {sublayer: (f"{sublayer}_conv", DynamicConv(cfg.hidden_size, shapes.conv_kernel_size,
                                                           shapes.conv_group_size))
                for sublayer in ("attention", "mlp")}

    def head_modules(self, cfg) -> dict[str, nn.Module]:
        return {"candidate_selector": CandidateSelector(cfg.hidden_size, cfg.vocab_size, shapes_of(cfg))}

    def choose(self, drafter: nn.Module, logits: torch.Tensor, hidden: torch.Tensor,
               previous: torch.Tensor) -> SelectorChoice:
        return SelectorChoice(*drafter.get_submodule("candidate_selector")(logits, hidden, previous))

    def head_loss(self, drafter: nn.Module, hidden: torch.Tensor, logits: torch.Tensor, anchors: torch.Tensor,
                  labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The selector's cross-entropy over the head's top K given the label before each position (the anchor at
        the first), with the label in the last candidate's place where the top K leaves it out (as SpecForge's and NeMo
        Automodel's DFlash2 recipes insert it), and its teacher-forced choice."""
        selector = cast(CandidateSelector, drafter.get_submodule("candidate_selector"))
        gold = labels.clamp(min=0)
        previous = torch.cat([anchors[:, None], gold[:, :-1]], dim=1)  # [N, B-1]
        candidates = logits.detach().topk(selector.top_k, dim=-1).indices  # [N, B-1, K]
        missing = ~(candidates == gold[..., None]).any(-1)
        candidates[..., -1] = torch.where(missing, gold, candidates[..., -1])
        chosen_logits = logits.float().gather(-1, candidates)
        # the selector's score, as CandidateSelector computes it, over these candidates
        query = selector.predecessor_codebook[previous] * selector.hidden_projection(hidden)  # [N, B-1, rank]
        scores = chosen_logits + (query[..., None, :] * selector.successor_codebook[candidates]).sum(-1)
        target = (candidates == gold[..., None]).float().argmax(-1)
        ce = F.cross_entropy(scores.reshape(-1, selector.top_k), target.reshape(-1), reduction="none").view(labels.shape)
        chosen = candidates.gather(-1, scores.argmax(-1, keepdim=True))[..., 0]
        return ce * (labels != -100), chosen

    def summaries(self, replayed: Sequence[Replayed]) -> list[Section]:
        bases = [r.base for r in replayed if r.base is not None]
        counts = [r.counts for r in replayed if r.counts is not None]
        if not replayed or not len(bases) == len(counts) == len(replayed):
            return []
        return [SelectorSection(selector_summary([r.drafts for r in replayed], bases, counts, self.COUNTS))]


def shapes_of(cfg) -> DFlash2Shapes:
    """A DFlash2 drafter config's four shapes (DrafterConfig.generation_fields)."""
    return cfg.generation_fields["shapes"]


# ----------------------------------------------------------------------------------------------
# The numbers: the selector against its unary head alone

SHARES = ("selector_accuracy", "argmax_accuracy", "candidate_recall")


def selector_summary(drafts: Sequence[PromptScore], unary: Sequence[PromptScore],
                     positions: Sequence[Sequence[Sequence[float]]], names: Sequence[str]) -> dict:
    """A DFlash2 drafter's candidate selector against its unary head alone, on the same references (the trainers'
    accuracies read the head's argmax, so they cannot say whether the selector helps):

    - unary_tau_macro / _pooled (and intervals): the tau the head's argmax alone would reach as the drafts (with
      sampled drafts, the head's q); lift: tau_macro minus it, with its paired 95% interval;
    - per draft position k = 1..B-1, over the positions the selector's decode steps compared (reached): the share
      where the selector's draft was accepted (selector_accuracy), where the head's argmax would have been
      (argmax_accuracy; the same context: every earlier draft accepted) and where the reference's token was among
      the K candidates the selector chooses from (candidate_recall, the selector's ceiling); `overall`, the
      same over every position. With sampled drafts each count is an expectation.

    drafts and unary: the scored references, in the same order; positions: per reference, per position, the counts
    `names` (DFlash2.COUNTS)."""
    return lift_over_base(drafts, unary, positions, names, SHARES, "unary")


class SelectorJson(TypedDict):
    """scores.json's `selector` (selector_summary)."""

    unary_tau_macro: float
    unary_tau_macro_ci95: list[float]
    unary_tau_pooled: float
    lift: float
    lift_ci95: list[float]
    position_counts: dict[str, list[float]]  # each of DFlash2.COUNTS per draft position
    selector_accuracy: list[float | None]
    argmax_accuracy: list[float | None]
    candidate_recall: list[float | None]
    overall: dict[str, float | None]  # each of SHARES over every draft position


@section
@dataclass(frozen=True)
class SelectorSection(Section):
    """A DFlash2 drafter's candidate selector against its unary head alone (scores.json's `selector`:
    selector_summary)."""

    KEY: ClassVar[str] = "selector"
    TITLE: ClassVar[str] = "Candidate selector"
    JSON: ClassVar[Any] = SelectorJson
    HISTORY: ClassVar[tuple[Column, ...]] = (Column("unary_tau_macro", "unary head tau", "unary head"),
                                             Column("selector_lift", "selector lift", "lift", signed=True))
    BESIDE_TAU: ClassVar[tuple[str, str] | None] = ("unary_tau_macro", "unary head alone")
    REPORT_COLUMNS: ClassVar[tuple[str, ...]] = ("unary head tau", "95% CI", "selector lift", "paired 95% CI",
                                                 "positions reached", "selector", "argmax", "recall")
    REPORT_TEXT: ClassVar[str] = (
        "Newest DFlash2 checkpoints and baselines: the unary head alone's tau with its 95% interval, the selector's "
        "lift with its paired 95% interval (per reference, on the same references), and over the draft positions the "
        "selector's decode steps reached: how often the selector's draft was accepted, how often the head's argmax "
        "would have been (in the same context), and how often the reference's token was among the K candidates the "
        "selector chooses from (its ceiling).")
    POSITION_LINES: ClassVar[Mapping[str, str]] = {"selector_accuracy": "selector's draft accepted",
                                                   "argmax_accuracy": "head's argmax would have been",
                                                   "candidate_recall": "reference among the K candidates"}

    summary: dict  # SelectorJson

    def positions(self) -> list[tuple[int, float, list[float | None]]]:
        """(k, positions reached, the three SHARES) for k = 1..B-1."""
        return [(k, reached, list(values)) for k, (reached, *values) in
                enumerate(zip(self.summary["position_counts"]["reached"], *(self.summary[n] for n in SHARES)), start=1)]

    def lines(self, context: Context) -> list[str]:
        s = self.summary
        low, high = s["unary_tau_macro_ci95"]
        lift_low, lift_high = s["lift_ci95"]
        overall = s["overall"]
        compared = count(sum(s["position_counts"]["reached"]))
        head = "unary head alone (drafts sampled from its q)" if context.sampled else "unary head alone (its argmax)"
        return [
            f"{head}: tau macro {s['unary_tau_macro']:.3f} (95% CI {low:.2f}-{high:.2f}), pooled "
            f"{s['unary_tau_pooled']:.3f}; selector lift {s['lift']:+.3f} (paired 95% CI {lift_low:+.2f} "
            f"to {lift_high:+.2f})",
            f"of {compared}{' expected' if context.sampled else ''} draft positions compared: selector's draft "
            f"accepted {share(overall['selector_accuracy'])}, head's argmax would have been "
            f"{share(overall['argmax_accuracy'])}, reference among the K candidates {share(overall['candidate_recall'])}",
        ]

    def tables(self, context: Context) -> list[Table]:
        return [Table(("k", "reached", "selector", "argmax", "recall"),
                      tuple((str(k), count(reached), *map(share, values)) for k, reached, values in self.positions()),
                      title="selector by draft position" + (" (expected counts)" if context.sampled else ""))]

    def markdown(self, context: Context) -> list[str]:
        """The two lines as sentences, then a row per draft position."""
        unary, shares = (f"{line[0].upper()}{line[1:]}." for line in self.lines(context))
        lines = [unary, "", shares, "", "| draft position | reached | selector | argmax | recall |",
                 "|---|---|---|---|---|"]
        lines += [f"| {k} | {count(reached)} | {' | '.join(map(share, values))} |" for k, reached, values in
                  self.positions()]
        return [*lines, ""]

    def metrics(self, context: Context) -> list[tuple[str, str]]:
        s = self.summary
        unary, lift = s["unary_tau_macro_ci95"], s["lift_ci95"]
        reached_name = "expected reached" if context.sampled else "reached"
        return [("unary head alone: tau macro", f"{s['unary_tau_macro']:.3f}"),
                ("unary head alone: tau macro 95% CI", f"{unary[0]:.3f} - {unary[1]:.3f}"),
                ("unary head alone: tau pooled", f"{s['unary_tau_pooled']:.3f}"),
                ("selector lift (tau macro minus the unary head's)", f"{s['lift']:+.3f}"),
                ("selector lift paired 95% CI", f"{lift[0]:+.3f} to {lift[1]:+.3f}")] + [
            (f"position {k}: selector's draft accepted / head's argmax would have been / reference among the K "
             "candidates", f"{share(values[0])} / {share(values[1])} / {share(values[2])} "
                           f"({count(reached)} {reached_name})") for k, reached, values in self.positions()]

    def scalars(self) -> dict[str, float]:
        values = {"selector/unary_tau_macro": self.summary["unary_tau_macro"], "selector/lift": self.summary["lift"]}
        for name, by_position in self.by_position().items():
            for k, value in enumerate(by_position, start=1):
                if value is not None:
                    values[f"selector/{name}/{k}"] = value
        return values

    def charts(self) -> list[Chart]:
        return [Chart("dflash-eval: DFlash2 selector", "tau against its unary head alone",
                      ("tau_macro", "selector/unary_tau_macro")),
                Chart("dflash-eval: DFlash2 selector", "the selector's lift", ("selector/lift",)),
                *(Chart("dflash-eval: DFlash2 selector", f"{name} by draft position", (rf"selector/{name}/\d+",))
                  for name in SHARES)]

    def history(self) -> dict[str, float | None]:
        return {"unary_tau_macro": self.summary["unary_tau_macro"], "selector_lift": self.summary["lift"]}

    @classmethod
    def history_text(cls, context: Context) -> str:
        return ("DFlash2 drafters draft with a candidate selector that picks among their unary head's top K candidates; "
                "the unary head tau is what the head's argmax alone would reach as the drafts on the same references"
                + (" (sampled from the head's q)" if context.sampled else "")
                + ", and the selector lift is tau macro minus it. A trainer's accuracy reads the head's argmax: it "
                  "cannot show the lift.")

    @classmethod
    def report_text(cls, context: Context) -> str:
        return cls.REPORT_TEXT + (" With sampled drafts every count is an expectation over the draws."
                                  if context.sampled else "")

    def report_row(self) -> tuple[str, ...]:
        s = self.summary
        (low, high), (lift_low, lift_high) = s["unary_tau_macro_ci95"], s["lift_ci95"]
        return (f"{s['unary_tau_macro']:.3f}", f"{low:.2f} - {high:.2f}", f"{s['lift']:+.3f}",
                f"{lift_low:+.2f} to {lift_high:+.2f}", count(sum(s["position_counts"]["reached"])),
                *(share(s["overall"][name]) for name in SHARES))

    def by_position(self) -> dict[str, list[float | None]]:
        return {name: list(self.summary[name]) for name in SHARES}
