"""DSpark (DeepSeek's DeepSpec, 2026-06; served by TensorRT-LLM, llama.cpp, vLLM, tokenspeed and SGLang; trained by
DeepSpec and speculators 0.9.0): the DFlash backbone with two small heads.

- The Markov head biases each draft slot's logits by the token before it, a low-rank product
  `markov_w2(markov_w1[prev])` (markov_w1 [V, r], markov_w2 r -> V, no bias): prev is the anchor for the first slot,
  then the token just drafted, so a block is a walk from the anchor, drafted left to right after one backbone
  forward: greedy, the argmax of the biased logits; sampled, a draw from them (q = the biased logits processed as
  served). The `gated` variant scales markov_w1[prev] by sigmoid(gate_proj([h ; markov_w1[prev]])) first. The `rnn`
  variant carries a state across the block (each slot's bias depends on every earlier one): it is refused.
- The confidence head predicts each slot's acceptance, sigmoid(proj([h ; markov_w1[prev]])) (proj(h) without the
  Markov part when `confidence_head_with_markov` is false). Served with a threshold t > 0, a step verifies only the
  drafts before the first slot whose confidence is below t; t = 0 verifies them all (`verified_drafts`).

While the drafts match the reference, the token before each is the reference's, so the walk and the confidences are
scored given the reference's token before each slot: the replay stays exact and batched. DSpark's own block
convention (every slot drafts: block 7 is 7 drafts, up to 8 tokens a step) is the config's (`drafts_from_anchor`,
set by the readers of DeepSpec's and speculators' saves). `markov_rank 0` with no confidence head is DeepSpec's
DFlash: the backbone alone.

Beside its tau the replay gives what no trainer logs: the tau of the backbone alone (its argmax as the drafts) and
the Markov head's lift over it with a paired interval, per draft position how often each was accepted
(`MarkovSection`, scores.json's `markov`); and the confidence head's calibration (`ConfidenceSection`).
"""

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar, cast

import torch
from torch import nn

from ..metrics import PromptScore, whole
from ..sampling import Sampling
from ..sections import Chart, Column, Section, Served, Table, count, section, share
from .base import CALIBRATION_BINS, ConfigFields, Generation, HeadChoice, Replayed, lift_over_base

# DeepSpec's markov_head_type values read here, each as its build_markov_head builds it
# (tests/golden/deepspec_markov.safetensors); its `rnn` is refused
MARKOV_TYPES = ("vanilla", "gated")


@dataclass(frozen=True)
class DSparkHeads:
    """What a DSpark config says of its heads."""

    markov_rank: int  # 0: no Markov head
    markov_head_type: str | None  # MARKOV_TYPES
    confidence_head: bool
    confidence_with_markov: bool  # the confidence head also reads markov_w1[prev]


class MarkovHead(nn.Module):
    """The slot's logit bias from the token before it: markov_w2(markov_w1[prev]), gated by the slot's hidden state
    in the `gated` variant. Tensor names as DeepSpec and speculators save them."""

    def __init__(self, hidden_size: int, vocab_size: int, heads: DSparkHeads):
        super().__init__()
        self.markov_w1 = nn.Embedding(vocab_size, heads.markov_rank)
        self.markov_w2 = nn.Linear(heads.markov_rank, vocab_size, bias=False)
        self.gate_proj = nn.Linear(hidden_size + heads.markov_rank, heads.markov_rank) \
            if heads.markov_head_type == "gated" else None

    def forward(self, previous: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """previous [...], hidden [..., H] -> the bias [..., V], in the drafter's dtype. (A previous token of -1, past
        a reference's end, stands for any: what is drafted there is never compared.)"""
        embedded = self.markov_w1(previous.clamp(min=0))  # [..., r]
        if self.gate_proj is not None:
            gate = torch.sigmoid(self.gate_proj(torch.cat([hidden, embedded.to(hidden.dtype)], dim=-1)))
            embedded = gate.to(embedded.dtype) * embedded
        return self.markov_w2(embedded)


class ConfidenceHead(nn.Module):
    """A slot's acceptance logit, proj([h ; markov_w1[prev]]) (proj(h) without the Markov part)."""

    def __init__(self, input_size: int):
        super().__init__()
        self.proj = nn.Linear(input_size, 1)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features).squeeze(-1)


@dataclass(frozen=True)
class MarkovChoice(HeadChoice):
    """The Markov head's choice at block positions: the backbone's processed logits plus its bias [..., V], float32."""

    logits: torch.Tensor

    @cached_property  # (read at every position of a block's walk)
    def tokens(self) -> torch.Tensor:
        return self.logits.argmax(-1)

    def probabilities(self, q: Sampling, vocab_size: int) -> torch.Tensor:
        return q.probabilities(self.logits)

    def probability_of(self, tokens: torch.Tensor, q: Sampling) -> torch.Tensor:
        return q.probability_of(self.logits, tokens)


class DSpark(Generation):
    NAME = "DSpark"
    ARCHITECTURES = ("Qwen3DSparkModel", "Gemma4DSparkModel", "DSparkDraftModel")
    SPECULATORS_MODEL_TYPE = "dspark"
    FIELDS = {"markov_rank": "Markov head", "markov_head_type": "Markov head",
              "enable_confidence_head": "confidence head", "confidence_head_with_markov": "confidence head"}
    WHAT = "a low-rank Markov head and a confidence head"
    HEAD = True
    WALKS_FROM_ANCHOR = True
    BASE_WALK = "backbone"
    COUNTS = ("reached", "markov", "argmax")
    COUNTS_NAME = "markov_positions"
    TRAINING_ACCURACY = "markov_acc"
    HEAD_LOSS_ONLY = True  # DeepSpec never trains the backbone's own logits
    TINY_FIELDS = {"markov_rank": 32, "markov_head_type": "vanilla", "enable_confidence_head": True,
                   "confidence_head_with_markov": True}

    def read(self, fields: ConfigFields, hidden_size: int, vocab_size: int | None) -> dict[str, Any]:
        rank = fields.integer(fields.name("markov_rank"), fields.dflash("markov_rank"), 0) or 0
        kind = fields.dflash("markov_head_type")
        if rank and kind not in MARKOV_TYPES:
            why = (": its state runs across the block, each slot's bias depending on every earlier one, which the "
                   "replay does not compute" if kind == "rnn" else "")
            fields.fail(f"{fields.name('markov_head_type')} {kind!r}: the Markov heads read here are "
                        f"{', '.join(MARKOV_TYPES)}, as DeepSpec defines them{why}")
        confidence = bool(fields.boolean(fields.name("enable_confidence_head"), fields.dflash("enable_confidence_head")))
        with_markov = bool(fields.boolean(fields.name("confidence_head_with_markov"),
                                          fields.dflash("confidence_head_with_markov")))
        with_markov = with_markov and confidence  # (the confidence head's input; without the head, nothing)
        if with_markov and not rank:
            fields.fail(f"{fields.name('confidence_head_with_markov')} is true but markov_rank is 0: the confidence "
                        "head reads markov_w1, which a drafter without a Markov head does not have")
        if (rank or confidence) and vocab_size is None:
            fields.fail("a DSpark drafter needs vocab_size: its Markov head has one row per token")
        return {"heads": DSparkHeads(rank, kind if rank else None, confidence, with_markov)}

    def head_modules(self, cfg) -> dict[str, nn.Module]:
        heads = heads_of(cfg)
        modules: dict[str, nn.Module] = {}
        if heads.markov_rank:
            modules["markov_head"] = MarkovHead(cfg.hidden_size, cfg.vocab_size, heads)
        if heads.confidence_head:
            modules["confidence_head"] = ConfidenceHead(cfg.hidden_size + heads.markov_rank * heads.confidence_with_markov)
        return modules

    def choose(self, drafter: nn.Module, logits: torch.Tensor, hidden: torch.Tensor,
               previous: torch.Tensor) -> MarkovChoice:
        if not heads_of(drafter.cfg).markov_rank:
            return MarkovChoice(logits)
        bias = cast(MarkovHead, drafter.get_submodule("markov_head"))(previous, hidden)
        return MarkovChoice(logits + bias.float())

    def schedules_verification(self, cfg) -> bool:
        return heads_of(cfg).confidence_head

    def verified_drafts(self, confidence: torch.Tensor, threshold: float) -> torch.Tensor:
        """The drafts before the first slot whose confidence is below the threshold (all D when none is), as DeepSpec's
        evaluator and the serving stacks' DSpark threshold verify them."""
        below = confidence < threshold  # [N, D]
        return torch.where(below.any(-1), below.float().argmax(-1),
                           torch.full_like(below[:, 0], below.shape[-1], dtype=torch.long))

    def confidences(self, drafter: nn.Module, hidden: torch.Tensor, previous: torch.Tensor) -> torch.Tensor | None:
        """Each slot's predicted acceptance, sigmoid of the confidence head [...] (float32), given its hidden state
        [..., H] and the token before it [...]; None without a confidence head."""
        heads = heads_of(drafter.cfg)
        if not heads.confidence_head:
            return None
        features = hidden
        if heads.confidence_with_markov:
            markov = cast(MarkovHead, drafter.get_submodule("markov_head"))
            features = torch.cat([hidden, markov.markov_w1(previous.clamp(min=0)).to(hidden.dtype)], dim=-1)
        return torch.sigmoid(cast(ConfidenceHead, drafter.get_submodule("confidence_head"))(features).float())

    def head_loss(self, drafter: nn.Module, hidden: torch.Tensor, logits: torch.Tensor, anchors: torch.Tensor,
                  labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """DeepSpec's loss per slot (deepspec/modeling/dspark/loss.py), teacher-forced as its forward is: each slot's
        logits biased by the Markov head given the label before it (the anchor at the first); the cross-entropy of the
        biased q; the confidence head trained toward each slot's acceptance 1 - TV(q, p) (detached) by binary
        cross-entropy. p is the target's choice, the label (the tiny run's references are its greedy tokens: a one-hot
        p), so the acceptance is q(label). DeepSpec's DSpark configs weigh the cross-entropy 0.1 and add 0.9 of the L1
        distance sum |q - p|; against a one-hot p that is 2 (1 - q(label)), whose gradient vanishes while q(label) is
        small (the tiny run's 400 steps reach tau 3.3 with it, 4.0 without), so the cross-entropy weighs 1 here, as
        DeepSpec's DFlash configs weigh it; the confidence term weighs 1, as in its DSpark configs. Returns that loss (0
        where unlabelled) and the biased argmax, teacher-forced; the trainer takes it as the whole loss (DeepSpec never
        trains the backbone's own logits)."""
        gold = labels.clamp(min=0)
        previous = torch.cat([anchors[:, None], gold[:, :-1]], dim=1)  # [N, D]
        biased = self.choose(drafter, logits.float(), hidden, previous).logits  # [N, D, V]
        functional = torch.nn.functional
        loss = functional.cross_entropy(biased.flatten(0, 1), gold.flatten(), reduction="none").view(labels.shape)
        heads = heads_of(drafter.cfg)
        if heads.confidence_head:
            accepted = biased.detach().softmax(-1).gather(-1, gold[..., None])[..., 0]  # 1 - TV(q, one-hot p)
            features = hidden
            if heads.confidence_with_markov:
                markov = cast(MarkovHead, drafter.get_submodule("markov_head"))
                features = torch.cat([hidden, markov.markov_w1(previous).to(hidden.dtype)], dim=-1)
            confidence = cast(ConfidenceHead, drafter.get_submodule("confidence_head"))(features).float()
            loss = loss + functional.binary_cross_entropy_with_logits(confidence, accepted, reduction="none")
        return loss * (labels != -100), biased.argmax(-1)

    def summaries(self, replayed: Sequence[Replayed]) -> list[Section]:
        found: list[Section] = []
        bases = [r.base for r in replayed if r.base is not None]
        counts = [r.counts for r in replayed if r.counts is not None]
        if replayed and len(bases) == len(counts) == len(replayed):
            found.append(MarkovSection(markov_summary([r.drafts for r in replayed], bases, counts, self.COUNTS)))
        calibrations = [r.calibration for r in replayed if r.calibration is not None]
        if replayed and len(calibrations) == len(replayed):
            found.append(ConfidenceSection(calibration_summary(calibrations)))
        return found


def heads_of(cfg) -> DSparkHeads:
    """A DSpark drafter config's heads (DrafterConfig.generation_fields)."""
    return cfg.generation_fields["heads"]


SHARES = ("markov_accuracy", "argmax_accuracy")


def markov_summary(drafts: Sequence[PromptScore], backbone: Sequence[PromptScore],
                   positions: Sequence[Sequence[Sequence[float]]], names: Sequence[str]) -> dict:
    """The Markov head against the backbone alone on the same references: the backbone's tau (its argmax as the
    drafts; sampled, its own q) with its interval, the lift (tau_macro minus it) with its paired interval, and per
    draft position, over the positions the Markov walk's decode steps compared, how often its draft was accepted and
    how often the backbone's argmax would have been (in the same context). positions: per reference, per position,
    the counts `names` (DSpark.COUNTS)."""
    return lift_over_base(drafts, backbone, positions, names, SHARES, "backbone")


@section
@dataclass(frozen=True)
class MarkovSection(Section):
    """scores.json's `markov` (markov_summary) and how it is shown."""

    KEY: ClassVar[str] = "markov"
    TITLE: ClassVar[str] = "Markov head"
    HISTORY: ClassVar[tuple[Column, ...]] = (Column("backbone_tau_macro", "backbone tau", "backbone"),
                                             Column("markov_lift", "Markov lift", "lift", signed=True))
    REPORT_COLUMNS: ClassVar[tuple[str, ...]] = ("backbone tau", "95% CI", "Markov lift", "paired 95% CI",
                                                 "positions reached", "Markov", "argmax")
    REPORT_TEXT: ClassVar[str] = (
        "DSpark drafters bias each draft slot's logits by the token drafted before it (a Markov head). Newest DSpark "
        "checkpoints: the backbone alone's tau (its argmax as the drafts) with its 95% interval, the Markov head's "
        "lift with its paired 95% interval, and over the draft positions its decode steps reached, how often the "
        "Markov walk's draft was accepted and how often the backbone's argmax would have been.")

    summary: dict

    def positions(self) -> list[tuple[int, float, list[float | None]]]:
        """(k, positions reached, the SHARES) for k = 1..B-1."""
        return [(k, reached, list(values)) for k, (reached, *values) in
                enumerate(zip(self.summary["position_counts"]["reached"], *(self.summary[n] for n in SHARES)), start=1)]

    def lines(self, served: Served) -> list[str]:
        s = self.summary
        low, high = s["backbone_tau_macro_ci95"]
        lift_low, lift_high = s["lift_ci95"]
        head = "backbone alone (drafts sampled from its q)" if served.sampled else "backbone alone (its argmax)"
        return [f"{head}: tau macro {s['backbone_tau_macro']:.3f} (95% CI {low:.2f}-{high:.2f}), pooled "
                f"{s['backbone_tau_pooled']:.3f}; Markov lift {s['lift']:+.3f} (paired 95% CI {lift_low:+.2f} to "
                f"{lift_high:+.2f})",
                f"of {count(sum(s['position_counts']['reached']))}{' expected' if served.sampled else ''} draft "
                f"positions compared: Markov draft accepted {share(s['overall']['markov_accuracy'])}, backbone's "
                f"argmax would have been {share(s['overall']['argmax_accuracy'])}"]

    def tables(self, served: Served) -> list[Table]:
        return [Table(("k", "reached", "Markov", "argmax"),
                      tuple((str(k), count(reached), *map(share, values)) for k, reached, values in self.positions()),
                      title="Markov head by draft position" + (" (expected counts)" if served.sampled else ""))]

    def metrics(self, served: Served) -> list[tuple[str, str]]:
        s = self.summary
        low, high = s["backbone_tau_macro_ci95"]
        lift_low, lift_high = s["lift_ci95"]
        return [("backbone alone: tau macro", f"{s['backbone_tau_macro']:.3f}"),
                ("backbone alone: tau macro 95% CI", f"{low:.3f} - {high:.3f}"),
                ("Markov lift (tau macro minus the backbone's)", f"{s['lift']:+.3f}"),
                ("Markov lift paired 95% CI", f"{lift_low:+.3f} to {lift_high:+.3f}")]

    def scalars(self) -> dict[str, float]:
        values = {"markov/backbone_tau_macro": self.summary["backbone_tau_macro"], "markov/lift": self.summary["lift"]}
        for name in SHARES:
            for k, value in enumerate(self.summary[name], start=1):
                if value is not None:
                    values[f"markov/{name}/{k}"] = value
        return values

    def charts(self) -> list[Chart]:
        group = "dflash-eval: DSpark Markov head"
        return [Chart(group, "tau against the backbone alone", ("tau_macro", "markov/backbone_tau_macro")),
                Chart(group, "the Markov head's lift", ("markov/lift",)),
                *(Chart(group, f"{name} by draft position", (rf"markov/{name}/\d+",)) for name in SHARES)]

    def history(self) -> dict[str, float | None]:
        return {"backbone_tau_macro": self.summary["backbone_tau_macro"], "markov_lift": self.summary["lift"]}

    def report_row(self) -> tuple[str, ...]:
        s = self.summary
        (low, high), (lift_low, lift_high) = s["backbone_tau_macro_ci95"], s["lift_ci95"]
        return (f"{s['backbone_tau_macro']:.3f}", f"{low:.2f}-{high:.2f}", f"{s['lift']:+.3f}",
                f"{lift_low:+.2f} to {lift_high:+.2f}", count(sum(s["position_counts"]["reached"])),
                *(share(s["overall"][name]) for name in SHARES))

    def by_position(self) -> dict[str, list[float | None]]:
        return {name: list(self.summary[name]) for name in SHARES}


def calibration_summary(calibrations: Sequence[Sequence[Sequence[Sequence[float]]]]) -> dict:
    """The confidence head's predictions against what happened, over the draft positions the decode steps compared:
    each a prediction c of the draft's acceptance given the drafts before it accepted (what the head is trained on),
    and whether it was. Per draft position: the positions compared, mean prediction and acceptance, expected
    calibration error (over CALIBRATION_BINS equal-width bins of c) and Brier score; pooled over positions the
    reliability curve (per bin, mean prediction against acceptance), and as DeepSpec's evaluator summarises its own
    per-position figures, their means weighed by the positions compared. calibrations: per reference, its
    ReplayResult.calibration ([B-1][BINS][weight, weight x c, weight x accepted, weight x squared error])."""
    counts = [[[sum(values) for values in zip(*cells)] for cells in zip(*positions)] for positions in zip(*calibrations)]

    def figures(bins: Sequence[Sequence[float]]) -> dict:
        weight = sum(b[0] for b in bins)
        if not weight:
            return {"compared": 0.0, "predicted": None, "observed": None, "ece": None, "brier": None}
        return {"compared": whole(weight), "predicted": sum(b[1] for b in bins) / weight,
                "observed": sum(b[2] for b in bins) / weight,
                "ece": sum(abs(b[1] - b[2]) for b in bins) / weight, "brier": sum(b[3] for b in bins) / weight}

    by_position = [figures(bins) for bins in counts]
    pooled = [[sum(values) for values in zip(*cells)] for cells in zip(*counts)]  # per bin, over positions
    total = sum(p["compared"] for p in by_position)
    return {
        "bins": CALIBRATION_BINS,
        "position_counts": counts,
        "by_position": {name: [p[name] for p in by_position] for name in ("compared", "predicted", "observed",
                                                                          "ece", "brier")},
        "reliability": {"compared": [whole(b[0]) for b in pooled],
                        "predicted": [b[1] / b[0] if b[0] else None for b in pooled],
                        "observed": [b[2] / b[0] if b[0] else None for b in pooled]},
        "overall": {name: (sum(p[name] * p["compared"] for p in by_position if p["compared"]) / total
                           if total else None) for name in ("predicted", "observed", "ece", "brier")},
        "compared": whole(total),
    }


@section
@dataclass(frozen=True)
class ConfidenceSection(Section):
    """scores.json's `confidence` (calibration_summary) and how it is shown."""

    KEY: ClassVar[str] = "confidence"
    TITLE: ClassVar[str] = "Confidence head"
    HISTORY: ClassVar[tuple[Column, ...]] = (Column("confidence_ece", "confidence ECE", "ECE"),)
    REPORT_COLUMNS: ClassVar[tuple[str, ...]] = ("positions compared", "predicted", "observed", "ECE", "Brier")
    REPORT_TEXT: ClassVar[str] = (
        "DSpark drafters predict each draft's acceptance (a confidence head), which a served confidence threshold "
        "uses to verify fewer drafts. Newest such checkpoints: over the draft positions their decode steps compared, "
        "the mean prediction against the share accepted, the expected calibration error (20 equal-width bins, per "
        "position, weighed by the positions compared) and the Brier score.")
    POSITION_LINES: ClassVar[dict[str, str]] = {"predicted": "predicted", "observed": "accepted"}
    POSITION_AXIS: ClassVar[str] = "acceptance, the drafts before it accepted"
    CURVE_AXES: ClassVar[tuple[str, str]] = ("predicted acceptance (bin mean)", "share accepted")

    summary: dict

    def lines(self, context: Served) -> list[str]:
        o = self.summary["overall"]
        if o["ece"] is None:
            return ["confidence head: no draft position was compared"]
        expected = " expected" if context.sampled else ""
        return [f"confidence head: over {count(self.summary['compared'])}{expected} draft positions compared, "
                f"predicted acceptance {share(o['predicted'])}, accepted {share(o['observed'])}; expected "
                f"calibration error {o['ece']:.3f}, Brier {o['brier']:.3f}"]

    def tables(self, context: Served) -> list[Table]:
        p = self.summary["by_position"]
        rows = tuple((str(k), count(n), share(pred), share(obs), _decimals(ece))
                     for k, (n, pred, obs, ece) in enumerate(zip(p["compared"], p["predicted"], p["observed"],
                                                                 p["ece"]), start=1))
        r, width = self.summary["reliability"], 1 / self.summary["bins"]
        curve = tuple((f"{b * width:.2f}-{(b + 1) * width:.2f}", count(n), share(pred), share(obs))
                      for b, (n, pred, obs) in enumerate(zip(r["compared"], r["predicted"], r["observed"])) if n)
        return [Table(("k", "compared", "predicted", "accepted", "ECE"), rows, text_columns=1,
                      title="Confidence head by draft position" + (" (expected counts)" if context.sampled else "")),
                Table(("predicted", "compared", "mean prediction", "accepted"), curve, text_columns=1,
                      title="Confidence head reliability (bins of the prediction, every position)")]

    def metrics(self, context: Served) -> list[tuple[str, str]]:
        o = self.summary["overall"]
        return [] if o["ece"] is None else [
            ("confidence head: expected calibration error", f"{o['ece']:.3f}"),
            ("confidence head: predicted / accepted", f"{share(o['predicted'])} / {share(o['observed'])}")]

    def scalars(self) -> dict[str, float]:
        o, p = self.summary["overall"], self.summary["by_position"]
        values = {f"confidence/{name}": o[name] for name in ("ece", "brier", "predicted", "observed")
                  if o[name] is not None}
        for name in ("predicted", "observed"):
            values.update({f"confidence/{name}/{k}": v for k, v in enumerate(p[name], start=1) if v is not None})
        return values

    def charts(self) -> list[Chart]:
        group = "dflash-eval: DSpark confidence head"
        return [Chart(group, "expected calibration error and Brier score", ("confidence/ece", "confidence/brier")),
                Chart(group, "predicted and accepted", ("confidence/predicted", "confidence/observed")),
                *(Chart(group, f"{name} by draft position", (rf"confidence/{name}/\d+",))
                  for name in ("predicted", "observed"))]

    def history(self) -> dict[str, float | None]:
        return {"confidence_ece": self.summary["overall"]["ece"]}

    def report_row(self) -> tuple[str, ...]:
        o = self.summary["overall"]
        return (count(self.summary["compared"]), share(o["predicted"]), share(o["observed"]), _decimals(o["ece"]),
                _decimals(o["brier"]))

    def by_position(self) -> dict[str, list[float | None]]:
        p = self.summary["by_position"]
        return {"predicted": list(p["predicted"]), "observed": list(p["observed"])}

    def curve(self) -> list[tuple[float, float, float]]:
        """The reliability curve: per non-empty bin, (mean prediction, share accepted, positions compared)."""
        r = self.summary["reliability"]
        return [(pred, obs, n) for n, pred, obs in zip(r["compared"], r["predicted"], r["observed"]) if n]


def _decimals(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"
