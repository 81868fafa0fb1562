"""The cost model's arithmetic and input checks (pd_dflash/costmodel.py, report/bm1.py), by hand."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from pd_dflash.costmodel import bm1_summary, evaluate_hide_inequality
from pd_dflash.report.bm1 import bm1_summary as row_bm1
from tests.helpers import exactly

TERMS = dict(
    resident_fraction=0.25,
    saturation=0.5,
    total_expert_bytes=64,
    measured_h2d_bytes_per_second=8.0,
    draft_seconds=0.5,
    router_seconds=0.25,
    overlap_seconds=1.0,
)


def test_hide_inequality_by_hand():
    h = evaluate_hide_inequality(**TERMS)
    # fetch = (1 - 0.25) * 0.5 * 64 / 8 = 3.0; window = 0.5 + 0.25 + 1.0 = 1.75
    assert h.fetch_seconds == 3.0 and h.hide_window_seconds == 1.75 and h.margin_seconds == -1.25
    assert h.hidden is False
    assert (h.resident_fraction, h.saturation, h.measured_h2d_bytes_per_second) == (0.25, 0.5, 8.0)
    assert (h.draft_seconds, h.router_seconds, h.overlap_seconds) == (0.5, 0.25, 1.0)
    assert h.total_expert_bytes == 64 and isinstance(h.total_expert_bytes, int)  # bytes stay whole
    assert isinstance(
        evaluate_hide_inequality(**{**TERMS, "total_expert_bytes": 64.0}).total_expert_bytes, float
    )
    everything_resident = evaluate_hide_inequality(**{**TERMS, "resident_fraction": 1.0})
    assert everything_resident.fetch_seconds == 0.0 and everything_resident.hidden is True
    # The bounds are inclusive: r = 0, s = 1, and zero-length windows are valid inputs.
    edge = evaluate_hide_inequality(**{**TERMS, "resident_fraction": 0, "saturation": 1, "draft_seconds": 0})
    assert edge.fetch_seconds == 8.0 and edge.hide_window_seconds == 1.25


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("resident_fraction", 1.5, "resident_fraction must be <= 1.0, got 1.5"),
        ("resident_fraction", -0.25, "resident_fraction must be >= 0.0, got -0.25"),
        ("saturation", 1.0000001, "saturation must be <= 1.0, got 1.0000001"),
        ("total_expert_bytes", -1, "total_expert_bytes must be >= 0.0, got -1"),
        ("total_expert_bytes", 2**63, "total_expert_bytes must be at most 2**63 - 1, got 9223372036854775808"),
        ("total_expert_bytes", -(2**63) - 1, "total_expert_bytes must be at most 2**63 - 1, got -9223372036854775809"),
        ("measured_h2d_bytes_per_second", 0.0, "measured_h2d_bytes_per_second must be > 0.0, got 0.0"),
        ("measured_h2d_bytes_per_second", float("inf"), "measured_h2d_bytes_per_second must be a finite number, got inf"),
        ("draft_seconds", float("nan"), "draft_seconds must be a finite number, got nan"),
        ("router_seconds", True, "router_seconds must be a finite number, got True"),
        ("overlap_seconds", "1", "overlap_seconds must be a finite number, got '1'"),
        ("overlap_seconds", -1e-9, "overlap_seconds must be >= 0.0, got -1e-09"),
    ],
)  # fmt: skip
def test_every_term_is_checked_and_named(name, value, message):
    with pytest.raises(ValueError, match=exactly(message)):
        evaluate_hide_inequality(**{**TERMS, name: value})


def test_the_largest_whole_byte_count_is_accepted():
    assert (
        evaluate_hide_inequality(**{**TERMS, "total_expert_bytes": 2**63 - 1}).total_expert_bytes == 2**63 - 1
    )


def test_bm1_is_a_strict_ratio_below_one():
    assert bm1_summary(0.25, 1.0) == {
        "t_router_seconds": 0.25,
        "t_verify_seconds": 1.0,
        "bm1_router_to_verify_ratio": 0.25,
        "bm1_pass": True,
    }
    equal = bm1_summary(2, 2)
    assert equal["bm1_pass"] is False and equal["bm1_router_to_verify_ratio"] == 1.0
    assert isinstance(equal["t_router_seconds"], float) and bm1_summary(0, 1)["bm1_pass"] is True
    with pytest.raises(ValueError, match=exactly("t_verify_seconds must be > 0.0, got 0")):
        bm1_summary(0.0, 0)
    with pytest.raises(ValueError, match=exactly("t_router_seconds must be >= 0.0, got -1.0")):
        bm1_summary(-1.0, 1.0)


class Terms(BaseModel):
    t_router_seconds: float | None = None
    t_verify_seconds: float | None = None


def test_bm1_of_a_row_needs_both_terms():
    assert row_bm1({"t_router_seconds": 1.0, "t_verify_seconds": 4.0})["bm1_router_to_verify_ratio"] == 0.25
    model = Terms(t_router_seconds=3.0, t_verify_seconds=2.0)  # a pydantic row: its set fields
    assert row_bm1(model)["bm1_pass"] is False and row_bm1(model)["bm1_router_to_verify_ratio"] == 1.5
    with pytest.raises(ValueError, match=exactly("row missing BM1 term: t_router_seconds")):
        row_bm1(Terms(t_verify_seconds=2.0))
    with pytest.raises(ValueError, match=exactly("row missing BM1 term: t_router_seconds")):
        row_bm1({"t_verify_seconds": 4.0})
    with pytest.raises(ValueError, match=exactly("row missing BM1 term: t_verify_seconds")):
        row_bm1({"t_router_seconds": 1.0, "t_verify_seconds": None})
