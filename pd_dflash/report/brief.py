"""What the report keeps of a row while it aggregates: a small summary, not the row.

A sweep's rows are about 10 KB each (engine facts, environment, latency distributions). The gates and tables
need a few dozen numbers and the row's identity and status, so that is all a :class:`RowBrief` holds; the whole
row is fetched again (its stored text, from its file offset; or the caller's object) only while
``result_matrix.json`` is written, one group at a time. That keeps ``pd-dflash report`` bounded on large row
files.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from pd_dflash.ablation import group_model, identity_of
from pd_dflash.costmodel import evaluate_hide_inequality
from pd_dflash.schema import MEASURED_STATUSES, Row, Status
from pd_dflash.upstream import REQUIRED_METRICS

#: Terms of the hide inequality a row stores (inputs of costmodel.evaluate_hide_inequality).
HIDE_TERMS: tuple[str, ...] = (
    "resident_fraction",
    "saturation",
    "total_expert_bytes",
    "measured_h2d_bytes_per_second",
    "draft_seconds",
    "router_seconds",
    "overlap_seconds",
)
#: Numeric row fields averaged over repeats besides the ten metrics (dotted = nested field).
EXTRA_COLUMNS: tuple[str, ...] = (
    "prefetched_in_time_coverage",
    "t_draft_seconds",
    "t_router_seconds",
    "t_verify_seconds",
    "route_ahead.waste_ratio",
    *(f"hide_inequality.{t}" for t in HIDE_TERMS),
    "hide_inequality.fetch_seconds",
    "hide_inequality.hide_window_seconds",
    "hide_inequality.margin_seconds",
    "latency.ttft_seconds.p50",
    "latency.ttft_seconds.p99",
    "latency.tpot_seconds.p50",
    "latency.tpot_seconds.p99",
    "cost_terms.measured_h2d_bytes_per_second",
    "cost_terms.h2d_bytes",
    "cost_terms.h2d_seconds",
    "cost_terms.exposed_fetch_seconds",
)
NUMERIC_COLUMNS: tuple[str, ...] = (*REQUIRED_METRICS, *EXTRA_COLUMNS)
#: Relative tolerance when comparing a row's stored hide-inequality results with the recomputed ones.
HIDE_REL_TOL = 1e-6
#: The route-ahead counters the gates read (vacuity and waste).
_ROUTE_AHEAD_KEPT = ("actual_experts", "predicted_experts", "waste_ratio")


@dataclass(frozen=True, slots=True)
class RowBrief:
    """Identity, status and numbers of one row; ``fetch()`` returns the row's stored form when it is needed."""

    model: str
    draft: str
    baseline: str
    block_size: int
    concurrency: int
    repeat: int
    status: Status
    reason: str | None
    warnings: tuple[str, ...]
    cell_id: str | None
    block_sizes_covered: tuple[int, ...] | None
    missing: tuple[str, ...]
    #: The route-ahead counters the gates read, or None when the row has no ``route_ahead``.
    route_ahead: dict[str, Any] | None
    #: NUMERIC_COLUMNS in order (hide_inequality columns recomputed from the stored terms), None if absent.
    numbers: tuple[float | None, ...]
    #: REQUIRED_METRICS whose value is an int (byte counts stay whole when every repeat's is).
    whole_metrics: frozenset[str]
    #: The recomputed hide inequality's verdict, and a text when the stored one disagrees with its terms.
    hide_hidden: bool | None
    hide_mismatch: str | None
    #: The stored ``cost_terms`` (merged over repeats in the aggregated row), or None.
    cost_terms: dict[str, Any] | None
    #: The row as stored: its JSON text (a JSON-lines row, re-read from its file) or its stored dict.
    fetch: Callable[[], str | dict[str, Any]]
    #: The row's ablation values (``ablation.ABLATION_AXES``), or None.
    ablation: dict[str, float] | None = None
    #: The device the engine ran on (``engine.device``, e.g. "cpu", "cuda:0"), or None when not recorded.
    device: str | None = None
    #: The repeat's sample seed (``Row.sample_seed``): rows of one repeat that share it are paired samples.
    sample_seed: int | None = None

    @property
    def identity(self) -> tuple:
        """Upstream's identity, plus the ablation values if any (``Row.identity``)."""
        return identity_of(
            self.model, self.baseline, self.block_size, self.concurrency, self.repeat, self.ablation
        )

    @property
    def group_model(self) -> str:
        """The model part of the row's report group key (``spec.group_model``)."""
        return group_model(self.model, self.ablation)

    @property
    def measured(self) -> bool:
        return self.status in MEASURED_STATUSES

    def missing_metrics(self) -> list[str]:
        return list(self.missing)


def _dig(obj: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        if isinstance(obj, BaseModel):
            obj = getattr(obj, part, None)
        elif isinstance(obj, dict):
            obj = obj.get(part)
        else:
            return None
    return obj


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def recompute_hide(row: Row) -> tuple[dict[str, Any] | None, str | None]:
    """The row's hide inequality evaluated again from its stored terms, and what disagrees (or None)."""
    stored = row.hide_inequality
    if stored is None:
        return None, None
    try:
        fresh = evaluate_hide_inequality(**{t: getattr(stored, t) for t in HIDE_TERMS})
    except ValueError as exc:
        return None, f"hide_inequality terms are invalid: {exc}"
    problems = []
    for name in ("fetch_seconds", "hide_window_seconds", "margin_seconds"):
        a, b = getattr(stored, name), getattr(fresh, name)
        if not math.isclose(a, b, rel_tol=HIDE_REL_TOL, abs_tol=1e-12):
            problems.append(f"{name} stored {a:.6g}, recomputed {b:.6g}")
    if stored.hidden != fresh.hidden:
        problems.append(f"hidden stored {stored.hidden}, recomputed {fresh.hidden}")
    return fresh.model_dump(), ("; ".join(problems) or None)


def brief_of(row: Row, fetch: Callable[[], str | dict[str, Any]] | None = None) -> RowBrief:
    """The summary of ``row``; ``fetch`` defaults to ``row.to_json_dict`` (the row stays referenced)."""
    hide, mismatch = recompute_hide(row)
    numbers = tuple(
        _number(hide.get(col.split(".", 1)[1]) if hide is not None else None)
        if col.startswith("hide_inequality.")
        else _number(_dig(row, col))
        for col in NUMERIC_COLUMNS
    )
    ra = row.route_ahead
    return RowBrief(
        model=row.model,
        draft=row.draft,
        baseline=row.baseline,
        block_size=row.block_size,
        concurrency=row.concurrency,
        repeat=row.repeat,
        status=row.status,
        reason=row.reason,
        warnings=tuple(row.warnings),
        cell_id=row.cell_id,
        block_sizes_covered=tuple(row.block_sizes_covered) if row.block_sizes_covered else None,
        missing=tuple(row.missing_metrics()),
        route_ahead=None if ra is None else {k: ra[k] for k in _ROUTE_AHEAD_KEPT if k in ra},
        numbers=numbers,
        whole_metrics=frozenset(m for m in REQUIRED_METRICS if type(getattr(row, m)) is int),
        hide_hidden=None if hide is None else hide["hidden"],
        hide_mismatch=mismatch,
        cost_terms=None
        if row.cost_terms is None
        else row.cost_terms.model_dump(mode="json", exclude_none=True),
        fetch=fetch or row.to_json_dict,
        ablation=dict(row.ablation) if row.ablation else None,
        device=device if isinstance(device := row.engine.get("device"), str) else None,
        sample_seed=row.sample_seed,
    )
