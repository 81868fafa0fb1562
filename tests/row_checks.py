"""Checks of stored rows and result matrices that end-to-end tests share: each metric recomputed from the row's
own raw fields, and every matrix value traced back to the row(s) it aggregates.

These are identities the definitions in docs/metrics.md imply (tokens/s = tokens / seconds, τ = the histogram's
weighted mean, coverage = covered / actual, ...), so a row whose metrics disagree with its own raw terms fails.
"""

from __future__ import annotations

import csv
import io
import json
from collections import defaultdict
from pathlib import Path

import pytest

from pd_dflash.costmodel import evaluate_hide_inequality
from pd_dflash.report.aggregate import group_key
from pd_dflash.schema import MEASURED_STATUSES, Row
from pd_dflash.spec import SweepSpec
from pd_dflash.upstream import REQUIRED_METRICS, UPSTREAM_CSV_COLUMNS


def assert_row_consistent(row: Row, spec: SweepSpec) -> None:
    """A measured row's metrics agree with its raw terms (docs/metrics.md §2 and §4)."""
    assert row.status in MEASURED_STATUSES, (row.baseline, row.status, row.reason)
    where = f"{row.baseline} B{row.block_size} c{row.concurrency} r{row.repeat}"
    # 1. tokens/s = generated tokens / timed seconds, over `requests` requests.
    assert row.requests == spec.workload.requests, where
    assert row.output_tokens_per_second == pytest.approx(row.generated_tokens / row.timed_seconds, rel=1e-9)
    # 2. τ is the weighted mean of the acceptance histogram (speculative), exactly 1 for autoregressive rows.
    if row.acceptance_histogram:
        hist = row.acceptance_histogram
        assert all(1 <= k <= row.block_size for k in hist), (where, hist)
        weighted = sum(k * n for k, n in hist.items()) / sum(hist.values())
        assert row.acceptance_length_a == pytest.approx(weighted, rel=1e-12), where
    elif row.acceptance_length_a is not None:
        assert row.acceptance_length_a == 1.0, where
    # 3. TTFT is the mean of the per-request TTFT distribution.
    if row.ttft_seconds is not None and "ttft_seconds" in row.latency:
        assert row.ttft_seconds == pytest.approx(row.latency["ttft_seconds"].mean, rel=1e-9), where
        assert row.latency["ttft_seconds"].n == row.requests, where
    # 5. Without an SLO, goodput is the throughput.
    if spec.slo.ttft_ms is None and spec.slo.tpot_ms is None and row.goodput_at_slo is not None:
        assert row.goodput_at_slo == pytest.approx(row.output_tokens_per_second, rel=1e-9), where
    # 6, 7: ratios.
    for ratio in ("expert_cache_hit_rate", "route_ahead_prefetch_coverage"):
        value = getattr(row, ratio)
        assert value is None or 0.0 <= value <= 1.0, (where, ratio, value)
    # 7, 8 against the route-ahead counters they come from (upstream's RouteAheadStats set math).
    ra = row.route_ahead
    if ra:
        if ra.get("actual_experts"):
            assert ra["coverage"] == pytest.approx(ra["covered_experts"] / ra["actual_experts"]), where
        if ra.get("predicted_experts"):
            assert ra["waste_ratio"] == pytest.approx(ra["wasted_experts"] / ra["predicted_experts"]), where
        if ra.get("predicted_prefetch_bytes") is not None:
            assert ra["predicted_prefetch_bytes"] == ra["kept_prefetch_bytes"] + ra["wasted_prefetch_bytes"]
        if row.route_ahead_prefetch_coverage is not None and row.baseline == "OURS":
            assert row.route_ahead_prefetch_coverage == ra["coverage"], where
    ct = row.cost_terms
    if ct is not None:
        assert ct.route_ahead_coverage == row.route_ahead_prefetch_coverage, where
        if row.wasted_prefetch_bytes is not None and ct.wasted_prefetch_bytes is not None:
            assert ct.wasted_prefetch_bytes == row.wasted_prefetch_bytes, where
    # The hide inequality recomputed from its own stored terms.
    hide = row.hide_inequality
    if hide is not None:
        terms = hide.model_dump()
        again = evaluate_hide_inequality(**{k: terms[k] for k in _HIDE_INPUTS})
        assert again.fetch_seconds == pytest.approx(hide.fetch_seconds, rel=1e-9), where
        assert again.hidden == hide.hidden, where


_HIDE_INPUTS = (
    "resident_fraction",
    "saturation",
    "total_expert_bytes",
    "measured_h2d_bytes_per_second",
    "draft_seconds",
    "router_seconds",
    "overlap_seconds",
)


def assert_matrix_matches_rows(out: Path, rows: list[Row]) -> dict:
    """result_matrix.json and .csv hold, per group and baseline, the mean of exactly the rows placed there.

    A row with ``block_sizes_covered`` (B0/B3 measured once) sits in every block-size group it covers.
    """
    matrix = json.loads((out / "result_matrix.json").read_text())
    placed: dict[tuple[str, str], list[Row]] = defaultdict(list)
    for row in rows:
        for b in row.block_sizes_covered or [row.block_size]:
            placed[(group_key(row.model, b, row.concurrency), row.baseline)].append(row)
    assert {(k, b) for k, group in matrix.items() for b in group} == set(placed)
    table = {(r["model"], int(r["block_size"]), int(r["concurrency"]), r["baseline"]): r for r in _csv(out)}
    for (key, baseline), group_rows in placed.items():
        cell = matrix[key][baseline]
        measured = [r for r in group_rows if r.status in MEASURED_STATUSES]
        assert cell["n_repeats"] == len(measured)
        assert cell["repeats_aggregated"] == sorted(r.repeat for r in measured)
        csv_row = table[(cell["model"], cell["block_size"], cell["concurrency"], baseline)]
        for metric in REQUIRED_METRICS:
            values = [getattr(r, metric) for r in measured if getattr(r, metric) is not None]
            if not values:
                assert cell.get(metric) is None and csv_row[metric] == "", (key, baseline, metric)
                continue
            mean, where = sum(values) / len(values), (key, baseline, metric)
            assert cell["aggregate"][metric]["mean"] == pytest.approx(mean, rel=1e-12), where
            if isinstance(cell[metric], int):  # whole byte counts stay whole: the rounded mean
                assert all(float(v).is_integer() for v in values) and cell[metric] == round(mean), where
            else:
                assert cell[metric] == pytest.approx(mean, rel=1e-12), where
            assert float(csv_row[metric]) == pytest.approx(cell[metric], rel=1e-9), (key, baseline, metric)
            assert cell["aggregate"][metric]["n"] == len(values)
        if measured:
            complete = all(cell.get(m) is not None for m in REQUIRED_METRICS)
            # upstream writes no status on an OK row
            assert cell.get("status") == (None if complete else "PARTIAL"), (key, baseline)
        shared = [r for r in group_rows if len(r.block_sizes_covered or []) > 1]
        if shared:
            assert cell["shared_across_block_sizes"] == sorted(shared[0].block_sizes_covered)
            assert cell["measured_at_block_size"] == shared[0].block_size
    return matrix


def _csv(out: Path) -> list[dict]:
    rows = list(csv.DictReader(io.StringIO((out / "result_matrix.csv").read_text())))
    assert rows and list(rows[0])[: len(UPSTREAM_CSV_COLUMNS)] == list(UPSTREAM_CSV_COLUMNS)
    return rows
