"""From what one cell measured to an ``EngineResult`` — the metric definitions live here, next to the numbers.

Request metrics (TTFT, TPOT, e2e, goodput at the SLO) follow ``pd_dflash/engine/request_metrics.py``, written
once for every engine. Throughput counts every generated token of the timed requests over the timed wall time
(first admission to last completion; warm-up excluded). τ counts committed tokens per request per verify round.
A metric that was not measured is left out with a warning and the row becomes PARTIAL — never a 0.0.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from pd_dflash.costmodel import bm1_summary, evaluate_hide_inequality
from pd_dflash.engine.reference import host_sync
from pd_dflash.engine.reference.decode import Request
from pd_dflash.engine.reference.offload import OffloadRuntime
from pd_dflash.engine.reference.serving import RoundRecord
from pd_dflash.engine.reference.transfer_overlap import transfer_overlap
from pd_dflash.engine.request_metrics import RequestTiming, goodput, latency_samples, latency_stats
from pd_dflash.schema import CostTerms, EngineResult, HideInequality, Status
from pd_dflash.spec import SLO
from pd_dflash.upstream import REQUIRED_METRICS


@dataclass
class LinkFacts:
    #: "real" (CUDA), "emulated" (CPU pacing), "host" (an un-emulated CPU host-to-host copy), "none" (resident).
    kind: str
    emulated_gbps: float | None = None
    emulated_latency_us: float | None = None
    #: The CUDA pinned-copy probe (bytes/s) measured at load, when on a GPU.
    probe_bytes_per_second: float | None = None


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
    def elapsed(self) -> float:
        """The timed window as a divisor (never 0)."""
        return max(self.timed_seconds, 1e-9)


def assemble(m: CellMeasurement, slo: SLO) -> EngineResult:
    """The cell's row: headline metrics, cost terms, hide inequality, distributions and engine facts."""
    timed = [r.timing for r in m.requests]
    samples = latency_samples(timed)
    committed = verify_commits(m)
    values, warnings = headline_metrics(m, timed, samples, committed, slo)
    bandwidth, source = measured_bandwidth(m)
    overlap = transfer_overlap(m.runtime.cache, m.rounds) if m.link.kind != "none" else None
    hide, hide_warning = hide_inequality(m, bandwidth, overlap)
    missing = [k for k in REQUIRED_METRICS if values[k] is None]
    return EngineResult(
        **values,
        status=Status.PARTIAL if missing else Status.OK,
        warnings=warnings + ([hide_warning] if hide_warning else []),
        cost_terms=cost_terms(m, values, bandwidth, source),
        **phase_seconds(m),
        latency=latency_stats({**samples, **round_samples(m)}),
        acceptance_histogram=dict(Counter(committed)),
        route_ahead=m.runtime.stats.as_dict() if issued_prefetches(m.runtime) else None,
        prefetched_in_time_coverage=in_time_coverage(m.runtime),
        hide_inequality=hide,
        requests=len(m.requests),
        generated_tokens=sum(t.tokens for t in timed),
        timed_seconds=m.timed_seconds,
        engine=engine_facts(m, committed, overlap),
        telemetry=m.telemetry,
        timings=m.timings,
    )


# -- headline metrics --------------------------------------------------------------------------------------------
def verify_commits(m: CellMeasurement) -> list[int]:
    """Committed tokens per request per verify round (bonus included). A speculative prefill proposes nothing,
    so it is not a verify round; in AR every round commits exactly one token, measured anyway."""
    return [
        n
        for rec in m.rounds
        for n, prefill in zip(rec.committed, rec.prefill, strict=True)
        if not (m.speculative and prefill)
    ]


def headline_metrics(
    m: CellMeasurement,
    timed: list[RequestTiming],
    samples: dict[str, list[float]],
    committed: list[int],
    slo: SLO,
) -> tuple[dict[str, float | int | None], list[str]]:
    """The row's top-level metrics (byte counts as ints), and a warning for each one this cell did not measure
    (left None)."""
    c = m.runtime.cache.counters
    coverage, coverage_warning = prefetch_coverage(m.runtime)
    wasted, wasted_warning = wasted_prefetch_bytes(m.runtime)
    ttft = samples["ttft_seconds"]
    values: dict[str, float | int | None] = {
        "output_tokens_per_second": sum(t.tokens for t in timed) / m.elapsed,
        "acceptance_length_a": sum(committed) / len(committed) if committed else None,
        "ttft_seconds": sum(ttft) / len(ttft),
        "per_round_latency_seconds": sum(rec.seconds for rec in m.rounds) / len(m.rounds),
        "goodput_at_slo": goodput(timed, slo, m.elapsed),
        "expert_cache_hit_rate": c.hit_rate,
        "route_ahead_prefetch_coverage": coverage,
        "wasted_prefetch_bytes": wasted,
        "expert_occupancy_bytes": c.peak_occupancy_bytes,  # byte counts stay ints (docs/metrics.md)
        "kv_occupancy_bytes": max(rec.kv_bytes for rec in m.rounds),
    }
    warnings = []
    if not committed:
        warnings.append("acceptance_length_a not measured: no verify round in the timed loop (prefills only)")
    if c.hit_rate is None:
        warnings.append("expert_cache_hit_rate not measured: no expert was accessed in the timed loop")
    return values, warnings + [w for w in (coverage_warning, wasted_warning) if w]


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


def in_time_coverage(rt: OffloadRuntime) -> float | None:
    """Σ|{k ∈ P∩A : resident and ready when the verify acquired it}| / Σ|A| over committed rounds; absent with
    no prefetcher or nothing routed (the headline coverage's warning says why)."""
    covered, actual = rt.in_time
    if rt.prefetcher is None or actual == 0:
        return None
    return covered / actual


def wasted_prefetch_bytes(rt: OffloadRuntime) -> tuple[int | None, str | None]:
    """Bytes of predicted experts no kept row used, or a measured 0 when no prefetch was issued at all."""
    c = rt.cache.counters
    if c.prefetch_transfers == 0 and (rt.cache.resident or not issued_prefetches(rt)):
        return 0, None  # measured: this configuration issued no prefetch at all
    if rt.stats.wasted_prefetch_bytes is not None:
        return rt.stats.wasted_prefetch_bytes, None
    return None, "wasted_prefetch_bytes not measured: prefetches were issued without byte accounting"


# -- link and hide inequality -----------------------------------------------------------------------------------
def measured_bandwidth(m: CellMeasurement) -> tuple[float | None, str | None]:
    """Host→device bytes/s and where it came from: the CUDA probe, else this cell's own transfers, else none
    (a datasheet figure is never used)."""
    c = m.runtime.cache.counters
    if m.link.probe_bytes_per_second:
        return m.link.probe_bytes_per_second, "probe"
    if c.h2d_seconds > 0 and c.h2d_bytes > 0:
        return c.h2d_bytes / c.h2d_seconds, "transfers"
    return None, None


def cost_terms(
    m: CellMeasurement, values: dict[str, float | None], bandwidth: float | None, source: str | None
) -> CostTerms:
    c = m.runtime.cache.counters
    return CostTerms(
        route_ahead_coverage=values["route_ahead_prefetch_coverage"],
        wasted_prefetch_bytes=values["wasted_prefetch_bytes"],
        measured_h2d_bytes_per_second=bandwidth,
        h2d_bandwidth_source=source,
        h2d_link=m.link.kind,
        emulated_h2d_gbps=m.link.emulated_gbps,
        emulated_latency_us=m.link.emulated_latency_us,
        h2d_bytes=c.h2d_bytes,
        h2d_seconds=c.h2d_seconds,
        h2d_transfers=c.h2d_transfers,
        exposed_fetch_seconds=c.exposed_seconds,
    )


def hide_inequality(
    m: CellMeasurement, bandwidth: float | None, overlap: dict[str, Any] | None
) -> tuple[HideInequality | None, str | None]:
    """``(1−r)·s·M/BW ≤ draft + router + overlap`` per round, from this cell's measured terms (AR: no draft and
    no router pass, 0). Overlap: the transfer time inside the verify windows (minus stalls), on the host clock on
    both devices (``transfer_overlap.py``); without a link (B3) nothing moves, so it is 0."""
    rt, c = m.runtime, m.runtime.cache.counters
    if bandwidth is None:
        return None, (
            "hide_inequality not evaluated: no measured host-to-device bandwidth "
            "(no transfer in this cell and no CUDA probe; a datasheet figure is never used)"
        )
    if not c.accesses:
        return None, None
    rounds = len(m.rounds)
    overlap_per_round = overlap["overlapped_seconds"]["verify"] / rounds if overlap is not None else 0.0
    needed = rt.needed_per_round or [0]
    hide = evaluate_hide_inequality(
        resident_fraction=c.resident_at_round_start / c.accesses,
        saturation=min(1.0, (sum(needed) / len(needed)) / rt.store.num_entries),
        total_expert_bytes=rt.store.total_bytes,
        measured_h2d_bytes_per_second=bandwidth,
        draft_seconds=sum(rec.draft_seconds for rec in m.rounds) / rounds,
        router_seconds=sum(rec.router_seconds for rec in m.rounds) / rounds,
        overlap_seconds=overlap_per_round,
    )
    return hide, None


# -- phase times and distributions ------------------------------------------------------------------------------
def phase_seconds(m: CellMeasurement) -> dict[str, float | None]:
    """Σ target forward time; Σ drafter and router time for the speculative configurations (absent for AR)."""
    speculative = m.speculative
    return {
        "t_draft_seconds": sum(rec.draft_seconds for rec in m.rounds) if speculative else None,
        "t_router_seconds": sum(rec.router_seconds for rec in m.rounds) if speculative else None,
        "t_verify_seconds": sum(rec.forward_seconds for rec in m.rounds),
    }


def round_samples(m: CellMeasurement) -> dict[str, list[float]]:
    """Per-round distributions: round and verify times, and draft and router times when speculative."""
    samples = {
        "round_seconds": [rec.seconds for rec in m.rounds],
        "verify_seconds": [rec.forward_seconds for rec in m.rounds],
    }
    if m.speculative:
        samples["draft_seconds"] = [rec.draft_seconds for rec in m.rounds]
        samples["router_seconds"] = [rec.router_seconds for rec in m.rounds]
    return samples


# -- engine facts -----------------------------------------------------------------------------------------------
def engine_facts(m: CellMeasurement, committed: list[int], overlap: dict[str, Any] | None) -> dict[str, Any]:
    """The row's ``engine`` field: the engine's own facts, then what this cell measured beyond the metrics."""
    rt = m.runtime
    extra: dict[str, Any] = {}
    if overlap is not None:
        extra["overlap"] = overlap
    if m.speculative:
        phases = phase_seconds(m)
        extra["bm1"] = bm1_summary(phases["t_router_seconds"], phases["t_verify_seconds"])
        extra["draft_verify_rounds"] = len(committed)
    if issued_prefetches(rt):
        extra["prediction"] = prediction_facts(rt, rt.store.expert_nbytes)
    tokens = sum(r.timing.tokens for r in m.requests)
    return {
        **m.engine,
        **extra,
        # Device→host reads of the timed loop (host_sync.py): a resident forward has none per MoE layer.
        "host_syncs": host_sync.COUNTER.facts(len(m.rounds), tokens),
        "expert_compute": rt.cache.slots.expert_compute,
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


def expert_cache_facts(rt: OffloadRuntime, elapsed: float, generated_tokens: int) -> dict[str, Any]:
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
        "exposed_fetch_fraction": c.exposed_seconds / elapsed,
        "experts_moved_per_token": experts_moved_per_token(c.h2d_transfers, generated_tokens),
        "needed_experts_per_round_mean": sum(rt.needed_per_round) / max(1, len(rt.needed_per_round)),
        "occupancy_bytes_mean": sum(rt.occupancy_per_round) / max(1, len(rt.occupancy_per_round)),
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
    counters = getattr(rt.prefetcher, "counters", None)
    if counters:
        facts["issue"] = dict(counters)
    return facts
