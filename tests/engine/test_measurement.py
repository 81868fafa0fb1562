"""The one measurement assembly (``pd_dflash/engine/measurement.py``): a hand-built trace in, the row out, every
answer worked out here by hand, independently of the code under test. Pure and fast: no engine, no torch.

The trace: two requests over a 2 s window (a: admitted 0, first token 0.25, finished 1.0, 4 tokens; b: admitted
0.5, first token 0.75, finished 1.0, 2 tokens), three verify rounds committing 3, 1, 4 tokens, round times 0.5,
0.25, 0.25 s (verify 0.25, 0.125, 0.125; draft 0.125 each; router 0.0625 each).
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from pd_dflash.engine.measurement import (
    NO_BANDWIDTH,
    CellTrace,
    ExpertCacheTrace,
    HideTerms,
    LinkFacts,
    PrefetchTrace,
    Rounds,
    engine_result,
    hide_inequality,
    measured_bandwidth,
)
from pd_dflash.engine.request_metrics import RequestTiming
from pd_dflash.schema import Status
from pd_dflash.spec import SLO
from pd_dflash.upstream import REQUIRED_METRICS

ROUNDS = Rounds(
    committed=[3, 1, 4],
    seconds=[0.5, 0.25, 0.25],
    verify_seconds=[0.25, 0.125, 0.125],
    draft_seconds=[0.125, 0.125, 0.125],
    router_seconds=[0.0625, 0.0625, 0.0625],
)
#: 8 accesses, 2 resident at round start; 4 of 16 experts needed per round; 16,000 B of experts; overlap 0.375 s.
HIDE = HideTerms(
    accesses=8,
    resident_at_round_start=2,
    needed_per_round=[4, 4, 4],
    num_experts=16,
    total_expert_bytes=16_000,
    overlap_seconds=0.375,
)


def cell_trace(**over) -> CellTrace:
    fields = dict(
        requests=[
            RequestTiming(admitted=0.0, first_token=0.25, finished=1.0, tokens=4),
            RequestTiming(admitted=0.5, first_token=0.75, finished=1.0, tokens=2),
        ],
        rounds=ROUNDS,
        timed_seconds=2.0,
        cache=ExpertCacheTrace(
            hit_rate=0.625,
            peak_occupancy_bytes=6000,
            h2d_bytes=8000,
            h2d_seconds=0.5,
            h2d_transfers=8,
            exposed_fetch_seconds=0.125,
        ),
        prefetch=PrefetchTrace(
            coverage=0.75, wasted_bytes=2000, in_time=(3, 8), route_ahead={"coverage": 0.75}
        ),
        kv_peak_bytes=12288,
        link=LinkFacts(kind="emulated", emulated_gbps=2.0, emulated_latency_us=5.0),
        hide=HIDE,
        engine={"name": "test"},
        telemetry={"start": {"gpu": 0}},
        timings={"timed": 2.0},
    )
    fields.update(over)
    return CellTrace(**fields)


def test_a_trace_becomes_a_row_with_every_metric_derived_once():
    r = engine_result(cell_trace(), SLO())
    assert r.status is Status.OK and r.warnings == [] and r.missing_metrics() == []
    assert r.output_tokens_per_second == 6 / 2.0 and r.goodput_at_slo == 6 / 2.0
    assert r.acceptance_length_a == 8 / 3
    assert r.acceptance_histogram == {1: 1, 3: 1, 4: 1} and list(r.acceptance_histogram) == [1, 3, 4]
    assert r.ttft_seconds == 0.25  # (0.25 + 0.25) / 2
    assert r.per_round_latency_seconds == 1.0 / 3
    assert (r.expert_cache_hit_rate, r.route_ahead_prefetch_coverage) == (0.625, 0.75)
    assert (r.wasted_prefetch_bytes, r.expert_occupancy_bytes, r.kv_occupancy_bytes) == (2000, 6000, 12288)
    assert r.prefetched_in_time_coverage == 3 / 8 and r.route_ahead == {"coverage": 0.75}
    assert (r.t_draft_seconds, r.t_router_seconds, r.t_verify_seconds) == (0.375, 0.1875, 0.5)
    assert set(r.latency) == {"ttft_seconds", "tpot_seconds", "e2e_seconds", "round_seconds", "verify_seconds",
                              "draft_seconds", "router_seconds"}  # fmt: skip
    assert r.latency["tpot_seconds"].mean == 0.25  # a: 0.75 / 3; b: 0.25 / 1
    assert (r.requests, r.generated_tokens, r.timed_seconds) == (2, 6, 2.0)
    assert r.engine["name"] == "test" and r.engine["draft_verify_rounds"] == 3
    assert r.engine["bm1"]["bm1_router_to_verify_ratio"] == 0.1875 / 0.5
    assert r.telemetry == {"start": {"gpu": 0}} and r.timings == {"timed": 2.0}


def test_cost_terms_carry_the_link_the_counters_and_the_bandwidth_of_the_cells_transfers():
    ct = engine_result(cell_trace(), SLO()).cost_terms
    assert (ct.route_ahead_coverage, ct.wasted_prefetch_bytes) == (0.75, 2000)
    assert (ct.measured_h2d_bytes_per_second, ct.h2d_bandwidth_source) == (8000 / 0.5, "transfers")
    assert (ct.h2d_link, ct.emulated_h2d_gbps, ct.emulated_latency_us) == ("emulated", 2.0, 5.0)
    assert (ct.h2d_bytes, ct.h2d_seconds, ct.h2d_transfers, ct.exposed_fetch_seconds) == (8000, 0.5, 8, 0.125)


def test_bandwidth_is_the_probe_else_the_transfers_else_none():
    probed = cell_trace(link=LinkFacts(kind="real", probe_bytes_per_second=5e10))
    assert measured_bandwidth(probed) == (5e10, "probe")
    assert measured_bandwidth(cell_trace()) == (16_000.0, "transfers")
    unmeasured = ExpertCacheTrace(hit_rate=0.5, peak_occupancy_bytes=0)  # no counters: MoE-Infinity on a CPU
    assert measured_bandwidth(cell_trace(cache=unmeasured)) == (None, None)
    timeless = replace(cell_trace().cache, h2d_seconds=0.0)
    assert measured_bandwidth(cell_trace(cache=timeless)) == (None, None)


def test_the_hide_inequality_per_round_from_the_traces_terms():
    # r = 2/8; s = 4/16; M = 16,000 B; BW = 16,000 B/s; per round: draft 0.125, router 0.0625, overlap 0.125.
    hide = engine_result(cell_trace(), SLO()).hide_inequality
    assert (hide.resident_fraction, hide.saturation, hide.total_expert_bytes) == (0.25, 0.25, 16_000)
    assert (hide.draft_seconds, hide.router_seconds, hide.overlap_seconds) == (0.125, 0.0625, 0.125)
    assert hide.fetch_seconds == pytest.approx(0.75 * 0.25 * 16_000 / 16_000)
    # No draft or router phase (AR): 0 s each; saturation capped at 1.
    ar = cell_trace(
        rounds=replace(ROUNDS, draft_seconds=None, router_seconds=None),
        hide=replace(HIDE, needed_per_round=[40]),
    )
    hide = hide_inequality(ar, 16_000.0)[0]
    assert (hide.draft_seconds, hide.router_seconds, hide.saturation) == (0.0, 0.0, 1.0)


def test_the_hide_inequality_is_absent_without_terms_or_accesses_and_says_so_without_a_bandwidth():
    assert engine_result(cell_trace(hide=None), SLO()).hide_inequality is None
    assert engine_result(cell_trace(hide=None), SLO()).warnings == []  # the engine observes no terms
    assert hide_inequality(cell_trace(hide=replace(HIDE, accesses=0)), 1.0) == (None, None)
    no_bandwidth = engine_result(
        cell_trace(cache=ExpertCacheTrace(hit_rate=0.5, peak_occupancy_bytes=0)), SLO()
    )
    assert no_bandwidth.hide_inequality is None and no_bandwidth.warnings == [NO_BANDWIDTH]
    assert no_bandwidth.status is Status.OK  # not a required metric


#: Each metric that can be unmeasured, the trace that leaves it so, and its value in the row.
ABSENT = {
    "acceptance_length_a": dict(rounds=replace(ROUNDS, committed=[])),
    "ttft_seconds": dict(requests=[RequestTiming(admitted=0.0, first_token=None, finished=None, tokens=0)]),
    "per_round_latency_seconds": dict(rounds=replace(ROUNDS, seconds=[])),
    "expert_cache_hit_rate": dict(cache=ExpertCacheTrace(hit_rate=None, peak_occupancy_bytes=6000)),
    "route_ahead_prefetch_coverage": dict(prefetch=PrefetchTrace(coverage=None, wasted_bytes=2000)),
    "wasted_prefetch_bytes": dict(prefetch=PrefetchTrace(coverage=0.75, wasted_bytes=None)),
    "expert_occupancy_bytes": dict(cache=ExpertCacheTrace(hit_rate=0.625, peak_occupancy_bytes=None)),
    "kv_occupancy_bytes": dict(kv_peak_bytes=None),
}


@pytest.mark.parametrize("metric", sorted(ABSENT))
def test_an_absent_metric_makes_the_row_partial_with_a_warning_naming_it_never_a_zero(metric):
    over = {**ABSENT[metric], "hide": None}
    r = engine_result(cell_trace(**over), SLO())
    assert r.status is Status.PARTIAL and getattr(r, metric) is None and r.missing_metrics() == [metric]
    assert r.warnings == [f"{metric} absent: not measured in this cell"]
    why = f"{metric} absent: the engine says why"
    assert engine_result(cell_trace(**over, absent={metric: why}), SLO()).warnings == [why]


def test_warnings_are_the_engines_notes_then_the_absent_metrics_in_upstream_order_then_the_hide_inequality():
    trace = cell_trace(
        cache=ExpertCacheTrace(hit_rate=None, peak_occupancy_bytes=None),
        rounds=replace(ROUNDS, committed=[]),
        warnings=["load note"],
        absent={"expert_occupancy_bytes": "expert_occupancy_bytes absent: no accessor"},
    )
    r = engine_result(trace, SLO())
    assert r.warnings == [
        "load note",
        "acceptance_length_a absent: not measured in this cell",
        "expert_cache_hit_rate absent: not measured in this cell",
        "expert_occupancy_bytes absent: no accessor",
        NO_BANDWIDTH,
    ]
    assert [k for k in REQUIRED_METRICS if getattr(r, k) is None] == [
        "acceptance_length_a",
        "expert_cache_hit_rate",
        "expert_occupancy_bytes",
    ]
    assert r.acceptance_histogram is None and r.engine["draft_verify_rounds"] == 0


def test_a_reason_for_a_measured_metric_is_the_converters_mistake():
    with pytest.raises(ValueError, match="kv_occupancy_bytes"):
        engine_result(cell_trace(absent={"kv_occupancy_bytes": "kv_occupancy_bytes absent: ?"}), SLO())


def test_an_unobserved_autoregressive_loop_has_tau_one_and_no_histogram():
    ar = Rounds(committed=None, seconds=[0.25, 0.25], verify_seconds=[0.25, 0.25])
    r = engine_result(cell_trace(rounds=ar, hide=None), SLO())
    assert r.acceptance_length_a == 1.0 and r.acceptance_histogram is None and r.status is Status.OK
    assert (r.t_draft_seconds, r.t_router_seconds) == (None, None)
    assert "bm1" not in r.engine and "draft_verify_rounds" not in r.engine  # no router timed: no BM1
    assert set(r.latency) == {
        "ttft_seconds",
        "tpot_seconds",
        "e2e_seconds",
        "round_seconds",
        "verify_seconds",
    }


def test_rounds_without_timestamps_in_a_sequential_loop_take_the_window_over_their_number():
    untimed = Rounds(committed=[4, 4, 4, 2], untimed=4, draft_seconds=[])
    r = engine_result(cell_trace(rounds=untimed, hide=None), SLO())
    assert r.per_round_latency_seconds == 2.0 / 4 and r.acceptance_length_a == 14 / 4
    assert r.t_draft_seconds is None and r.t_verify_seconds is None  # empty: no sample, no zero
    assert "round_seconds" not in r.latency and "draft_seconds" not in r.latency


def test_goodput_counts_the_requests_that_meet_every_slo_over_the_window():
    # TTFT 0.25 s each; TPOT a 0.25 s, b 0.25 s: a TTFT SLO of 200 ms keeps none, a TPOT SLO of 300 ms keeps both.
    assert engine_result(cell_trace(), SLO(ttft_ms=200)).goodput_at_slo == 0.0
    assert engine_result(cell_trace(), SLO(tpot_ms=300)).goodput_at_slo == 3.0
    slow = [RequestTiming(0.0, 0.25, 1.0, 4), RequestTiming(0.5, 1.5, 1.75, 2)]  # b's TTFT 1 s
    assert engine_result(cell_trace(requests=slow), SLO(ttft_ms=500)).goodput_at_slo == 4 / 2.0


def test_a_zero_timed_window_leaves_the_rates_absent_and_says_so_never_invents_one():
    r = engine_result(cell_trace(timed_seconds=0.0, hide=None), SLO())
    assert r.output_tokens_per_second is None and r.goodput_at_slo is None and r.timed_seconds == 0.0
    assert r.status == Status.PARTIAL
    for metric in ("output_tokens_per_second", "goodput_at_slo"):
        assert f"{metric} absent: the timed window measured 0.0 s (nothing to divide by)" in r.warnings
    untimed = engine_result(
        cell_trace(timed_seconds=0.0, hide=None, rounds=Rounds(committed=[2, 3], untimed=2)), SLO()
    )
    assert untimed.per_round_latency_seconds is None
