"""Aggregation over repeats (report/aggregate.py, report/brief.py) against an independent computation: Python's
``statistics`` for mean and sample std, a t table for the interval, and hand-built rows for placement.

One group (m, B=8, c=1); OURS has three repeats whose values are chosen so every mean is exact.
"""

from __future__ import annotations

import math
import statistics

import pytest

from pd_dflash.costmodel import evaluate_hide_inequality
from pd_dflash.errors import InputError
from pd_dflash.report.aggregate import _t_two_sided_cdf, build_matrix, summary_stats, t_quantile_975
from pd_dflash.report.brief import EXTRA_COLUMNS, NUMERIC_COLUMNS, brief_of, recompute_hide
from pd_dflash.schema import Row, Status
from pd_dflash.spec import expand
from pd_dflash.upstream import REQUIRED_METRICS
from tests.core.helpers import HIDE, KEY, gate_spec, result, rows_of
from tests.helpers import exactly

T2 = 4.302652729911275  # t(0.975, 2)


def three_repeats(**ours):
    return rows_of(gate_spec(repeats=3), OURS=ours)


# -- Student t --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("t", "df", "p"),
    [(1.0, 1, 0.5), (12.706204736174696, 1, 0.95), (T2, 2, 0.95), (3.182446305284263, 3, 0.95),
     (2.776445105197799, 4, 0.95), (2.570581835636314, 5, 0.95), (2.364624251592785, 7, 0.95),
     (2.262157162740992, 9, 0.95), (0.0, 7, 0.0)],
)  # fmt: skip
def test_the_t_distribution_two_sided_cdf_against_a_table(t, df, p):
    assert _t_two_sided_cdf(t, df) == pytest.approx(p, abs=1e-9)


def test_the_t_quantile_is_cached_per_degree_of_freedom_and_refuses_zero():
    t_quantile_975.cache_clear()
    assert t_quantile_975(2) == pytest.approx(T2, abs=1e-9)
    assert t_quantile_975(6) == pytest.approx(2.446911851144969, abs=1e-9)
    with pytest.raises(ValueError, match=exactly("degrees of freedom must be >= 1, got 0")):
        t_quantile_975(0)


def test_summary_stats_interval_and_its_clipping():
    s = summary_stats(10.0, 2.0, 3)
    half = T2 * 2.0 / math.sqrt(3)
    assert s["ci95_low"] == pytest.approx(10.0 - half, abs=1e-9) and s["ci95_high"] == pytest.approx(
        10.0 + half
    )
    assert summary_stats(1.0, 2.0, 3)["ci95_low"] == 0.0  # clipped at the lower bound
    assert summary_stats(0.5, 1.0, 3, upper=1.0)["ci95_high"] == 1.0  # a ratio stays <= 1
    assert summary_stats(-1.0, 1.0, 3, lower=None)["ci95_low"] == pytest.approx(-1.0 - T2 / math.sqrt(3))
    assert summary_stats(1.0, float("nan"), 3) == {
        "mean": 1.0,
        "std": None,
        "n": 3,
        "ci95_low": None,
        "ci95_high": None,
    }
    assert summary_stats(1.0, None, 2)["ci95_high"] is None and summary_stats(1.0, 0.5, 1)["std"] is None


# -- the aggregated row --------------------------------------------------------------------------------------


def test_every_metric_is_the_mean_of_the_measured_repeats_with_its_sample_std():
    tokens = [40.0, 45.0, 50.0]
    kv = [1000, 2000, 4000]
    rows = three_repeats(output_tokens_per_second=lambda r: tokens[r], kv_occupancy_bytes=lambda r: kv[r])
    matrix = build_matrix(rows)
    ours = matrix.rows[KEY]["OURS"]
    agg = matrix.stats[(KEY, "OURS")]
    assert ours["output_tokens_per_second"] == statistics.mean(tokens) == 45.0
    assert agg["output_tokens_per_second"]["std"] == pytest.approx(statistics.stdev(tokens))
    assert agg["output_tokens_per_second"]["n"] == 3
    half = T2 * statistics.stdev(tokens) / math.sqrt(3)
    assert agg["output_tokens_per_second"]["ci95_low"] == pytest.approx(45.0 - half)
    # Whole byte counts stay whole: the rounded mean (2333.33 -> 2333); the exact mean is in the stats.
    assert ours["kv_occupancy_bytes"] == 2333 and isinstance(ours["kv_occupancy_bytes"], int)
    assert agg["kv_occupancy_bytes"]["mean"] == pytest.approx(7000 / 3)
    assert ours["repeats_aggregated"] == [0, 1, 2] and ours["n_repeats"] == 3
    assert "status" not in ours and "repeat_statuses" not in ours
    assert (ours["model"], ours["draft"], ours["baseline"], ours["block_size"], ours["concurrency"]) == (
        "m",
        "micro-dflash",
        "OURS",
        8,
        1,
    )
    assert set(ours["aggregate"]) <= set(NUMERIC_COLUMNS)
    assert matrix.mean(KEY, "OURS", "t_draft_seconds") == 0.5 and matrix.mean(KEY, "B2", "x") is None


def test_a_mean_of_halves_rounds_to_even_and_float_bytes_stay_floats():
    rows = three_repeats(
        expert_occupancy_bytes=lambda r: [1, 2, 2][r] * 3 + [0, 0, 1][r],  # 3, 6, 7: mean 5.33 -> 5
        wasted_prefetch_bytes=lambda r: [1.5, 2.5, 2.0][r],  # floats: mean 2.0 stays a float
    )
    ours = build_matrix(rows).rows[KEY]["OURS"]
    assert ours["expert_occupancy_bytes"] == 5 and isinstance(ours["expert_occupancy_bytes"], int)
    assert ours["wasted_prefetch_bytes"] == 2.0 and isinstance(ours["wasted_prefetch_bytes"], float)
    halves = build_matrix(rows_of(gate_spec(repeats=2), OURS={"kv_occupancy_bytes": lambda r: [2, 3][r]}))
    assert halves.rows[KEY]["OURS"]["kv_occupancy_bytes"] == 2  # 2.5 -> 2 (half to even)


def test_ratio_intervals_stop_at_one_and_the_hide_margin_may_go_negative():
    rows = three_repeats(
        expert_cache_hit_rate=lambda r: [0.5, 1.0, 1.0][r],
        hide_inequality=lambda r: evaluate_hide_inequality(
            **{**HIDE, "total_expert_bytes": [8.0, 12.0, 16.0][r]}
        ),
    )
    agg = build_matrix(rows).stats[(KEY, "OURS")]
    assert agg["expert_cache_hit_rate"]["ci95_high"] == 1.0
    margins = [1.25 - 1.0, 1.25 - 1.5, 1.25 - 2.0]  # window 1.25 s; fetch M/8 s
    m = agg["hide_inequality.margin_seconds"]
    assert m["mean"] == pytest.approx(statistics.mean(margins))
    assert m["ci95_low"] == pytest.approx(
        statistics.mean(margins) - T2 * statistics.stdev(margins) / math.sqrt(3)
    )
    assert m["ci95_low"] < 0
    assert agg["hide_inequality.fetch_seconds"]["mean"] == pytest.approx(1.5)


def test_repeats_that_were_not_measured_are_listed_not_averaged():
    s = gate_spec(repeats=3)
    rows = rows_of(
        s,
        status={("OURS", 1): (Status.ERROR, "boom")},
        OURS={"output_tokens_per_second": lambda r: [40.0, 0, 50.0][r]},
    )
    ours = build_matrix(rows).rows[KEY]["OURS"]
    assert ours["output_tokens_per_second"] == 45.0 and ours["n_repeats"] == 2
    assert ours["repeats_aggregated"] == [0, 2] and ours["repeat_statuses"] == {
        "0": "OK",
        "1": "ERROR",
        "2": "OK",
    }
    rows = rows_of(gate_spec(), status={("OURS", 0): (Status.TIMEOUT, "slow")})
    failed = build_matrix(rows).rows[KEY]["OURS"]
    assert failed["status"] == "TIMEOUT" and failed["reason"] == "slow" and failed["n_repeats"] == 0
    assert "output_tokens_per_second" not in failed and "aggregate" not in failed


def test_a_metric_absent_from_every_repeat_makes_the_aggregate_partial_and_warnings_are_merged():
    rows = three_repeats(
        kv_occupancy_bytes=None, status="PARTIAL", warnings=lambda r: ["kv absent", f"note {r % 2}"]
    )
    ours = build_matrix(rows).rows[KEY]["OURS"]
    assert ours["status"] == "PARTIAL" and "kv_occupancy_bytes" not in ours
    assert ours["warnings"] == ["kv absent", "note 0", "note 1"]


def test_bm1_terms_in_the_aggregate_follow_upstream():
    ours = build_matrix(rows_of(gate_spec())).rows[KEY]["OURS"]
    assert (ours["t_draft_seconds"], ours["t_router_seconds"], ours["t_verify_seconds"]) == (0.5, 0.125, 1.0)
    zero = build_matrix(rows_of(gate_spec(), OURS={"t_verify_seconds": 0.0})).rows[KEY]["OURS"]
    assert (
        "t_router_seconds" not in zero and "t_verify_seconds" not in zero and zero["t_draft_seconds"] == 0.5
    )
    b0 = build_matrix(rows_of(gate_spec())).rows[KEY]["B0"]
    assert "t_draft_seconds" not in b0 and "t_router_seconds" not in b0


def test_drafts_differing_between_repeats_are_joined():
    rows = rows_of(gate_spec(repeats=2))
    rows = [r.model_copy(update={"draft": "d2"}) if (r.baseline, r.repeat) == ("B1", 1) else r for r in rows]
    assert build_matrix(rows).rows[KEY]["B1"]["draft"] == "d2 | micro-dflash"


# -- placement ----------------------------------------------------------------------------------------------


def test_groups_and_baselines_come_in_a_fixed_order():
    s = gate_spec(models=("n", "m"), block_sizes=(16, 8), repeats=2)
    rows = list(reversed(rows_of(s)))
    matrix = build_matrix(rows)
    assert list(matrix.groups) == ["m|B8|c1", "m|B16|c1", "n|B8|c1", "n|B16|c1"]
    group = matrix.groups["m|B16|c1"]
    assert list(group.by_baseline) == ["B0", "B1", "B3", "OURS"]
    assert [p.row.repeat for p in group.by_baseline["B1"]] == [0, 1]
    assert group.by_baseline["B0"][0].shared == (8, 16) and group.by_baseline["B1"][0].shared == ()
    assert group.by_baseline["B0"][0].block_size == 16 and group.by_baseline["B0"][0].row.block_size == 8
    assert matrix.n_input_rows == len(rows) and matrix.superseded == []


def test_duplicates_are_refused_naming_both_sources():
    rows = rows_of(gate_spec())
    with pytest.raises(InputError) as err:
        build_matrix([*rows, rows[1]], sources=[f"f:{i}" for i in range(len(rows) + 1)])
    assert str(err.value) == (
        "duplicate identity (model=m, baseline=B1, block_size=8, concurrency=1, repeat=0): f:1 and f:4"
    )
    with pytest.raises(
        InputError,
        match=exactly(
            "duplicate identity (model=m, baseline=B1, block_size=8, concurrency=1, repeat=0): f:1 and f:4"
        ),
    ):
        build_matrix(
            [*rows, rows[1].model_copy(update={"status": Status.ERROR})], sources=[f"f:{i}" for i in range(5)]
        )


def test_a_failed_row_followed_by_a_retry_is_superseded_and_listed():
    rows = rows_of(gate_spec())
    failed = Row.model_validate({**rows[1].to_json_dict(), **{m: None for m in REQUIRED_METRICS}} | {"status": "ERROR", "reason": "x", "route_ahead": None, "hide_inequality": None, "cost_terms": None, "t_draft_seconds": None, "t_router_seconds": None, "t_verify_seconds": None, "latency": {}, "acceptance_histogram": None})  # fmt: skip
    matrix = build_matrix([failed, *rows])
    assert matrix.superseded == [
        ("row 1 (cell " + rows[1].cell_id + ")", "row 3 (cell " + rows[1].cell_id + ")")
    ]
    assert matrix.rows[KEY]["B1"]["n_repeats"] == 1 and "repeat_statuses" not in matrix.rows[KEY]["B1"]


def test_a_shared_row_must_cover_its_own_block_size_and_collides_with_an_own_row():
    rows = rows_of(gate_spec(block_sizes=(8, 16)))
    b0 = next(r for r in rows if r.baseline == "B0")
    with pytest.raises(InputError) as err:
        build_matrix([b0.model_copy(update={"block_sizes_covered": [16, 32]})], sources=["x.jsonl:1"])
    assert str(err.value) == "x.jsonl:1: block_sizes_covered [16, 32] does not include the row's block_size 8"
    own = b0.model_copy(update={"block_size": 16, "block_sizes_covered": None, "cell_id": None})
    with pytest.raises(InputError) as err:
        build_matrix([b0, own], sources=["a:1", "a:2"])
    assert str(err.value) == (
        "duplicate identity (model=m, baseline=B0, block_size=16, concurrency=1, repeat=0): "
        "a:1 (row at block_size 8 shared across [8, 16]) and a:2"
    )


# -- the brief of a row ----------------------------------------------------------------------------------------


def test_a_brief_keeps_the_numbers_the_gates_need_in_column_order():
    row = rows_of(gate_spec())[-1]  # OURS
    brief = brief_of(row)
    numbers = dict(zip(NUMERIC_COLUMNS, brief.numbers, strict=True))
    assert numbers["output_tokens_per_second"] == 45.0 and numbers["route_ahead.waste_ratio"] == 0.25
    assert numbers["t_router_seconds"] == 0.125 and numbers["hide_inequality.fetch_seconds"] == 1.0
    assert numbers["hide_inequality.margin_seconds"] == 0.25 and numbers["latency.ttft_seconds.p50"] is None
    assert set(EXTRA_COLUMNS) < set(NUMERIC_COLUMNS) and NUMERIC_COLUMNS[:10] == REQUIRED_METRICS
    assert brief.route_ahead == {"actual_experts": 80, "predicted_experts": 100, "waste_ratio": 0.25}
    assert brief.whole_metrics == frozenset(
        {"wasted_prefetch_bytes", "expert_occupancy_bytes", "kv_occupancy_bytes"}
    )
    assert brief.hide_hidden is True and brief.hide_mismatch is None and brief.measured
    assert brief.identity == ("m", "OURS", 8, 1, 0) and brief.fetch() == row.to_json_dict()
    b0 = brief_of(rows_of(gate_spec())[0])
    assert b0.route_ahead is None and b0.hide_hidden is None and b0.cost_terms is None


def test_a_stored_hide_inequality_that_disagrees_with_its_terms_is_found():
    good = evaluate_hide_inequality(**HIDE).model_dump()
    row = Row.from_result(
        next(c for c in expand(gate_spec()) if c.baseline == "OURS"),
        result(
            "OURS",
            0,
            hide_inequality={**good, "fetch_seconds": 2.0, "margin_seconds": -0.75, "hidden": False},
        ),
    )
    fresh, mismatch = recompute_hide(row)
    assert fresh["fetch_seconds"] == 1.0 and fresh["hidden"] is True
    assert mismatch == (
        "fetch_seconds stored 2, recomputed 1; margin_seconds stored -0.75, recomputed 0.25; "
        "hidden stored False, recomputed True"
    )
    close = {**good, "fetch_seconds": 1.0 + 1e-9}  # within the relative tolerance
    assert (
        recompute_hide(row.model_copy(update={"hide_inequality": type(row.hide_inequality)(**close)}))[1]
        is None
    )
    bad = row.model_copy(
        update={"hide_inequality": row.hide_inequality.model_copy(update={"saturation": 2.0})}
    )
    assert recompute_hide(bad) == (
        None,
        "hide_inequality terms are invalid: saturation must be <= 1.0, got 2.0",
    )


# -- what mutation testing found unpinned ------------------------------------------------------------------------


def test_the_reasons_of_unmeasured_repeats_are_joined_in_order():
    rows = rows_of(
        gate_spec(repeats=2),
        status={("OURS", 0): (Status.ERROR, "out of memory"), ("OURS", 1): (Status.TIMEOUT, "boom")},
    )
    assert build_matrix(rows).rows[KEY]["OURS"]["reason"] == "boom; out of memory"


def test_waste_ratio_and_in_time_coverage_intervals_stop_at_one():
    # Repeats 0.75 and 1.0: mean 0.875, std 0.25/sqrt(2); t(0.975, 1) = 12.706 puts the raw interval at about
    # [-0.71, 2.46]: clipped to [0, 1].
    def route(r):
        return {
            "predicted_experts": 100,
            "actual_experts": 80,
            "covered_experts": 70,
            "coverage": 0.875,
            "waste_ratio": [0.75, 1.0][r],
        }

    rows = rows_of(
        gate_spec(repeats=2),
        OURS={"route_ahead": route, "prefetched_in_time_coverage": lambda r: [0.75, 1.0][r]},
    )
    agg = build_matrix(rows).stats[(KEY, "OURS")]
    for column in ("route_ahead.waste_ratio", "prefetched_in_time_coverage"):
        assert agg[column]["mean"] == 0.875
        assert (agg[column]["ci95_low"], agg[column]["ci95_high"]) == (0.0, 1.0)


def test_rows_without_a_cell_id_are_named_by_their_position_only():
    rows = [r.model_copy(update={"cell_id": None}) for r in rows_of(gate_spec())]
    with pytest.raises(
        InputError,
        match=exactly(
            "duplicate identity (model=m, baseline=B1, block_size=8, concurrency=1, repeat=0): row 2 and row 5"
        ),
    ):
        build_matrix([*rows, rows[1]])
    with_ids = rows_of(gate_spec())
    with pytest.raises(InputError) as err:
        build_matrix([*with_ids, with_ids[1]])
    cell = with_ids[1].cell_id
    assert str(err.value).endswith(f": row 2 (cell {cell}) and row 5 (cell {cell})")


def ours_row_with_hide(hide: dict) -> Row:
    cell = next(c for c in expand(gate_spec()) if c.baseline == "OURS")
    return Row.from_result(cell, result("OURS", 0, hide_inequality=hide))


def test_a_brief_takes_the_hide_results_from_the_recomputation_not_the_stored_row():
    good = evaluate_hide_inequality(**HIDE).model_dump()  # fetch 1 s, window 1.25 s, margin 0.25 s
    row = ours_row_with_hide(
        {**good, "fetch_seconds": 9.0, "hide_window_seconds": 7.0, "margin_seconds": -2.0}
    )
    numbers = dict(zip(NUMERIC_COLUMNS, brief_of(row).numbers, strict=True))
    assert numbers["hide_inequality.fetch_seconds"] == 1.0
    assert numbers["hide_inequality.hide_window_seconds"] == 1.25
    assert numbers["hide_inequality.margin_seconds"] == 0.25


def test_a_margin_that_is_zero_up_to_rounding_is_no_mismatch():
    # 10 bytes: fetch (1 - 0.5) * 1 * 10 / 4 = 1.25 s = window 0.5 + 0.25 + 0.5 s, so the margin is exactly 0;
    # a stored 5e-13 s is within the absolute tolerance (1e-12 s), where no relative tolerance can help.
    exact = evaluate_hide_inequality(**{**HIDE, "total_expert_bytes": 10.0}).model_dump()
    assert exact["margin_seconds"] == 0.0
    assert recompute_hide(ours_row_with_hide({**exact, "margin_seconds": 5e-13}))[1] is None
    assert recompute_hide(ours_row_with_hide({**exact, "margin_seconds": 5e-12}))[1] == (
        "margin_seconds stored 5e-12, recomputed 0"
    )
