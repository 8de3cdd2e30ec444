"""How a DFlash2 drafter's candidate selector is told, in the same words on the command line, in the run's summary
and in the report: scores.json's `selector` (dflash_core.metrics.selector_summary), the tau its unary head's
argmax alone reaches, what the selector adds to it, and per draft position how often the selector's draft, the
head's argmax and the K candidates hold the reference's token. Other drafters have no `selector`: nothing is told.
"""

from dataclasses import dataclass

from dflash_eval.reporting.history import HistoryRow

SHARES = ("selector_accuracy", "argmax_accuracy", "candidate_recall")


@dataclass(frozen=True)
class SelectorPosition:
    """One draft position k of selector_summary: the decode steps that compared it and the three shares."""

    k: int
    reached: float  # a count; an expectation with sampled drafts
    selector_accuracy: float | None  # None: no step reached k
    argmax_accuracy: float | None
    candidate_recall: float | None


def selector_positions(selector: dict) -> list[SelectorPosition]:
    """The per-position rows of a `selector` record, k = 1..B-1."""
    return [SelectorPosition(k, reached, *shares) for k, (reached, *shares) in
            enumerate(zip(selector["position_counts"]["reached"], *(selector[name] for name in SHARES)), start=1)]


def share(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def count(n: float) -> str:
    """A count as written: whole, or an expectation to one decimal."""
    return f"{n:.0f}" if float(n).is_integer() else f"{n:.1f}"


def selector_lines(selector: dict, sampled: bool) -> list[str]:
    """Two lines: the unary head alone's tau and the selector's lift (tau macro minus it) with their intervals; the
    shares over every draft position compared. sampled: the drafts are sampled (the head's alone from its q, the
    counts expectations)."""
    low, high = selector["unary_tau_macro_ci95"]
    lift_low, lift_high = selector["lift_ci95"]
    overall = selector["overall"]
    compared = count(sum(selector["position_counts"]["reached"]))
    head = "unary head alone (drafts sampled from its q)" if sampled else "unary head alone (its argmax)"
    return [
        f"{head}: tau macro {selector['unary_tau_macro']:.3f} (95% CI {low:.2f}-{high:.2f}), pooled "
        f"{selector['unary_tau_pooled']:.3f}; selector lift {selector['lift']:+.3f} (paired 95% CI {lift_low:+.2f} "
        f"to {lift_high:+.2f})",
        f"of {compared}{' expected' if sampled else ''} draft positions compared: selector's draft accepted "
        f"{share(overall['selector_accuracy'])}, head's argmax would have been {share(overall['argmax_accuracy'])}, "
        f"reference among the K candidates {share(overall['candidate_recall'])}",
    ]


@dataclass(frozen=True)
class ShownSelector:
    """A shown DFlash2 checkpoint's candidate selector: its scores.json `selector` (reporting.selector)."""

    row: HistoryRow
    summary: dict
