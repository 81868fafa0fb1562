"""The MoE-Infinity adapter's derivations (``results.py``, ``metrics.py``, ``measure``'s pure helpers, and the
row ``pd_dflash/engine/measurement.py`` derives from the adapter's trace) on hand-built observations whose answers
are worked out here, by hand, not by the code under test.

Each test states the trace and the value it must give; nothing imports moe_infinity or torch.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pd_dflash.engine import measurement
from pd_dflash.engine.measurement import CellTrace, ExpertCacheTrace, LinkFacts, PrefetchTrace, engine_result
from pd_dflash.engine.moe_infinity import measure
from pd_dflash.engine.moe_infinity import metrics as m
from pd_dflash.engine.moe_infinity import trace as results
from pd_dflash.engine.moe_infinity.cells import CellPlan
from pd_dflash.engine.moe_infinity.measure import CounterBaseline, Loop, Observation
from pd_dflash.engine.moe_infinity.metrics import RequestTrace
from pd_dflash.engine.moe_infinity.serving import ClientRun, KVPeak, RoundLog, SessionWatch
from pd_dflash.spec import SLO

AR = CellPlan(speculative=False, route_ahead=None, verify_budgets=None, serving_path="ar_batched")
B1 = CellPlan(speculative=True, route_ahead=False, verify_budgets={}, serving_path="spec_sessions")
OURS = CellPlan(speculative=True, route_ahead=True, verify_budgets={}, serving_path="spec_sessions")


def trace(rid: str, submitted: float, chunks: list[tuple[int, float]], tokens: int) -> RequestTrace:
    return RequestTrace(rid, submitted, tokens, chunks[0][1], chunks[-1][1], list(chunks))


#: Two requests over a 2 s window (times exact in binary).
#: a: submitted 0, chunks at steps 0, 1, 3 (t = 0.25, 0.5, 1.0), 4 tokens: TTFT 0.25, gaps 0.25, 0.5
#: b: submitted 0.5, chunks at steps 2, 3 (t = 0.75, 1.0), 2 tokens: TTFT 0.25, gap 0.25
TRACES = [
    trace("a", 0.0, [(0, 0.25), (1, 0.5), (3, 1.0)], 4),
    trace("b", 0.5, [(2, 0.75), (3, 1.0)], 2),
]


def observation(**over) -> Observation:
    """An observation with nothing measured; ``over`` sets fields (``run``/``rounds``/``sessions`` on the loop)."""
    run = over.pop("run", ClientRun(traces=[], steps=0, elapsed=2.0))
    loop = Loop(
        run=run,
        rounds=over.pop("rounds", None),
        kv=None,
        occupancy_samples=[],
        sessions=over.pop("sessions", None),
        executions=None,
        peak_speculative_sessions=None,
    )
    fields = dict(
        loop=loop,
        bindings={},
        stats=None,
        hit=(None, None),
        occupancy=(None, None),
        exposed_after=None,
        wasted_after=None,
        native_getters={},
        paged_kv_bytes=None,
        native_kv=(None, None),
        token_kv_bytes=0,
        baseline=CounterBaseline(exposed_reset=False, exposed_before=None, wasted_before=None),
        timings={},
        telemetry_start=None,
    )
    fields.update(over)
    return Observation(**fields)


def cell(concurrency: int = 1, block_size: int = 8):
    return SimpleNamespace(concurrency=concurrency, block_size=block_size)


def requests_row(obs: Observation, slo: SLO, plan: CellPlan = AR):
    """The row ``measurement.engine_result`` derives from the observation's requests and rounds alone (no cache,
    prefetch or KV reading), and the rounds' notes: throughput, TTFT, goodput and the distributions."""
    loop = results.rounds(plan, cell(), obs)
    trace = CellTrace(
        requests=[t.timing() for t in obs.run.traces],
        rounds=loop.value,
        timed_seconds=obs.run.elapsed,
        cache=ExpertCacheTrace(hit_rate=None, peak_occupancy_bytes=None),
        prefetch=PrefetchTrace(coverage=None, wasted_bytes=None),
        kv_peak_bytes=None,
        link=LinkFacts(kind=None),
    )
    return engine_result(trace, slo), loop.warnings


def tau(plan: CellPlan, rounds: RoundLog | None, block_size: int):
    """τ, its histogram and the reason it is absent, from the rounds the adapter's trace holds."""
    loop = results.rounds(plan, cell(block_size=block_size), observation(rounds=rounds))
    absent = [loop.absent["acceptance_length_a"]] if "acceptance_length_a" in loop.absent else []
    return (measurement.acceptance_length(loop.value), measurement.acceptance_histogram(loop.value)), absent


def round_latency(plan: CellPlan, c: int, obs: Observation):
    """The per-round latency of the adapter's rounds, their sources and the reason it is absent."""
    loop = results.rounds(plan, cell(c), obs)
    absent = [loop.absent["per_round_latency_seconds"]] if "per_round_latency_seconds" in loop.absent else []
    return measurement.per_round_latency(loop.value, obs.run.elapsed), loop.sources, absent


# -- acceptance length τ ---------------------------------------------------------------------------------


def test_tau_is_the_mean_of_min_accept_plus_one_and_b_over_rounds():
    # commits 3, 1, 8, 9 (over B: clipped to 8), 0 (below 1: clipped to 1) -> 3 + 1 + 8 + 8 + 1 = 21 over 5
    rounds = measurement.Rounds(committed=m.clip_commits([3, 1, 8, 9, 0], block_size=8))
    tau, histogram = measurement.acceptance_length(rounds), measurement.acceptance_histogram(rounds)
    assert tau == 21 / 5
    assert histogram == {1: 2, 3: 1, 8: 2} and list(histogram) == [1, 3, 8]
    empty = measurement.Rounds(committed=m.clip_commits([], 8))
    assert (measurement.acceptance_length(empty), measurement.acceptance_histogram(empty)) == (None, None)


def test_tau_of_an_autoregressive_cell_is_one_by_definition_and_absent_without_rounds():
    assert tau(AR, None, 8)[0] == (1.0, None)
    absent = tau(OURS, RoundLog(), 8)
    assert absent == ((None, None), [m.ABSENT["acceptance_length_a"]])
    assert tau(OURS, None, 8)[0] == (None, None)
    measured = tau(OURS, RoundLog(committed=[2, 4, 4]), 4)
    assert measured == ((10 / 3, {2: 1, 4: 2}), [])


# -- per-round latency -----------------------------------------------------------------------------------


def test_round_latency_is_the_mean_gap_between_a_requests_consecutive_chunks():
    # gaps: a 0.25, 0.5; b 0.25 -> mean 1.0 / 3
    obs = observation(run=ClientRun(TRACES, steps=4, elapsed=2.0))
    assert TRACES[0].chunk_gaps() == [0.25, 0.5] and TRACES[1].chunk_gaps() == [0.25]
    value, _, absent = round_latency(OURS, 2, obs)
    assert value == 1.0 / 3 and absent == []


def test_round_latency_without_a_stream_at_c1_is_the_loop_over_the_verify_rounds():
    single = [trace("a", 0.0, [(0, 1.5)], 12)]  # the whole request in one serving step: no gap
    obs = observation(
        run=ClientRun(single, steps=1, elapsed=1.5), rounds=RoundLog(committed=[4, 4, 4, 2, 1, 1])
    )
    value, sources, _ = round_latency(OURS, 1, obs)
    assert value == 1.5 / 6
    assert sources == {
        "per_round_latency_seconds": "timed loop / observed verify rounds (no per-round stream)"
    }
    # ... but never for c > 1 (the rounds overlap) nor for an autoregressive cell: absent, with the reason.
    for plan, c in ((OURS, 2), (AR, 1)):
        value, _, absent = round_latency(plan, c, obs)
        assert value is None
        assert absent == ["per_round_latency_seconds absent: no request received tokens in two serving steps"]


# -- throughput, TTFT, goodput, latency distributions ----------------------------------------------------


def test_per_request_throughput_ttft_goodput_and_distributions():
    slo = SLO(tpot_ms=300)  # a: TPOT (1.0 - 0.25) / 3 = 0.25 s; b: 0.25 / 1 = 0.25 s
    obs = observation(run=ClientRun(TRACES, steps=4, elapsed=2.0))
    r, _ = requests_row(obs, slo)
    assert r.output_tokens_per_second == 6 / 2.0
    assert r.generated_tokens == 6 and r.requests == 2
    assert r.ttft_seconds == 0.25  # (0.25 + 0.25) / 2
    assert r.goodput_at_slo == 6 / 2.0  # both meet 300 ms
    latency = r.latency
    assert latency["round_seconds"].n == 3 and latency["round_seconds"].max == 0.5
    assert latency["tpot_seconds"].mean == 0.25 and latency["e2e_seconds"].max == 1.0
    assert "draft_seconds" not in latency  # no verify rounds: no sample, no zeros


def test_goodput_counts_the_half_of_the_requests_that_meet_the_slo():
    # TPOT a = 0.25 s, b = 0.25 s; TTFT a = 0.25 s, b = 0.25 s. Make b slow: first token at 1.5, finished 1.75.
    slow_b = trace("b", 0.5, [(2, 1.5), (3, 1.75)], 2)  # TTFT 1.0 s
    obs = observation(run=ClientRun([TRACES[0], slow_b], steps=4, elapsed=2.0))
    r, _ = requests_row(obs, SLO(ttft_ms=500))
    assert r.goodput_at_slo == 4 / 2.0  # only a's 4 tokens
    assert r.output_tokens_per_second == 6 / 2.0
    assert r.ttft_seconds == (0.25 + 1.0) / 2
    # The SLO is in milliseconds: 1000 ms admits b's 1 s TTFT exactly (<=), 999 ms does not.
    assert requests_row(obs, SLO(ttft_ms=1000))[0].goodput_at_slo == 3.0
    assert requests_row(obs, SLO(ttft_ms=999))[0].goodput_at_slo == 2.0


def test_round_phase_samples_and_missing_accepts():
    rounds = RoundLog(committed=[2], draft_seconds=[0.5, 0.25], verify_seconds=[1.0], missing_accept=2)
    obs = observation(run=ClientRun(TRACES, steps=4, elapsed=2.0), rounds=rounds)
    r, notes = requests_row(obs, SLO())
    assert r.latency["draft_seconds"].mean == 0.375
    assert r.latency["verify_seconds"].n == 1
    assert notes == ["2 verify results carried no accept count (not counted)"]


# -- coverage and wasted bytes ---------------------------------------------------------------------------

STATS = {
    "steps": 3,
    "predicted_experts": 10,
    "actual_experts": 8,
    "covered_experts": 7,
    "coverage": 0.875,
    "waste_ratio": 0.25,
    "wasted_prefetch_bytes": 3_000_000,
}


def test_ours_coverage_and_waste_come_from_route_ahead_stats():
    derived = results.prefetch_metrics(OURS, observation(stats=STATS))
    assert derived.value == (0.875, 3_000_000) and derived.warnings == []
    assert derived.sources == {
        "route_ahead_prefetch_coverage": "RouteAheadStats.coverage",
        "wasted_prefetch_bytes": "RouteAheadStats.wasted_prefetch_bytes",
    }


def test_ours_coverage_with_nothing_routed_is_flagged_vacuous():
    vacuous = {**STATS, "actual_experts": 0, "coverage": 1.0, "wasted_prefetch_bytes": 0}
    derived = results.prefetch_metrics(OURS, observation(stats=vacuous))
    assert derived.value == (1.0, 0) and derived.warnings == [m.VACUOUS_COVERAGE]


def test_waste_without_byte_sizes_falls_to_the_native_counters_timed_loop_delta():
    sizeless = {**STATS, "wasted_prefetch_bytes": None}
    native = {"wasted_prefetch_bytes": "expert_prefetcher.archer_engine.get_wasted_prefetch_bytes"}
    obs = observation(
        stats=sizeless,
        native_getters=native,
        wasted_after=7_000_000.0,
        baseline=CounterBaseline(False, None, 2_000_000.0),
    )
    derived = results.prefetch_metrics(OURS, obs)
    assert derived.value == (0.875, 5_000_000)  # 7 MB after - 2 MB before
    assert derived.sources["wasted_prefetch_bytes"] == (
        "expert_prefetcher.archer_engine.get_wasted_prefetch_bytes via expert_prefetcher.wasted_prefetch_bytes "
        "(timed-loop delta)"
    )


def test_ar_prefetcher_coverage_is_absent_and_its_waste_is_the_native_delta():
    native = {"wasted_prefetch_bytes": "expert_prefetcher.archer_engine.get_wasted_prefetch_bytes"}
    obs = observation(
        stats={**STATS, "predicted_experts": 0},
        native_getters=native,
        wasted_after=1_500_000.0,
        baseline=CounterBaseline(False, None, 500_000.0),
    )
    derived = results.prefetch_metrics(B1, obs)
    assert derived.value == (None, 1_000_000)
    assert derived.warnings == [m.ABSENT["route_ahead_prefetch_coverage"]]
    missing_stats = results.prefetch_metrics(OURS, observation())
    assert missing_stats.value == (None, None)
    assert missing_stats.warnings == [m.NO_ROUTE_AHEAD_STATS, m.ABSENT["wasted_prefetch_bytes"]]


def test_native_waste_is_absent_without_a_reading_or_a_native_getter():
    unread = results.native_waste(observation(wasted_after=5.0))  # no reading before the loop
    assert unread.value is None and unread.warnings == [m.ABSENT["wasted_prefetch_bytes"]]
    wrapper_only = results.native_waste(
        observation(wasted_after=0.0, baseline=CounterBaseline(False, None, 0.0))
    )
    assert wrapper_only.value is None
    assert wrapper_only.warnings == [
        "wasted_prefetch_bytes absent: MoE-Infinity's accessor returned 0.0 with no native getter behind it (its "
        "wrappers return 0.0 when the native getter is missing or raises)"
    ]
    # A counter that went backwards (reset by the library) gives 0, never a negative byte count.
    getter = {"wasted_prefetch_bytes": "g"}
    back = results.native_waste(
        observation(native_getters=getter, wasted_after=1.0, baseline=CounterBaseline(False, None, 9.0))
    )
    assert back.value == 0
    rounded = results.native_waste(
        observation(native_getters=getter, wasted_after=10.6, baseline=CounterBaseline(False, None, 0.0))
    )
    assert rounded.value == 11 and isinstance(rounded.value, int)


# -- hit rate and expert occupancy -----------------------------------------------------------------------

GETTERS = {
    "expert_cache_hit_rate": "expert_prefetcher.expert_dispatcher.get_cache_hit_rate",
    "expert_occupancy_bytes": "expert_prefetcher.expert_dispatcher.get_cache_occupancy_bytes",
}


def test_hit_rate_and_occupancy_are_read_from_the_accessors():
    obs = observation(
        run=ClientRun(TRACES, 4, 2.0),
        hit=(0.625, "engine.expert_cache_hit_rate"),
        occupancy=(3_000_000.4, "engine.expert_occupancy_bytes (peak over serving steps)"),
        native_getters=GETTERS,
    )
    derived = results.native_metrics(obs)
    assert derived.value == {"expert_cache_hit_rate": 0.625, "expert_occupancy_bytes": 3_000_000}
    assert derived.warnings == []
    assert derived.sources["expert_occupancy_bytes"].endswith("(peak over serving steps)")


def test_a_zero_from_a_wrapper_is_absent_unless_its_native_getter_exists_and_nothing_contradicts_it():
    zeros = dict(hit=(0.0, "engine.expert_cache_hit_rate"), occupancy=(0.0, "engine.expert_occupancy_bytes"))
    no_getter = results.native_metrics(observation(run=ClientRun([], 0, 1.0), **zeros))
    assert no_getter.value == {"expert_cache_hit_rate": None, "expert_occupancy_bytes": None}
    assert all("no native getter behind it" in w for w in no_getter.warnings) and len(no_getter.warnings) == 2
    # With the getter and tokens computed through the experts, a 0.0 is implausible: absent.
    contradicted = results.native_metrics(
        observation(run=ClientRun(TRACES, 4, 2.0), native_getters=GETTERS, **zeros)
    )
    assert contradicted.value == {"expert_cache_hit_rate": None, "expert_occupancy_bytes": None}
    assert contradicted.warnings == [
        "expert_cache_hit_rate absent: expert_prefetcher.expert_dispatcher.get_cache_hit_rate read 0.0, implausible "
        "although the timed loop routed 6 tokens through the experts",
        "expert_occupancy_bytes absent: expert_prefetcher.expert_dispatcher.get_cache_occupancy_bytes read 0.0, "
        "implausible although experts were on the device to compute 6 tokens",
    ]
    # With the getter and no token computed, the 0.0 stands.
    stands = results.native_metrics(observation(run=ClientRun([], 0, 1.0), native_getters=GETTERS, **zeros))
    assert stands.value == {"expert_cache_hit_rate": 0.0, "expert_occupancy_bytes": 0}
    assert stands.warnings == []


def test_a_missing_accessor_is_absent_with_the_reason():
    derived = results.native_metrics(observation(hit=(None, "engine.get_hit_rate raised RuntimeError: x")))
    assert derived.value["expert_cache_hit_rate"] is None
    assert (
        derived.warnings[0]
        == m.ABSENT["expert_cache_hit_rate"] + " (engine.get_hit_rate raised RuntimeError: x)"
    )
    assert derived.warnings[1] == m.ABSENT["expert_occupancy_bytes"]


def test_expert_occupancy_is_the_peak_over_the_serving_steps_not_the_last_reading():
    engine = SimpleNamespace(expert_occupancy_bytes=4_000_000)  # the reading at the end of the loop
    value, source = measure._peak_occupancy(engine, [1_000_000, 6_000_000, 5_000_000])
    assert value == 6_000_000 and source == "engine.expert_occupancy_bytes (peak over serving steps)"
    assert measure._peak_occupancy(engine, [])[0] == 4_000_000
    assert measure._peak_occupancy(SimpleNamespace(), [6_000_000]) == (None, None)


# -- KV occupancy ----------------------------------------------------------------------------------------


def test_kv_of_an_autoregressive_cell_is_the_paged_peak_else_the_native_reading():
    paged = results.kv_occupancy(AR, observation(paged_kv_bytes=65_536, native_kv=(1.0, "x")))
    assert paged.value == 65_536
    assert paged.sources == {"kv_occupancy_bytes": "serving PagedKVCache: peak blocks in use x block bytes"}
    native = results.kv_occupancy(AR, observation(native_kv=(4096.4, "engine.kv_occupancy_bytes")))
    assert native.value == 4096 and native.sources == {"kv_occupancy_bytes": "engine.kv_occupancy_bytes"}
    absent = results.kv_occupancy(AR, observation())
    assert absent.value is None and absent.warnings == [m.ABSENT["kv_occupancy_bytes"]]


def test_kv_of_a_speculative_cell_is_the_private_caches_peak_tokens_times_bytes_per_token():
    sessions = SessionWatch(private_kv_peak_tokens=96)
    obs = observation(sessions=sessions, token_kv_bytes=512, paged_kv_bytes=4096)
    derived = results.kv_occupancy(OURS, obs)
    assert derived.value == 96 * 512 and derived.warnings == []
    assert derived.facts == {"paged_kv_prompt_only_peak_bytes": 4096}
    # Without private caches, the paged prompt blocks are reported and labelled as not comparable.
    prompt_only = results.kv_occupancy(
        OURS, observation(sessions=SessionWatch(private_kv_peak_tokens=None), paged_kv_bytes=4096)
    )
    assert prompt_only.value == 4096 and prompt_only.warnings == [
        "kv_occupancy_bytes counts the paged prompt blocks only: MoE-Infinity keeps a speculative request's target "
        "KV in a private cache this serving path does not expose, so the value is not comparable with B0"
    ]
    assert prompt_only.sources == {"kv_occupancy_bytes": "serving PagedKVCache (prompt blocks only)"}
    assert prompt_only.facts == {"paged_kv_prompt_only_peak_bytes": 4096}
    nothing = results.kv_occupancy(OURS, observation(sessions=SessionWatch(private_kv_peak_tokens=0)))
    assert nothing.value is None and nothing.warnings == [m.ABSENT["kv_occupancy_bytes"]]


def test_kv_bytes_per_token_and_paged_peak_from_the_model_geometry():
    # 4 layers x (K, V) x 2 KV heads x 8 head dim x element size
    for dtype, size in (
        ("torch.bfloat16", 2),
        ("torch.float16", 2),
        ("torch.float32", 4),
        ("torch.float8_e4m3fn", 1),
    ):
        config = SimpleNamespace(
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, hidden_size=32
        )
        model = SimpleNamespace(config=config, dtype=dtype)
        assert measure.token_kv_bytes(model) == 4 * 2 * 2 * 8 * size  # head_dim = hidden / heads = 8
    model = SimpleNamespace(
        config=SimpleNamespace(num_hidden_layers=2, num_key_value_heads=1, head_dim=16), dtype="float32"
    )
    peak = KVPeak(allocator=None, total_blocks=10, peak_blocks=3)
    assert measure.paged_kv_bytes(model, cell(block_size=8), peak) == 3 * 8 * (2 * 2 * 1 * 16 * 4)
    assert measure.paged_kv_bytes(model, cell(), KVPeak(allocator=None, total_blocks=10)) is None
    with pytest.raises(RuntimeError, match="dtype=int8"):
        measure.token_kv_bytes(SimpleNamespace(config=model.config, dtype="int8"))


def test_kv_peak_samples_the_most_blocks_in_use():
    allocator = SimpleNamespace(num_free_blocks=10)
    peak = KVPeak(allocator=allocator, total_blocks=10)
    for free in (7, 4, 6, 10):  # in use: 3, 6, 4, 0
        allocator.num_free_blocks = free
        peak.sample()
    assert peak.peak_blocks == 6


# -- exposed fetch seconds -------------------------------------------------------------------------------


def test_exposed_fetch_is_the_reset_reading_or_the_timed_loop_delta():
    reset = observation(exposed_after=0.75, baseline=CounterBaseline(True, 0.0, None))
    assert results.exposed_fetch(reset, 0.5, offloaded_experts=10).value == 0.75
    delta = observation(exposed_after=2.0, baseline=CounterBaseline(False, 0.5, None))
    assert results.exposed_fetch(delta, 0.5, offloaded_experts=10).value == 1.5
    unread = results.exposed_fetch(observation(exposed_after=2.0), 0.5, 10)
    assert unread.value is None and unread.warnings == [m.ABSENT["exposed_fetch_seconds"]]


def test_a_zero_exposed_fetch_stands_only_when_nothing_was_fetched_on_demand():
    zero = observation(exposed_after=0.0, baseline=CounterBaseline(True, None, None))
    assert results.exposed_fetch(zero, 1.0, offloaded_experts=10).value == 0.0  # the cache never missed
    assert results.exposed_fetch(zero, 0.5, offloaded_experts=0).value == 0.0  # nothing offloaded
    missed = results.exposed_fetch(zero, 0.5, offloaded_experts=10)
    assert missed.value is None and missed.warnings == [
        "exposed_fetch_seconds absent: OffloadEngine.get_exposed_fetch_seconds read 0.0, implausible although the "
        "expert cache missed (hit rate 0.500: every miss is an on-demand fetch)"
    ]
    unknown = results.exposed_fetch(zero, None, offloaded_experts=10)
    assert unknown.value is None and unknown.warnings == [
        "exposed_fetch_seconds absent: OffloadEngine.get_exposed_fetch_seconds read 0.0, implausible with no hit "
        "rate to show that nothing was fetched on demand"
    ]


# -- accessors -------------------------------------------------------------------------------------------


def test_read_number_takes_the_first_finite_number_and_reports_what_raised():
    def boom():
        raise RuntimeError("not ready")

    holder = SimpleNamespace(a=boom, b=float("nan"), c=True, d=lambda: 3, e=4.5)
    value, source = m.read_number([("h", holder, n) for n in ("a", "b", "c", "missing", "d", "e")])
    assert (value, source) == (3.0, "h.d")
    value, note = m.read_number([("h", holder, "a"), ("none", None, "x"), ("h", holder, "b")])
    assert value is None and note == "h.a raised RuntimeError: not ready"
    assert m.read_number([("h", holder, "b")]) == (None, None)


def test_offloaded_experts_and_total_expert_bytes():
    prefetcher = SimpleNamespace(expert_nbytes_map={(0, 0): 5, (0, 1): 7, (1, 0): 9})
    assert m.total_expert_bytes(SimpleNamespace(expert_prefetcher=prefetcher)) == 21
    assert (
        m.total_expert_bytes(SimpleNamespace(expert_prefetcher=SimpleNamespace(expert_nbytes_map={}))) is None
    )
    assert m.offloaded_experts(SimpleNamespace(expert_prefetcher=prefetcher)) == 3  # the byte map's size
    assert m.offloaded_experts(SimpleNamespace(num_offloaded_experts=11, expert_prefetcher=prefetcher)) == 11
    assert m.offloaded_experts(SimpleNamespace(offloaded_expert_count=4)) == 4
    counted = SimpleNamespace(
        num_offloaded_experts=True, expert_prefetcher=SimpleNamespace(num_offloaded_experts=2)
    )
    assert m.offloaded_experts(counted) == 2  # a bool is not a count
    assert m.offloaded_experts(SimpleNamespace()) == 0


def test_observed_max_in_flight_is_the_most_requests_between_first_and_last_chunk():
    # a spans steps 0..3, b spans 2..3: both in flight at steps 2 and 3
    assert m.observed_max_in_flight(TRACES) == 2
    back_to_back = [trace("x", 0, [(0, 0.1), (1, 0.2)], 2), trace("y", 0, [(2, 0.3), (3, 0.4)], 2)]
    assert m.observed_max_in_flight(back_to_back) == 1
    assert m.observed_max_in_flight([RequestTrace("z", 0.0)]) == 0


# -- the assembled row -------------------------------------------------------------------------------------------

ROUTE = {
    "steps": 3,
    "layers_observed": 12,
    "predicted_experts": 10,
    "actual_experts": 8,
    "covered_experts": 7,
    "kept_experts": 6,
    "wasted_experts": 4,
    "coverage": 0.875,
    "waste_ratio": 0.4,
    "predicted_prefetch_bytes": 10_000_000,
    "kept_prefetch_bytes": 6_000_000,
    "wasted_prefetch_bytes": 4_000_000,
}


def ours_observation(**over) -> Observation:
    from pd_dflash.engine.moe_infinity.serving import ModelExecutions

    fields = dict(
        run=ClientRun(TRACES, steps=4, elapsed=2.0),
        rounds=RoundLog(
            committed=[3, 4, 1],
            draft_seconds=[0.125, 0.125, 0.25],
            verify_seconds=[0.25, 0.5, 0.25],
            demand_bytes=[1000, 3000],
        ),
        sessions=SessionWatch(sessions=["s1", "s2"], teed=2, private_kv_peak_tokens=30),
        stats=dict(ROUTE),
        bindings={"bound": 3, "withheld": 0},
        hit=(0.5, "engine.expert_cache_hit_rate"),
        occupancy=(3_000_000.0, "engine.expert_occupancy_bytes (peak over serving steps)"),
        exposed_after=0.25,
        baseline=CounterBaseline(True, None, 0.0, ["baseline note"]),
        native_getters=GETTERS,
        paged_kv_bytes=4096,
        token_kv_bytes=512,
        timings={"timed_seconds": 2.0},
    )
    fields.update(over)
    obs = observation(**fields)
    obs.loop.peak_speculative_sessions = 2
    obs.loop.executions = ModelExecutions(calls=5, rows=12)
    return obs


def assemble(plan, obs, *, concurrency=2, baseline="OURS"):
    ctx = SimpleNamespace(slo=SLO())
    loaded = SimpleNamespace(warnings=["load note"], num_offloaded=10)
    cell_ = SimpleNamespace(concurrency=concurrency, block_size=4, offloaded=True, baseline=baseline)
    return engine_result(
        results.cell_trace(loaded, {"name": "moe_infinity"}, cell_, plan, obs, None, False), ctx.slo
    )


def test_an_ours_row_assembled_from_its_observation():
    r = assemble(OURS, ours_observation())
    assert r.status.value == "OK" and r.missing_metrics() == []
    assert r.output_tokens_per_second == 3.0 and r.goodput_at_slo == 3.0 and r.ttft_seconds == 0.25
    assert r.acceptance_length_a == 8 / 3 and r.acceptance_histogram == {1: 1, 3: 1, 4: 1}
    assert r.per_round_latency_seconds == 1.0 / 3
    assert r.expert_cache_hit_rate == 0.5 and r.expert_occupancy_bytes == 3_000_000
    assert r.route_ahead_prefetch_coverage == 0.875 and r.wasted_prefetch_bytes == 4_000_000
    assert r.kv_occupancy_bytes == 30 * 512
    assert r.warnings == ["load note", "baseline note", m.ABSENT["measured_h2d_bytes_per_second"]]
    assert r.t_draft_seconds == 0.5 and r.t_verify_seconds == 1.0
    assert set(r.latency) == {"ttft_seconds", "tpot_seconds", "e2e_seconds", "round_seconds", "draft_seconds",
                              "verify_seconds"}  # fmt: skip
    assert r.route_ahead == ROUTE and (r.requests, r.generated_tokens, r.timed_seconds) == (2, 6, 2.0)
    ct = r.cost_terms
    assert (ct.route_ahead_coverage, ct.wasted_prefetch_bytes, ct.exposed_fetch_seconds) == (
        0.875,
        4_000_000,
        0.25,
    )
    assert (
        ct.measured_h2d_bytes_per_second is None and ct.h2d_bandwidth_source is None and ct.h2d_link is None
    )
    assert r.telemetry is None and r.timings == {"timed_seconds": 2.0}
    e = r.engine
    assert e["name"] == "moe_infinity"
    assert e["configuration"] == {
        "route_ahead": True,
        "verify_budgets": {},
        "serving_path": "spec_sessions",
        "max_batch_size": 2,
        "block_size": 4,
    }
    assert (e["observed_max_in_flight"], e["serving_steps"]) == (2, 4)
    assert e["metric_sources"] == {
        "route_ahead_prefetch_coverage": "RouteAheadStats.coverage",
        "wasted_prefetch_bytes": "RouteAheadStats.wasted_prefetch_bytes",
        "expert_cache_hit_rate": "engine.expert_cache_hit_rate",
        "expert_occupancy_bytes": "engine.expert_occupancy_bytes (peak over serving steps)",
        "kv_occupancy_bytes": "speculative sessions' private target caches: peak of their summed "
        "get_seq_length() x KV bytes per token",
    }
    assert e["route_ahead_bindings"] == {"bound": 3, "withheld": 0}
    assert e["mean_verify_demand_bytes"] == 2000
    assert e["speculative_sessions"] == {"opened": 2, "route_recorders_teed": 2}
    assert e["peak_speculative_sessions"] == 2 and e["paged_kv_prompt_only_peak_bytes"] == 4096
    assert e["model_runner"] == {"executions": 5, "rows": 12, "rows_per_emitted_token": 2.0}
    assert "route_ahead_observer" not in e


def test_a_route_ahead_off_row_keeps_what_the_observer_saw_as_a_fact_not_as_its_statistics():
    seen = {
        **ROUTE,
        "predicted_experts": 0,
        "covered_experts": 0,
        "coverage": 0.0,
        "wasted_prefetch_bytes": 0,
    }
    native = {**GETTERS, "wasted_prefetch_bytes": "expert_prefetcher.archer_engine.get_wasted_prefetch_bytes"}
    obs = ours_observation(stats=seen, native_getters=native, wasted_after=2000.0)
    r = assemble(B1, obs, baseline="B1")
    assert r.route_ahead is None and r.engine["route_ahead_observer"] == seen
    assert r.status.value == "PARTIAL" and r.route_ahead_prefetch_coverage is None
    assert r.wasted_prefetch_bytes == 2000 and r.cost_terms.wasted_prefetch_bytes == 2000
    assert m.ABSENT["route_ahead_prefetch_coverage"] in r.warnings


def test_fewer_requests_in_flight_than_the_concurrency_is_flagged():
    back_to_back = [trace("x", 0, [(0, 0.25), (1, 0.5)], 2), trace("y", 0, [(2, 0.75), (3, 1.0)], 2)]
    obs = ours_observation(run=ClientRun(back_to_back, steps=4, elapsed=2.0))
    obs.loop.peak_speculative_sessions = None  # nothing to refuse on: the warning is what remains
    r = assemble(OURS, obs)
    assert r.engine["observed_max_in_flight"] == 1
    assert (
        "concurrency 2 requested, but at most 1 requests were observed in flight (between their first and last "
        "token)"
    ) in r.warnings
    # c=1 with one request in flight at a time is what was asked: no warning.
    assert not [w for w in assemble(OURS, obs, concurrency=1).warnings if w.startswith("concurrency")]


# -- every accessor MoE-Infinity builds may have, one at a time ---------------------------------------------------


@pytest.mark.parametrize(
    ("reader", "holder", "name"),
    [
        (m.hit_rate, "engine", "expert_cache_hit_rate"),
        (m.hit_rate, "expert_prefetcher", "get_hit_rate"),
        (m.hit_rate, "expert_prefetcher", "hit_rate"),
        (m.hit_rate, "expert_prefetcher", "expert_hit_rate"),
        (m.hit_rate, "engine", "get_hit_rate"),
        (m.hit_rate, "engine", "hit_rate"),
        (m.expert_occupancy_bytes, "engine", "expert_occupancy_bytes"),
        (m.expert_occupancy_bytes, "engine", "get_expert_occupancy_bytes"),
        (m.expert_occupancy_bytes, "expert_prefetcher", "expert_occupancy_bytes"),
        (m.native_kv_occupancy_bytes, "engine", "kv_occupancy_bytes"),
        (m.native_kv_occupancy_bytes, "engine", "get_kv_occupancy_bytes"),
        (m.native_wasted_prefetch_bytes, "expert_prefetcher", "wasted_prefetch_bytes"),
        (m.exposed_fetch_seconds, "engine", "get_exposed_fetch_seconds"),
    ],
)
def test_each_accessor_is_read_and_named(reader, holder, name):
    prefetcher = SimpleNamespace()
    engine = SimpleNamespace(expert_prefetcher=prefetcher)
    setattr(engine if holder == "engine" else prefetcher, name, lambda: 0.25)
    assert reader(engine) == (0.25, f"{holder}.{name}")
    assert reader(SimpleNamespace(expert_prefetcher=SimpleNamespace())) == (None, None)


def test_accessors_are_tried_in_order():
    prefetcher = SimpleNamespace(get_hit_rate=0.5, hit_rate=0.75)
    engine = SimpleNamespace(expert_prefetcher=prefetcher, expert_cache_hit_rate=float("inf"), hit_rate=0.875)
    assert m.hit_rate(engine) == (0.5, "expert_prefetcher.get_hit_rate")  # inf is no reading: the next one
    assert m.hit_rate(None) == (None, None)


@pytest.mark.parametrize(
    ("metric", "holder", "name"),
    [
        ("expert_cache_hit_rate", "expert_dispatcher", "get_cache_hit_rate"),
        ("expert_cache_hit_rate", "archer_engine", "get_hit_rate"),
        ("expert_occupancy_bytes", "expert_dispatcher", "get_cache_occupancy_bytes"),
        ("expert_occupancy_bytes", "archer_engine", "get_expert_occupancy_bytes"),
        ("wasted_prefetch_bytes", "archer_engine", "get_wasted_prefetch_bytes"),
    ],
)
def test_the_native_getter_behind_each_wrapper_is_found(metric, holder, name):
    prefetcher = SimpleNamespace(**{holder: SimpleNamespace(**{name: lambda: 1.0})})
    assert (
        m.native_getter(SimpleNamespace(expert_prefetcher=prefetcher), metric)
        == f"expert_prefetcher.{holder}.{name}"
    )
    not_callable = SimpleNamespace(**{holder: SimpleNamespace(**{name: 1.0})})
    assert m.native_getter(SimpleNamespace(expert_prefetcher=not_callable), metric) is None
    assert m.native_getter(SimpleNamespace(), metric) is None


def test_why_a_zero_is_not_a_reading():
    assert m.vet_zero("x", 0.5, None, None) is None and m.vet_zero("x", None, None, None) is None
    assert m.vet_zero("x", 0.0, None, None) == (
        "x absent: MoE-Infinity's accessor returned 0.0 with no native getter behind it (its wrappers return 0.0 "
        "when the native getter is missing or raises)"
    )
    assert m.vet_zero("x", 0.0, "g.h", "because y") == "x absent: g.h read 0.0, implausible because y"
    assert m.vet_zero("x", 0.0, "g.h", None) is None


def test_call_if_present_calls_only_a_whole_path():
    calls = []
    obj = SimpleNamespace(a=SimpleNamespace(b=SimpleNamespace(c=lambda: calls.append("c"))))
    assert m.call_if_present(obj, "a", "b", "c") is True and calls == ["c"]
    assert m.call_if_present(obj, "a", "x", "c") is False
    assert m.call_if_present(obj, "a", "b") is False  # not callable
    assert m.call_if_present(SimpleNamespace(f=lambda: calls.append("f")), "f") is True and calls == [
        "c",
        "f",
    ]


def test_a_trace_becomes_the_shared_request_timing():
    t = TRACES[0].timing()
    assert (t.admitted, t.first_token, t.finished, t.tokens) == (0.0, 0.25, 1.0, 4)
    assert RequestTrace("z", 1.0).chunk_gaps() == [] and RequestTrace("z", 1.0).timing().ttft is None


# -- what mutation testing found unpinned --------------------------------------------------------------------------


def test_a_request_that_ends_as_two_others_start_leaves_three_in_flight():
    # a: step 0 only; b: steps 0..5; c and d: steps 1..2. At step 1, a is done and b, c, d are in flight.
    staggered = [
        trace("a", 0, [(0, 0.25)], 1),
        trace("b", 0, [(0, 0.25), (5, 1.5)], 2),
        trace("c", 0, [(1, 0.5), (2, 0.75)], 2),
        trace("d", 0, [(1, 0.5), (2, 0.75)], 2),
    ]
    assert m.observed_max_in_flight(staggered) == 3


def test_a_single_offloaded_expert_can_still_be_fetched_on_demand():
    zero = observation(exposed_after=0.0, baseline=CounterBaseline(True, None, None))
    one = results.exposed_fetch(zero, 0.5, offloaded_experts=1)
    assert one.value is None and one.warnings == [
        "exposed_fetch_seconds absent: OffloadEngine.get_exposed_fetch_seconds read 0.0, implausible although the "
        "expert cache missed (hit rate 0.500: every miss is an on-demand fetch)"
    ]


def test_kv_facts_name_the_paged_peak_only_when_there_is_one():
    native = results.kv_occupancy(AR, observation(native_kv=(4096.0, None)))
    assert native.value == 4096 and native.sources == {"kv_occupancy_bytes": ""}  # a reading without a name
    private = results.kv_occupancy(
        OURS, observation(sessions=SessionWatch(private_kv_peak_tokens=2), token_kv_bytes=512)
    )
    assert private.value == 1024 and private.facts == {}
    nothing = results.kv_occupancy(OURS, observation(sessions=SessionWatch(private_kv_peak_tokens=0)))
    assert nothing.value is None and nothing.facts == {}


@pytest.mark.parametrize(
    ("offloaded", "h2d", "cuda", "expected"),
    [
        (True, 2.5e10, True, (2.5e10, "probe", "real")),
        (False, 2.5e10, True, (2.5e10, "probe", "none")),
        (True, None, True, (None, None, "real")),
        (True, 2.5e10, False, (2.5e10, "probe", None)),
    ],
)
def test_cost_terms_name_the_probed_bandwidth_and_the_link(offloaded, h2d, cuda, expected):
    cell_ = SimpleNamespace(concurrency=2, block_size=4, offloaded=offloaded, baseline="OURS")
    loaded = SimpleNamespace(warnings=[], num_offloaded=10)
    obs = ours_observation(stats={**ROUTE, "coverage": 0.875, "wasted_prefetch_bytes": 4_000_000.0})
    ct = engine_result(results.cell_trace(loaded, {}, cell_, OURS, obs, h2d, cuda), SLO()).cost_terms
    assert (ct.measured_h2d_bytes_per_second, ct.h2d_bandwidth_source, ct.h2d_link) == expected
    assert (ct.route_ahead_coverage, ct.wasted_prefetch_bytes, ct.exposed_fetch_seconds) == (
        0.875,
        4_000_000,
        0.25,
    )
    assert isinstance(ct.wasted_prefetch_bytes, int)


def test_an_accessor_reading_without_a_name_has_an_empty_source():
    derived = results.native_metrics(observation(hit=(0.5, None), occupancy=(1000.4, None)))
    assert derived.value == {"expert_cache_hit_rate": 0.5, "expert_occupancy_bytes": 1000}
    assert derived.sources == {"expert_cache_hit_rate": "", "expert_occupancy_bytes": ""}
    assert derived.warnings == []


def test_a_loop_whose_requests_got_no_token_has_no_mean_ttft():
    run = ClientRun([RequestTrace("p", 0.0), RequestTrace("q", 0.5)], steps=1, elapsed=2.0)
    r, _ = requests_row(observation(run=run), SLO())
    assert r.ttft_seconds is None
    assert r.output_tokens_per_second == 0.0 and r.requests == 2


def test_read_number_skips_an_absent_holder_and_lists_every_accessor_that_raised():
    def boom():
        raise RuntimeError("not ready")

    def late():
        raise TimeoutError("later")

    holder = SimpleNamespace(a=boom, b=late, e=4.5)
    assert m.read_number([("none", None, "x"), ("h", holder, "e")]) == (4.5, "h.e")
    assert m.read_number([("h", holder, "a"), ("h", holder, "b")]) == (
        None,
        "h.a raised RuntimeError: not ready; h.b raised TimeoutError: later",
    )


def test_an_assembled_row_on_a_device_probes_the_link_and_takes_telemetry_at_both_ends(monkeypatch):
    """cuda=True with a probed bandwidth: the cost terms name the probe and the real link, the h2d warning is
    gone, and telemetry has the start the observation took and an end read from device 0 (NVML is replaced by a
    fixed snapshot: this machine has no device). A zero exposed-fetch reading stands: the cache never missed."""
    monkeypatch.setattr(results.nvml, "telemetry", lambda position=0: {"device": position})
    obs = ours_observation(
        telemetry_start={"device": "start"},
        hit=(1.0, "engine.expert_cache_hit_rate"),
        exposed_after=0.0,
    )
    obs.loop.executions = None
    ctx = SimpleNamespace(slo=SLO())
    loaded = SimpleNamespace(warnings=[], num_offloaded=10)
    cell_ = SimpleNamespace(concurrency=2, block_size=4, offloaded=True, baseline="OURS")
    r = engine_result(results.cell_trace(loaded, {}, cell_, OURS, obs, 2.5e10, True), ctx.slo)
    ct = r.cost_terms
    assert (ct.measured_h2d_bytes_per_second, ct.h2d_bandwidth_source, ct.h2d_link) == (
        2.5e10,
        "probe",
        "real",
    )
    assert ct.exposed_fetch_seconds == 0.0
    assert r.warnings == ["baseline note"]
    assert r.telemetry == {"start": {"device": "start"}, "end": {"device": 0}}
    assert "model_runner" not in r.engine
    # Without a start snapshot the end is still kept; without a device nothing is read.
    no_start = ours_observation(telemetry_start=None)
    assert results.cell_trace(loaded, {}, cell_, OURS, no_start, None, True).telemetry == {
        "start": None,
        "end": {"device": 0},
    }
    cpu = engine_result(
        results.cell_trace(loaded, {}, cell_, OURS, ours_observation(telemetry_start=None), None, False),
        ctx.slo,
    )
    assert cpu.telemetry is None and cpu.cost_terms.h2d_link is None


def test_total_expert_bytes_is_unknown_without_a_prefetcher_or_its_byte_map():
    assert m.total_expert_bytes(SimpleNamespace()) is None
    assert m.total_expert_bytes(SimpleNamespace(expert_prefetcher=SimpleNamespace())) is None


def test_the_converter_hands_the_one_assembly_a_neutral_trace():
    """The adapter only converts: vetted readings with their reasons go into the trace (an absence reason keyed by
    its metric, a note on a present value among the warnings), and ``measurement.engine_result`` derives the row."""
    loaded = SimpleNamespace(warnings=["load note"], num_offloaded=10)
    cell_ = SimpleNamespace(concurrency=2, block_size=4, offloaded=True, baseline="OURS")
    t = results.cell_trace(loaded, {}, cell_, OURS, ours_observation(stats=None), None, False)
    assert isinstance(t, CellTrace) and t.rounds.committed == [3, 4, 1] and t.rounds.router_seconds is None
    assert t.absent == {
        "route_ahead_prefetch_coverage": m.NO_ROUTE_AHEAD_STATS,
        "wasted_prefetch_bytes": m.ABSENT["wasted_prefetch_bytes"],
    }
    assert t.warnings == ["load note", "baseline note", m.ABSENT["measured_h2d_bytes_per_second"]]
    assert t.hide is None and t.link == LinkFacts(kind=None)
    r = engine_result(t, SLO())
    assert r.status.value == "PARTIAL"
    assert r.missing_metrics() == ["route_ahead_prefetch_coverage", "wasted_prefetch_bytes"]
    assert r.warnings == [*t.warnings, m.NO_ROUTE_AHEAD_STATS, m.ABSENT["wasted_prefetch_bytes"]]
