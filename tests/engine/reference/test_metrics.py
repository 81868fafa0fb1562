"""The reference engine's rows on a hand-built cell measurement whose answers are worked out here,
independently of the code under test: ``pd_dflash/engine/reference/trace.py`` turns the measurement into a
``CellTrace`` and ``pd_dflash/engine/measurement.py`` derives the row from it.

The cell: two requests, four rounds (the first a prefill of both), an expert store of 16 experts of 1,000 B,
an LRU cache of 8 slots, and a route-ahead prefetcher whose statistics come from hand-built masks.

| round | seconds | forward | draft | router | requests | tokens | committed (prefill?)      | KV bytes |
|-------|---------|---------|-------|--------|----------|--------|--------------------------|----------|
| 0     | 0.5     | 0.25    | 0     | 0      | 2        | 16     | 1 (yes), 1 (yes)          | 4096     |
| 1     | 0.25    | 0.125   | 0.0625| 0.03125| 2        | 8      | 3, 4                      | 12288    |
| 2     | 0.25    | 0.125   | 0.0625| 0.03125| 2        | 8      | 2, 4                      | 8192     |
| 3     | 0.125   | 0.0625  | 0.0625| 0.03125| 1        | 4      | 1                         | 2048     |

Requests (timed window 2.0 s): a admitted 0, first token 0.5, finished 1.0, 8 tokens; b admitted 0, first token
0.5, finished 1.5, 5 tokens.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import pytest

from pd_dflash.engine.measurement import (
    CellTrace,
    cost_terms,
    engine_result,
    hide_inequality,
    in_time_coverage,
    measured_bandwidth,
    phase_seconds,
    round_samples,
)
from pd_dflash.engine.reference import trace as metrics
from pd_dflash.engine.reference.decoding.loop import RoundRecord
from pd_dflash.engine.reference.offload.cache import CacheCounters
from pd_dflash.engine.reference.trace import CellMeasurement, LinkFacts
from pd_dflash.engine.request_metrics import RequestTiming
from pd_dflash.engine.route_ahead import RouteAheadStats
from pd_dflash.schema import Status
from pd_dflash.spec import SLO
from pd_dflash.upstream import REQUIRED_METRICS

NBYTES = 1000
T, F = True, False


def rounds() -> list[RoundRecord]:
    def rec(seconds, forward, draft, router, requests, tokens, committed, prefill, kv):
        return RoundRecord(
            start=0.0,
            seconds=seconds,
            forward_seconds=forward,
            requests=requests,
            tokens=tokens,
            committed=committed,
            kv_bytes=kv,
            kv_allocated_bytes=16384,
            prefill=prefill,
            draft_seconds=draft,
            router_seconds=router,
            issue_seconds=0.0078125,
            idle_steps=1,
        )

    return [
        rec(0.5, 0.25, 0.0, 0.0, 2, 16, [1, 1], [T, T], 4096),
        rec(0.25, 0.125, 0.0625, 0.03125, 2, 8, [3, 4], [F, F], 12288),
        rec(0.25, 0.125, 0.0625, 0.03125, 2, 8, [2, 4], [F, F], 8192),
        rec(0.125, 0.0625, 0.0625, 0.03125, 1, 4, [1], [F], 2048),
    ]


def requests() -> list:
    timings = [
        RequestTiming(admitted=0.0, first_token=0.5, finished=1.0, tokens=8),
        RequestTiming(admitted=0.0, first_token=0.5, finished=1.5, tokens=5),
    ]
    return [SimpleNamespace(timing=t, output=[1, 2, 3]) for t in timings]


def route_stats(nbytes: bool = True) -> RouteAheadStats:
    """One verify step over one layer: P = {0, 1, 3, 4}, A = {0, 1, 2, 3, 5}, U_keep (2 rows) = {0, 1, 2}:
    covered 3 of 5 actual; wasted P \\ U_keep = {3, 4}: 4 mispredicted (nobody routed it), 3 routed by a rejected row."""
    stats = RouteAheadStats()
    stats.begin_step()
    mask = [[T, T, F, F, F, F], [F, T, T, F, F, F], [F, F, F, T, F, T]]
    stats.observe_layer(0, [0, 1, 3, 4], mask, dict.fromkeys(range(6), NBYTES) if nbytes else None)
    stats.commit_step(2)
    return stats


#: The cache's slot pool as the facts read it (``offload/slot_pool.py``).
SLOTS = SimpleNamespace(
    expert_compute="grouped_mm",
    expert_compute_facts={"path": "grouped_mm", "why": "test", "capability": None, "probe": None},
    direct=True,
    device_slot_nbytes=NBYTES,
)


def cache(**over) -> SimpleNamespace:
    """The expert cache as the converter reads it: counters, geometry and slot pool (``over`` replaces any)."""
    fields = dict(
        counters=CacheCounters(),
        resident=False,
        capacity_bytes=8 * NBYTES,
        num_slots=8,
        policy="lru",
        slots=SLOTS,
        transfer_log=[],
        stall_log=[],
    )
    fields.update(over)
    return SimpleNamespace(**fields)


def runtime(**over) -> SimpleNamespace:
    counters = CacheCounters(
        accesses=8,
        hits=3,
        inflight_hits=2,
        misses=3,
        resident_at_round_start=2,
        prefetch_transfers=4,
        h2d_bytes=7 * NBYTES,
        h2d_seconds=0.5,
        h2d_transfers=7,
        exposed_seconds=0.25,
        peak_occupancy_bytes=6 * NBYTES,
    )
    rt = dict(
        cache=cache(counters=counters),
        stats=route_stats(),
        prefetcher=SimpleNamespace(issue=True, counters={"issued": 4}),
        store=SimpleNamespace(num_entries=16, total_bytes=16 * NBYTES, expert_nbytes=NBYTES),
        needed_per_round=[4, 8, 6, 6],
        occupancy_per_round=[2000, 6000, 5000, 5000],
        per_layer={0: (4, 5, 3), 1: (2, 0, 0)},
        # Of the 8 experts the verify routed (committed rounds), 6 were prefetched and ready when acquired.
        in_time=(6, 8),
    )
    rt.update(over)
    return SimpleNamespace(**rt)


def measurement(speculative: bool = True, link: str | LinkFacts = "none", **over) -> CellMeasurement:
    fields = dict(
        requests=requests(),
        rounds=rounds(),
        timed_seconds=2.0,
        runtime=runtime(),
        link=link if isinstance(link, LinkFacts) else LinkFacts(kind=link),
        engine={"name": "reference"},
        speculative=speculative,
    )
    fields.update(over)
    return CellMeasurement(**fields)


# -- τ: committed tokens per verify round, prefills excluded when speculative -----------------------------------


def test_tau_leaves_out_the_prefill_blocks_of_a_speculative_cell():
    m = measurement()
    assert metrics.verify_commits(m) == [3, 4, 2, 4, 1]  # the two prefill blocks are not verify rounds
    values, _ = headline(m)
    assert values["acceptance_length_a"] == 14 / 5


def test_tau_of_an_autoregressive_cell_counts_every_round():
    m = measurement(speculative=False)
    assert metrics.verify_commits(m) == [1, 1, 3, 4, 2, 4, 1]
    assert headline(m)[0]["acceptance_length_a"] == 16 / 7


def test_tau_is_absent_with_prefills_only():
    only_prefill = [r for r in rounds() if all(r.prefill)]
    values, warnings = headline(measurement(rounds=only_prefill))
    assert values["acceptance_length_a"] is None
    assert "acceptance_length_a not measured: no verify round in the timed loop (prefills only)" in warnings


def trace(m: CellMeasurement) -> CellTrace:
    return metrics.cell_trace(m)


def row(m: CellMeasurement, slo: SLO | None = None):
    return engine_result(trace(m), slo or SLO())


def headline(m: CellMeasurement, slo: SLO | None = None):
    """The row's ten metrics (as the row holds them) and its warnings."""
    result = row(m, slo)
    return {k: getattr(result, k) for k in REQUIRED_METRICS}, result.warnings


# -- the other headline metrics ---------------------------------------------------------------------------------


def test_throughput_ttft_round_latency_and_goodput():
    values, _ = headline(measurement())
    assert values["output_tokens_per_second"] == 13 / 2.0
    assert values["ttft_seconds"] == 0.5
    assert values["per_round_latency_seconds"] == (0.5 + 0.25 + 0.25 + 0.125) / 4
    assert values["goodput_at_slo"] == 13 / 2.0  # no SLO: every token
    # TPOT a = 0.5 / 7 s = 71 ms, b = 1.0 / 4 s = 250 ms: an SLO of 100 ms keeps a's 8 tokens only.
    assert headline(measurement(), SLO(tpot_ms=100))[0]["goodput_at_slo"] == 8 / 2.0


def test_hit_rate_counts_only_experts_ready_when_compute_needed_them():
    # 3 ready hits and 2 hits on a transfer still in flight out of 8 accesses: the hit rate is 3/8, not 5/8.
    values, _ = headline(measurement())
    assert values["expert_cache_hit_rate"] == 3 / 8
    facts = metrics.expert_cache_facts(runtime(), 2.0, 13)
    assert facts["in_cache_rate"] == 5 / 8 and facts["hits"] == 3 and facts["inflight_hits"] == 2


def test_hit_rate_without_any_access_is_absent_with_a_warning():
    rt = runtime(cache=cache(counters=CacheCounters(), resident=False))
    values, warnings = headline(measurement(runtime=rt))
    assert values["expert_cache_hit_rate"] is None
    assert "expert_cache_hit_rate not measured: no expert was accessed in the timed loop" in warnings


def test_expert_and_kv_occupancy_are_peaks_not_the_last_round():
    values, _ = headline(measurement())
    assert values["kv_occupancy_bytes"] == 12288  # round 1, not the last round's 2048
    assert values["expert_occupancy_bytes"] == 6000  # the counters' peak
    # byte counts are whole numbers and stay ints (a float here reaches the row file and the matrix)
    assert all(type(values[m]) is int for m in ("kv_occupancy_bytes", "expert_occupancy_bytes"))


def test_the_kv_arena_reports_entries_in_use_and_its_allocation_apart():
    facts = metrics.kv_cache_facts(rounds())
    assert facts["in_use_bytes_peak"] == 12288 and facts["allocated_bytes_peak"] == 16384


def test_coverage_and_waste_from_the_route_ahead_statistics():
    values, warnings = headline(measurement())
    assert values["route_ahead_prefetch_coverage"] == 3 / 5
    assert values["wasted_prefetch_bytes"] == 2 * NBYTES  # {3, 4}: predicted, routed by no kept row
    assert type(values["wasted_prefetch_bytes"]) is int
    assert warnings == []


def test_prefetched_in_time_coverage_counts_only_experts_ready_at_the_verify():
    def in_time(rt) -> float | None:
        return in_time_coverage(trace(measurement(runtime=rt)).prefetch)

    assert in_time(runtime()) == 6 / 8
    assert in_time(runtime(prefetcher=None)) is None
    assert in_time(runtime(in_time=(0, 0))) is None  # nothing routed: no ratio
    assert in_time(runtime(in_time=(0, 5))) == 0.0


def test_coverage_without_a_prefetcher_or_with_nothing_routed_is_absent():
    assert metrics.prefetch_coverage(runtime(prefetcher=None)) == (
        None,
        "route_ahead_prefetch_coverage not measured: this configuration has no prefetcher",
    )
    value, why = metrics.prefetch_coverage(runtime(stats=RouteAheadStats()))
    assert value is None and "coverage would be vacuous" in why


def test_waste_is_a_measured_zero_only_when_no_prefetch_was_issued():
    sizeless = route_stats(nbytes=False)
    issued = runtime(stats=sizeless)
    assert metrics.wasted_prefetch_bytes(issued) == (
        None,
        "wasted_prefetch_bytes not measured: prefetches were issued without byte accounting",
    )
    none_issued = CacheCounters(prefetch_transfers=0)
    cache = SimpleNamespace(counters=none_issued, resident=False)
    assert metrics.wasted_prefetch_bytes(runtime(stats=sizeless, cache=cache, prefetcher=None)) == (0, None)
    idle = SimpleNamespace(issue=False)
    assert metrics.wasted_prefetch_bytes(runtime(stats=sizeless, cache=cache, prefetcher=idle)) == (0, None)
    resident = SimpleNamespace(counters=none_issued, resident=True)
    assert metrics.wasted_prefetch_bytes(runtime(stats=sizeless, cache=resident)) == (0, None)
    assert type(metrics.wasted_prefetch_bytes(runtime(stats=sizeless, cache=resident))[0]) is int
    busy = SimpleNamespace(counters=none_issued, resident=False)
    assert metrics.wasted_prefetch_bytes(runtime(stats=sizeless, cache=busy))[0] is None


# -- bandwidth, cost terms, hide inequality --------------------------------------------------------------------


def test_bandwidth_is_the_probe_else_this_cells_transfers_never_a_datasheet():
    assert measured_bandwidth(trace(measurement())) == (7 * NBYTES / 0.5, "transfers")
    probed = measurement(link=LinkFacts(kind="real", probe_bytes_per_second=5e10))
    assert measured_bandwidth(trace(probed)) == (5e10, "probe")
    idle = runtime(cache=cache(counters=CacheCounters(h2d_bytes=0, h2d_seconds=0.0)))
    assert measured_bandwidth(trace(measurement(runtime=idle))) == (None, None)
    timeless = runtime(cache=cache(counters=CacheCounters(h2d_bytes=10, h2d_seconds=0.0)))
    assert measured_bandwidth(trace(measurement(runtime=timeless))) == (None, None)


def test_hide_inequality_terms_per_round():
    # r = resident at round start / accesses = 2/8; s = mean needed (24/4 = 6) / 16 entries; M = 16,000 B;
    # BW = 14,000 B/s; draft = 0.1875 / 4; router = 0.09375 / 4; overlap 0 (no link).
    hide, warning = hide_inequality(trace(measurement()), 14_000.0)
    assert warning is None
    assert hide.resident_fraction == 0.25 and hide.saturation == 6 / 16
    assert hide.total_expert_bytes == 16_000 and hide.measured_h2d_bytes_per_second == 14_000
    assert hide.draft_seconds == 0.1875 / 4 and hide.router_seconds == 0.09375 / 4
    assert hide.overlap_seconds == 0.0
    assert hide.fetch_seconds == pytest.approx(0.75 * (6 / 16) * 16_000 / 14_000)
    t = trace(measurement())
    overlapped = replace(t, hide=replace(t.hide, overlap_seconds=0.5))
    assert hide_inequality(overlapped, 14_000.0)[0].overlap_seconds == 0.5 / 4


def test_hide_inequality_saturation_is_capped_at_one_and_needs_a_bandwidth():
    over = runtime(needed_per_round=[40, 40])
    assert hide_inequality(trace(measurement(runtime=over)), 1.0)[0].saturation == 1.0
    hide, warning = hide_inequality(trace(measurement()), None)
    assert hide is None and warning.startswith(
        "hide_inequality not evaluated: no measured host-to-device bandwidth"
    )
    no_access = runtime(cache=cache(counters=CacheCounters()))
    assert hide_inequality(trace(measurement(runtime=no_access)), 1.0) == (None, None)


def test_cost_terms_carry_the_link_and_the_counters():
    m = measurement(link=LinkFacts(kind="emulated", emulated_gbps=2.0, emulated_latency_us=5.0))
    terms = cost_terms(trace(m), 14_000.0, "transfers")
    assert terms.route_ahead_coverage == 3 / 5 and terms.wasted_prefetch_bytes == 2 * NBYTES
    assert terms.measured_h2d_bytes_per_second == 14_000.0 and terms.h2d_bandwidth_source == "transfers"
    assert (terms.h2d_link, terms.emulated_h2d_gbps, terms.emulated_latency_us) == ("emulated", 2.0, 5.0)
    assert (terms.h2d_bytes, terms.h2d_seconds, terms.h2d_transfers) == (7000, 0.5, 7)
    assert terms.exposed_fetch_seconds == 0.25


# -- phases and distributions ------------------------------------------------------------------------------------


def test_phase_sums_and_round_samples():
    spec = phase_seconds(trace(measurement()).rounds)
    assert spec == {"t_draft_seconds": 0.1875, "t_router_seconds": 0.09375, "t_verify_seconds": 0.5625}
    ar = phase_seconds(trace(measurement(speculative=False)).rounds)
    assert ar == {"t_draft_seconds": None, "t_router_seconds": None, "t_verify_seconds": 0.5625}
    samples = round_samples(trace(measurement()).rounds)
    assert samples["round_seconds"] == [0.5, 0.25, 0.25, 0.125]
    assert samples["verify_seconds"] == [0.25, 0.125, 0.125, 0.0625]
    assert samples["draft_seconds"] == [0.0, 0.0625, 0.0625, 0.0625]
    assert samples["router_seconds"] == [0.0, 0.03125, 0.03125, 0.03125]
    assert set(round_samples(trace(measurement(speculative=False)).rounds)) == {
        "round_seconds",
        "verify_seconds",
    }


def test_batch_facts():
    facts = metrics.batch_facts(rounds())
    assert facts == {
        "rounds": 4,
        "requests_per_forward_mean": 7 / 4,
        "requests_per_forward_max": 2,
        "requests_per_forward_histogram": {"1": 1, "2": 3},
        "tokens_per_forward_mean": 36 / 4,
        "idle_scheduling_steps": 4,
        "issue_seconds": 4 * 0.0078125,
    }


def test_expert_cache_facts_rates_and_occupancy():
    facts = metrics.expert_cache_facts(runtime(), 2.0, 13)
    assert facts["capacity_bytes"] == 8000 and facts["slots"] == 8 and facts["policy"] == "lru"
    assert facts["expert_nbytes"] == NBYTES and facts["total_expert_bytes"] == 16_000
    assert facts["resident"] is False and facts["accesses"] == 8
    assert facts["exposed_fetch_fraction"] == 0.25 / 2.0
    assert facts["needed_experts_per_round_mean"] == 24 / 4
    assert facts["occupancy_bytes_mean"] == 18_000 / 4
    assert facts["occupancy_bytes_series"] == [2000, 6000, 5000, 5000]
    assert facts["experts_moved_per_token"] == 7 / 13  # 7 host-to-device transfers, 13 generated tokens
    empty = metrics.expert_cache_facts(runtime(needed_per_round=[], occupancy_per_round=[]), 2.0, 13)
    assert (
        empty["needed_experts_per_round_mean"] is None and empty["occupancy_bytes_mean"] is None
    )  # no round
    none = metrics.expert_cache_facts(
        runtime(cache=cache(counters=CacheCounters(), capacity_bytes=0, num_slots=0, resident=True)),
        2.0,
        0,
    )
    assert none["in_cache_rate"] is None and none["experts_moved_per_token"] is None  # no token generated


def test_occupancy_series_is_downsampled_to_64_evenly_spaced_samples():
    xs = list(range(200))
    series = metrics._downsample(xs, 64)
    assert len(series) == 64 and series[0] == 0 and series[-1] == 199
    assert series[1] == round(199 / 63) and series[32] == round(32 * 199 / 63)
    assert metrics._downsample([5, 6], 64) == [5, 6]
    assert metrics._downsample(list(range(64)), 64) == list(range(64))


def test_prediction_facts_split_waste_into_mispredicted_and_rejected_rows():
    facts = metrics.prediction_facts(runtime(), NBYTES)
    # P = {0, 1, 3, 4}, A = {0, 1, 2, 3, 5}: 4 was mispredicted (P \ A); 3 was routed only by a rejected row.
    assert facts["recall"] == 3 / 5 and facts["predicted_over_actual"] == 4 / 5
    assert facts["mispredicted_experts"] == 1 and facts["wasted_on_rejected_rows_experts"] == 1
    assert facts["mispredicted_bytes"] == NBYTES and facts["wasted_on_rejected_rows_bytes"] == NBYTES
    assert facts["per_layer"] == {
        "0": {"predicted": 4, "actual": 5, "covered": 3, "recall": 3 / 5},
        "1": {"predicted": 2, "actual": 0, "covered": 0, "recall": None},
    }
    assert facts["issue"] == {"issued": 4}
    sizeless = metrics.prediction_facts(
        runtime(stats=route_stats(nbytes=False), prefetcher=SimpleNamespace(counters={})), NBYTES
    )
    assert "mispredicted_bytes" not in sizeless and "issue" not in sizeless
    vacuous = metrics.prediction_facts(runtime(stats=RouteAheadStats()), NBYTES)
    assert vacuous["recall"] is None and vacuous["predicted_over_actual"] is None


# -- the assembled row -----------------------------------------------------------------------------------------


def test_assembled_row_is_ok_with_every_metric_and_its_distributions():
    result = row(measurement(), SLO())
    assert result.status is Status.OK and result.warnings == []
    assert result.acceptance_length_a == 14 / 5
    assert result.acceptance_histogram == {3: 1, 4: 2, 2: 1, 1: 1}
    assert result.requests == 2 and result.generated_tokens == 13 and result.timed_seconds == 2.0
    assert result.t_verify_seconds == 0.5625 and result.t_router_seconds == 0.09375
    assert result.latency["round_seconds"].n == 4 and result.latency["ttft_seconds"].mean == 0.5
    assert (
        result.route_ahead["coverage"] == 3 / 5 and result.route_ahead["wasted_prefetch_bytes"] == 2 * NBYTES
    )
    assert result.hide_inequality.resident_fraction == 0.25
    assert result.engine["bm1"]["bm1_router_to_verify_ratio"] == 0.09375 / 0.5625
    assert result.engine["draft_verify_rounds"] == 5
    assert result.engine["name"] == "reference" and len(result.engine["output_digest"]) == 16
    assert result.engine["prediction"]["mispredicted_experts"] == 1
    assert result.prefetched_in_time_coverage == 6 / 8
    assert result.engine["expert_cache"]["experts_moved_per_token"] == 7 / 13


def test_assembled_row_without_a_prefetcher_is_partial_and_says_why():
    result = row(measurement(speculative=False, runtime=runtime(prefetcher=None)), SLO())
    assert result.status is Status.PARTIAL and result.route_ahead_prefetch_coverage is None
    assert result.warnings == [
        "route_ahead_prefetch_coverage not measured: this configuration has no prefetcher"
    ]
    assert result.route_ahead is None and "prediction" not in result.engine and "bm1" not in result.engine
    assert result.prefetched_in_time_coverage is None
    assert result.t_draft_seconds is None


def test_an_observe_only_prefetcher_gives_coverage_but_no_prediction_counts():
    """B3 (every expert resident): the prefetcher only observes. Coverage is still its measured recall (3 of 5),
    but the row carries no prediction counts and a measured zero waste: nothing was prefetched (issue 12, 8c)."""
    idle = SimpleNamespace(issue=False, counters={"issued": 0})
    resident = cache(
        counters=CacheCounters(
            accesses=8, hits=8, resident_at_round_start=8, peak_occupancy_bytes=8 * NBYTES
        ),
        resident=True,
        capacity_bytes=16 * NBYTES,
        num_slots=16,
    )
    result = row(measurement(runtime=runtime(prefetcher=idle, cache=resident)))
    assert result.route_ahead_prefetch_coverage == 3 / 5
    assert result.route_ahead is None and "prediction" not in result.engine
    assert result.wasted_prefetch_bytes == 0 and type(result.wasted_prefetch_bytes) is int


# -- BM4 overlap of the transfers with the compute windows -----------------------------------------------------

#: Round windows: draft [0, 0.25), router [0.25, 0.3125), verify [0.5, 1.0) and [1.0, 1.5); compute stalled on
#: the link during [0.75, 0.875). Transfers: a prefetch of 1000 B over [0.125, 0.625), an on-demand fetch of
#: 2000 B over [0.75, 1.25), and an instantaneous 500 B one at 2.0 (no duration: hidden nowhere).
WINDOWS = [
    [("draft", 0.0, 0.25), ("router", 0.25, 0.3125), ("issue", 0.3125, 0.5), ("verify", 0.5, 1.0)],
    [("verify", 1.0, 1.5)],
]
LINK = SimpleNamespace(
    transfer_log=[(0.125, 0.625, 1000, False), (0.75, 1.25, 2000, True), (2.0, 2.0, 500, False)],
    stall_log=[(0.75, 0.875)],
)


def overlap_rounds() -> list[RoundRecord]:
    out = []
    for windows in WINDOWS:
        rec = rounds()[1]
        rec.windows = windows
        out.append(rec)
    return out


def test_transfer_overlap_by_hand():
    from pd_dflash.engine.reference.offload.overlap import compute_windows, transfer_overlap

    windows = compute_windows(overlap_rounds(), LINK.stall_log)
    assert windows == {
        "draft": [(0.0, 0.25)],
        "router": [(0.25, 0.3125)],
        "verify": [(0.5, 0.75), (0.875, 1.5)],  # the stall is not compute
        "any_compute": [(0.0, 0.3125), (0.5, 0.75), (0.875, 1.5)],  # issue windows do not hide
    }
    out = transfer_overlap(LINK, overlap_rounds())
    # prefetch: draft 0.125, router 0.0625, verify 0.125 (any 0.3125); demand: verify 0.375 (any 0.375)
    assert out["overlapped_seconds"] == {
        "draft": 0.125,
        "router": 0.0625,
        "verify": 0.5,
        "any_compute": 0.6875,
    }
    # bytes weighted by the overlapped share of each transfer's duration, over all 3500 B
    assert out["overlap_fraction"] == {
        "draft": 250 / 3500,
        "router": 125 / 3500,
        "verify": (250 + 1500) / 3500,
        "any_compute": (625 + 1500) / 3500,
    }
    assert out["h2d_bytes"] == 3500 and out["h2d_link_seconds"] == 1.0
    assert out["transfers"] == 3 and out["demand_transfers"] == 1 and out["stall_seconds"] == 0.125
    assert out["source"].startswith("engine timestamps")
    empty = transfer_overlap(SimpleNamespace(transfer_log=[], stall_log=[]), overlap_rounds())
    assert empty["overlap_fraction"] == dict.fromkeys(["draft", "router", "verify", "any_compute"])
    assert empty["h2d_link_seconds"] == 0 and empty["stall_seconds"] == 0


def test_assembled_row_with_a_link_carries_overlap_cost_terms_and_bookkeeping():
    rt = runtime()
    rt.cache.transfer_log, rt.cache.stall_log = LINK.transfer_log, LINK.stall_log
    m = measurement(
        link=LinkFacts(kind="emulated", emulated_gbps=1.0, emulated_latency_us=10.0),
        runtime=rt,
        rounds=overlap_rounds(),
        timings={"timed_seconds": 2.0},
        telemetry={"start": {"gpu": 0}},
    )
    result = row(m, SLO())
    assert result.engine["overlap"]["overlapped_seconds"]["verify"] == 0.5
    assert result.hide_inequality.overlap_seconds == 0.5 / 2  # per round, two rounds
    assert (
        result.cost_terms.h2d_link == "emulated" and result.cost_terms.measured_h2d_bytes_per_second == 14_000
    )
    assert (
        result.cost_terms.h2d_bandwidth_source == "transfers"
        and result.cost_terms.wasted_prefetch_bytes == 2000
    )
    assert result.timings == {"timed_seconds": 2.0} and result.telemetry == {"start": {"gpu": 0}}
    # Without a measured bandwidth the row says why the hide inequality is missing.
    idle = runtime(cache=cache(counters=CacheCounters(accesses=8, hits=8, h2d_bytes=0)))
    result = row(measurement(runtime=idle))
    assert result.hide_inequality is None
    assert result.warnings[-1].startswith(
        "hide_inequality not evaluated: no measured host-to-device bandwidth"
    )


# -- details people read: facts, digests, messages ----------------------------------------------------------------


def test_a_round_whose_prefill_flags_do_not_match_its_blocks_is_an_error():
    broken = rounds()
    broken[1].prefill = [False]  # two committed blocks, one flag
    with pytest.raises(ValueError, match="zip"):
        metrics.verify_commits(measurement(rounds=broken))


def test_engine_facts_carry_the_batch_the_cache_and_a_digest_of_the_outputs():
    import hashlib
    import json

    result = row(measurement(), SLO())
    outputs = json.dumps([[1, 2, 3], [1, 2, 3]]).encode()
    assert result.engine["output_digest"] == hashlib.sha256(outputs).hexdigest()[:16]
    assert result.engine["batch"]["rounds"] == 4 and result.engine["expert_cache"]["slots"] == 8
    assert "overlap" not in result.engine  # no link: nothing was transferred


def test_means_over_one_round_and_a_long_occupancy_series():
    one = metrics.expert_cache_facts(runtime(needed_per_round=[6], occupancy_per_round=[6000]), 2.0, 13)
    assert one["needed_experts_per_round_mean"] == 6 and one["occupancy_bytes_mean"] == 6000
    facts = metrics.expert_cache_facts(
        runtime(needed_per_round=[6], occupancy_per_round=list(range(100))), 2.0, 13
    )
    assert facts["needed_experts_per_round_mean"] == 6
    assert facts["occupancy_bytes_mean"] == sum(range(100)) / 100
    assert len(facts["occupancy_bytes_series"]) == 64 and facts["occupancy_bytes_series"][-1] == 99


def test_saturation_without_recorded_needs_is_zero():
    hide, _ = hide_inequality(trace(measurement(runtime=runtime(needed_per_round=[]))), 14_000.0)
    assert hide.saturation == 0.0 and hide.fetch_seconds == 0.0


def test_bandwidth_needs_bytes_and_seconds():
    one_byte = runtime(cache=cache(counters=CacheCounters(h2d_bytes=1, h2d_seconds=0.5)))
    assert measured_bandwidth(trace(measurement(runtime=one_byte))) == (2.0, "transfers")
    no_bytes = runtime(cache=cache(counters=CacheCounters(h2d_bytes=0, h2d_seconds=0.5)))
    assert measured_bandwidth(trace(measurement(runtime=no_bytes))) == (None, None)


def test_the_warnings_say_what_is_missing_and_why():
    _, warning = hide_inequality(trace(measurement()), None)
    assert warning == (
        "hide_inequality not evaluated: no measured host-to-device bandwidth "
        "(no transfer in this cell and no CUDA probe; a datasheet figure is never used)"
    )
    assert metrics.prefetch_coverage(runtime(stats=RouteAheadStats()))[1] == (
        "route_ahead_prefetch_coverage not reported: nothing was routed (coverage would be vacuous)"
    )


def test_the_converter_hands_the_one_assembly_a_neutral_trace():
    """The reference engine only converts: its trace holds the rounds' commits and times, the cache counters and
    the link as they were measured, and ``measurement.engine_result`` derives the row from them alone."""
    t = trace(measurement(link=LinkFacts(kind="emulated", emulated_gbps=2.0)))
    assert isinstance(t, CellTrace) and t.rounds.committed == [3, 4, 2, 4, 1]
    assert t.rounds.seconds == [0.5, 0.25, 0.25, 0.125] and t.rounds.router_seconds is not None
    assert (t.cache.hit_rate, t.cache.h2d_bytes, t.kv_peak_bytes) == (3 / 8, 7 * NBYTES, 12288)
    assert t.prefetch.in_time == (6, 8) and t.absent == {} and t.warnings == []
    assert t.hide.overlap_seconds == 0.0  # no transfer was logged on the link
    ar = trace(measurement(speculative=False, runtime=runtime(prefetcher=None)))
    assert ar.rounds.draft_seconds is None and ar.rounds.router_seconds is None
    assert ar.prefetch.in_time is None and set(ar.absent) == {"route_ahead_prefetch_coverage"}
    assert engine_result(ar, SLO()).missing_metrics() == ["route_ahead_prefetch_coverage"]
