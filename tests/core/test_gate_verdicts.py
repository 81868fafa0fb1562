"""Every gate's every answer on one hand-built group: the exact summary a person reads, the detail the verdict
keeps, and the overall go/no-go line (docs/metrics.md §6–7).

The group (model m, B=8, c=1) passes every gate as built in tests/core/helpers.py; each test changes the rows
of one or two baselines and states what the verdict must say.
"""

from __future__ import annotations

import pytest

from pd_dflash.baselines import BLOCK_INDEPENDENT
from pd_dflash.costmodel import evaluate_hide_inequality
from pd_dflash.report.aggregate import build_matrix
from pd_dflash.report.gates import Expectations, evaluate, overall
from pd_dflash.schema import Status
from pd_dflash.spec import Gates
from tests.core.helpers import HIDE, KEY, gate_spec, rows_of


def judge(rows, gates: Gates | None = None, s=None, *, with_spec: bool = True):
    matrix = build_matrix(rows)
    details = evaluate(matrix, gates or Gates(), Expectations.infer(matrix, s if with_spec else None))
    return details, overall(details)


def group(**kw):
    s = kw.pop("s", None) or gate_spec()
    gates = kw.pop("gates", None)
    details, summary = judge(rows_of(s, **kw), gates, s)
    return details[KEY], summary


def gate(detail, name):
    g = detail["gates"][name]
    return g["status"], g["summary"]


# -- completeness --------------------------------------------------------------------------------------------


def test_a_complete_group_lists_what_it_holds():
    d, summary = group()
    assert d["present"] == ["B0", "B1", "B3", "OURS"]
    assert (d["missing"], d["blocked"], d["blocked_allowed"], d["invalid"]) == ([], [], [], [])
    assert (d["failed"], d["partial"], d["unmeasured"], d["missing_repeats"]) == ({}, {}, {}, {})
    assert d["complete"] is True and d["valid"] is True and gate(d, "completeness") == ("pass", "")
    assert summary["line"] == (
        "go/no-go: GO (bm1, hide_inequality, speedup_over_b0, coverage, waste, ordering pass in all 1 groups)"
    )
    assert summary["groups"] == summary["groups_complete"] == 1 and summary["also"] == []


def test_every_completeness_problem_is_named_in_order():
    s = gate_spec(repeats=2)
    lying = {**evaluate_hide_inequality(**HIDE).model_dump(), "hidden": False}
    d, _ = group(
        s=s,
        drop=[("B0", 0), ("B0", 1), ("B1", 1)],
        status={("B3", 0): (Status.UNAVAILABLE_CAPACITY, "too big"), ("B1", 0): (Status.ERROR, "boom")},
        OURS={
            "kv_occupancy_bytes": lambda r: None if r == 1 else 2**16,
            "status": lambda r: "PARTIAL" if r == 1 else "OK",
            "warnings": lambda r: ["kv absent"] if r == 1 else [],
            "hide_inequality": lambda r: lying if r == 0 else evaluate_hide_inequality(**HIDE),
        },
    )
    assert d["missing"] == ["B0"] and d["missing_repeats"] == {"B1": [1]}
    assert d["blocked"] == ["B3"] and d["blocked_allowed"] == []
    assert d["failed"] == {"B1": ["repeat 0: ERROR (boom)"]} and d["partial"] == {
        "OURS": ["kv_occupancy_bytes"]
    }
    assert d["invalid"] == ["OURS"] and d["valid"] is False and d["complete"] is False
    status, text = gate(d, "completeness")
    assert status == "fail"
    problems = text.split("; ")
    assert problems[:5] == [
        "missing B0",
        "B1 missing repeats [1]",
        "blocked B3 (not allowed)",
        "B1 repeat 0: ERROR (boom)",
        "OURS PARTIAL, missing kv_occupancy_bytes",
    ]
    assert problems[5].startswith("OURS hide_inequality mismatch: repeat 0 (row ")
    assert "hidden stored False, recomputed True" in problems[5]
    assert d["invalid_detail"]["OURS"][0].startswith("repeat 0 (row ")


def test_an_allowed_blocked_baseline_is_excused_and_left_out_of_the_chain():
    d, summary = group(
        gates=Gates(allow_blocked=["B3"]), status={("B3", 0): (Status.UNAVAILABLE_CAPACITY, "too big")}
    )
    assert d["blocked"] == ["B3"] and d["blocked_allowed"] == ["B3"] and d["complete"] is True
    assert gate(d, "ordering") == ("pass", "(B3 allowed blocked, left out)")
    assert d["gates"]["ordering"]["tokens_per_second"] == {"B0": 20.0, "B1": 30.0, "OURS": 45.0}
    assert set(d["gates"]["speedup_over_b0"]["per_baseline"]) == {"B1", "OURS"}
    assert summary["verdict"] == "GO"
    # Broken ordering with B3 left out names it too.
    d, _ = group(
        gates=Gates(allow_blocked=["B3"]),
        status={("B3", 0): (Status.UNAVAILABLE_CAPACITY, "too big")},
        B1={"output_tokens_per_second": 50.0},
    )
    assert gate(d, "ordering") == ("fail", "ordering: B1 50 !< OURS 45 (B3 allowed blocked, left out)")


def test_unmeasured_metrics_that_are_allowed_keep_the_group_complete():
    partial = {
        "route_ahead_prefetch_coverage": None,
        "status": "PARTIAL",
        "warnings": ["no coverage accessor"],
    }
    d, _ = group(gates=Gates(allow_unmeasured=["route_ahead_prefetch_coverage"]), B1=partial)
    assert d["complete"] is True and d["unmeasured"] == {"B1": ["route_ahead_prefetch_coverage"]}
    assert d["partial"] == {}


# -- bm1 ----------------------------------------------------------------------------------------------------


def test_bm1_answers():
    d, _ = group()
    assert gate(d, "bm1") == ("pass", "") and set(d["bm1"]) == {"B1", "OURS"}
    assert d["bm1"]["OURS"] == {
        "t_router_seconds": 0.125,
        "t_verify_seconds": 1.0,
        "bm1_router_to_verify_ratio": 0.125,
        "bm1_pass": True,
    }
    d, summary = group(OURS={"t_router_seconds": 1.5}, B1={"t_router_seconds": 2.0})
    assert gate(d, "bm1") == ("fail", "B1 t_router/t_verify 2 >= 1; OURS t_router/t_verify 1.5 >= 1")
    assert (
        summary["line"]
        == f"go/no-go: NO-GO (bm1 fails in 1/1 groups (e.g. {KEY}: {d['gates']['bm1']['summary']}))"
    )
    d, _ = group(OURS={"t_router_seconds": None, "t_verify_seconds": None})
    assert gate(d, "bm1") == ("not evaluated", "OURS rows carry no t_router_seconds/t_verify_seconds")
    d, _ = group(OURS={"t_verify_seconds": 0.0})
    assert gate(d, "bm1") == ("not evaluated", "OURS: t_verify_seconds missing or 0")
    s = gate_spec(baselines=("B0", "B3"))
    d, _ = group(s=s)
    assert gate(d, "bm1") == ("not evaluated", "no row carries t_router_seconds and t_verify_seconds")
    d, _ = group(s=gate_spec(baselines=("B0", "B1", "B3")))
    assert gate(d, "bm1") == ("pass", "")  # no OURS expected: the baselines that carry the terms decide


# -- hide inequality -------------------------------------------------------------------------------------------


def test_hide_inequality_answers():
    d, _ = group()
    info = d["gates"]["hide_inequality"]["per_baseline"]
    assert (
        set(info) == {"OURS"}
        and info["OURS"]["hidden_repeats"] == 1
        and info["OURS"]["repeats_with_terms"] == 1
    )
    assert info["OURS"]["on_means"]["fetch_seconds"] == 1.0
    exposed = evaluate_hide_inequality(**{**HIDE, "total_expert_bytes": 24.0})  # fetch 3 s, window 1.25 s
    d, _ = group(OURS={"hide_inequality": exposed})
    assert gate(d, "hide_inequality") == ("fail", "OURS fetch 3 s > window 1.25 s (exposed by 1750 ms)")
    d, _ = group(OURS={"hide_inequality": None})
    assert gate(d, "hide_inequality") == ("not evaluated", "OURS rows carry no hide_inequality terms")
    d, _ = group(status={("OURS", 0): (Status.ERROR, "boom")})
    assert gate(d, "hide_inequality") == ("not evaluated", "OURS not measured")
    d, _ = group(s=gate_spec(baselines=("B0", "B1", "B3")))
    assert gate(d, "hide_inequality") == ("not evaluated", "no OURS rows")
    # Other baselines' terms are reported as information, counted per repeat.
    d, _ = group(
        s=gate_spec(repeats=2),
        B1={"hide_inequality": lambda r: exposed if r else evaluate_hide_inequality(**HIDE)},
    )
    assert d["gates"]["hide_inequality"]["per_baseline"]["B1"]["hidden_repeats"] == 1
    assert d["gates"]["hide_inequality"]["per_baseline"]["B1"]["repeats_with_terms"] == 2


# -- speedup ------------------------------------------------------------------------------------------------


def test_speedup_answers():
    d, _ = group(status={("B0", 0): (Status.ERROR, "boom")})
    assert gate(d, "speedup_over_b0") == ("not evaluated", "B0 tokens/s not measured")
    assert d["gates"]["speedup_over_b0"]["per_baseline"] == {}
    d, _ = group(B0={"output_tokens_per_second": 0.0, "goodput_at_slo": 0.0})
    assert gate(d, "speedup_over_b0") == ("not evaluated", "B0 tokens/s is 0")
    d, _ = group(status={("B1", 0): (Status.ERROR, "boom")})
    assert gate(d, "speedup_over_b0") == ("not evaluated", "tokens/s not measured for B1")
    assert d["gates"]["speedup_over_b0"]["per_baseline"] == {"B1": None, "OURS": 2.25, "B3": 3.5}
    d, _ = group(B1={"output_tokens_per_second": 10.0}, B3={"output_tokens_per_second": 15.0})
    assert gate(d, "speedup_over_b0") == ("fail", "speedup over B0: B1 0.5x < 1x, B3 0.75x < 1x")


# -- coverage and waste ----------------------------------------------------------------------------------------


def test_coverage_answers():
    d, _ = group()
    assert d["gates"]["coverage"] == {
        "status": "pass",
        "summary": "",
        "value": 0.875,
        "ci95_low": None,
        "n": 1,
        "vacuity_checked": True,
    }
    d, _ = group(OURS={"route_ahead_prefetch_coverage": 0.5})
    assert gate(d, "coverage") == ("fail", "OURS coverage 0.50 < 0.80")
    d, _ = group(OURS={"route_ahead": None})
    assert gate(d, "coverage") == ("pass", "no route_ahead counters: vacuity not checked")
    assert d["gates"]["coverage"]["vacuity_checked"] is False
    vacuous = {
        "route_ahead": {"predicted_experts": 4, "actual_experts": 0, "coverage": 1.0, "waste_ratio": 0.5}
    }
    d, _ = group(s=gate_spec(repeats=2), OURS={"route_ahead": lambda r: vacuous["route_ahead"] if r else
                                          {"predicted_experts": 4, "actual_experts": 2, "waste_ratio": 0.5}})  # fmt: skip
    assert gate(d, "coverage") == (
        "not evaluated",
        "OURS coverage is vacuous (no routed experts observed) in repeats [1]",
    )
    unmeasured = {"route_ahead_prefetch_coverage": None, "status": "PARTIAL", "warnings": ["none"]}
    d, _ = group(OURS=unmeasured)
    assert gate(d, "coverage") == ("not evaluated", "OURS route_ahead_prefetch_coverage not measured")
    d, _ = group(status={("OURS", 0): (Status.ERROR, "boom")})
    assert gate(d, "coverage") == ("not evaluated", "OURS not measured")
    d, _ = group(s=gate_spec(baselines=("B0", "B1", "B3")))
    assert gate(d, "coverage") == ("not evaluated", "no OURS rows")
    # Three repeats: the interval's low end is reported with the mean.
    d, _ = group(
        s=gate_spec(repeats=3), OURS={"route_ahead_prefetch_coverage": lambda r: [0.75, 0.875, 1.0][r]}
    )
    g = d["gates"]["coverage"]
    assert g["value"] == 0.875 and g["n"] == 3 and 0 < g["ci95_low"] < 0.875


def test_waste_answers():
    d, _ = group()
    assert d["gates"]["waste"] == {"status": "pass", "summary": "", "value": 0.25, "ci95_high": None, "n": 1}
    wasteful = {"route_ahead": {"predicted_experts": 100, "actual_experts": 80, "waste_ratio": 0.75}}
    d, _ = group(OURS=wasteful)
    assert gate(d, "waste") == ("fail", "OURS waste ratio 0.75 > 0.50")
    d, _ = group(OURS={"route_ahead": None})
    assert gate(d, "waste") == ("not evaluated", "OURS rows carry no route_ahead.waste_ratio (repeats [0])")
    idle = {"route_ahead": {"predicted_experts": 0, "actual_experts": 80, "waste_ratio": 0.0}}
    d, _ = group(OURS=idle)
    assert gate(d, "waste") == (
        "not evaluated",
        "OURS prefetched nothing (predicted_experts 0) in repeats [0]",
    )
    d, _ = group(status={("OURS", 0): (Status.ERROR, "boom")})
    assert gate(d, "waste") == ("not evaluated", "OURS not measured")
    d, _ = group(s=gate_spec(baselines=("B0", "B1", "B3")))
    assert gate(d, "waste") == ("not evaluated", "no OURS rows")


# -- ordering -------------------------------------------------------------------------------------------------


def test_ordering_answers():
    d, summary = group(gates=Gates(require_ordering=False))
    assert gate(d, "ordering") == ("disabled", "require_ordering is false")
    assert (
        summary["line"]
        == "go/no-go: GO (bm1, hide_inequality, speedup_over_b0, coverage, waste pass in all 1 groups)"
    )
    d, _ = group(s=gate_spec(baselines=("B0", "B1", "B3")))
    assert gate(d, "ordering") == ("not evaluated", "no OURS rows")
    d, _ = group(status={("B1", 0): (Status.ERROR, "boom"), ("B3", 0): (Status.ERROR, "boom")})
    assert gate(d, "ordering") == ("not evaluated", "tokens/s not measured for B1, B3")
    assert d["gates"]["ordering"]["tokens_per_second"] == {"B0": 20.0, "B1": None, "OURS": 45.0, "B3": None}
    d, _ = group(B0={"output_tokens_per_second": 40.0}, B3={"output_tokens_per_second": 44.0})
    assert gate(d, "ordering") == ("fail", "ordering: B0 40 !< B1 30, OURS 45 !<= B3 44")


# -- the overall verdict ---------------------------------------------------------------------------------------


def test_no_go_lists_every_failing_gate_and_keeps_the_rest_as_also():
    _, summary = judge(
        rows_of(
            gate_spec(),
            OURS={"route_ahead_prefetch_coverage": 0.5, "t_router_seconds": None, "t_verify_seconds": None},
        ),
        s=gate_spec(),
    )
    assert summary["verdict"] == "NO-GO"
    assert summary["reasons"] == [f"coverage fails in 1/1 groups (e.g. {KEY}: OURS coverage 0.50 < 0.80)"]
    assert (
        summary["line"]
        == f"go/no-go: NO-GO (coverage fails in 1/1 groups (e.g. {KEY}: OURS coverage 0.50 < 0.80))"
    )
    assert summary["also"] == [
        f"bm1 not evaluated in 1/1 groups (e.g. {KEY}: OURS rows carry no t_router_seconds/t_verify_seconds)"
    ]
    assert summary["gate_counts"]["coverage"] == {"pass": 0, "fail": 1, "not evaluated": 0, "disabled": 0}
    assert summary["gate_counts"]["bm1"] == {"pass": 0, "fail": 0, "not evaluated": 1, "disabled": 0}
    assert summary["gate_counts"]["completeness"]["pass"] == 1


def test_inconclusive_counts_incomplete_groups_and_unevaluated_gates():
    s = gate_spec(models=("m", "n"))
    rows = rows_of(s, drop=[("B1", 0)], OURS={"hide_inequality": None})
    details, summary = judge(rows, s=s)
    assert list(details) == ["m|B8|c1", "n|B8|c1"]
    assert summary["verdict"] == "INCONCLUSIVE" and summary["groups_complete"] == 0 and summary["also"] == []
    assert summary["line"] == (
        "go/no-go: INCONCLUSIVE (2/2 groups incomplete or invalid; not evaluated: hide_inequality 2/2, "
        "speedup_over_b0 2/2, ordering 2/2 groups)"
    )
    assert summary["reasons"] == [
        "2/2 groups incomplete or invalid (e.g. m|B8|c1: missing B1)",
        "hide_inequality not evaluated in 2/2 groups (e.g. m|B8|c1: OURS rows carry no hide_inequality terms)",
        "speedup_over_b0 not evaluated in 2/2 groups (e.g. m|B8|c1: tokens/s not measured for B1)",
        "ordering not evaluated in 2/2 groups (e.g. m|B8|c1: tokens/s not measured for B1)",
    ]


def test_no_rows_is_inconclusive():
    assert overall({})["line"] == "go/no-go: INCONCLUSIVE (no rows)"
    assert overall({})["reasons"] == ["no rows"] and overall({})["groups"] == 0


def test_a_group_of_the_spec_without_rows_is_evaluated_as_missing_everything():
    s = gate_spec(block_sizes=(8, 16))
    details, summary = judge(rows_of(gate_spec()), s=s)  # no rows for B=16
    assert list(details) == ["m|B8|c1", "m|B16|c1"]  # sorted by (model, B, c), numerically
    empty = details["m|B16|c1"]
    assert gate(empty, "completeness") == ("fail", "missing B0, B1, B3, OURS") and empty["present"] == []
    assert gate(empty, "coverage") == ("not evaluated", "no OURS rows")
    assert summary["groups"] == 2 and summary["groups_complete"] == 1


def test_expectations_without_a_spec_are_upstreams_baselines_and_the_repeats_seen():
    rows = rows_of(gate_spec(repeats=3), drop=[("B1", 1)])
    matrix = build_matrix(rows)
    e = Expectations.infer(matrix)
    assert e.groups is None and e.baselines == ("B0", "B1", "B2", "B3", "OURS") and e.repeats == (0, 1, 2)
    details, _ = judge(rows, with_spec=False)
    assert details[KEY]["missing"] == ["B2"] and details[KEY]["missing_repeats"] == {"B1": [1]}
    e = Expectations.infer(matrix, gate_spec(repeats=3, baselines=("OURS", "B0")))
    assert e.groups == (("m", 8, 1),) and e.baselines == ("B0", "OURS") and e.repeats == (0, 1, 2)


@pytest.mark.parametrize("shared_baseline", sorted(BLOCK_INDEPENDENT))
def test_rows_shared_across_block_sizes_are_named_in_every_group(shared_baseline):
    s = gate_spec(block_sizes=(8, 16))
    details, _ = judge(rows_of(s), s=s)
    for key in ("m|B8|c1", "m|B16|c1"):
        assert details[key]["shared_across_block_sizes"][shared_baseline] == [8, 16]
        assert set(details[key]["shared_across_block_sizes"]) == BLOCK_INDEPENDENT


# -- what mutation testing found unpinned ------------------------------------------------------------------------


def test_bm1_and_hide_with_ours_expected_but_without_rows_in_the_group():
    d, _ = group(drop=[("OURS", 0)])  # B1 passes BM1, but it cannot stand for the OURS the spec expects
    assert gate(d, "bm1") == ("not evaluated", "OURS rows carry no t_router_seconds/t_verify_seconds")
    assert d["gates"]["hide_inequality"] == {
        "status": "not evaluated",
        "summary": "OURS not measured",
        "per_baseline": {},
    }
    assert gate(d, "ordering") == ("not evaluated", "tokens/s not measured for OURS")


def test_ours_rows_outside_the_spec_are_still_gated_but_their_repeats_not_required():
    rows = rows_of(
        gate_spec(repeats=2), drop=[("OURS", 1)], OURS={"t_router_seconds": None, "t_verify_seconds": None}
    )
    details, _ = judge(rows, s=gate_spec(repeats=2, baselines=("B0", "B1", "B3")))
    d = details[KEY]
    assert gate(d, "bm1") == ("not evaluated", "OURS rows carry no t_router_seconds/t_verify_seconds")
    assert gate(d, "hide_inequality") == ("pass", "")
    assert gate(d, "ordering") == ("pass", "")
    assert d["missing_repeats"] == {} and d["complete"] is True


def test_bm1_needs_both_terms_and_names_every_zero_verify():
    d, _ = group(OURS={"t_router_seconds": None})  # t_verify alone
    assert gate(d, "bm1") == ("not evaluated", "OURS rows carry no t_router_seconds/t_verify_seconds")
    d, _ = group(OURS={"t_verify_seconds": None})  # t_router alone
    assert gate(d, "bm1") == ("not evaluated", "OURS: t_verify_seconds missing or 0")
    d, _ = group(B1={"t_verify_seconds": 0.0}, OURS={"t_verify_seconds": 0.0})
    assert gate(d, "bm1") == (
        "not evaluated",
        "B1: t_verify_seconds missing or 0; OURS: t_verify_seconds missing or 0",
    )


def test_hide_gate_details_in_every_answer():
    d, _ = group()
    hide = d["gates"]["hide_inequality"]
    assert (hide["status"], hide["summary"]) == ("pass", "")
    assert set(hide["per_baseline"]["OURS"]) == {"hidden_repeats", "repeats_with_terms", "on_means"}
    lying = {**evaluate_hide_inequality(**HIDE).model_dump(), "hidden": False}
    d, _ = group(s=gate_spec(repeats=2), OURS={"hide_inequality": lying})
    hide = d["gates"]["hide_inequality"]
    assert (hide["status"], hide["summary"]) == (
        "fail",
        "stored hide_inequality disagrees with its terms: OURS repeat 0: hidden stored False, recomputed True; "
        "OURS repeat 1: hidden stored False, recomputed True",
    )
    assert hide["per_baseline"]["OURS"]["repeats_with_terms"] == 2
    terms = {"hide_inequality": evaluate_hide_inequality(**HIDE)}
    d, _ = group(s=gate_spec(baselines=("B0", "B1", "B3")), B1=terms)
    hide = d["gates"]["hide_inequality"]
    assert (hide["status"], hide["summary"]) == ("not evaluated", "no OURS rows")
    assert hide["per_baseline"]["B1"]["repeats_with_terms"] == 1
    for answer in (
        group(status={("OURS", 0): (Status.ERROR, "boom")}),
        group(OURS={"hide_inequality": None}),
    ):
        assert answer[0]["gates"]["hide_inequality"]["per_baseline"] == {}


def test_a_blocked_baseline_that_is_not_allowed_stays_in_speedup_and_ordering():
    d, _ = group(status={("B3", 0): (Status.UNAVAILABLE_CAPACITY, "too big")})
    assert gate(d, "speedup_over_b0") == ("not evaluated", "tokens/s not measured for B3")
    assert gate(d, "ordering") == ("not evaluated", "tokens/s not measured for B3")


def test_completeness_lists_several_problems_of_one_kind():
    s = gate_spec(repeats=2)
    lying = {**evaluate_hide_inequality(**HIDE).model_dump(), "hidden": False}
    blocked = (Status.UNAVAILABLE_CAPACITY, "too big")
    d, _ = group(
        s=s,
        status={
            ("B0", 0): blocked,
            ("B0", 1): blocked,
            ("B1", 0): blocked,
            ("B1", 1): blocked,
            ("B3", 0): (Status.ERROR, "boom"),
            ("B3", 1): (Status.TIMEOUT, "slow"),
        },
        OURS={
            "kv_occupancy_bytes": None,
            "ttft_seconds": None,
            "status": "PARTIAL",
            "warnings": ["kv and ttft absent"],
            "hide_inequality": lying,
        },
    )
    status, text = gate(d, "completeness")
    assert status == "fail"
    assert text.startswith(
        "blocked B0, B1 (not allowed); B3 repeat 0: ERROR (boom); repeat 1: TIMEOUT (slow); "
        "OURS PARTIAL, missing ttft_seconds, kv_occupancy_bytes; OURS hide_inequality mismatch: repeat 0 (row "
    )
    assert "recomputed True; repeat 1 (row " in text


def test_expectations_from_an_ablation_spec_name_each_settings_group():
    from tests.core.helpers import ablation_spec

    e = Expectations.infer(build_matrix([]), ablation_spec())
    assert set(e.groups) == {
        (f"micro[expert_cache_fraction={f},emulated_h2d_gbps={g}]", 8, 1)
        for f in ("0.25", "0.5")
        for g in ("0.03", "0.05", "0.1")
    }


def test_speedup_over_a_b0_slower_than_one_token_per_second_is_evaluated():
    d, _ = group(B0={"output_tokens_per_second": 0.5, "goodput_at_slo": 0.5})
    assert gate(d, "speedup_over_b0") == ("pass", "")
    assert d["gates"]["speedup_over_b0"]["per_baseline"] == {"B1": 60.0, "OURS": 90.0, "B3": 140.0}


def test_ordering_without_ours_is_strict_and_names_every_baseline_left_out():
    blocked = (Status.UNAVAILABLE_CAPACITY, "too big")
    d, _ = group(
        gates=Gates(allow_blocked=["OURS"]),
        status={("OURS", 0): blocked},
        B1={"output_tokens_per_second": 70.0},
    )  # B1 = B3 = 70 tokens/s: only OURS <= B3 is loose
    assert gate(d, "ordering") == ("fail", "ordering: B1 70 !< B3 70 (OURS allowed blocked, left out)")
    d, _ = group(gates=Gates(allow_blocked=["B1", "B3"]), status={("B1", 0): blocked, ("B3", 0): blocked})
    assert gate(d, "ordering") == ("pass", "(B1, B3 allowed blocked, left out)")


def test_speedup_names_every_baseline_without_tokens():
    d, _ = group(status={("B1", 0): (Status.ERROR, "boom"), ("B3", 0): (Status.ERROR, "boom")})
    assert gate(d, "speedup_over_b0") == ("not evaluated", "tokens/s not measured for B1, B3")


def test_a_spec_group_without_rows_never_reads_another_groups_numbers():
    """The model named "None" has rows; model m, which the spec also expects, has none: m's empty group must not
    be evaluated with anyone else's means."""
    s = gate_spec(models=("m", "None"))
    details, _ = judge(rows_of(gate_spec(models=("None",))), s=s)
    empty = details[KEY]
    assert empty["present"] == []
    assert gate(empty, "speedup_over_b0") == ("not evaluated", "B0 tokens/s not measured")
    assert gate(empty, "ordering") == ("not evaluated", "tokens/s not measured for B0, B1, OURS, B3")
    assert gate(details["None|B8|c1"], "speedup_over_b0") == ("pass", "")
