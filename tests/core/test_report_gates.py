"""Report statistics and gates: Student t, BM1, the hide inequality, coverage/waste, speedup, ordering, go/no-go.

Rows are synthetic (`synth_rows` over `expand(jobs/phase_a.yaml)`), with one field changed per test.
"""

from __future__ import annotations

import json
import math

import pytest

from pd_dflash.costmodel import evaluate_hide_inequality
from pd_dflash.report import build_report
from pd_dflash.report.aggregate import summary_stats, t_quantile_975
from pd_dflash.schema import Row
from pd_dflash.spec import Gates, load_spec
from pd_dflash.upstream import REQUIRED_METRICS
from tests.core.helpers import ANCHOR, PHASE_A, synth_rows

GROUPS = 24
KEY = "openai/gpt-oss-20b|B16|c8"


def report(rows, gates: Gates | None = None, *, spec: bool = True):
    verdict, files = build_report(rows, gates or Gates(), spec=load_spec(PHASE_A) if spec else None)
    return verdict, files


def ours_at(c: int | None = None, **over):
    """A tweak changing OURS rows (at concurrency c, or all of them)."""
    return lambda cell: over if cell.baseline == "OURS" and (c is None or cell.concurrency == c) else {}


def gate(verdict, name, key=KEY):
    return verdict["groups"][key]["gates"][name]


# -- statistics -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("df", "expected"),
    [(1, 12.7062047), (2, 4.3026527), (3, 3.1824463), (4, 2.7764451), (5, 2.5705818), (10, 2.2281389),
     (30, 2.0422725), (100, 1.9839715), (1000, 1.9623391)],
)  # fmt: skip
def test_t_quantile_matches_the_t_table(df, expected):
    assert t_quantile_975(df) == pytest.approx(expected, abs=2e-6)


def test_summary_stats_by_hand():
    s = summary_stats(20.0, 1.0, 3)  # e.g. repeats 19, 20, 21
    half = 4.3026527 / math.sqrt(3)
    assert s["ci95_low"] == pytest.approx(20.0 - half) and s["ci95_high"] == pytest.approx(20.0 + half)
    assert summary_stats(2.0, 1.0, 3, lower=None)["ci95_low"] == pytest.approx(2.0 - half)
    assert summary_stats(0.5, 0.4, 2)["ci95_low"] == 0.0  # clipped: metrics are non-negative
    assert summary_stats(0.9, 0.2, 2, upper=1.0)["ci95_high"] == 1.0  # ratios stay <= 1
    assert summary_stats(3.0, None, 1) == {
        "mean": 3.0,
        "std": None,
        "n": 1,
        "ci95_low": None,
        "ci95_high": None,
    }
    with pytest.raises(ValueError):
        t_quantile_975(0)


def test_repeats_aggregate_with_pandas_stats():
    rows = synth_rows()
    _, files = report(rows)

    matrix = json.loads(files["result_matrix.json"])
    repeats = [
        r
        for r in rows
        if (r.model, r.baseline, r.block_size, r.concurrency) == ("openai/gpt-oss-20b", "B1", 16, 8)
    ]
    xs = [r.ttft_seconds for r in repeats]
    mean = sum(xs) / 3
    std = math.sqrt(sum((x - mean) ** 2 for x in xs) / 2)
    agg = matrix[KEY]["B1"]["aggregate"]["ttft_seconds"]
    assert agg["mean"] == pytest.approx(mean) and agg["std"] == pytest.approx(std) and agg["n"] == 3
    assert agg["ci95_high"] - agg["mean"] == pytest.approx(t_quantile_975(2) * std / math.sqrt(3))
    assert matrix[KEY]["B1"]["ttft_seconds"] == agg["mean"]


# -- BM1 ------------------------------------------------------------------------------------------------


def test_bm1_pass_and_fail():
    verdict, _ = report(synth_rows(tweak=ours_at(t_router_seconds=0.002, t_verify_seconds=0.020)))
    g = gate(verdict, "bm1")
    assert g["status"] == "pass"
    bm1 = verdict["groups"][KEY]["bm1"]["OURS"]  # upstream's detail key: {baseline: summary}
    assert bm1["bm1_router_to_verify_ratio"] == pytest.approx(0.1) and bm1["bm1_pass"] is True

    verdict, _ = report(synth_rows(tweak=ours_at(8, t_router_seconds=0.03, t_verify_seconds=0.02)))
    g = gate(verdict, "bm1")
    assert g["status"] == "fail" and "OURS t_router/t_verify 1.5 >= 1" in g["summary"]
    assert gate(verdict, "bm1", "openai/gpt-oss-20b|B16|c4")["status"] == "pass"
    assert verdict["overall"]["verdict"] == "NO-GO"
    assert "bm1 fails in 4/24 groups" in verdict["overall"]["line"]


def test_bm1_not_evaluated_without_terms():
    verdict, _ = report(synth_rows(tweak=ours_at(t_router_seconds=None, t_verify_seconds=None)))
    g = gate(verdict, "bm1")
    assert g["status"] == "not evaluated" and "OURS" in g["summary"]
    assert verdict["overall"]["line_on_means"] == "go/no-go: INCONCLUSIVE (not evaluated: bm1 24/24 groups)"
    assert verdict["overall"]["line"].startswith(
        "go/no-go: INCONCLUSIVE on means (not evaluated: bm1 24/24 groups); INCONCLUSIVE on 98.75% intervals, "
        "adaptive, "  # jobs/phase_a.yaml's repeats are adaptive, 3-6: the looks' intervals (metrics.md §7f)
    )


# -- hide inequality ------------------------------------------------------------------------------------


def test_hide_inequality_anchor_hidden_and_r0_not_hidden():
    verdict, _ = report(synth_rows(tweak=ours_at(hide_inequality=evaluate_hide_inequality(**ANCHOR))))
    g = gate(verdict, "hide_inequality")
    assert g["status"] == "pass"
    on_means = g["per_baseline"]["OURS"]["on_means"]
    assert on_means["fetch_seconds"] == pytest.approx(0.14) and on_means[
        "hide_window_seconds"
    ] == pytest.approx(0.15)
    assert g["per_baseline"]["OURS"]["hidden_repeats"] == 3

    exposed = evaluate_hide_inequality(**{**ANCHOR, "resident_fraction": 0.0})
    verdict, _ = report(synth_rows(tweak=ours_at(hide_inequality=exposed)))
    g = gate(verdict, "hide_inequality")
    assert g["status"] == "fail" and "fetch 0.28 s > window 0.15 s" in g["summary"]
    assert verdict["overall"]["verdict"] == "NO-GO"


def test_hide_inequality_not_evaluated_without_terms():
    verdict, _ = report(synth_rows(tweak=ours_at(hide_inequality=None)))
    g = gate(verdict, "hide_inequality")
    assert g["status"] == "not evaluated" and "no hide_inequality terms" in g["summary"]


def test_stored_hidden_flag_is_recomputed_not_trusted():
    exposed = evaluate_hide_inequality(**{**ANCHOR, "resident_fraction": 0.0}).model_dump()
    lying = {**exposed, "hidden": True}
    verdict, _ = report(synth_rows(tweak=ours_at(8, hide_inequality=lying)))
    g = gate(verdict, "hide_inequality")
    assert g["status"] == "fail" and "hidden stored True, recomputed False" in g["summary"]
    assert verdict["groups"][KEY]["invalid"] == ["OURS"] and verdict["groups"][KEY]["valid"] is False
    assert verdict["exit_code"] == 1


# -- coverage, waste, speedup, ordering -----------------------------------------------------------------


def test_low_coverage_is_no_go_with_a_one_line_reason():
    verdict, files = report(synth_rows(tweak=ours_at(8, route_ahead_prefetch_coverage=0.62)))
    assert gate(verdict, "coverage")["status"] == "fail"
    assert gate(verdict, "coverage", "openai/gpt-oss-20b|B16|c4")["status"] == "pass"
    line = verdict["overall"]["line"]
    assert line.startswith("go/no-go: NO-GO on means (coverage fails in 4/24 groups (e.g. ")
    assert "OURS coverage 0.62 < 0.80" in line
    assert line in files["result_matrix.md"]
    assert verdict["exit_code"] == 0  # the matrix is complete and valid; the verdict is separate


def test_vacuous_coverage_is_not_evaluated():
    def vacuous(cell):
        if cell.baseline != "OURS":
            return {}
        return {
            "route_ahead_prefetch_coverage": 1.0,
            "route_ahead": {
                "steps": 5,
                "predicted_experts": 0,
                "actual_experts": 0,
                "coverage": 1.0,
                "waste_ratio": 0.0,
            },
        }

    verdict, _ = report(synth_rows(tweak=vacuous))
    assert gate(verdict, "coverage")["status"] == "not evaluated"
    assert "vacuous" in gate(verdict, "coverage")["summary"]
    assert gate(verdict, "waste")["status"] == "not evaluated"
    assert verdict["overall"]["verdict"] == "INCONCLUSIVE"


def test_waste_ratio_gate_and_missing_counters():
    def wasteful(cell):
        if cell.baseline != "OURS":
            return {}
        return {"route_ahead": {"predicted_experts": 100, "actual_experts": 90, "waste_ratio": 0.7}}

    verdict, _ = report(synth_rows(tweak=wasteful))
    assert (
        gate(verdict, "waste")["status"] == "fail"
        and "OURS waste ratio 0.70 > 0.50" in gate(verdict, "waste")["summary"]
    )
    verdict, _ = report(synth_rows(tweak=ours_at(route_ahead=None)))
    assert gate(verdict, "waste")["status"] == "not evaluated"
    assert (
        gate(verdict, "coverage")["status"] == "pass"
    )  # the metric is there; vacuity just cannot be checked
    assert "vacuity not checked" in gate(verdict, "coverage")["summary"]


def test_speedup_and_ordering():
    def slow_b2(cell):
        return {"output_tokens_per_second": 15.0} if cell.baseline == "B2" and cell.concurrency == 1 else {}

    verdict, _ = report(synth_rows(tweak=slow_b2))
    g = gate(verdict, "speedup_over_b0", "openai/gpt-oss-20b|B16|c1")
    assert g["status"] == "fail" and g["summary"].startswith("speedup over B0: B2 0.")
    assert (
        gate(verdict, "ordering", "openai/gpt-oss-20b|B16|c1")["status"] == "pass"
    )  # B2 is not in the chain

    def fast_b1(cell):
        return {"output_tokens_per_second": 500.0} if cell.baseline == "B1" else {}

    verdict, _ = report(synth_rows(tweak=fast_b1))
    g = gate(verdict, "ordering")
    assert g["status"] == "fail" and "B1 500 !< OURS" in g["summary"]
    verdict, _ = report(synth_rows(tweak=fast_b1), Gates(require_ordering=False))
    assert gate(verdict, "ordering")["status"] == "disabled"


def test_partial_row_is_present_but_incomplete():
    def partial(cell):
        if cell.baseline == "OURS" and cell.repeat == 1:
            return {
                "kv_occupancy_bytes": None,
                "status": "PARTIAL",
                "warnings": ["kv_occupancy_bytes: no accessor"],
            }
        return {}

    verdict, files = report(synth_rows(tweak=partial))
    detail = verdict["groups"][KEY]
    assert detail["partial"] == {"OURS": ["kv_occupancy_bytes"]} and detail["complete"] is False
    assert "OURS PARTIAL, missing kv_occupancy_bytes" in detail["gates"]["completeness"]["summary"]
    assert verdict["exit_code"] == 1 and verdict["overall"]["verdict"] == "INCONCLUSIVE"
    row = json.loads(files["result_matrix.json"])[KEY]["OURS"]
    assert "status" not in row and row["aggregate"]["kv_occupancy_bytes"]["n"] == 2  # OK: no status
    assert row["repeat_statuses"] == {"0": "OK", "1": "PARTIAL", "2": "OK"}


def test_allow_unmeasured_keeps_a_group_complete_but_lists_the_gap():
    # MoE-Infinity cannot observe its AR prefetcher: B1 rows carry no coverage at all.
    def no_ar_coverage(cell):
        if cell.baseline == "B1":
            return {
                "route_ahead_prefetch_coverage": None,
                "status": "PARTIAL",
                "warnings": ["route_ahead_prefetch_coverage: no accessor"],
            }
        return {}

    rows = synth_rows(tweak=no_ar_coverage)
    verdict, _ = report(rows)
    assert verdict["groups"][KEY]["complete"] is False and verdict["exit_code"] == 1
    verdict, files = report(rows, Gates(allow_unmeasured=["route_ahead_prefetch_coverage"]))
    detail = verdict["groups"][KEY]
    assert detail["complete"] is True and detail["partial"] == {}
    assert detail["unmeasured"] == {"B1": ["route_ahead_prefetch_coverage"]}
    assert gate(verdict, "coverage")["status"] == "pass"  # judged on OURS, which measured it
    assert "allowed unmeasured: route_ahead_prefetch_coverage" in files["result_matrix.md"]
    with pytest.raises(ValueError, match="unknown metric"):
        Gates(allow_unmeasured=["vibes"])


def test_missing_repeat_and_failed_repeat_are_incomplete():
    rows = [r for r in synth_rows() if not (r.baseline == "B1" and r.repeat == 2)]
    verdict, _ = report(rows, spec=False)
    assert verdict["groups"][KEY]["missing_repeats"] == {"B1": [2]}
    failed = [
        Row.model_validate(
            {
                k: v
                for k, v in r.to_json_dict().items()
                if k in ("model", "draft", "baseline", "block_size", "concurrency", "repeat")
            }
            | {"status": "TIMEOUT", "reason": "watchdog"}
        )
        if r.baseline == "B1" and r.repeat == 2
        else r
        for r in synth_rows()
    ]
    verdict, _ = report(failed)
    assert verdict["groups"][KEY]["failed"] == {"B1": ["repeat 2: TIMEOUT (watchdog)"]}
    assert gate(verdict, "speedup_over_b0")["status"] == "pass"  # means over the two measured repeats


def test_allowed_blocked_baseline_is_left_out_of_the_gates():
    def block_b2(cell):
        if cell.baseline != "B2":
            return {}

        return {**dict.fromkeys(REQUIRED_METRICS), "status": "BLOCKED_UNTIL_2D_SCHEDULER", "t_draft_seconds": None,
                "t_router_seconds": None, "t_verify_seconds": None, "route_ahead": None}  # fmt: skip

    rows = synth_rows(tweak=block_b2)
    verdict, _ = report(rows)
    assert verdict["exit_code"] == 1 and verdict["groups"][KEY]["blocked"] == ["B2"]
    verdict, _ = report(rows, Gates(allow_blocked=["B2"]))
    assert verdict["exit_code"] == 0 and verdict["overall"]["verdict"] == "GO"
    assert "B2" not in gate(verdict, "speedup_over_b0")["per_baseline"]
    assert verdict["overall"]["gate_counts"]["completeness"]["pass"] == GROUPS
