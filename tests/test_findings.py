"""dflash_core.diagnostics.findings: what each pattern of diagnostic numbers names, and what a healthy drafter's
numbers name (nothing). The planted-bug tests (test_planted_bugs.py) show the patterns on trained drafters."""

from dflash_core.diagnostics import findings

HEALTHY = {"context": [60, 100], "references": [80, 100],
           "offset -1": [5, 100], "offset 0": [50, 100], "offset +1": [8, 100]}
ABLATED = {1: 2.2, 2: 2.0}  # each layer's ablation costs a part of tau 2.6


def kinds(*args, **kwargs) -> list[str]:
    return [f["kind"] for f in findings(*args, **kwargs)]


def test_a_healthy_drafter_raises_nothing():
    assert kinds(2.6, ABLATED, 1.1, HEALTHY) == []
    assert kinds(2.6, ABLATED, None) == []  # diagnostics recorded before agreement and noise


def test_each_pattern_is_named():
    assert kinds(2.6, {1: 1.1, 2: 2.4}, 1.1, HEALTHY) == ["collapses without one layer"]
    assert kinds(2.6, ABLATED, 1.7, HEALTHY) == ["hardly changed under noise"]
    late = {**HEALTHY, "offset +1": [70, 100]}
    found = findings(2.6, ABLATED, 1.1, late)
    assert [f["kind"] for f in found] == ["labels one position off"] and "one position later" in found[0]["message"]
    assert "one position earlier" in findings(2.6, ABLATED, 1.1, {**HEALTHY, "offset -1": [70, 100]})[0]["message"]
    neither = {**HEALTHY, "context": [20, 100], "references": [30, 100]}
    assert kinds(2.6, ABLATED, 1.1, neither) == ["agrees with the target on neither"]
    # a drafter at tau 1 still gets the agreement finding (nothing else: it has no gain to lose)
    assert kinds(1.0, {1: 1.0, 2: 1.0}, 1.0, neither) == ["agrees with the target on neither"]


def test_near_zero_neighbours_are_no_label_offset():
    """A drafter that matches nothing anywhere (tau 1) has no offset to speak of: noise between 0.5% and 0.8%."""
    broken = {**HEALTHY, "offset -1": [8, 1000], "offset 0": [5, 1000], "offset +1": [5, 1000]}
    assert "labels one position off" not in kinds(2.6, ABLATED, 1.1, broken)
