"""Byte counts stay integers end to end: the real reference engine's rows, as ``rows.jsonl`` stores them, and the
result matrix ``pd-dflash report`` builds from that file (not a hand-built row: the interop tests build theirs by
hand, so they never saw what the engine emits)."""

from __future__ import annotations

import json

import pytest

from pd_dflash.report import effective_gates, open_inputs, write_outputs
from pd_dflash.rows import ROWS_FILE, append_row
from pd_dflash.schema import Row
from pd_dflash.spec import expand
from tests.engine.reference.helpers import make_engine, make_spec

BYTE_METRICS = ("wasted_prefetch_bytes", "expert_occupancy_bytes", "kv_occupancy_bytes")
BYTE_COST_TERMS = ("wasted_prefetch_bytes", "h2d_bytes", "h2d_transfers")


@pytest.fixture(scope="module")
def results_dir(micro, tmp_path_factory):
    """Two repeats of B0 and OURS at c = 1 through the real engine, appended as a sweep's collector does."""
    spec = make_spec(
        baselines=("B0", "OURS"),
        concurrency=(1,),
        repeats=2,
        options={"emulated_h2d_gbps": 2.0, "emulated_latency_us": 5.0},
    )
    out = tmp_path_factory.mktemp("engine-rows")
    engine = make_engine(spec)
    try:
        for cell in expand(spec):
            append_row(out / ROWS_FILE, Row.from_result(cell, engine.run_cell(cell)))
    finally:
        engine.close()
    return spec, out


def _assert_whole(where: str, obj: dict, names: tuple[str, ...]) -> None:
    for name in names:
        if name in obj:
            assert type(obj[name]) is int, f"{where}.{name} is {obj[name]!r}, not an int"


def test_engine_rows_store_byte_counts_as_ints(results_dir):
    _, out = results_dir
    lines = [json.loads(line) for line in (out / ROWS_FILE).read_text().splitlines()]
    assert len(lines) == 4
    for i, row in enumerate(lines):
        assert all(m in row for m in BYTE_METRICS), row.get("warnings")
        _assert_whole(f"row {i}", row, BYTE_METRICS)
        _assert_whole(f"row {i}.cost_terms", row["cost_terms"], BYTE_COST_TERMS)
    ours = [r for r in lines if r["baseline"] == "OURS"]
    # OURS prefetched: its wasted bytes are a real count (the figure that used to come out as 59454720.0)
    assert all(r["route_ahead"]["predicted_experts"] > 0 for r in ours)
    assert all(r["wasted_prefetch_bytes"] == r["route_ahead"]["wasted_prefetch_bytes"] for r in ours)


def test_the_matrix_of_engine_rows_keeps_byte_counts_integral(results_dir):
    spec, out = results_dir
    with open_inputs([out]) as (rows, sources):
        write_outputs(rows, out / "report", effective_gates(spec), spec=spec, sources=sources)
    matrix = json.loads((out / "report" / "result_matrix.json").read_text())
    (group,) = matrix.values()
    for baseline in ("B0", "OURS"):
        agg = group[baseline]
        assert agg["n_repeats"] == 2
        # the aggregated row: the mean of two whole byte counts, rounded to a whole byte count
        _assert_whole(baseline, agg, BYTE_METRICS)
        _assert_whole(f"{baseline}.cost_terms", agg["cost_terms"], BYTE_COST_TERMS)
        for m in BYTE_METRICS:
            exact = agg["aggregate"][m]["mean"]
            assert abs(agg[m] - exact) <= 0.5
        for i, repeat in enumerate(agg["repeats"]):
            _assert_whole(f"{baseline}.repeats[{i}]", repeat, BYTE_METRICS)
