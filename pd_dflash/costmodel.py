"""The design's cost model: the hide inequality and the BM1 router-cost check (pure arithmetic; docs/metrics.md).

Engines call :func:`evaluate_hide_inequality` with the terms they measured; the report re-evaluates it from
the stored terms, so a row and its verdict can never disagree. BW is always a measured figure.
"""

from __future__ import annotations

import math

from pd_dflash.errors import excerpt
from pd_dflash.schema import MAX_INT, HideInequality


def _check(
    name: str, value: float, *, low: float = 0.0, high: float | None = None, strict: bool = False
) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a finite number, got {excerpt(value)}")
    if isinstance(value, int) and abs(value) > MAX_INT:
        raise ValueError(f"{name} must be at most 2**63 - 1, got {excerpt(value)}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value!r}")
    if value < low or (strict and value == low):
        raise ValueError(f"{name} must be {'>' if strict else '>='} {low}, got {value!r}")
    if high is not None and value > high:
        raise ValueError(f"{name} must be <= {high}, got {value!r}")
    return float(value)


def evaluate_hide_inequality(
    *,
    resident_fraction: float,
    saturation: float,
    total_expert_bytes: float,
    measured_h2d_bytes_per_second: float,
    draft_seconds: float,
    router_seconds: float,
    overlap_seconds: float,
) -> HideInequality:
    """``(1−r)·s·M / BW ≤ t_draft + t_router + overlap`` (inclusive), as upstream's report evaluates it.

    r: fraction of the round's needed expert bytes already resident; s: fraction of all routed-expert bytes
    M the round touches; BW: measured host→device bytes/s; the window terms are seconds per round.
    """
    r = _check("resident_fraction", resident_fraction, high=1.0)
    s = _check("saturation", saturation, high=1.0)
    m = _check("total_expert_bytes", total_expert_bytes)
    m = total_expert_bytes if isinstance(total_expert_bytes, int) else m  # bytes stay whole
    bw = _check("measured_h2d_bytes_per_second", measured_h2d_bytes_per_second, strict=True)
    draft = _check("draft_seconds", draft_seconds)
    router = _check("router_seconds", router_seconds)
    overlap = _check("overlap_seconds", overlap_seconds)
    fetch = (1.0 - r) * s * m / bw
    window = draft + router + overlap
    return HideInequality(
        resident_fraction=r,
        saturation=s,
        total_expert_bytes=m,
        measured_h2d_bytes_per_second=bw,
        draft_seconds=draft,
        router_seconds=router,
        overlap_seconds=overlap,
        fetch_seconds=fetch,
        hide_window_seconds=window,
        margin_seconds=window - fetch,
        hidden=fetch <= window,
    )


def bm1_summary(t_router_seconds: float, t_verify_seconds: float) -> dict[str, float | bool]:
    """BM1: the route-ahead router pass must cost less than the verify it predicts (strict)."""
    router = _check("t_router_seconds", t_router_seconds)
    verify = _check("t_verify_seconds", t_verify_seconds, strict=True)
    return {
        "t_router_seconds": router,
        "t_verify_seconds": verify,
        "bm1_router_to_verify_ratio": router / verify,
        "bm1_pass": router < verify,
    }
