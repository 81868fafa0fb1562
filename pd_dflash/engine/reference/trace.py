"""From what one reference cell measured to its :class:`~pd_dflash.engine.measurement.CellTrace`.

This module reads the offload runtime and the rounds; ``pd_dflash/engine/measurement.py`` derives every metric
from the trace, once, for both engines (definitions in docs/metrics.md). What is read here: τ's commits per
request per verify round (a speculative prefill is not a verify round), the cache counters, the prefetcher's
statistics and why a value is absent, the KV peak, the hide inequality's terms and BM4 overlap, and the engine
facts the row carries. A metric that was not measured is left None with its reason — never a 0.0.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from pd_dflash.engine.measurement import (
    CellTrace,
    ExpertCacheTrace,
    HideTerms,
    LinkFacts,
    PrefetchTrace,
    Rounds,
)
from pd_dflash.engine.reference import host_sync
from pd_dflash.engine.reference.decoding.loop import RoundRecord
from pd_dflash.engine.reference.decoding.target import Request
from pd_dflash.engine.reference.offload.overlap import transfer_overlap
from pd_dflash.engine.reference.offload.runtime import OffloadRuntime


@dataclass
class CellMeasurement:
    requests: list[Request]
    rounds: list[RoundRecord]
    timed_seconds: float
    runtime: OffloadRuntime
    link: LinkFacts
    engine: dict[str, Any] = field(default_factory=dict)
    timings: dict[str, float] = field(default_factory=dict)
    telemetry: dict[str, Any] | None = None
    speculative: bool = False

    @property
    def elapsed(self) -> float | None:
        """The timed window as a divisor; None when it measured no time."""
        return self.timed_seconds if self.timed_seconds > 0 else None


def cell_trace(m: CellMeasurement) -> CellTrace:
    """The cell's trace (``measurement.engine_result`` turns it into the row)."""
    rt, c = m.runtime, m.runtime.cache.counters
    overlap = transfer_overlap(rt.cache, m.rounds) if m.link.kind != "none" else None
    coverage, coverage_warning = prefetch_coverage(rt)
    wasted, wasted_warning = wasted_prefetch_bytes(rt)
    rounds = round_trace(m)
    return CellTrace(
        requests=[r.timing for r in m.requests],
        rounds=rounds,
        timed_seconds=m.timed_seconds,
        cache=ExpertCacheTrace(
            hit_rate=c.hit_rate,
            peak_occupancy_bytes=c.peak_occupancy_bytes,  # byte counts stay ints (docs/metrics.md)
            h2d_bytes=c.h2d_bytes,
            h2d_seconds=c.h2d_seconds,
            h2d_transfers=c.h2d_transfers,
            exposed_fetch_seconds=c.exposed_seconds,
        ),
        prefetch=PrefetchTrace(
            coverage=coverage,
            wasted_bytes=wasted,
            in_time=(rt.in_time[0], rt.in_time[1]) if rt.prefetcher is not None else None,
            route_ahead=rt.stats.as_dict() if issued_prefetches(rt) else None,
        ),
        kv_peak_bytes=max(rec.kv_bytes for rec in m.rounds),
        link=m.link,
        hide=hide_terms(rt, overlap),
        engine=engine_facts(m, overlap),
        telemetry=m.telemetry,
        timings=m.timings,
        absent=absences(m, rounds.committed, coverage_warning, wasted_warning),
    )


def round_trace(m: CellMeasurement) -> Rounds:
    """The rounds' commits and times; draft and router times only for the speculative configurations."""
    speculative = m.speculative
    return Rounds(
        committed=verify_commits(m),
        seconds=[rec.seconds for rec in m.rounds],
        verify_seconds=[rec.forward_seconds for rec in m.rounds],
        draft_seconds=[rec.draft_seconds for rec in m.rounds] if speculative else None,
        router_seconds=[rec.router_seconds for rec in m.rounds] if speculative else None,
    )


def absences(
    m: CellMeasurement, committed: list[int] | None, coverage_warning: str | None, wasted_warning: str | None
) -> dict[str, str]:
    """Why each metric this cell did not measure is absent."""
    absent = {}
    if not committed:
        absent["acceptance_length_a"] = (
            "acceptance_length_a not measured: no verify round in the timed loop (prefills only)"
        )
    if m.runtime.cache.counters.hit_rate is None:
        absent["expert_cache_hit_rate"] = (
            "expert_cache_hit_rate not measured: no expert was accessed in the timed loop"
        )
    if coverage_warning:
        absent["route_ahead_prefetch_coverage"] = coverage_warning
    if wasted_warning:
        absent["wasted_prefetch_bytes"] = wasted_warning
    return absent


def hide_terms(rt: OffloadRuntime, overlap: dict[str, Any] | None) -> HideTerms:
    """The hide inequality's terms: accesses resident at round start, experts needed per round, the store, and
    the transfer time inside the verify windows (on the host clock on both devices, ``offload/overlap.py``;
    without a link (B3) nothing moves, so it is 0)."""
    c = rt.cache.counters
    return HideTerms(
        accesses=c.accesses,
        resident_at_round_start=c.resident_at_round_start,
        needed_per_round=list(rt.needed_per_round),
        num_experts=rt.store.num_entries,
        total_expert_bytes=rt.store.total_bytes,
        overlap_seconds=overlap["overlapped_seconds"]["verify"] if overlap is not None else 0.0,
    )


def verify_commits(m: CellMeasurement) -> list[int]:
    """Committed tokens per request per verify round (bonus included). A speculative prefill proposes nothing,
    so it is not a verify round; in AR every round commits exactly one token, measured anyway."""
    return [
        n
        for rec in m.rounds
        for n, prefill in zip(rec.committed, rec.prefill, strict=True)
        if not (m.speculative and prefill)
    ]


def issued_prefetches(rt: OffloadRuntime) -> bool:
    """Whether the cell's prefetcher may issue transfers. An observe-only one (B3: every expert resident) still
    gives the headline coverage, on the same scale as the offloaded baselines', but the row carries no prediction
    counts (``route_ahead``, ``engine.prediction``): nothing was prefetched, so there is no waste to count."""
    return rt.prefetcher is not None and rt.prefetcher.issue


def prefetch_coverage(rt: OffloadRuntime) -> tuple[float | None, str | None]:
    """Route-ahead coverage of the cell's prefetcher (AR or route-ahead), or why there is none."""
    if rt.prefetcher is None:
        return None, "route_ahead_prefetch_coverage not measured: this configuration has no prefetcher"
    if rt.stats.vacuous:
        return None, (
            "route_ahead_prefetch_coverage not reported: nothing was routed (coverage would be vacuous)"
        )
    return rt.stats.coverage, None


def wasted_prefetch_bytes(rt: OffloadRuntime) -> tuple[int | None, str | None]:
    """Bytes of predicted experts no kept row used, or a measured 0 when no prefetch was issued at all."""
    c = rt.cache.counters
    if c.prefetch_transfers == 0 and (rt.cache.resident or not issued_prefetches(rt)):
        return 0, None  # measured: this configuration issued no prefetch at all
    if rt.stats.wasted_prefetch_bytes is not None:
        return rt.stats.wasted_prefetch_bytes, None
    return None, "wasted_prefetch_bytes not measured: prefetches were issued without byte accounting"


# -- engine facts -----------------------------------------------------------------------------------------------
def engine_facts(m: CellMeasurement, overlap: dict[str, Any] | None) -> dict[str, Any]:
    """The row's ``engine`` field: the engine's own facts, then what this cell measured beyond the metrics (BM1
    is added by ``measurement.engine_result``, from the phase sums)."""
    rt = m.runtime
    extra: dict[str, Any] = {}
    if overlap is not None:
        extra["overlap"] = overlap
    if issued_prefetches(rt):
        extra["prediction"] = prediction_facts(rt, rt.store.expert_nbytes)
    tokens = sum(r.timing.tokens for r in m.requests)
    return {
        **m.engine,
        **extra,
        # Device→host reads of the timed loop (host_sync.py): a resident forward has none per MoE layer.
        "host_syncs": host_sync.COUNTER.facts(len(m.rounds), tokens),
        # The path, why, and on CUDA the capability and the grouped_mm probe (offload/grouped.py).
        "expert_compute": rt.cache.slots.expert_compute_facts,
        # Same prompts, same tokens: offloading must not change outputs (equal digests at equal output lengths).
        "output_digest": hashlib.sha256(json.dumps([r.output for r in m.requests]).encode()).hexdigest()[:16],
        "batch": batch_facts(m.rounds),
        "kv_cache": kv_cache_facts(m.rounds),
        "expert_cache": expert_cache_facts(rt, m.elapsed, tokens),
    }


def batch_facts(rounds: list[RoundRecord]) -> dict[str, Any]:
    """How many requests shared each batched forward (concurrency is observable), and the scheduling cost."""
    per_forward = Counter(rec.requests for rec in rounds)
    return {
        "rounds": len(rounds),
        "requests_per_forward_mean": sum(rec.requests for rec in rounds) / len(rounds),
        "requests_per_forward_max": max(per_forward),
        "requests_per_forward_histogram": {str(k): v for k, v in sorted(per_forward.items())},
        "tokens_per_forward_mean": sum(rec.tokens for rec in rounds) / len(rounds),
        "idle_scheduling_steps": sum(rec.idle_steps for rec in rounds),
        "issue_seconds": sum(rec.issue_seconds for rec in rounds),
    }


def kv_cache_facts(rounds: list[RoundRecord]) -> dict[str, Any]:
    """The target's KV arena: the peak of the entries in use (the ``kv_occupancy_bytes`` metric) and of what the
    arena allocated (every row × its capacity, whatever it holds)."""
    return {
        "in_use_bytes_peak": max(rec.kv_bytes for rec in rounds),
        "allocated_bytes_peak": max(rec.kv_allocated_bytes for rec in rounds),
        "counts": "in use: positions held × layers × 2 × kv_heads × head_dim × element size",
    }


def experts_moved_per_token(transfers: int, generated_tokens: int) -> float | None:
    """Host→device expert transfers (on demand and prefetched) per generated token; None without tokens."""
    return transfers / generated_tokens if generated_tokens else None


def expert_cache_facts(rt: OffloadRuntime, elapsed: float | None, generated_tokens: int) -> dict[str, Any]:
    """The cache's geometry and every counter, with the rates and occupancy derived from them."""
    c, cache, store = rt.cache.counters, rt.cache, rt.store
    return {
        "capacity_bytes": cache.capacity_bytes,
        # Capacity counts stored bytes (slots = capacity // expert_nbytes); a slot takes device_slot_nbytes.
        "capacity_counts": "stored_bytes",
        "slots": cache.num_slots,
        "device_slot_nbytes": cache.slots.device_slot_nbytes,
        "dequantize": "none (stored in the compute dtype)" if cache.slots.direct else "once per landing",
        "expert_nbytes": store.expert_nbytes,
        "total_expert_bytes": store.total_bytes,
        "policy": cache.policy,
        "resident": cache.resident,
        **dict(vars(c)),
        # Found in the cache at all (ready or still in flight from a prefetch): no new transfer issued.
        "in_cache_rate": (c.hits + c.inflight_hits) / c.accesses if c.accesses else None,
        "exposed_fetch_fraction": c.exposed_seconds / elapsed if elapsed else None,
        "experts_moved_per_token": experts_moved_per_token(c.h2d_transfers, generated_tokens),
        "needed_experts_per_round_mean": _mean(rt.needed_per_round),
        "occupancy_bytes_mean": _mean(rt.occupancy_per_round),
        # Occupancy over time: end-of-round samples, at most 64 evenly spaced.
        "occupancy_bytes_series": _downsample(rt.occupancy_per_round, 64),
    }


def _downsample(xs: list[int], n: int) -> list[int]:
    if len(xs) <= n:
        return list(xs)
    return [xs[round(i * (len(xs) - 1) / (n - 1))] for i in range(n)]


def prediction_facts(rt: OffloadRuntime, expert_nbytes: int) -> dict[str, Any]:
    """The prefetcher's prediction against the verify's routing: recall per layer, and the waste split into
    mispredicted experts (P \\ A: nobody routed them) and experts only rejected rows routed ((P ∩ A) \\ U_keep)."""
    st = rt.stats
    mispredicted = st.predicted_experts - st.covered_experts
    on_rejected = st.wasted_experts - mispredicted
    facts: dict[str, Any] = {
        "recall": None if st.vacuous else st.coverage,
        "predicted_over_actual": st.predicted_experts / st.actual_experts if st.actual_experts else None,
        "mispredicted_experts": mispredicted,
        "wasted_on_rejected_rows_experts": on_rejected,
        "per_layer": {
            str(layer): {
                "predicted": p,
                "actual": a,
                "covered": cov,
                "recall": cov / a if a else None,
            }
            for layer, (p, a, cov) in sorted(rt.per_layer.items())
        },
    }
    if st.wasted_prefetch_bytes is not None:
        facts["mispredicted_bytes"] = mispredicted * expert_nbytes
        facts["wasted_on_rejected_rows_bytes"] = on_rejected * expert_nbytes
    if rt.prefetcher is not None and rt.prefetcher.counters:
        facts["issue"] = dict(rt.prefetcher.counters)
    return facts


def _mean(xs: list[int]) -> float | None:
    """The mean of per-round samples; None without a round (never a made-up 0)."""
    return sum(xs) / len(xs) if xs else None
