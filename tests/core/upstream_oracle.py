"""Test oracle: upstream's Phase-A report checks, restated so our files can be checked against them.

Upstream is ``benchmarks/dflash/report.py`` of the PD-DFlash Phase-A change to MoE-Infinity (EfficientMoE/
MoE-Infinity). Its three functions below are the interop contract of ``result_matrix.json``; they are written
here from upstream's documented behaviour (not copied), keeping its rules exactly:

- ``validate_result_matrix(rows)``: B0..B3 must all be present (``missing baselines: ...``); every row must
  have the ten metrics as finite, non-negative, non-bool numbers; the one exemption is a B3 row whose status is
  ``UNAVAILABLE_CAPACITY``. Raises ValueError on the first problem.
- ``evaluate_matrix(rows, allow_blocked)``: loops over B0..B3; absent → ``missing``; any truthy ``status`` →
  ``blocked`` (fails unless allowed); otherwise invalid metrics → ``invalid``; a row carrying both BM1 terms
  gets ``summarise_row`` under ``bm1`` (which raises when t_verify ≤ 0). Returns ``(ok, detail)``.
- ``summarise_row(row)``: the BM1 summary; ValueError on a missing term, a non-finite or negative term, or a
  non-positive ``t_verify_seconds``. Upstream converts with ``float()``.

Used only by tests; the package never imports this.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

REQUIRED_METRICS = (
    "output_tokens_per_second",
    "acceptance_length_a",
    "ttft_seconds",
    "per_round_latency_seconds",
    "goodput_at_slo",
    "expert_cache_hit_rate",
    "route_ahead_prefetch_coverage",
    "wasted_prefetch_bytes",
    "expert_occupancy_bytes",
    "kv_occupancy_bytes",
)
REQUIRED_BASELINES = ("B0", "B1", "B2", "B3")


def _finite_non_negative(name: str, value: Any) -> float:
    number = float(value)
    if not math.isfinite(number) or number < 0.0:
        raise ValueError(f"{name} must be finite and >= 0; got {value!r}")
    return number


def _metric_row(baseline: str, row: Mapping[str, Any]) -> None:
    for metric in REQUIRED_METRICS:
        if metric not in row:
            raise ValueError(f"{baseline} missing metric: {metric}")
        value = row[metric]
        bad = isinstance(value, bool) or not isinstance(value, (int, float))
        if bad or not math.isfinite(float(value)) or float(value) < 0.0:
            raise ValueError(f"{baseline}.{metric} must be a finite, non-negative number; got {value!r}")


def validate_result_matrix(rows: Mapping[str, Mapping[str, Any]]) -> None:
    missing = [b for b in REQUIRED_BASELINES if b not in rows]
    if missing:
        raise ValueError(f"missing baselines: {', '.join(missing)}")
    for baseline in REQUIRED_BASELINES:
        row = rows[baseline]
        if baseline == "B3" and row.get("status") == "UNAVAILABLE_CAPACITY":
            continue
        _metric_row(baseline, row)


def summarise_row(row: Mapping[str, Any]) -> dict[str, Any]:
    for key in ("t_router_seconds", "t_verify_seconds"):
        if key not in row:
            raise ValueError(f"row missing BM1 term: {key}")
    router = _finite_non_negative("t_router_seconds", row["t_router_seconds"])
    verify = _finite_non_negative("t_verify_seconds", row["t_verify_seconds"])
    if verify <= 0.0:
        raise ValueError(f"t_verify_seconds must be > 0; got {verify!r}")
    return {
        "t_router_seconds": router,
        "t_verify_seconds": verify,
        "bm1_router_to_verify_ratio": router / verify,
        "bm1_pass": router < verify,
    }


def evaluate_matrix(
    rows: Mapping[str, Mapping[str, Any]], allow_blocked: Sequence[str] = ()
) -> tuple[bool, dict[str, Any]]:
    allow = set(allow_blocked)
    detail: dict[str, Any] = {"present": sorted(rows), "blocked": [], "missing": [], "invalid": [], "bm1": {}}
    ok = True
    for baseline in REQUIRED_BASELINES:
        row = rows.get(baseline)
        if row is None:
            detail["missing"].append(baseline)
            ok = False
            continue
        if row.get("status"):
            detail["blocked"].append(baseline)
            ok = ok and baseline in allow
            continue
        try:
            _metric_row(baseline, row)
        except ValueError:
            detail["invalid"].append(baseline)
            ok = False
        if "t_router_seconds" in row and "t_verify_seconds" in row:
            detail["bm1"][baseline] = summarise_row(row)
    return ok, detail
