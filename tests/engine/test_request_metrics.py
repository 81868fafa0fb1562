"""Request metrics shared by every engine (``pd_dflash/engine/request_metrics.py``), on hand-computed timings.

Four requests over a 4 s timed window (times in s, exact in binary):

| request | admitted | first token | finished | tokens | TTFT  | e2e   | TPOT = (e2e − TTFT)/(tokens − 1) |
|---------|----------|-------------|----------|--------|-------|-------|----------------------------------|
| A       | 0        | 0.25        | 1.25     | 5      | 0.25  | 1.25  | 1.0/4 = 0.25                     |
| B       | 0        | 0.5         | 2.5      | 5      | 0.5   | 2.5   | 2.0/4 = 0.5                      |
| C       | 1        | 1.125       | 1.125    | 1      | 0.125 | 0.125 | none (one token)                 |
| D       | 1        | 1.75        | 3.75     | 9      | 0.75  | 2.75  | 2.0/8 = 0.25                     |
"""

from __future__ import annotations

import pytest

from pd_dflash.engine.request_metrics import (
    RequestTiming,
    goodput,
    latency_samples,
    latency_stats,
    meets_slo,
)
from pd_dflash.spec import SLO

A = RequestTiming(admitted=0.0, first_token=0.25, finished=1.25, tokens=5)
B = RequestTiming(admitted=0.0, first_token=0.5, finished=2.5, tokens=5)
C = RequestTiming(admitted=1.0, first_token=1.125, finished=1.125, tokens=1)
D = RequestTiming(admitted=1.0, first_token=1.75, finished=3.75, tokens=9)
TIMINGS = [A, B, C, D]
WINDOW = 4.0


def test_per_request_ttft_e2e_and_tpot():
    assert [t.ttft for t in TIMINGS] == [0.25, 0.5, 0.125, 0.75]
    assert [t.e2e for t in TIMINGS] == [1.25, 2.5, 0.125, 2.75]
    assert [t.tpot for t in TIMINGS] == [0.25, 0.5, None, 0.25]


def test_goodput_counts_only_the_requests_meeting_every_slo():
    # TTFT ≤ 300 ms and TPOT ≤ 300 ms: A meets both, C meets TTFT and has no TPOT, B and D miss TTFT.
    slo = SLO(ttft_ms=300, tpot_ms=300)
    assert [meets_slo(t, slo) for t in TIMINGS] == [True, False, True, False]
    assert goodput(TIMINGS, slo, WINDOW) == pytest.approx((5 + 1) / WINDOW)  # 1.5 tokens/s
    assert goodput(TIMINGS, SLO(), WINDOW) == pytest.approx(20 / WINDOW)  # no SLO: every token


def test_a_one_token_request_has_no_tpot_and_passes_a_tpot_slo():
    slo = SLO(tpot_ms=300)  # B's 500 ms TPOT misses it; C has no inter-token time
    assert [meets_slo(t, slo) for t in TIMINGS] == [True, False, True, True]
    assert goodput(TIMINGS, slo, WINDOW) == pytest.approx((5 + 1 + 9) / WINDOW)
    assert latency_samples(TIMINGS)["tpot_seconds"] == [0.25, 0.5, 0.25]  # C left out


def test_a_request_without_a_first_token_fails_a_ttft_slo():
    pending = RequestTiming(admitted=0.0, first_token=None, finished=None, tokens=0)
    assert pending.ttft is None and pending.tpot is None
    assert not meets_slo(pending, SLO(ttft_ms=1e9))
    assert latency_samples([pending]) == {"ttft_seconds": [], "tpot_seconds": [], "e2e_seconds": []}


def test_ttft_and_tpot_percentiles():
    stats = latency_stats(latency_samples(TIMINGS))
    ttft, tpot, e2e = stats["ttft_seconds"], stats["tpot_seconds"], stats["e2e_seconds"]
    # TTFT sorted [0.125, 0.25, 0.5, 0.75], linear interpolation at (n − 1)·q.
    assert ttft.n == 4 and ttft.max == 0.75
    assert ttft.mean == pytest.approx(1.625 / 4)
    assert ttft.p50 == pytest.approx(0.375)  # between 0.25 and 0.5
    assert ttft.p90 == pytest.approx(0.675)  # 0.5 + 0.7 × 0.25
    assert ttft.p99 == pytest.approx(0.7425)  # 0.5 + 0.97 × 0.25
    # TPOT sorted [0.25, 0.25, 0.5]: three samples, not four.
    assert tpot.n == 3 and tpot.max == 0.5
    assert tpot.mean == pytest.approx(1.0 / 3)
    assert tpot.p50 == pytest.approx(0.25)
    assert tpot.p90 == pytest.approx(0.45)  # 0.25 + 0.8 × 0.25
    assert tpot.p99 == pytest.approx(0.495)  # 0.25 + 0.98 × 0.25
    assert e2e.n == 4 and e2e.p50 == pytest.approx((1.25 + 2.5) / 2)


def test_an_empty_sample_list_is_left_out_not_zero():
    assert latency_stats({"tpot_seconds": []}) == {}


def test_goodput_needs_a_positive_window():
    with pytest.raises(ValueError, match="positive timed window"):
        goodput(TIMINGS, SLO(), 0.0)


def test_a_tpot_exactly_at_the_slo_meets_it_and_the_slo_is_in_milliseconds():
    # A and D: TPOT 0.25 s = 250 ms exactly; B: 500 ms; C has none.
    assert [meets_slo(t, SLO(tpot_ms=250)) for t in TIMINGS] == [True, False, True, True]
    assert [meets_slo(t, SLO(tpot_ms=250.1)) for t in TIMINGS] == [True, False, True, True]
    assert [meets_slo(t, SLO(tpot_ms=249.9)) for t in TIMINGS] == [False, False, True, False]
