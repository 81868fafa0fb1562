"""The row contract's checks, each with its exact message (pd_dflash/schema.py), and the helpers behind the
latency distributions."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from pd_dflash.errors import InputError
from pd_dflash.schema import (
    BLOCKED_STATUSES,
    FAILED_STATUSES,
    FINAL_STATUSES,
    MEASURED_STATUSES,
    REASON_REQUIRED,
    EngineResult,
    LatencyStats,
    Row,
    Status,
    check_number,
    parse_row,
    percentile,
)
from pd_dflash.upstream import REQUIRED_METRICS, ROUTE_AHEAD_KEYS
from tests.helpers import exactly

METRICS = dict.fromkeys(REQUIRED_METRICS, 1.0)
IDENT = {"model": "m", "baseline": "B1", "block_size": 4, "concurrency": 1}


def fails(message: str, **data):
    with pytest.raises(ValidationError) as err:
        Row.model_validate({**IDENT, **data})
    assert [e["msg"] for e in err.value.errors()] == [f"Value error, {message}"]


def test_statuses_fall_into_their_groups():
    assert str(Status.PARTIAL) == "PARTIAL"
    assert {Status.OK, Status.PARTIAL} == MEASURED_STATUSES
    assert {
        Status.BLOCKED_UNTIL_2D_SCHEDULER,
        Status.UNAVAILABLE_CAPACITY,
        Status.REFUSED,
    } == BLOCKED_STATUSES
    assert {Status.ERROR, Status.TIMEOUT} == FAILED_STATUSES
    assert {Status.REFUSED, Status.ERROR, Status.TIMEOUT} == REASON_REQUIRED
    assert set(Status) - {Status.ERROR, Status.TIMEOUT} == FINAL_STATUSES


@pytest.mark.parametrize(
    ("value", "upper", "message"),
    [
        ("1", None, "x must be a number, got str '1'"),
        (True, None, "x must be a number, got bool True"),
        (2**63, None, "x must be at most 2**63 - 1, got an integer of about 20 digits"),
        (float("inf"), None, "x must be finite, got inf"),
        (-0.5, None, "x must be non-negative, got -0.5"),
        (1.5, 1.0, "x must be at most 1.0, got 1.5"),
    ],
)
def test_a_number_is_checked_and_named(value, upper, message):
    with pytest.raises(ValueError, match=exactly(message)):
        check_number("x", value, upper=upper)


def test_a_good_number_comes_back_as_it_was():
    assert check_number("x", 2**63 - 1) == 2**63 - 1 and isinstance(check_number("x", 3), int)
    assert check_number("x", 1.0, upper=1.0) == 1.0 and check_number("x", 0) == 0


def test_percentiles_interpolate_linearly():
    xs = [1.0, 2.0, 4.0, 8.0]
    assert [percentile(xs, q) for q in (0, 50, 90, 99, 100)] == pytest.approx([1.0, 3.0, 6.8, 7.88, 8.0])
    assert percentile([5.0], 99) == 5.0
    with pytest.raises(ValueError, match="percentile of an empty list"):
        percentile([], 50)
    s = LatencyStats.from_samples([8, 1, 4, 2])  # unsorted ints
    assert (s.n, s.mean, s.p50, s.max) == (4, 3.75, 3.0, 8.0)
    assert (s.p90, s.p99) == pytest.approx((6.8, 7.88))
    assert LatencyStats.from_samples([]) is None


def test_status_and_metrics_must_agree():
    fails("status OK but metrics missing: ttft_seconds (an unmeasured metric makes the row PARTIAL, with a warning)",
          **{**METRICS, "ttft_seconds": None})  # fmt: skip
    fails("status PARTIAL but every metric is present; use OK", **METRICS, status="PARTIAL", warnings=["w"])
    fails(
        "status PARTIAL needs a warning saying which metric is absent and why",
        status="PARTIAL",
        ttft_seconds=1.0,
    )
    fails("status ERROR must carry no metrics, found: ttft_seconds, kv_occupancy_bytes",
          status="ERROR", reason="x", ttft_seconds=1.0, kv_occupancy_bytes=1)  # fmt: skip
    fails("status TIMEOUT needs a reason", status="TIMEOUT", reason="  ")
    fails("status REFUSED needs a reason", status="REFUSED")
    assert Row.model_validate({**IDENT, "status": "BLOCKED_UNTIL_2D_SCHEDULER"}).reason is None
    partial = Row.model_validate({**IDENT, "status": "PARTIAL", "ttft_seconds": 1.0, "warnings": ["w"]})
    assert partial.present_metrics() == ["ttft_seconds"] and len(partial.missing_metrics()) == 9


def test_ratio_metrics_are_at_most_one_and_metrics_never_negative():
    fails("expert_cache_hit_rate must be at most 1.0, got 1.5", **{**METRICS, "expert_cache_hit_rate": 1.5})
    fails("kv_occupancy_bytes must be non-negative, got -1", **{**METRICS, "kv_occupancy_bytes": -1})
    row = Row.model_validate({**IDENT, **METRICS, "output_tokens_per_second": 1e9})
    assert row.output_tokens_per_second == 1e9  # not a ratio: no upper bound


def test_route_ahead_keys_are_upstreams_put_in_their_order():
    fails(
        "unknown route_ahead keys ['hits']; expected " + str(list(ROUTE_AHEAD_KEYS)),
        **METRICS,
        route_ahead={"hits": 1},
    )
    fails("route_ahead.coverage must be non-negative, got -0.5", **METRICS, route_ahead={"coverage": -0.5})
    row = Row.model_validate(
        {**IDENT, **METRICS, "route_ahead": {"waste_ratio": 0.5, "steps": 2, "coverage": None}}
    )
    assert (
        list(row.route_ahead) == ["steps", "coverage", "waste_ratio"] and row.route_ahead["coverage"] is None
    )


def test_tau_lies_between_one_and_the_block_size():
    fails(
        "acceptance_length_a must lie in [1, block_size=4], got 0.5",
        **{**METRICS, "acceptance_length_a": 0.5},
    )
    fails(
        "acceptance_length_a must lie in [1, block_size=4], got 4.01",
        **{**METRICS, "acceptance_length_a": 4.01},
    )
    for tau in (1.0, 4.0, 1.0 - 1e-10, 4.0 + 1e-10):
        assert Row.model_validate({**IDENT, **METRICS, "acceptance_length_a": tau}).acceptance_length_a == tau


def test_the_stored_form_puts_identity_and_metrics_first_and_drops_what_is_empty():
    row = Row.model_validate(
        {"kv_occupancy_bytes": 1, **{k: v for k, v in METRICS.items() if k != "kv_occupancy_bytes"}, **IDENT,
         "draft": "d", "cell_id": "c", "engine": {}, "timings": {}, "latency": {}, "warnings": []}
    )  # fmt: skip
    stored = row.to_json_dict()
    assert list(stored)[:16] == [
        "model",
        "draft",
        "baseline",
        "block_size",
        "concurrency",
        "repeat",
        *REQUIRED_METRICS,
    ]
    assert list(stored)[16:] == ["status", "cell_id", "attempt"]
    assert stored["status"] == "OK" and stored["kv_occupancy_bytes"] == 1
    kept = Row.model_validate(
        {**IDENT, **METRICS, "engine": {"a": 1}, "timings": {"t": 1.0}, "warnings": ["w"]}
    )
    assert {"engine", "timings", "warnings"} <= set(kept.to_json_dict())


def test_parse_row_names_the_place():
    with pytest.raises(InputError) as err:
        parse_row([1], where="f:3")
    assert str(err.value) == "f:3: a row must be a JSON object, got list"
    with pytest.raises(InputError) as err:
        parse_row({**IDENT, **METRICS, "ttft_seconds": "x"}, where="f:4")
    assert str(err.value).startswith("f:4: ") and "ttft_seconds" in str(err.value)


def test_an_engine_result_lists_its_present_and_missing_metrics():
    r = EngineResult(status="PARTIAL", warnings=["w"], ttft_seconds=0.5, kv_occupancy_bytes=0)
    assert r.present_metrics() == ["ttft_seconds", "kv_occupancy_bytes"]
    assert r.missing_metrics() == [
        m for m in REQUIRED_METRICS if m not in ("ttft_seconds", "kv_occupancy_bytes")
    ]
