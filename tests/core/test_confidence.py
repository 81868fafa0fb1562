"""The confidence-aware verdict beside upstream's mean-based one, and the basis every verdict line states
(docs/metrics.md §7, "On 95% intervals" and "Basis").

One hand-built group (tests/core/helpers.py's, which passes every gate on means), its repeats spread a little
around the same means (``NOISE``: repeats that copy one another are no evidence); each test spreads one input
over the repeats so that its Student-t 95% interval clears a threshold, straddles it, or lies beyond it.
"""

from __future__ import annotations

import json

import pytest

from pd_dflash.costmodel import evaluate_hide_inequality
from pd_dflash.report import build_report
from pd_dflash.report.confidence import FAIL, INCONCLUSIVE, PASS
from pd_dflash.report.gates import VERDICT_GATES
from pd_dflash.schema import CostTerms
from pd_dflash.spec import Gates
from tests.core.helpers import HIDE, KEY, TOKENS, gate_spec, rows_of


def spread(*values):
    """A field that takes ``values[repeat]``."""
    return lambda r: values[r]


def around(value, step, pattern):
    """``value + step * pattern[repeat]``: a spread with the same mean over three repeats (exact in binary)."""
    return lambda r: value + step * pattern[r % 3]


RA = {"predicted_experts": 100, "actual_experts": 80, "covered_experts": 70, "coverage": 0.875}
#: Each baseline's repeats spread around helpers.py's values, in a different pattern per baseline so that the
#: paired differences spread too.
NOISE = {
    "B0": {"output_tokens_per_second": around(TOKENS["B0"], 0.5, (-1, 0, 1))},
    "B1": {
        "output_tokens_per_second": around(TOKENS["B1"], 0.5, (0, 1, -1)),
        "t_router_seconds": around(0.125, 1 / 64, (-1, 0, 1)),
    },
    "B3": {"output_tokens_per_second": around(TOKENS["B3"], 0.5, (-1, 1, 0))},
    "OURS": {
        "output_tokens_per_second": around(TOKENS["OURS"], 0.5, (1, -1, 0)),
        "t_router_seconds": around(0.125, 1 / 64, (1, 0, -1)),
        "route_ahead_prefetch_coverage": around(0.875, 1 / 64, (-1, 0, 1)),
        "route_ahead": lambda r: {**RA, "waste_ratio": 0.25 + (r % 3 - 1) / 64},
        "hide_inequality": lambda r: evaluate_hide_inequality(
            **{**HIDE, "draft_seconds": 0.5 + (r % 3 - 1) / 64}
        ),
    },
}


def run(repeats: int = 3, gates: Gates | None = None, noise: bool = True, **by_baseline: dict):
    s = gate_spec(repeats)
    over = {
        b: {**(NOISE.get(b, {}) if noise else {}), **by_baseline.get(b, {})} for b in {*NOISE, *by_baseline}
    }
    return build_report(rows_of(s, **over), gates or Gates(), spec=s)


def conf(verdict, name):
    return verdict["groups"][KEY]["confidence"][name]


def test_a_single_repeat_is_inconclusive_on_intervals_although_the_means_pass():
    verdict, files = run(repeats=1)
    assert verdict["overall"]["verdict"] == "GO"
    assert all(conf(verdict, g)["status"] == INCONCLUSIVE for g in VERDICT_GATES)
    assert "1 repeat (no interval)" in conf(verdict, "coverage")["summary"]
    assert verdict["confidence"]["verdict"] == "INCONCLUSIVE"
    assert verdict["confidence"]["counts"] == {PASS: 0, FAIL: 0, INCONCLUSIVE: 6}
    line = verdict["overall"]["line"]
    assert (
        "GO on means (" in line and "; INCONCLUSIVE on 95% intervals (0 pass, 0 fail, 6 inconclusive)" in line
    )
    assert "1 repeat per group (no interval)" in line
    assert line in files["result_matrix.md"] and json.loads(files["verdict.json"])["confidence"][
        "verdict"
    ] == ("INCONCLUSIVE")


def test_repeats_that_copy_one_another_decide_no_gate_on_intervals():
    """Repeats that replay one sample give every metric one value: zero-width intervals from n = 3, which are
    no evidence, so nothing passes or fails on intervals although every gate passes on means."""
    verdict, _ = run(repeats=3, noise=False)
    assert verdict["overall"]["verdict"] == "GO"
    assert {g: conf(verdict, g)["status"] for g in VERDICT_GATES} == dict.fromkeys(
        VERDICT_GATES, INCONCLUSIVE
    )
    assert all("no spread across repeats" in conf(verdict, g)["summary"] for g in VERDICT_GATES)
    assert verdict["confidence"]["verdict"] == "INCONCLUSIVE"
    assert verdict["groups"][KEY]["gates"]["coverage"]["ci95_low"] == 0.875  # the interval is there, [x, x]


def test_repeats_that_agree_pass_every_gate_on_intervals():
    verdict, files = run(repeats=3)
    assert {g: conf(verdict, g)["status"] for g in VERDICT_GATES} == dict.fromkeys(VERDICT_GATES, PASS)
    assert verdict["confidence"]["verdict"] == "GO" and verdict["overall"]["verdict"] == "GO"
    assert "GO on 95% intervals (6 pass, 0 fail, 0 inconclusive)" in verdict["overall"]["line"]
    assert (
        "| m | 8 | 1 |" not in files["result_matrix.md"]
    )  # the interval table is per model, rows by B and c
    assert "| 8 | 1 | PASS | PASS | PASS | PASS | PASS | PASS |" in files["result_matrix.md"]


@pytest.mark.parametrize(
    ("values", "on_means", "on_intervals"),
    [
        ((0.86, 0.87, 0.88), "pass", PASS),  # the interval clears 0.8
        ((0.7, 0.8, 0.9), "pass", INCONCLUSIVE),  # the mean passes, the interval straddles 0.8
        ((0.7, 0.75, 0.8), "fail", INCONCLUSIVE),  # the mean fails, the interval straddles 0.8
        ((0.5, 0.51, 0.52), "fail", FAIL),  # wholly below
    ],
)
def test_coverage_on_its_interval(values, on_means, on_intervals):
    verdict, _ = run(OURS={"route_ahead_prefetch_coverage": spread(*values)})
    assert verdict["groups"][KEY]["gates"]["coverage"]["status"] == on_means
    assert conf(verdict, "coverage")["status"] == on_intervals
    expected = {PASS: "GO", INCONCLUSIVE: "INCONCLUSIVE", FAIL: "NO-GO"}[on_intervals]
    assert verdict["confidence"]["verdict"] == expected


def test_waste_on_its_interval():
    wide = spread(*({**RA, "waste_ratio": w} for w in (0.3, 0.5, 0.7)))
    verdict, _ = run(OURS={"route_ahead": wide})
    assert conf(verdict, "waste")["status"] == INCONCLUSIVE
    high = spread(*({**RA, "waste_ratio": w} for w in (0.8, 0.81, 0.82)))
    verdict, _ = run(OURS={"route_ahead": high})
    assert conf(verdict, "waste")["status"] == FAIL and "> 0.5" in conf(verdict, "waste")["summary"]


def test_a_hide_margin_that_fails_on_means_but_straddles_zero_is_inconclusive():
    margins = spread(
        *(evaluate_hide_inequality(**{**HIDE, "overlap_seconds": o}) for o in (0.0, 0.125, 0.25))
    )
    verdict, _ = run(OURS={"hide_inequality": margins})
    assert verdict["groups"][KEY]["gates"]["hide_inequality"]["status"] == "fail"  # mean margin -0.125 s
    assert conf(verdict, "hide_inequality")["status"] == INCONCLUSIVE
    assert verdict["overall"]["verdict"] == "NO-GO" and verdict["confidence"]["verdict"] == "INCONCLUSIVE"
    assert verdict["overall"]["line"].startswith(
        "go/no-go: NO-GO on means (hide_inequality fails in 1/1 groups"
    )


def test_speedup_ordering_and_bm1_compare_intervals():
    # B1's tokens/s spread over B0's 20 and OURS's 45: speedup and ordering cannot tell
    verdict, _ = run(B1={"output_tokens_per_second": spread(10.0, 30.0, 50.0)})
    assert conf(verdict, "speedup_over_b0")["status"] == INCONCLUSIVE
    assert conf(verdict, "ordering")["status"] == INCONCLUSIVE
    # OURS wholly below B1 (30): the ordering fails on intervals too
    verdict, _ = run(OURS={"output_tokens_per_second": spread(24.0, 25.0, 26.0)})
    assert conf(verdict, "ordering")["status"] == FAIL
    assert conf(verdict, "ordering")["summary"].startswith(
        "OURS - B1 tokens/s, paired by repeat, n=3: 95% interval [-8.286, -1.714]"
    ) and conf(verdict, "ordering")["summary"].endswith("<= 0: fails")
    # OURS wholly below B0's 20: the speedup fails
    verdict, _ = run(OURS={"output_tokens_per_second": spread(9.0, 10.0, 11.0)})
    assert conf(verdict, "speedup_over_b0")["status"] == FAIL
    # t_router overlapping t_verify (1.0)
    verdict, _ = run(OURS={"t_router_seconds": spread(0.5, 0.9, 1.3)})
    assert conf(verdict, "bm1")["status"] == INCONCLUSIVE
    verdict, _ = run(OURS={"t_router_seconds": spread(1.5, 1.6, 1.7)})
    assert conf(verdict, "bm1")["status"] == FAIL


def test_a_disabled_gate_stays_disabled_and_an_unevaluated_one_is_inconclusive():
    verdict, _ = run(gates=Gates(require_ordering=False), OURS={"t_router_seconds": None})
    assert conf(verdict, "ordering")["status"] == "disabled"
    assert conf(verdict, "bm1")["status"] == INCONCLUSIVE
    assert conf(verdict, "bm1")["summary"].startswith("not evaluated: ")
    assert verdict["confidence"]["counts"] == {PASS: 4, FAIL: 0, INCONCLUSIVE: 1}


# -- basis ----------------------------------------------------------------------------------------------------


EMULATED = CostTerms(h2d_link="emulated", emulated_h2d_gbps=0.05, h2d_bandwidth_source="transfers")
REAL = CostTerms(h2d_link="real", h2d_bandwidth_source="probe", measured_h2d_bytes_per_second=5e10)


def everyone(**over):
    return {b: over for b in ("B0", "B1", "B3", "OURS")}


def test_an_emulated_cpu_run_says_it_is_a_pipeline_check_not_a_hardware_verdict():
    by = everyone(cost_terms=EMULATED, engine={"device": "cpu"})
    by["B3"] = {"cost_terms": CostTerms(h2d_link="none"), "engine": {"device": "cpu"}}  # all resident
    verdict, files = run(repeats=1, **by)
    line = verdict["overall"]["line"]
    assert line.startswith("go/no-go (pipeline check, not a hardware verdict): GO on means (")
    assert line.endswith(
        "basis: links emulated 0.05 GB/s (3 rows), none (all experts resident) (1 row), device cpu, "
        "bandwidth from transfers, 1 repeat per group (no interval)"
    )
    basis = verdict["basis"]
    assert basis["pipeline_check"] is True and basis["hardware_verdict"] is False
    assert basis["not_hardware_because"] == ["emulated link (3 rows)", "cpu device (4 rows)"]
    assert basis["repeats_per_group"] == {KEY: 1} and basis["h2d_link"] == {"emulated": 3, "none": 1}
    assert basis["h2d_bandwidth_source"] == {"transfers": 3}  # a resident row needs no bandwidth
    md = files["result_matrix.md"]
    assert "**pipeline check, not a hardware verdict**: emulated link (3 rows), cpu device (4 rows)" in md
    assert json.loads(files["verdict.json"])["basis"]["pipeline_check"] is True


def test_a_device_link_run_names_its_link_source_and_repeats():
    verdict, _ = run(repeats=2, **everyone(cost_terms=REAL, engine={"device": "cuda:0"}))
    line = verdict["overall"]["line"]
    assert line.startswith("go/no-go: GO on means (") and "pipeline check" not in line
    assert line.endswith("basis: real link, device cuda:0, bandwidth from probe, 2 repeats per group")
    assert verdict["basis"]["hardware_verdict"] is True


def test_rows_that_record_no_link_say_so_and_claim_no_hardware():
    verdict, _ = run(repeats=2)
    assert verdict["overall"]["line"].endswith(
        "basis: link not recorded, device not recorded, bandwidth source not recorded, 2 repeats per group"
    )
    assert verdict["basis"]["hardware_verdict"] is False and verdict["basis"]["pipeline_check"] is False


def test_mixed_links_are_counted():
    by = everyone(cost_terms=REAL, engine={"device": "cuda:0"})
    by["B0"] = {"cost_terms": EMULATED, "engine": {"device": "cuda:0"}}
    verdict, _ = run(repeats=2, **by)
    assert verdict["basis"]["h2d_link"] == {"emulated": 2, "real": 6}
    assert (
        "basis: links emulated 0.05 GB/s (2 rows), real (6 rows), device cuda:0" in verdict["overall"]["line"]
    )
    assert verdict["overall"]["line"].startswith("go/no-go (pipeline check, not a hardware verdict): ")
