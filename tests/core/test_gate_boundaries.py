"""Every gate at, just below and just above its threshold, and the ties of the ordering B0 < B1 < OURS <= B3.

One hand-built group (one model, B=8, c=1) whose rows pass every gate; each test moves one input onto a
threshold and one ulp either side of it (``math.nextafter``). Thresholds and values are chosen so that the mean
over repeats is exact in binary floating point, so "at the threshold" really is equality.
"""

from __future__ import annotations

import math

import pytest

from pd_dflash.costmodel import evaluate_hide_inequality
from pd_dflash.report.aggregate import build_matrix
from pd_dflash.report.gates import Expectations, evaluate, overall
from pd_dflash.spec import Gates
from tests.core.helpers import HIDE, KEY, TOKENS, gate_spec, rows_of


def below(x: float) -> float:
    return math.nextafter(x, -math.inf)


def above(x: float) -> float:
    return math.nextafter(x, math.inf)


def verdict(gates: Gates | None = None, repeats: int = 1, **by_baseline: dict):
    """The group's gate verdicts; ``by_baseline`` maps a baseline to the fields its rows change."""
    s = gate_spec(repeats)
    matrix = build_matrix(rows_of(s, **by_baseline))
    details = evaluate(matrix, gates or Gates(), Expectations.infer(matrix, s))
    return details[KEY]["gates"], overall(details)


def status(gates: dict, name: str) -> str:
    return gates[name]["status"]


def test_the_baseline_group_passes_every_gate():
    gates, summary = verdict()
    assert {name: g["status"] for name, g in gates.items()} == dict.fromkeys(gates, "pass")
    assert summary["verdict"] == "GO"


# -- coverage: OURS mean coverage >= min_coverage ----------------------------------------------------------


@pytest.mark.parametrize(
    ("coverage", "expected"), [(0.8, "pass"), (below(0.8), "fail"), (above(0.8), "pass")]
)
def test_coverage_at_just_below_and_just_above_the_minimum(coverage, expected):
    gates, summary = verdict(OURS={"route_ahead_prefetch_coverage": coverage})
    assert status(gates, "coverage") == expected
    assert gates["coverage"]["value"] == coverage
    assert summary["verdict"] == ("GO" if expected == "pass" else "NO-GO")


def test_coverage_gate_uses_the_mean_over_repeats_not_a_single_repeat():
    values = [0.5, 0.75, 1.0]  # mean exactly 0.75; one repeat below the minimum, one above
    on = {"route_ahead_prefetch_coverage": lambda r: values[r]}
    gates, _ = verdict(Gates(min_coverage=0.75), repeats=3, OURS=on)
    assert status(gates, "coverage") == "pass" and gates["coverage"]["value"] == 0.75
    assert gates["coverage"]["n"] == 3
    gates, _ = verdict(Gates(min_coverage=above(0.75)), repeats=3, OURS=on)
    assert status(gates, "coverage") == "fail"


def test_coverage_ignores_other_baselines():
    gates, _ = verdict(B1={"route_ahead_prefetch_coverage": 0.0}, B0={"route_ahead_prefetch_coverage": 0.0})
    assert status(gates, "coverage") == "pass" and gates["coverage"]["value"] == 0.875


# -- waste: OURS mean route_ahead.waste_ratio <= max_waste_ratio -------------------------------------------


def _waste(ratio) -> dict:
    def route_ahead(repeat):
        r = ratio(repeat) if callable(ratio) else ratio
        return {"predicted_experts": 100, "actual_experts": 80, "coverage": 0.875, "waste_ratio": r}

    return {"route_ahead": route_ahead}


@pytest.mark.parametrize(("ratio", "expected"), [(0.5, "pass"), (below(0.5), "pass"), (above(0.5), "fail")])
def test_waste_at_just_below_and_just_above_the_maximum(ratio, expected):
    gates, _ = verdict(OURS=_waste(ratio))
    assert status(gates, "waste") == expected and gates["waste"]["value"] == ratio


def test_waste_gate_uses_the_mean_over_repeats():
    values = [0.25, 0.5, 0.75]  # mean exactly 0.5; one repeat above the maximum
    gates, _ = verdict(repeats=3, OURS=_waste(lambda r: values[r]))
    assert status(gates, "waste") == "pass" and gates["waste"]["value"] == 0.5
    gates, _ = verdict(Gates(max_waste_ratio=below(0.5)), repeats=3, OURS=_waste(lambda r: values[r]))
    assert status(gates, "waste") == "fail"


# -- speedup: every configuration's tokens/s / B0's >= min_speedup_over_b0 --------------------------------


@pytest.mark.parametrize(
    ("b1", "expected"),
    [(25.0, "pass"), (below(25.0), "fail"), (above(25.0), "pass")],
    ids=["at", "below", "above"],
)
def test_speedup_at_just_below_and_just_above_the_minimum(b1, expected):
    # B0 20 tok/s and a minimum of 1.25x: B1 needs exactly 25 tok/s.
    gates, _ = verdict(Gates(min_speedup_over_b0=1.25), B1={"output_tokens_per_second": b1})
    assert status(gates, "speedup_over_b0") == expected
    assert gates["speedup_over_b0"]["per_baseline"]["B1"] == b1 / 20.0
    if expected == "fail":
        assert gates["speedup_over_b0"]["summary"] == "speedup over B0: B1 1.25x < 1.25x"


def test_speedup_equal_to_b0_meets_the_default_minimum():
    gates, _ = verdict(B3={"output_tokens_per_second": 20.0})
    assert (
        status(gates, "speedup_over_b0") == "pass" and gates["speedup_over_b0"]["per_baseline"]["B3"] == 1.0
    )
    gates, _ = verdict(B3={"output_tokens_per_second": below(20.0)})
    assert status(gates, "speedup_over_b0") == "fail"


def test_speedup_per_baseline_is_each_configurations_ratio_to_b0():
    gates, _ = verdict()
    assert gates["speedup_over_b0"]["per_baseline"] == {"B1": 1.5, "OURS": 2.25, "B3": 3.5}


# -- ordering: B0 < B1 < OURS <= B3 in mean tokens/s --------------------------------------------------------


@pytest.mark.parametrize(
    ("tokens", "expected", "broken"),
    [
        ({"B1": 20.0}, "fail", "B0 20 !< B1 20"),  # a tie B0 = B1 breaks the strict <
        ({"B1": above(20.0)}, "pass", None),
        ({"OURS": 30.0}, "fail", "B1 30 !< OURS 30"),  # a tie B1 = OURS breaks the strict <
        ({"OURS": above(30.0)}, "pass", None),
        ({"OURS": 70.0}, "pass", None),  # a tie OURS = B3 is allowed (<=)
        ({"OURS": above(70.0)}, "fail", "OURS 70 !<= B3 70"),
        ({"B3": below(45.0)}, "fail", "OURS 45 !<= B3 45"),
    ],
)
def test_ordering_ties_and_one_ulp_either_side(tokens, expected, broken):
    over = {b: {"output_tokens_per_second": v} for b, v in tokens.items()}
    gates, _ = verdict(**over)
    g = gates["ordering"]
    assert g["status"] == expected
    assert g["tokens_per_second"] == {**TOKENS, **tokens}
    if broken:
        assert g["summary"] == f"ordering: {broken}"


def test_ordering_uses_means_over_repeats():
    # B1's repeats straddle OURS's mean (45) but their mean is 40: the chain holds.
    values = [50.0, 30.0, 40.0]
    gates, _ = verdict(repeats=3, B1={"output_tokens_per_second": lambda r: values[r]})
    assert status(gates, "ordering") == "pass" and gates["ordering"]["tokens_per_second"]["B1"] == 40.0


# -- BM1: t_router < t_verify (strict) ----------------------------------------------------------------------


@pytest.mark.parametrize(("router", "expected"), [(1.0, "fail"), (below(1.0), "pass"), (above(1.0), "fail")])
def test_bm1_at_just_below_and_just_above_equality(router, expected):
    gates, _ = verdict(OURS={"t_router_seconds": router})
    assert status(gates, "bm1") == expected
    if expected == "fail":
        assert "OURS t_router/t_verify" in gates["bm1"]["summary"]


# -- hide inequality: fetch <= window (inclusive) ----------------------------------------------------------


@pytest.mark.parametrize(("nbytes", "expected"), [(8.0, "pass"), (below(8.0), "pass"), (above(8.0), "fail")])
def test_hide_inequality_at_just_below_and_just_above_equality(nbytes, expected):
    # window = 0.5 + 0.25 + 0.25 = 1.0 s; fetch = (1 - 0.5) * 1 * M / 4 B/s: equal at M = 8 B (powers of two:
    # one ulp of M is one ulp of the fetch time).
    terms = evaluate_hide_inequality(**{**HIDE, "overlap_seconds": 0.25, "total_expert_bytes": nbytes})
    assert terms.hide_window_seconds == 1.0 and terms.fetch_seconds == nbytes / 8
    gates, _ = verdict(OURS={"hide_inequality": terms})
    assert status(gates, "hide_inequality") == expected
    on_means = gates["hide_inequality"]["per_baseline"]["OURS"]["on_means"]
    assert on_means["hidden"] is (expected == "pass") and on_means["margin_seconds"] == 1.0 - nbytes / 8
