"""Upstream's own report checks accept our files (issue 12, item 8): result_matrix.json passes upstream's
``evaluate_matrix`` and ``validate_result_matrix`` as it is, integer byte counts stay integers, plot files are
unique per model, and ``bm1_summary(row)`` answers as upstream's ``summarise_row`` does."""

from __future__ import annotations

import json
import math

import pytest

from pd_dflash.report import bm1_summary, build_report, write_outputs
from pd_dflash.rows import append_row, read_rows
from pd_dflash.schema import Row, parse_row
from pd_dflash.spec import Gates
from tests.core import upstream_oracle as upstream_report
from tests.core.helpers import synth_rows, upstream, upstream_group

BYTE_METRICS = ("wasted_prefetch_bytes", "expert_occupancy_bytes", "kv_occupancy_bytes")


def whole_bytes(cell) -> dict:
    """Byte metrics as the integers an engine measures."""
    return {
        "wasted_prefetch_bytes": 123_456_789 + cell.repeat,
        "expert_occupancy_bytes": 18_246_754_304,
        "kv_occupancy_bytes": 65_000_000 + 2 * cell.repeat,
        "cost_terms": {
            "h2d_bytes": 1000 + cell.repeat,
            "h2d_transfers": 10,
            "wasted_prefetch_bytes": 123_456_789 + cell.repeat,
        },
    }


def test_upstreams_evaluate_and_validate_accept_our_matrix_as_it_is(tmp_path):
    write_outputs(synth_rows(tweak=whole_bytes), tmp_path, Gates())
    matrix = json.loads((tmp_path / "result_matrix.json").read_text())
    assert len(matrix) == 24
    for key, group in matrix.items():
        ok, detail = upstream_report.evaluate_matrix(group)
        assert ok, (key, detail)
        assert detail["blocked"] == [] and detail["invalid"] == [] and detail["missing"] == []
        assert set(detail["bm1"]) == {"B1", "B2"}  # the speculative upstream baselines carry BM1 terms
        upstream_report.validate_result_matrix(group)  # raises on any problem
        assert all("status" not in row for row in group.values())  # upstream writes none on an OK row
        assert group["OURS"]["aggregate"] and group["OURS"]["repeats"]  # our own fields stay


def test_blocked_rows_keep_their_status_for_upstream():
    _, files = build_report([parse_row(r, where="t") for r in upstream_group()], Gates(allow_blocked=["B2"]))
    group = next(iter(json.loads(files["result_matrix.json"]).values()))
    assert group["B2"]["status"] == "BLOCKED_UNTIL_2D_SCHEDULER"
    ok, detail = upstream_report.evaluate_matrix(group, allow_blocked=["B2"])
    assert ok and detail["blocked"] == ["B2"]
    assert upstream_report.evaluate_matrix(group)[0] is False


def test_integer_byte_counts_stay_integers_in_rows_and_matrices(tmp_path):
    row = parse_row(upstream("B0", wasted_prefetch_bytes=123456789, kv_occupancy_bytes=7), where="t")
    assert type(row.wasted_prefetch_bytes) is int and type(row.kv_occupancy_bytes) is int
    append_row(tmp_path / "rows.jsonl", row)
    assert '"wasted_prefetch_bytes":123456789,' in (tmp_path / "rows.jsonl").read_text()
    assert type(read_rows(tmp_path / "rows.jsonl")[0][0].wasted_prefetch_bytes) is int
    # a float stays a float (upstream writes some byte metrics as floats)
    assert type(parse_row(upstream("B0"), where="t").expert_occupancy_bytes) is float

    _, files = build_report(synth_rows(tweak=whole_bytes), Gates())
    text = files["result_matrix.json"]
    matrix = json.loads(text)
    b1 = matrix["openai/gpt-oss-20b|B16|c1"]["B1"]
    for m in BYTE_METRICS:
        assert type(b1[m]) is int, m
    # a mean of repeats may be fractional: the row holds the rounded whole bytes, aggregate the exact mean
    assert (
        b1["wasted_prefetch_bytes"] == 123_456_790
        and b1["aggregate"]["wasted_prefetch_bytes"]["mean"] == 123456790.0
    )
    assert b1["kv_occupancy_bytes"] == 65_000_002
    assert '"wasted_prefetch_bytes": 123456790\n' in text  # an integer, never 123456790.0
    assert b1["cost_terms"] == {"h2d_bytes": 1001, "h2d_transfers": 10, "wasted_prefetch_bytes": 123_456_790}


def test_a_zero_verify_time_does_not_break_upstreams_bm1():
    def zero_verify(cell):
        return {"t_router_seconds": 0.0, "t_verify_seconds": 0.0} if cell.baseline == "B1" else {}

    _, files = build_report(synth_rows(tweak=zero_verify), Gates())
    for group in json.loads(files["result_matrix.json"]).values():
        ok, detail = upstream_report.evaluate_matrix(group)  # would raise on t_verify <= 0
        assert ok and "B1" not in detail["bm1"]
        assert group["B1"]["aggregate"]["t_verify_seconds"]["mean"] == 0.0  # the terms stay in aggregate


def test_plot_files_are_unique_per_model():
    def rows_of(model: str) -> list[Row]:
        return [parse_row({**r, "model": model}, where="t") for r in upstream_group()]

    _, files = build_report(rows_of("org/model") + rows_of("org_model"), Gates(), plots=True)
    pngs = sorted(f for f in files if f.endswith(".png"))
    assert len(pngs) == 6 and len(set(pngs)) == 6
    assert "plots/org_model_tokens_per_second.png" in pngs  # the plain form for an id with "/"
    assert any(p.startswith("plots/org_model+") for p in pngs)  # a hash keeps "org_model" apart


@pytest.mark.parametrize(
    "terms",
    [
        {"t_router_seconds": 0.002, "t_verify_seconds": 0.020},
        {"t_router_seconds": 0.03, "t_verify_seconds": 0.02},
        {"t_router_seconds": 0, "t_verify_seconds": 1},
        {"t_router_seconds": 0.02, "t_verify_seconds": 0.02},
        {"t_verify_seconds": 0.02},
        {"t_router_seconds": 0.002},
        {"t_router_seconds": -0.1, "t_verify_seconds": 0.02},
        {"t_router_seconds": 0.002, "t_verify_seconds": 0.0},
        {"t_router_seconds": math.nan, "t_verify_seconds": 0.02},
        {"t_router_seconds": 0.002, "t_verify_seconds": math.inf},
    ],
)
def test_bm1_summary_has_upstreams_summarise_row_semantics(terms):
    row = {**upstream("OURS"), **terms}
    try:
        expected = upstream_report.summarise_row(row)
    except ValueError as exc:
        with pytest.raises(ValueError) as ours:
            bm1_summary(row)
        if "missing" in str(exc):
            assert str(ours.value) == str(exc)
        return
    assert bm1_summary(row) == expected
    assert bm1_summary(parse_row(row, where="t")) == expected  # a Row works too
