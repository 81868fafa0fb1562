"""One cell's measurement, whichever engine took it, and the one function that turns it into the row.

In the manner of vLLM's ``calculate_metrics(input_requests, outputs, dur_s)``: an engine describes what its timed
loop observed as a neutral :class:`CellTrace` (per-request timings, verify rounds, cache counters, prefetch
statistics, link facts) and :func:`engine_result` derives every headline metric (``upstream.REQUIRED_METRICS``),
the status, the latency distributions, the acceptance histogram, the cost terms and the hide inequality from it,
once, here. The engines only convert: ``engine/reference/trace.py`` reads the offload runtime and the rounds,
``engine/moe_infinity/trace.py`` vets MoE-Infinity's native readings. A value an engine could not observe is
None in the trace with its reason in ``absent``; the row then has no value for it, a warning naming it, and
status PARTIAL — never a 0.0. Pure: no torch, no Ray (``pd-dflash report`` and the tests import it freely).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from pd_dflash.costmodel import bm1_summary, evaluate_hide_inequality
from pd_dflash.engine.request_metrics import RequestTiming, goodput, latency_samples, latency_stats
from pd_dflash.schema import CostTerms, EngineResult, HideInequality, Status
from pd_dflash.spec import SLO
from pd_dflash.upstream import REQUIRED_METRICS

#: Why the hide inequality has no value when no bandwidth was measured (a datasheet figure is never used).
NO_BANDWIDTH = (
    "hide_inequality not evaluated: no measured host-to-device bandwidth "
    "(no transfer in this cell and no CUDA probe; a datasheet figure is never used)"
)


@dataclass(frozen=True)
class LinkFacts:
    """The host→device link the cell ran on, and the probe's bandwidth when one was measured."""

    #: "real" (CUDA), "emulated" (CPU pacing), "host" (an un-emulated CPU host-to-host copy), "none" (resident),
    #: None where the engine does not know (MoE-Infinity on the CPU).
    kind: str | None
    emulated_gbps: float | None = None
    emulated_latency_us: float | None = None
    #: The CUDA pinned-copy probe (bytes/s) measured at load, when on a GPU.
    probe_bytes_per_second: float | None = None


@dataclass(frozen=True)
class Rounds:
    """The timed loop's verify rounds (an autoregressive step is a round that commits one token)."""

    #: Committed tokens per request per verify round (bonus included); None for an autoregressive loop whose
    #: engine does not observe its steps (τ = 1 by construction, no histogram); empty: no round was observed.
    committed: list[int] | None
    #: Seconds of each round (the reference: the round's wall time; MoE-Infinity: a request's chunk gaps).
    seconds: list[float] = field(default_factory=list)
    verify_seconds: list[float] = field(default_factory=list)
    #: Per-round drafter and router times; None where the configuration has no such phase (or it is not timed).
    draft_seconds: list[float] | None = None
    router_seconds: list[float] | None = None
    #: Verify rounds observed without per-round timestamps in a sequential (c = 1) loop: then each round took
    #: the timed window over their number.
    untimed: int = 0


@dataclass(frozen=True)
class ExpertCacheTrace:
    """What the expert cache counted over the timed loop (host→device counters None where not observed)."""

    hit_rate: float | None
    peak_occupancy_bytes: int | float | None
    h2d_bytes: int | None = None
    h2d_seconds: float | None = None
    h2d_transfers: int | None = None
    exposed_fetch_seconds: float | None = None


@dataclass(frozen=True)
class PrefetchTrace:
    """The configuration's prefetcher over the timed loop."""

    coverage: float | None
    wasted_bytes: int | None
    #: (experts predicted and ready when the verify acquired them, experts the verify routed); None: not observed.
    in_time: tuple[int, int] | None = None
    #: ``RouteAheadStats.as_dict()`` when the prefetcher issued predictions (the row's ``route_ahead``).
    route_ahead: dict[str, Any] | None = None


@dataclass(frozen=True)
class HideTerms:
    """The hide inequality's per-cell terms beside the bandwidth and the rounds' draft and router times."""

    accesses: int
    resident_at_round_start: int
    needed_per_round: list[int]
    num_experts: int
    total_expert_bytes: int
    #: Σ transfer time inside the verify windows minus stalls (``offload/overlap.py``); 0 without a link.
    overlap_seconds: float


@dataclass(frozen=True)
class CellTrace:
    """Everything one cell measured, before any metric is derived: what both engines hand to ``engine_result``."""

    requests: list[RequestTiming]
    rounds: Rounds
    timed_seconds: float
    cache: ExpertCacheTrace
    prefetch: PrefetchTrace
    kv_peak_bytes: int | float | None
    link: LinkFacts
    #: None where the engine does not observe the terms (the row then has no hide inequality).
    hide: HideTerms | None = None
    #: The row's ``engine`` facts as the engine observed them (BM1 is added here, from the phase sums).
    engine: dict[str, Any] = field(default_factory=dict)
    telemetry: dict[str, Any] | None = None
    timings: dict[str, float] = field(default_factory=dict)
    #: The engine's notes, in its order, first in the row's warnings.
    warnings: list[str] = field(default_factory=list)
    #: Why each metric the engine could not measure is absent (the metric's name first).
    absent: dict[str, str] = field(default_factory=dict)

    @property
    def elapsed(self) -> float | None:
        """The timed window as a divisor; None when it measured no time (nothing to divide by)."""
        return self.timed_seconds if self.timed_seconds > 0 else None


def engine_result(trace: CellTrace, slo: SLO) -> EngineResult:
    """The cell's row: every metric derived once from the trace; PARTIAL, with a warning naming each, when a
    required metric is absent."""
    values = headline_metrics(trace, slo)
    missing = [k for k in REQUIRED_METRICS if values[k] is None]
    bandwidth, source = measured_bandwidth(trace)
    hide, hide_warning = hide_inequality(trace, bandwidth)
    return EngineResult(
        **values,
        status=Status.PARTIAL if missing else Status.OK,
        warnings=[
            *trace.warnings,
            *absence_warnings(trace, missing),
            *([hide_warning] if hide_warning else []),
        ],
        cost_terms=cost_terms(trace, bandwidth, source),
        **phase_seconds(trace.rounds),
        latency=latency_stats({**latency_samples(trace.requests), **round_samples(trace.rounds)}),
        acceptance_histogram=acceptance_histogram(trace.rounds),
        route_ahead=trace.prefetch.route_ahead,
        prefetched_in_time_coverage=in_time_coverage(trace.prefetch),
        hide_inequality=hide,
        requests=len(trace.requests),
        generated_tokens=sum(t.tokens for t in trace.requests),
        timed_seconds=trace.timed_seconds,
        engine={**trace.engine, **bm1_facts(trace.rounds)},
        telemetry=trace.telemetry,
        timings=trace.timings,
    )


# -- headline metrics --------------------------------------------------------------------------------------------
def headline_metrics(trace: CellTrace, slo: SLO) -> dict[str, float | int | None]:
    """The ten metrics, in upstream order (byte counts stay ints); None where the trace has nothing to derive
    one from. Throughput and goodput count every generated token of the timed requests over the timed window."""
    timed, elapsed = trace.requests, trace.elapsed
    ttft = [t.ttft for t in timed if t.ttft is not None]
    values: dict[str, float | int | None] = {
        "output_tokens_per_second": sum(t.tokens for t in timed) / elapsed if elapsed else None,
        "acceptance_length_a": acceptance_length(trace.rounds),
        "ttft_seconds": sum(ttft) / len(ttft) if ttft else None,
        "per_round_latency_seconds": per_round_latency(trace.rounds, trace.timed_seconds),
        "goodput_at_slo": goodput(timed, slo, elapsed) if elapsed else None,
        "expert_cache_hit_rate": trace.cache.hit_rate,
        "route_ahead_prefetch_coverage": trace.prefetch.coverage,
        "wasted_prefetch_bytes": trace.prefetch.wasted_bytes,
        "expert_occupancy_bytes": trace.cache.peak_occupancy_bytes,
        "kv_occupancy_bytes": trace.kv_peak_bytes,
    }
    assert tuple(values) == REQUIRED_METRICS
    return values


def acceptance_length(rounds: Rounds) -> float | None:
    """τ: mean committed tokens per request per verify round; 1 by construction for an unobserved AR loop."""
    if rounds.committed is None:
        return 1.0
    return sum(rounds.committed) / len(rounds.committed) if rounds.committed else None


def acceptance_histogram(rounds: Rounds) -> dict[int, int] | None:
    """Committed tokens per verify round → number of rounds (None when no round was observed)."""
    return dict(sorted(Counter(rounds.committed).items())) if rounds.committed else None


def per_round_latency(rounds: Rounds, timed_seconds: float) -> float | None:
    """Mean round seconds; without per-round timestamps, the sequential loop's window over its rounds."""
    if rounds.seconds:
        return sum(rounds.seconds) / len(rounds.seconds)
    return timed_seconds / rounds.untimed if rounds.untimed and timed_seconds > 0 else None


def absence_warnings(trace: CellTrace, missing: list[str]) -> list[str]:
    """One warning per absent metric, in upstream order: the engine's reason, else that it was not measured. A
    reason for a metric that has a value is the converter's mistake, not a warning."""
    stray = [k for k in trace.absent if k in REQUIRED_METRICS and k not in missing]
    if stray:
        raise ValueError(f"absence reasons given for measured metrics: {stray}")
    return [trace.absent.get(k) or _derived_absence(trace, k) for k in missing]


#: Metrics divided by the timed window: absent, not invented, when the window measured no time.
PER_WINDOW = ("output_tokens_per_second", "goodput_at_slo", "per_round_latency_seconds")


def _derived_absence(trace: CellTrace, metric: str) -> str:
    if metric in PER_WINDOW and trace.timed_seconds <= 0:
        return f"{metric} absent: the timed window measured {trace.timed_seconds} s (nothing to divide by)"
    return f"{metric} absent: not measured in this cell"


def in_time_coverage(prefetch: PrefetchTrace) -> float | None:
    """Σ|{k ∈ P∩A : resident and ready when the verify acquired it}| / Σ|A| over committed rounds; absent when
    not observed or nothing was routed (the headline coverage's warning says why)."""
    if prefetch.in_time is None or prefetch.in_time[1] == 0:
        return None
    covered, actual = prefetch.in_time
    return covered / actual


# -- link, cost terms and the hide inequality ---------------------------------------------------------------------
def measured_bandwidth(trace: CellTrace) -> tuple[float | None, str | None]:
    """Host→device bytes/s and where it came from: the CUDA probe, else this cell's own transfers, else none
    (a datasheet figure is never used)."""
    c = trace.cache
    if trace.link.probe_bytes_per_second:
        return trace.link.probe_bytes_per_second, "probe"
    if c.h2d_seconds and c.h2d_bytes:
        return c.h2d_bytes / c.h2d_seconds, "transfers"
    return None, None


def cost_terms(trace: CellTrace, bandwidth: float | None, source: str | None) -> CostTerms:
    c, link = trace.cache, trace.link
    return CostTerms(
        route_ahead_coverage=trace.prefetch.coverage,
        wasted_prefetch_bytes=trace.prefetch.wasted_bytes,
        measured_h2d_bytes_per_second=bandwidth,
        h2d_bandwidth_source=source,
        h2d_link=link.kind,
        emulated_h2d_gbps=link.emulated_gbps,
        emulated_latency_us=link.emulated_latency_us,
        h2d_bytes=c.h2d_bytes,
        h2d_seconds=c.h2d_seconds,
        h2d_transfers=c.h2d_transfers,
        exposed_fetch_seconds=c.exposed_fetch_seconds,
    )


def hide_inequality(trace: CellTrace, bandwidth: float | None) -> tuple[HideInequality | None, str | None]:
    """``(1−r)·s·M/BW ≤ draft + router + overlap`` per round, from this cell's measured terms (no draft or router
    phase: 0). Absent where the engine observes no terms, or nothing was accessed; a warning without bandwidth."""
    terms, rounds = trace.hide, trace.rounds
    if terms is None:
        return None, None
    if bandwidth is None:
        return None, NO_BANDWIDTH
    if not terms.accesses:
        return None, None
    n = len(rounds.seconds)
    needed = terms.needed_per_round or [0]
    hide = evaluate_hide_inequality(
        resident_fraction=terms.resident_at_round_start / terms.accesses,
        saturation=min(1.0, (sum(needed) / len(needed)) / terms.num_experts),
        total_expert_bytes=terms.total_expert_bytes,
        measured_h2d_bytes_per_second=bandwidth,
        draft_seconds=sum(rounds.draft_seconds or []) / n,
        router_seconds=sum(rounds.router_seconds or []) / n,
        overlap_seconds=terms.overlap_seconds / n,
    )
    return hide, None


# -- phase times and distributions --------------------------------------------------------------------------------
def phase_seconds(rounds: Rounds) -> dict[str, float | None]:
    """Σ verify (target forward) time, and Σ drafter and router time where the configuration has them."""

    def total(xs: list[float] | None) -> float | None:
        return sum(xs) if xs else None

    return {
        "t_draft_seconds": total(rounds.draft_seconds),
        "t_router_seconds": total(rounds.router_seconds),
        "t_verify_seconds": total(rounds.verify_seconds),
    }


def round_samples(rounds: Rounds) -> dict[str, list[float]]:
    """Per-round distributions: round and verify times, and draft and router times where there are such phases."""
    samples = {"round_seconds": rounds.seconds, "verify_seconds": rounds.verify_seconds}
    if rounds.draft_seconds is not None:
        samples["draft_seconds"] = rounds.draft_seconds
    if rounds.router_seconds is not None:
        samples["router_seconds"] = rounds.router_seconds
    return samples


def bm1_facts(rounds: Rounds) -> dict[str, Any]:
    """BM1 (the router pass must cost less than the verify it predicts) and the verify rounds behind it, where
    the router was timed."""
    phases = phase_seconds(rounds)
    if phases["t_router_seconds"] is None or phases["t_verify_seconds"] is None:
        return {}
    return {
        "bm1": bm1_summary(phases["t_router_seconds"], phases["t_verify_seconds"]),
        "draft_verify_rounds": len(rounds.committed or []),
    }
