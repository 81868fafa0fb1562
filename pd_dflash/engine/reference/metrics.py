"""From what one cell measured to an ``EngineResult`` — the metric definitions live here, next to the numbers.

Request metrics follow vLLM's ``benchmarks/serve.py``: TTFT = admission (the request enters the batch) to its
first token; TPOT = (e2e − TTFT)/(tokens − 1), over requests with more than one token; goodput = tokens/s of
the requests meeting EVERY given SLO (a 1-token request passes TPOT). Throughput counts every generated token
of the timed requests over the timed wall time (first admission to last completion; warm-up excluded).
A metric that was not measured is left out with a warning and the row becomes PARTIAL — never a 0.0.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from pd_dflash.costmodel import evaluate_hide_inequality
from pd_dflash.engine.reference.decode import Request, RoundRecord
from pd_dflash.engine.reference.offload import OffloadRuntime
from pd_dflash.schema import REQUIRED_METRICS, CostTerms, EngineResult, LatencyStats, Status
from pd_dflash.spec import SLO


@dataclass
class LinkFacts:
    #: "real" (CUDA, or an un-emulated host copy), "emulated" (CPU pacing), "none" (resident: no transfer).
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


def request_latencies(requests: list[Request]) -> tuple[list[float], list[float], list[float]]:
    ttft, tpot, e2e = [], [], []
    for r in requests:
        first = r.first_token_at - r.admitted_at
        total = r.finished_at - r.admitted_at
        ttft.append(first)
        e2e.append(total)
        if len(r.output) > 1:
            tpot.append((total - first) / (len(r.output) - 1))
    return ttft, tpot, e2e


def meets_slo(r: Request, slo: SLO) -> bool:
    ttft = r.first_token_at - r.admitted_at
    if slo.ttft_ms is not None and ttft * 1e3 > slo.ttft_ms:
        return False
    if slo.tpot_ms is not None and len(r.output) > 1:
        tpot = (r.finished_at - r.admitted_at - ttft) / (len(r.output) - 1)
        if tpot * 1e3 > slo.tpot_ms:
            return False
    return True


def assemble(m: CellMeasurement, slo: SLO) -> EngineResult:
    warnings: list[str] = []
    rt, c = m.runtime, m.runtime.cache.counters
    store = rt.store
    elapsed = max(m.timed_seconds, 1e-9)
    tokens = sum(len(r.output) for r in m.requests)
    ttft, tpot, e2e = request_latencies(m.requests)
    committed = [n for rec in m.rounds for n in rec.committed]
    values: dict[str, float | None] = {
        "output_tokens_per_second": tokens / elapsed,
        # Committed tokens per request per round (bonus included): exactly 1.0 for AR, measured anyway.
        "acceptance_length_a": sum(committed) / len(committed),
        "ttft_seconds": sum(ttft) / len(ttft),
        "per_round_latency_seconds": sum(rec.seconds for rec in m.rounds) / len(m.rounds),
        "goodput_at_slo": sum(len(r.output) for r in m.requests if meets_slo(r, slo)) / elapsed,
        "expert_cache_hit_rate": c.hit_rate,
        "route_ahead_prefetch_coverage": None,
        "wasted_prefetch_bytes": None,
        "expert_occupancy_bytes": float(c.peak_occupancy_bytes),
        "kv_occupancy_bytes": float(max(rec.kv_bytes for rec in m.rounds)),
    }
    if c.hit_rate is None:
        warnings.append("expert_cache_hit_rate not measured: no expert was accessed in the timed loop")
    stats = rt.stats
    if rt.prefetcher is None:
        warnings.append("route_ahead_prefetch_coverage not measured: this configuration has no prefetcher")
    elif stats.vacuous:
        warnings.append(
            "route_ahead_prefetch_coverage not reported: nothing was routed (coverage would be vacuous)"
        )
    else:
        values["route_ahead_prefetch_coverage"] = stats.coverage
    if stats.wasted_prefetch_bytes is not None:
        values["wasted_prefetch_bytes"] = float(stats.wasted_prefetch_bytes)
    elif c.prefetch_transfers == 0 and (
        rt.cache.resident or rt.prefetcher is None or not rt.prefetcher.issue
    ):
        values["wasted_prefetch_bytes"] = 0.0  # measured: this configuration issued no prefetch at all
    else:
        warnings.append("wasted_prefetch_bytes not measured: prefetches were issued without byte accounting")

    bandwidth, source = None, None
    if m.link.probe_bytes_per_second:
        bandwidth, source = m.link.probe_bytes_per_second, "probe"
    elif c.h2d_seconds > 0 and c.h2d_bytes > 0:
        bandwidth, source = c.h2d_bytes / c.h2d_seconds, "transfers"
    cost_terms = CostTerms(
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
    hide = None
    rounds = len(m.rounds)
    if bandwidth is None:
        warnings.append(
            "hide_inequality not evaluated: no measured host-to-device bandwidth "
            "(no transfer in this cell and no CUDA probe; a datasheet figure is never used)"
        )
    elif c.accesses:
        needed = rt.needed_per_round or [0]
        hide = evaluate_hide_inequality(
            resident_fraction=c.resident_at_round_start / c.accesses,
            saturation=min(1.0, (sum(needed) / len(needed)) / store.num_entries),
            total_expert_bytes=store.total_bytes,
            measured_h2d_bytes_per_second=bandwidth,
            draft_seconds=0.0,  # AR: no draft
            router_seconds=0.0,  # AR: no route-ahead router pass
            overlap_seconds=max(0.0, c.h2d_seconds - c.exposed_seconds) / rounds,
        )
    missing = [k for k in REQUIRED_METRICS if values[k] is None]
    latency = {
        name: stats_
        for name, stats_ in {
            "ttft_seconds": LatencyStats.from_samples(ttft),
            "tpot_seconds": LatencyStats.from_samples(tpot),
            "e2e_seconds": LatencyStats.from_samples(e2e),
            "round_seconds": LatencyStats.from_samples([rec.seconds for rec in m.rounds]),
            "verify_seconds": LatencyStats.from_samples([rec.forward_seconds for rec in m.rounds]),
        }.items()
        if stats_ is not None
    }
    per_forward = Counter(rec.requests for rec in m.rounds)
    engine = {
        **m.engine,
        # Same prompts, same tokens: offloading must not change outputs (B0 and B3 rows carry equal digests).
        "output_digest": hashlib.sha256(json.dumps([r.output for r in m.requests]).encode()).hexdigest()[:16],
        "batch": {
            "rounds": rounds,
            "requests_per_forward_mean": sum(rec.requests for rec in m.rounds) / rounds,
            "requests_per_forward_max": max(per_forward),
            "requests_per_forward_histogram": {str(k): v for k, v in sorted(per_forward.items())},
            "tokens_per_forward_mean": sum(rec.tokens for rec in m.rounds) / rounds,
        },
        "expert_cache": {
            "capacity_bytes": rt.cache.capacity_bytes,
            "slots": rt.cache.num_slots,
            "expert_nbytes": store.expert_nbytes,
            "total_expert_bytes": store.total_bytes,
            "policy": rt.cache.policy,
            "resident": rt.cache.resident,
            **{k: v for k, v in vars(c).items()},
            # Found in the cache at all (ready or still in flight from a prefetch): no new transfer issued.
            "in_cache_rate": (c.hits + c.inflight_hits) / c.accesses if c.accesses else None,
            "exposed_fetch_fraction": c.exposed_seconds / elapsed,
            "needed_experts_per_round_mean": sum(rt.needed_per_round) / max(1, len(rt.needed_per_round)),
            "occupancy_bytes_mean": sum(rt.occupancy_per_round) / max(1, len(rt.occupancy_per_round)),
            # Occupancy over time: end-of-round samples, at most 64 evenly spaced.
            "occupancy_bytes_series": _downsample(rt.occupancy_per_round, 64),
        },
    }
    return EngineResult(
        **values,
        status=Status.PARTIAL if missing else Status.OK,
        warnings=warnings,
        cost_terms=cost_terms,
        t_verify_seconds=sum(rec.forward_seconds for rec in m.rounds),
        latency=latency,
        acceptance_histogram=dict(Counter(committed)),
        route_ahead=stats.as_dict() if rt.prefetcher is not None else None,
        hide_inequality=hide,
        requests=len(m.requests),
        generated_tokens=tokens,
        timed_seconds=m.timed_seconds,
        engine=engine,
        telemetry=m.telemetry,
        timings=m.timings,
    )


def _downsample(xs: list[int], n: int) -> list[int]:
    if len(xs) <= n:
        return list(xs)
    return [xs[round(i * (len(xs) - 1) / (n - 1))] for i in range(n)]
