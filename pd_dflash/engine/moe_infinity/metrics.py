"""Metric extraction for the MoE-Infinity adapter: native accessors, per-request latencies, acceptance.

Upstream's Phase-A harness tried a few accessor names and fell back to 0.0 with a warning. Here a metric without
an accessor is *absent*: its value is None, the warning keeps upstream's metric name at the start of the string
and says it is absent, and the row becomes PARTIAL.

Per-request TTFT, TPOT, E2E and goodput follow the shared rules of ``pd_dflash.engine.request_metrics`` (vLLM's
``benchmarks/serve.py``): a :class:`RequestTrace` becomes a ``RequestTiming`` from its submission (the request
is admitted when the client submits it). A round (chunk) is a serving step in which a request received tokens;
the round latency is the gap between a request's consecutive chunks (chunk-level ITL). Pure Python: no torch, no
moe_infinity.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from pd_dflash.engine.request_metrics import RequestTiming

#: Adapted from upstream's "<metric> fell back to 0.0" strings; the metric name stays first.
ABSENT = {
    "expert_cache_hit_rate": (
        "expert_cache_hit_rate absent: no hit-rate accessor on this MoE-Infinity build (upstream fell back to 0.0)"
    ),
    "expert_occupancy_bytes": (
        "expert_occupancy_bytes absent: no occupancy accessor on this MoE-Infinity build (upstream fell back to 0.0)"
    ),
    "kv_occupancy_bytes": (
        "kv_occupancy_bytes absent: neither the serving KV allocator nor a native accessor reported "
        "occupancy (upstream fell back to 0.0)"
    ),
    "wasted_prefetch_bytes": (
        "wasted_prefetch_bytes unavailable from RouteAheadStats; a route-ahead configuration on offloaded "
        "experts must report real bytes (absent: no native wasted-bytes accessor either)"
    ),
    "measured_h2d_bytes_per_second": (
        "measured_h2d_bytes_per_second absent: no CUDA device to probe; the hide inequality needs a "
        "measured host-to-device bandwidth"
    ),
    "acceptance_length_a": (
        "acceptance_length_a absent: no verify round result was observed (upstream fell back to 1.0)"
    ),
    "route_ahead_prefetch_coverage": (
        "route_ahead_prefetch_coverage absent: MoE-Infinity exposes no record of what its AR prefetcher "
        "predicted (RouteAheadStats observes route-ahead only, which this configuration does not use)"
    ),
    "exposed_fetch_seconds": "exposed_fetch_seconds absent: no get_exposed_fetch_seconds accessor",
}
#: The native getters behind MoE-Infinity's Python wrappers (``ExpertPrefetcher.get_hit_rate``,
#: ``expert_occupancy_bytes()``, ``wasted_prefetch_bytes()`` and the ``OffloadEngine`` properties over them), which
#: return 0.0 when every native getter is missing or raises: a 0.0 is a reading only when one of these exists.
NATIVE_GETTERS: dict[str, tuple[tuple[str, str], ...]] = {
    "expert_cache_hit_rate": (("expert_dispatcher", "get_cache_hit_rate"), ("archer_engine", "get_hit_rate")),
    "expert_occupancy_bytes": (
        ("expert_dispatcher", "get_cache_occupancy_bytes"),
        ("archer_engine", "get_expert_occupancy_bytes"),
    ),
    "wasted_prefetch_bytes": (("archer_engine", "get_wasted_prefetch_bytes"),),
}
VACUOUS_COVERAGE = (
    "route_ahead_prefetch_coverage is vacuous: 1.0 with no routed expert observed (the route-ahead seam never "
    "fired, e.g. gpt-oss experts never reach the executor)"
)
NO_ROUTE_AHEAD_STATS = (
    "route_ahead_prefetch_coverage absent: this MoE-Infinity build has no RouteAheadStats "
    "(DFlashSpeculator.enable_route_ahead_stats)"
)
HIT_RATE_CUMULATIVE = (
    "expert_cache_hit_rate covers everything since the model load: this build has no "
    "clear_expert_cache_counts to restart the counters after warm-up"
)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value) if math.isfinite(value) else None


def read_number(candidates: Iterable[tuple[str, Any, str]]) -> tuple[float | None, str | None]:
    """The first finite number among ``(label, obj, attribute)`` candidates, calling it if callable.

    Returns ``(value, "label.attribute")``, or ``(None, note)`` where the note lists accessors that raised.
    """
    errors = []
    for label, obj, name in candidates:
        if obj is None:
            continue
        value = getattr(obj, name, None)
        if callable(value):
            try:
                value = value()
            except Exception as exc:  # a native accessor that is not ready is an absent metric, not a crash
                errors.append(f"{label}.{name} raised {type(exc).__name__}: {exc}")
                continue
        number = _number(value)
        if number is not None:
            return number, f"{label}.{name}"
    return None, "; ".join(errors) or None


def _prefetcher(engine: Any) -> Any:
    return getattr(engine, "expert_prefetcher", None)


def hit_rate(engine: Any) -> tuple[float | None, str | None]:
    p = _prefetcher(engine)
    return read_number(
        [
            ("engine", engine, "expert_cache_hit_rate"),
            ("expert_prefetcher", p, "get_hit_rate"),
            ("expert_prefetcher", p, "hit_rate"),
            ("expert_prefetcher", p, "expert_hit_rate"),
            ("engine", engine, "get_hit_rate"),
            ("engine", engine, "hit_rate"),
        ]
    )


def expert_occupancy_bytes(engine: Any) -> tuple[float | None, str | None]:
    return read_number(
        [
            ("engine", engine, "expert_occupancy_bytes"),
            ("engine", engine, "get_expert_occupancy_bytes"),
            ("expert_prefetcher", _prefetcher(engine), "expert_occupancy_bytes"),
        ]
    )


def native_kv_occupancy_bytes(engine: Any) -> tuple[float | None, str | None]:
    return read_number(
        [("engine", engine, "kv_occupancy_bytes"), ("engine", engine, "get_kv_occupancy_bytes")]
    )


def native_wasted_prefetch_bytes(engine: Any) -> tuple[float | None, str | None]:
    return read_number([("expert_prefetcher", _prefetcher(engine), "wasted_prefetch_bytes")])


def exposed_fetch_seconds(engine: Any) -> tuple[float | None, str | None]:
    return read_number([("engine", engine, "get_exposed_fetch_seconds")])


def native_getter(engine: Any, metric: str) -> str | None:
    """The native getter behind the wrapper of ``metric`` (``expert_prefetcher.<holder>.<name>``), or None."""
    prefetcher = _prefetcher(engine)
    for holder, name in NATIVE_GETTERS[metric]:
        if callable(getattr(getattr(prefetcher, holder, None), name, None)):
            return f"expert_prefetcher.{holder}.{name}"
    return None


def vet_zero(metric: str, value: float | None, getter: str | None, implausible: str | None) -> str | None:
    """Why a native 0.0 is not a measurement (the metric is then absent), or None when it stands.

    MoE-Infinity's wrappers return 0.0 when the native getter is missing or raises, so a 0.0 counts only when the
    native getter is proven present (``getter``) and nothing in the cell contradicts it (``implausible``: the
    evidence against it, e.g. tokens generated through experts the hit rate says were never hit).
    """
    if value != 0.0:
        return None
    if getter is None:
        return (
            f"{metric} absent: MoE-Infinity's accessor returned 0.0 with no native getter behind it (its "
            "wrappers return 0.0 when the native getter is missing or raises)"
        )
    if implausible:
        return f"{metric} absent: {getter} read 0.0, implausible {implausible}"
    return None


def offloaded_experts(engine: Any) -> int:
    """Upstream's count for the refusal rule: native counters first, then the per-expert byte map."""
    for obj, name in ((engine, "num_offloaded_experts"), (engine, "offloaded_expert_count")):
        value = getattr(obj, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    p = _prefetcher(engine)
    value = getattr(p, "num_offloaded_experts", None)
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    nbytes = getattr(p, "expert_nbytes_map", None)
    return len(nbytes) if isinstance(nbytes, dict) else 0


def total_expert_bytes(engine: Any) -> int | None:
    """Σ stored bytes of every routed expert (the design's M), from ``expert_nbytes_map``; None if unknown."""
    nbytes = getattr(_prefetcher(engine), "expert_nbytes_map", None)
    if isinstance(nbytes, dict) and nbytes:
        return int(sum(int(v) for v in nbytes.values()))
    return None


def call_if_present(obj: Any, *path: str) -> bool:
    """Call ``obj.a.b.c()`` when every step exists; True when it was called."""
    for name in path[:-1]:
        obj = getattr(obj, name, None)
    fn = getattr(obj, path[-1], None) if obj is not None else None
    if callable(fn):
        fn()
        return True
    return False


# -- per-request latencies ------------------------------------------------------------------------------


@dataclass
class RequestTrace:
    """What the adapter observes of one request through the serving engine's token callback."""

    request_id: str
    submitted: float
    tokens: int = 0
    first_token: float | None = None
    finished: float | None = None
    #: (serving step index, time) of each step in which the request received tokens.
    chunks: list[tuple[int, float]] = field(default_factory=list)

    def timing(self) -> RequestTiming:
        """The shared per-request timing (admitted when the client submitted it)."""
        return RequestTiming(
            admitted=self.submitted, first_token=self.first_token, finished=self.finished, tokens=self.tokens
        )

    def chunk_gaps(self) -> list[float]:
        times = [t for _, t in self.chunks]
        return [b - a for a, b in itertools.pairwise(times)]


def observed_max_in_flight(traces: Iterable[RequestTrace]) -> int:
    """Most requests between their first and last chunk at one serving step (intervals inclusive)."""
    events: list[tuple[int, int]] = []
    for t in traces:
        if t.chunks:
            events.append((t.chunks[0][0], 1))
            events.append((t.chunks[-1][0] + 1, -1))
    live = best = 0
    for _, delta in sorted(events):
        live += delta
        best = max(best, live)
    return best


def clip_commits(committed_per_round: list[int], block_size: int) -> list[int]:
    """Committed tokens per verify round as upstream counts them, min(accept + 1, B) (and at least 1): τ and its
    histogram follow from these in ``measurement.py``."""
    return [min(max(c, 1), block_size) for c in committed_per_round]
