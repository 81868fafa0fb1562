"""Aggregation: place rows in their ``model|B{b}|c{c}`` groups, refuse duplicates, average the repeats.

Upstream keyed a group on (model, B, c) and could hold one row per baseline, so repeats could not be
aggregated. Here every (group, baseline) holds its repeats; OK and PARTIAL repeats are averaged with pandas
(mean, sample standard deviation, n, Student-t 95% interval) into one upstream-shaped row (the raw repeats
are added when result_matrix.json is written: matrix_json.py). B0 rows measured once for several block
sizes (``block_sizes_covered``) fill every group they cover. Rows are held as :class:`RowBrief` summaries.
Definitions: docs/metrics.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np
import pandas as pd

from pd_dflash.baselines import ORDER
from pd_dflash.errors import InputError
from pd_dflash.report.brief import NUMERIC_COLUMNS, RowBrief, brief_of
from pd_dflash.schema import FINAL_STATUSES, Row, Status
from pd_dflash.upstream import RATIO_METRICS, REQUIRED_METRICS


def group_key(model: str, block_size: int, concurrency: int) -> str:
    """Upstream's printed group key, e.g. ``openai/gpt-oss-20b|B16|c8``."""
    return f"{model}|B{int(block_size)}|c{int(concurrency)}"


# -- Student t ------------------------------------------------------------------------------------------


def _t_two_sided_cdf(t: float, df: int) -> float:
    """P(|T| ≤ t) for Student's t with integer ``df`` (Abramowitz & Stegun 26.7.3/26.7.4, exact sums)."""
    theta = math.atan(t / math.sqrt(df))
    c2 = math.cos(theta) ** 2
    if df % 2 == 1:
        if df == 1:
            return 2.0 / math.pi * theta
        term = total = math.cos(theta)
        for k in range(1, (df - 3) // 2 + 1):
            term *= c2 * (2 * k) / (2 * k + 1)
            total += term
        return 2.0 / math.pi * (theta + math.sin(theta) * total)
    term = total = 1.0
    for k in range(1, (df - 2) // 2 + 1):
        term *= c2 * (2 * k - 1) / (2 * k)
        total += term
    return math.sin(theta) * total


@lru_cache(maxsize=256)
def t_quantile_975(df: int) -> float:
    """The two-sided 95% critical value of Student's t (e.g. 12.706 for df=1, 1.984 for df=100)."""
    return t_quantile(df, 0.95)


@lru_cache(maxsize=1024)
def t_quantile(df: int, coverage: float) -> float:
    """The two-sided critical value of Student's t for an interval of ``coverage`` (0.95: 12.706 at df=1)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    if not 0.0 < coverage < 1.0:
        raise ValueError(f"coverage must be in (0, 1), got {coverage}")
    lo, hi = 0.0, 1e7
    for _ in range(400):
        mid = (lo + hi) / 2
        if _t_two_sided_cdf(mid, df) < coverage:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12:
            break
    return (lo + hi) / 2


def summary_stats(
    mean: float,
    std: float | None,
    n: int,
    *,
    lower: float | None = 0.0,
    upper: float | None = None,
    distinct: int | None = None,
    coverage: float = 0.95,
) -> dict[str, Any]:
    """{mean, std, n, ci95_low, ci95_high}: mean ± t(0.975, n−1)·std/√n, clipped to the column's range.

    std (sample, ddof=1) and the interval are None for n < 2, and when they exceed the float range (then
    ``no_interval`` says so). ``distinct``: how many different values the repeats hold (1: no spread, so a
    zero-width interval that is no evidence, ``confidence.py``). Another ``coverage`` (an adaptive look's,
    ``stopping.py``) widens the interval; the keys keep their names.
    """
    out: dict[str, Any] = {"mean": mean, "std": None, "n": n, "ci95_low": None, "ci95_high": None}
    if distinct is not None:
        out["distinct"] = distinct
    if n < 2 or std is None or math.isnan(std):
        return out
    half = t_quantile(n - 1, coverage) * (std / math.sqrt(n)) if math.isfinite(std) else math.inf
    low, high = mean - half, mean + half
    if not (math.isfinite(low) and math.isfinite(high)):
        out["no_interval"] = "the spread of the repeats exceeds the float range"
        return out
    if lower is not None:
        low = max(lower, low)
    if upper is not None:
        high = min(upper, high)
    return {**out, "std": std, "ci95_low": low, "ci95_high": high}


def scaled_moments(values: Sequence[float]) -> tuple[float, float | None]:
    """Mean and sample std of finite values without overflow (``1.7e308`` twice has mean ``1.7e308``): computed
    on the values divided by a power of two near the largest (exact), then scaled back. The mean is always
    finite; the std is ``inf`` when it exceeds the float range, None for one value."""
    n = len(values)
    big = max(abs(v) for v in values)
    scale = math.ldexp(1.0, math.frexp(big)[1] - 1) if big > 0 else 1.0
    ys = [v / scale for v in values]
    mean_y = math.fsum(ys) / n
    mean = min(max(mean_y * scale, -big), big)
    if n < 2:
        return mean, None
    std_y = math.sqrt(math.fsum((y - mean_y) ** 2 for y in ys) / (n - 1))
    return mean, (std_y * scale if std_y * scale < math.inf else math.inf)


# -- placement ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Placed:
    """One row as it appears in one group (a B0 row covering [8, 16] is placed twice)."""

    row: RowBrief
    source: str
    #: The group's block size (the row's own ``block_size`` unless the row is shared).
    block_size: int
    #: Block sizes the row stands for when it covers more than one, else ().
    shared: tuple[int, ...]

    @property
    def measured(self) -> bool:
        return self.row.measured


@dataclass
class Group:
    model: str
    block_size: int
    concurrency: int
    #: baseline -> its repeats, sorted by repeat.
    by_baseline: dict[str, list[Placed]] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return group_key(self.model, self.block_size, self.concurrency)


@dataclass
class Matrix:
    """Everything the gates and renderers need: groups, per-(group, baseline) stats and aggregated rows."""

    groups: dict[str, Group]
    #: (group key, baseline) -> column -> summary_stats(...) over the measured repeats.
    stats: dict[tuple[str, str], dict[str, dict[str, Any]]]
    #: group key -> baseline -> aggregated, upstream-shaped row: result_matrix.json's content without
    #: ``repeats`` and ``cost_terms``, which matrix_json.py adds from the rows themselves when it writes.
    rows: dict[str, dict[str, dict[str, Any]]]
    #: Failed rows (ERROR/TIMEOUT) replaced by a later row of the same identity: (old source, new source).
    superseded: list[tuple[str, str]]
    n_input_rows: int
    #: The coverage of the intervals in ``stats`` (0.95; an adaptive look's is wider, ``stopping.py``).
    coverage: float = 0.95

    def mean(self, key: str, baseline: str, column: str) -> float | None:
        found = self.stats.get((key, baseline), {}).get(column)
        return None if found is None else found["mean"]


def _describe(row: RowBrief) -> str:
    return (
        f"(model={row.model}, baseline={row.baseline}, block_size={row.block_size}, "
        f"concurrency={row.concurrency}, repeat={row.repeat})"
    )


def place_rows(rows: Sequence[RowBrief], sources: Sequence[str] | None = None) -> tuple[list[Placed], list]:
    """Every row in each group it fills. Duplicate identities are an InputError naming both sources.

    One exception, so a sweep's ``rows.jsonl`` after ``--retry-errors`` reads cleanly: an ERROR/TIMEOUT row
    followed (later in the input) by a row of the same identity is superseded by it, and the report lists it.
    """
    if sources is None:
        sources = [f"row {i + 1}" + (f" (cell {r.cell_id})" if r.cell_id else "") for i, r in enumerate(rows)]
    by_identity: dict[tuple, int] = {}
    kept: list[int | None] = []
    superseded: list[tuple[str, str]] = []
    for i, row in enumerate(rows):
        ident = row.identity
        j = by_identity.get(ident)
        if j is not None:
            if rows[j].status not in FINAL_STATUSES:
                superseded.append((sources[j], sources[i]))
                kept[j] = None
            else:
                raise InputError(f"duplicate identity {_describe(row)}: {sources[j]} and {sources[i]}")
        by_identity[ident] = i
        kept.append(i)

    placed: list[Placed] = []
    seen: dict[tuple, str] = {}
    for i in (k for k in kept if k is not None):
        row = rows[i]
        covered = tuple(sorted(set(row.block_sizes_covered or [row.block_size])))
        if row.block_size not in covered:
            raise InputError(
                f"block_sizes_covered {list(covered)} does not include the row's block_size {row.block_size}",
                where=sources[i],
            )
        shared = covered if len(covered) > 1 else ()
        here = sources[i] + (
            f" (row at block_size {row.block_size} shared across {list(covered)})" if shared else ""
        )
        for b in covered:
            slot = (row.group_model, row.baseline, b, row.concurrency, row.repeat)
            if slot in seen:
                raise InputError(
                    f"duplicate identity (model={row.model}, baseline={row.baseline}, block_size={b}, "
                    f"concurrency={row.concurrency}, repeat={row.repeat}): {seen[slot]} and {here}"
                )
            seen[slot] = here
            placed.append(Placed(row, sources[i], b, shared))
    return placed, superseded


# -- aggregation ----------------------------------------------------------------------------------------


def _whole(value: float) -> int:
    """A mean of whole byte counts, as a whole byte count (round half to even; the exact mean is in stats)."""
    return round(value)


def _aggregated_head(group: Group, baseline: str, repeats: list[Placed], stats: dict[str, dict]) -> dict:
    """The upstream-shaped row of one (group, baseline) from its repeats' summaries.

    Upstream writes no ``status`` on an OK row (its ``evaluate_matrix`` counts any status as blocked), so an
    aggregated OK row has none; other statuses are kept. A byte metric whose every measured repeat is an int
    stays an int (the rounded mean; ``aggregate`` keeps the exact mean).
    """
    first = repeats[0]
    measured = [p for p in repeats if p.measured]
    drafts = sorted({p.row.draft for p in repeats})
    out: dict[str, Any] = {
        "model": first.row.model,
        "draft": drafts[0] if len(drafts) == 1 else " | ".join(drafts),
        "baseline": baseline,
        "block_size": group.block_size,
        "concurrency": group.concurrency,
        "repeats_aggregated": [p.row.repeat for p in measured],
        "n_repeats": len(measured),
    }
    if measured:
        for m in REQUIRED_METRICS:
            if m in stats:
                whole = all(
                    m in p.row.whole_metrics for p in measured if p.row.numbers[_COLUMN[m]] is not None
                )
                out[m] = _whole(stats[m]["mean"]) if whole else stats[m]["mean"]
        if not all(m in out for m in REQUIRED_METRICS):
            out["status"] = Status.PARTIAL.value
        _bm1_terms(out, stats)
        out["aggregate"] = stats
    else:
        out["status"] = first.row.status.value
        reasons = sorted({p.row.reason for p in repeats if p.row.reason})
        if reasons:
            out["reason"] = "; ".join(reasons)
    warnings: list[str] = []
    for p in repeats:
        warnings.extend(w for w in p.row.warnings if w not in warnings)
    if warnings:
        out["warnings"] = warnings
    if any(p.row.status != Status.OK for p in repeats):
        out["repeat_statuses"] = {str(p.row.repeat): p.row.status.value for p in repeats}
    if first.row.ablation:
        out["ablation"] = dict(first.row.ablation)
    if first.shared:
        out["shared_across_block_sizes"] = list(first.shared)
        out["measured_at_block_size"] = first.row.block_size
    return out


def _bm1_terms(out: dict[str, Any], stats: dict[str, dict]) -> None:
    """The mean BM1 terms; t_router/t_verify only as a pair with t_verify > 0, because upstream's
    ``evaluate_matrix`` summarises (and fails on) any row carrying both (the raw terms stay in ``aggregate``)."""
    if "t_draft_seconds" in stats:
        out["t_draft_seconds"] = stats["t_draft_seconds"]["mean"]
    router, verify = stats.get("t_router_seconds"), stats.get("t_verify_seconds")
    if router is not None and verify is not None and verify["mean"] <= 0:
        return
    for name, s in (("t_router_seconds", router), ("t_verify_seconds", verify)):
        if s is not None:
            out[name] = s["mean"]


_COLUMN = {c: i for i, c in enumerate(NUMERIC_COLUMNS)}


def build_matrix(
    rows: Sequence[Row | RowBrief], sources: Sequence[str] | None = None, *, coverage: float = 0.95
) -> Matrix:
    """Group, check and aggregate rows (raises InputError on duplicates). Fast enough to run every N rows.
    ``coverage`` is that of the intervals (an adaptive look asks for a wider one)."""
    briefs = [r if isinstance(r, RowBrief) else brief_of(r) for r in rows]
    placed, superseded = place_rows(briefs, sources)
    groups: dict[tuple[str, int, int], Group] = {}
    for p in placed:
        gid = (p.row.group_model, p.block_size, p.row.concurrency)
        group = groups.setdefault(gid, Group(*gid))
        group.by_baseline.setdefault(p.row.baseline, []).append(p)
    ordered = {g.key: g for _, g in sorted(groups.items())}
    rank = {b: i for i, b in enumerate(ORDER)}
    for g in ordered.values():
        g.by_baseline = {
            b: sorted(ps, key=lambda p: p.row.repeat)
            for b, ps in sorted(g.by_baseline.items(), key=lambda kv: rank[kv[0]])
        }
    stats = _stats(
        [
            (key, p.row.baseline, *p.row.numbers)
            for key, g in ordered.items()
            for ps in g.by_baseline.values()
            for p in ps
            if p.measured
        ],
        coverage,
    )
    matrix_rows = {
        key: {b: _aggregated_head(g, b, ps, stats.get((key, b), {})) for b, ps in g.by_baseline.items()}
        for key, g in ordered.items()
    }
    return Matrix(ordered, stats, matrix_rows, superseded, len(rows), coverage)


def _stats(records: list[tuple], coverage: float = 0.95) -> dict[tuple[str, str], dict[str, dict[str, Any]]]:
    """pandas groupby over the measured repeats: mean, std (ddof=1), count, distinct values → summary_stats per
    column. A mean or std that overflows (finite values near the float range) is computed again, scaled."""
    if not records:
        return {}
    frame = pd.DataFrame.from_records(records, columns=["key", "baseline", *NUMERIC_COLUMNS])
    values = frame[list(NUMERIC_COLUMNS)].astype("float64")
    values.insert(0, "baseline", frame["baseline"])
    values.insert(0, "key", frame["key"])
    with np.errstate(over="ignore", invalid="ignore"):  # an overflow is computed again below, scaled
        agg = values.groupby(["key", "baseline"], sort=False).agg(["mean", "std", "count", "nunique"])
    out: dict[tuple[str, str], dict[str, dict[str, Any]]] = {}
    for (key, baseline), line in zip(agg.index, agg.itertuples(index=False, name=None), strict=True):
        per: dict[str, dict[str, Any]] = {}
        for i, col in enumerate(NUMERIC_COLUMNS):
            mean, std, n, distinct = line[4 * i], line[4 * i + 1], int(line[4 * i + 2]), int(line[4 * i + 3])
            if n == 0:
                continue
            std = None if n < 2 else float(std)
            if not math.isfinite(mean) or (std is not None and not math.isfinite(std)):
                chosen = values[(values["key"] == key) & (values["baseline"] == baseline)][col].dropna()
                mean, std = scaled_moments(chosen.tolist())
            upper = (
                1.0
                if col in RATIO_METRICS or col in ("route_ahead.waste_ratio", "prefetched_in_time_coverage")
                else None
            )
            lower = None if col == "hide_inequality.margin_seconds" else 0.0  # a margin may be negative
            per[col] = summary_stats(
                float(mean), std, n, lower=lower, upper=upper, distinct=distinct, coverage=coverage
            )
        out[(key, baseline)] = per
    return out
