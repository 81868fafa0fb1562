"""From what one cell measured to an ``EngineResult`` — the metric definitions live here, next to the numbers.

Request metrics follow vLLM's ``benchmarks/serve.py``: TTFT = admission (the request enters the batch) to its
first token; TPOT = (e2e − TTFT)/(tokens − 1), over requests with more than one token; goodput = tokens/s of
the requests meeting EVERY given SLO (a 1-token request passes TPOT). Throughput counts every generated token
of the timed requests over the timed wall time (first admission to last completion; warm-up excluded).
A metric that was not measured is left out with a warning and the row becomes PARTIAL — never a 0.0.
"""

from __future__ import annotations

import bisect
import hashlib
import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from pd_dflash.costmodel import bm1_summary, evaluate_hide_inequality
from pd_dflash.engine.reference.decode import Request, RoundRecord
from pd_dflash.engine.reference.offload import OffloadRuntime
from pd_dflash.schema import CostTerms, EngineResult, LatencyStats, Status
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
    block_size: int = 1


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
    # τ is over verify rounds: a speculative prefill proposes nothing (AR: every round commits exactly one).
    committed = [
        n
        for rec in m.rounds
        for n, prefill in zip(rec.committed, rec.prefill, strict=True)
        if not (m.speculative and prefill)
    ]
    values: dict[str, float | None] = {
        "output_tokens_per_second": tokens / elapsed,
        # Committed tokens per request per verify round (bonus included): exactly 1.0 for AR, measured anyway.
        "acceptance_length_a": sum(committed) / len(committed) if committed else None,
        "ttft_seconds": sum(ttft) / len(ttft),
        "per_round_latency_seconds": sum(rec.seconds for rec in m.rounds) / len(m.rounds),
        "goodput_at_slo": sum(len(r.output) for r in m.requests if meets_slo(r, slo)) / elapsed,
        "expert_cache_hit_rate": c.hit_rate,
        "route_ahead_prefetch_coverage": None,
        "wasted_prefetch_bytes": None,
        "expert_occupancy_bytes": float(c.peak_occupancy_bytes),
        "kv_occupancy_bytes": float(max(rec.kv_bytes for rec in m.rounds)),
    }
    if not committed:
        warnings.append("acceptance_length_a not measured: no verify round in the timed loop (prefills only)")
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
    overlap = transfer_overlap(rt.cache, m.rounds) if m.link.kind in ("emulated", "host") else None
    draft_per_round = sum(rec.draft_seconds for rec in m.rounds) / rounds
    router_per_round = sum(rec.router_seconds for rec in m.rounds) / rounds
    if overlap is not None:
        overlap_per_round = overlap["overlapped_seconds"]["verify"] / rounds
    else:  # CUDA: no host timeline of the copies; the link time not spent stalled, per round
        overlap_per_round = max(0.0, c.h2d_seconds - c.exposed_seconds) / rounds
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
            draft_seconds=draft_per_round,  # AR: no draft, 0
            router_seconds=router_per_round,  # B0/B1/B2/B3: no route-ahead router pass, 0
            overlap_seconds=overlap_per_round,
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
            **(
                {
                    "draft_seconds": LatencyStats.from_samples([rec.draft_seconds for rec in m.rounds]),
                    "router_seconds": LatencyStats.from_samples([rec.router_seconds for rec in m.rounds]),
                }
                if m.speculative
                else {}
            ),
        }.items()
        if stats_ is not None
    }
    t_verify = sum(rec.forward_seconds for rec in m.rounds)
    t_draft = t_router = None
    if m.speculative:
        t_draft = sum(rec.draft_seconds for rec in m.rounds)
        t_router = sum(rec.router_seconds for rec in m.rounds)
    per_forward = Counter(rec.requests for rec in m.rounds)
    extra: dict[str, Any] = {}
    if overlap is not None:
        extra["overlap"] = overlap
    if m.speculative:
        extra["bm1"] = bm1_summary(t_router, t_verify)
        extra["draft_verify_rounds"] = len(committed)
    if rt.prefetcher is not None:
        extra["prediction"] = prediction_facts(rt, store.expert_nbytes)
    engine = {
        **m.engine,
        **extra,
        # Same prompts, same tokens: offloading must not change outputs (B0 and B3 rows carry equal digests).
        "output_digest": hashlib.sha256(json.dumps([r.output for r in m.requests]).encode()).hexdigest()[:16],
        "batch": {
            "rounds": rounds,
            "requests_per_forward_mean": sum(rec.requests for rec in m.rounds) / rounds,
            "requests_per_forward_max": max(per_forward),
            "requests_per_forward_histogram": {str(k): v for k, v in sorted(per_forward.items())},
            "tokens_per_forward_mean": sum(rec.tokens for rec in m.rounds) / rounds,
            "idle_scheduling_steps": sum(rec.idle_steps for rec in m.rounds),
            "issue_seconds": sum(rec.issue_seconds for rec in m.rounds),
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
        t_draft_seconds=t_draft,
        t_router_seconds=t_router,
        t_verify_seconds=t_verify,
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


def _merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _subtract(
    intervals: list[tuple[float, float]], holes: list[tuple[float, float]]
) -> list[tuple[float, float]]:
    out = []
    holes = _merge(holes)
    for a, b in _merge(intervals):
        cur = a
        for h0, h1 in holes:
            if h1 <= cur or h0 >= b:
                continue
            if h0 > cur:
                out.append((cur, h0))
            cur = max(cur, h1)
        if cur < b:
            out.append((cur, b))
    return out


def _covered(start: float, end: float, merged: list[tuple[float, float]], starts: list[float]) -> float:
    """Length of [start, end] inside the union ``merged`` (sorted, disjoint)."""
    total = 0.0
    i = max(0, bisect.bisect_right(starts, start) - 1)
    while i < len(merged) and merged[i][0] < end:
        a, b = merged[i]
        total += max(0.0, min(b, end) - max(a, start))
        i += 1
    return total


def transfer_overlap(cache, rounds: list[RoundRecord]) -> dict[str, Any]:
    """BM4 from the engine's own timestamps: how much of each transfer's link time fell inside the draft, router
    and verify windows while compute was running (windows minus the intervals compute waited for a transfer).
    Issue windows do not hide (as upstream's parser). Bytes are weighted like BM4: a transfer contributes
    bytes × overlapped / duration."""
    kinds = ("draft", "router", "verify")
    stalls = cache.stall_log
    windows = {
        k: _subtract([(a, b) for rec in rounds for (w, a, b) in rec.windows if w == k], stalls) for k in kinds
    }
    windows["any_compute"] = _merge([iv for k in kinds for iv in windows[k]])
    starts = {k: [a for a, _ in v] for k, v in windows.items()}
    total_bytes = sum(n for _, _, n, _ in cache.transfer_log)
    link_seconds = sum(e - s for s, e, _, _ in cache.transfer_log)
    seconds = dict.fromkeys(windows, 0.0)
    hidden_bytes = dict.fromkeys(windows, 0.0)
    for start, end, nbytes, _ in cache.transfer_log:
        duration = end - start
        for k in windows:
            ov = _covered(start, end, windows[k], starts[k])
            seconds[k] += ov
            hidden_bytes[k] += nbytes * (ov / duration if duration > 0 else float(ov > 0))
    return {
        "source": "engine timestamps: link timeline of each transfer vs the rounds' compute windows",
        "h2d_bytes": total_bytes,
        "h2d_link_seconds": link_seconds,
        "transfers": len(cache.transfer_log),
        "demand_transfers": sum(1 for *_, demand in cache.transfer_log if demand),
        "overlapped_seconds": seconds,
        "overlap_fraction": {k: (v / total_bytes if total_bytes else None) for k, v in hidden_bytes.items()},
        "stall_seconds": sum(b - a for a, b in _merge(stalls)),
    }
