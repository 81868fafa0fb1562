"""Row contract: upstream metrics and units, honest statuses, errors that name the field."""

from __future__ import annotations

import json
import math

import pytest

from pd_dflash.errors import InputError
from pd_dflash.rows import append_row, read_rows, repair_torn_tail
from pd_dflash.schema import EngineResult, Row, Status, parse_row
from pd_dflash.spec import expand, parse_spec
from pd_dflash.upstream import REQUIRED_METRICS, ROUTE_AHEAD_KEYS

METRICS = {
    "output_tokens_per_second": 64.9,
    "acceptance_length_a": 3.5,
    "ttft_seconds": 0.29,
    "per_round_latency_seconds": 0.015,
    "goodput_at_slo": 64.9,
    "expert_cache_hit_rate": 0.76,
    "route_ahead_prefetch_coverage": 0.9,
    "wasted_prefetch_bytes": 1024.0,
    "expert_occupancy_bytes": 18246754304.0,
    "kv_occupancy_bytes": 65536.0,
}


def upstream_row(**over):
    row = {
        "model": "openai/gpt-oss-20b",
        "draft": "z-lab/gpt-oss-20b-DFlash",
        "baseline": "OURS",
        "block_size": 16,
        "concurrency": 1,
        "repeat": 0,
        **METRICS,
    }
    row.update(over)
    return row


def test_required_metrics_order_is_upstreams():
    assert REQUIRED_METRICS[0] == "output_tokens_per_second"
    assert REQUIRED_METRICS[-1] == "kv_occupancy_bytes"
    assert len(REQUIRED_METRICS) == len(set(REQUIRED_METRICS)) == 10


def test_upstream_row_parses_as_ok():
    row = parse_row(upstream_row(), where="f:1")
    assert row.status == Status.OK and row.identity == ("openai/gpt-oss-20b", "OURS", 16, 1, 0)


def test_upstream_blocked_row_needs_no_reason_and_no_metrics():
    blocked = {k: v for k, v in upstream_row(baseline="B2").items() if k not in METRICS}
    row = parse_row({**blocked, "status": "BLOCKED_UNTIL_2D_SCHEDULER"}, where="f:2")
    assert row.status == Status.BLOCKED_UNTIL_2D_SCHEDULER and row.present_metrics() == []


@pytest.mark.parametrize(
    ("metric", "value", "needle"),
    [
        ("ttft_seconds", float("nan"), "finite"),
        ("ttft_seconds", -1.0, "non-negative"),
        ("kv_occupancy_bytes", True, "must be a number"),
        ("expert_cache_hit_rate", 1.5, "at most 1.0"),
        ("output_tokens_per_second", "fast", "must be a number"),
    ],
)
def test_bad_metric_values_name_the_field(metric, value, needle):
    with pytest.raises(InputError) as err:
        parse_row(upstream_row(**{metric: value}), where="rows.jsonl:3")
    assert metric in str(err.value) and needle in str(err.value) and "rows.jsonl:3" in str(err.value)


def test_ok_row_missing_a_metric_is_rejected():
    data = upstream_row()
    del data["kv_occupancy_bytes"]
    with pytest.raises(InputError, match="kv_occupancy_bytes"):
        parse_row(data, where="x")


def test_partial_row_carries_a_warning_and_no_fake_zero():
    data = upstream_row(status="PARTIAL", warnings=["kv_occupancy_bytes: no accessor on this engine"])
    del data["kv_occupancy_bytes"]
    row = parse_row(data, where="x")
    assert row.missing_metrics() == ["kv_occupancy_bytes"]
    assert "kv_occupancy_bytes" not in row.to_json_dict()
    with pytest.raises(InputError, match="needs a warning"):
        parse_row({**data, "warnings": []}, where="x")


def test_unknown_status_and_metrics_on_failed_rows():
    with pytest.raises(InputError, match="status"):
        parse_row(upstream_row(status="MAYBE"), where="x")
    with pytest.raises(InputError, match="must carry no metrics"):
        parse_row(upstream_row(status="ERROR", reason="boom"), where="x")
    bare = {k: v for k, v in upstream_row().items() if k not in METRICS}
    with pytest.raises(InputError, match="needs a reason"):
        parse_row({**bare, "status": "TIMEOUT"}, where="x")


def test_acceptance_length_bounded_by_block_size():
    with pytest.raises(InputError, match="acceptance_length_a"):
        parse_row(upstream_row(acceptance_length_a=17.0), where="x")
    with pytest.raises(InputError, match="acceptance_length_a"):
        parse_row(upstream_row(acceptance_length_a=0.5), where="x")


def test_route_ahead_keys_are_upstreams_in_order():
    stats = {k: 0 for k in reversed(ROUTE_AHEAD_KEYS)}
    result = EngineResult(**METRICS, route_ahead=stats)
    assert list(result.route_ahead) == list(ROUTE_AHEAD_KEYS)
    with pytest.raises(ValueError, match="unknown route_ahead keys"):
        EngineResult(**METRICS, route_ahead={"coverage": 1.0, "bogus": 1})


def test_row_from_result_and_json_order():
    spec = parse_spec(
        {
            "name": "t",
            "models": [{"id": "m", "draft": "d"}],
            "baselines": ["OURS"],
            "block_sizes": [8],
            "concurrency": [2],
            "repeats": 1,
        }
    )
    cell = expand(spec)[0]
    row = Row.from_result(cell, EngineResult(**{**METRICS, "acceptance_length_a": 4.0}), attempt=2)
    data = row.to_json_dict()
    assert list(data)[:6] == ["model", "draft", "baseline", "block_size", "concurrency", "repeat"]
    assert list(data)[6:16] == list(REQUIRED_METRICS)
    assert data["cell_id"] == cell.cell_id and data["attempt"] == 2 and data["status"] == "OK"
    failed = Row.without_metrics(cell, Status.ERROR, "engine raised")
    assert failed.present_metrics() == [] and failed.reason == "engine raised"


def test_append_and_torn_tail(tmp_path):
    path = tmp_path / "rows.jsonl"
    append_row(path, parse_row(upstream_row(), where="x"))
    append_row(path, parse_row(upstream_row(concurrency=2), where="x"))
    with open(path, "a") as fh:
        fh.write('{"model": "cut mid-wri')
    with pytest.raises(InputError, match=r"rows\.jsonl:3.*torn"):
        read_rows(path)
    rows, torn = read_rows(path, tolerate_torn_tail=True)
    assert len(rows) == 2 and torn is not None
    aside = repair_torn_tail(path, torn)
    assert read_rows(path) == (rows, None)
    assert "cut mid-wri" in aside.read_text()


def test_torn_line_in_the_middle_is_an_error_even_for_resume(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(upstream_row()) + "\n{oops\n" + json.dumps(upstream_row(concurrency=2)) + "\n")
    with pytest.raises(InputError, match=r"rows\.jsonl:2"):
        read_rows(path, tolerate_torn_tail=True)


def test_upstream_list_and_single_object_files(tmp_path):
    lst = tmp_path / "qwen.json"
    lst.write_text(json.dumps([upstream_row(), upstream_row(concurrency=2)], indent=2))
    single = tmp_path / "one.json"
    single.write_text(json.dumps(upstream_row()))
    assert len(read_rows(lst)[0]) == 2 and len(read_rows(single)[0]) == 1
    lst.write_text(
        json.dumps([upstream_row(), upstream_row(ttft_seconds=math.inf)]).replace("Infinity", "1e999")
    )
    with pytest.raises(InputError, match=r"qwen\.json\[1\].*ttft_seconds"):
        read_rows(lst)


def test_the_percentile_of_nothing_is_refused_in_these_words():
    from pd_dflash.schema import percentile

    with pytest.raises(ValueError) as err:
        percentile([], 50)
    assert str(err.value) == "percentile of an empty list"


def test_the_stored_form_is_plain_json_data():
    """``to_json_dict`` is what rows.jsonl stores and what a runner sends: JSON data already, so it equals its
    own JSON round trip: histogram keys are text, and a NaN an engine put in a free-form field is null (a
    NaN in the file would make the row unreadable)."""
    row = parse_row(
        upstream_row(acceptance_histogram={1: 2, 3: 5}, engine={"name": "x", "spread": math.nan}), where="t"
    )
    assert row.acceptance_histogram == {1: 2, 3: 5} and math.isnan(row.engine["spread"])
    data = row.to_json_dict()
    assert data["acceptance_histogram"] == {"1": 2, "3": 5}
    assert data["engine"] == {"name": "x", "spread": None}
    assert json.loads(json.dumps(data, allow_nan=False)) == data


def test_the_stored_form_keeps_latency_and_drops_empty_fields():
    stats = {"n": 2, "mean": 0.25, "p50": 0.25, "p90": 0.29, "p99": 0.299, "max": 0.3}
    data = parse_row(upstream_row(latency={"ttft_seconds": stats}), where="t").to_json_dict()
    assert data["latency"] == {"ttft_seconds": stats}
    bare = parse_row(upstream_row(), where="t").to_json_dict()
    assert not {"latency", "warnings", "engine", "timings"} & set(bare)


def test_a_row_attaches_the_cells_identity_and_keeps_the_result_as_it_is():
    """``from_result`` adds identity and bookkeeping only: the result's free-form values stay as the engine
    gave them (a None included), and a single-valued cell's row has no ablation (the stored row none either)."""
    spec = parse_spec(
        {
            "name": "t",
            "models": [{"id": "m", "draft": "d"}],
            "baselines": ["OURS"],
            "block_sizes": [8],
            "concurrency": [2],
            "repeats": 1,
        }
    )
    cell = expand(spec)[0]
    result = EngineResult(
        **METRICS,
        engine={"name": "x", "preset": None},
        route_ahead={"steps": 4, "coverage": None},
    )
    row = Row.from_result(cell, result, attempt=1)
    assert row.engine == {"name": "x", "preset": None}
    assert row.route_ahead == {"steps": 4, "coverage": None}
    assert row.ablation is None and "ablation" not in row.to_json_dict()
    failed = Row.without_metrics(cell, Status.ERROR, "engine raised")
    assert failed.ablation is None and "ablation" not in failed.to_json_dict()
