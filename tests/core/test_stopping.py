"""The stopping rule of adaptive repeats under optional stopping (docs/metrics.md §7f), by seeded simulation.

A synthetic group is one gate's metric drawn per repeat from N(threshold, 1): its true value sits exactly at the
gate's threshold, so any decision the rule reaches is the noise deciding. The rule looks after min..max repeats
and stops at the first look whose interval clears or misses the threshold (``confidence._threshold``'s PASS/FAIL).
Its rate of decided groups must stay within α = 5 % (plus the binomial margin of the simulation), whatever look
it stopped at; the same looks on fixed-n 95 % intervals exceed it, which is what the rule is for.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from pd_dflash.report.adaptive import Design, replay
from pd_dflash.report.aggregate import t_quantile
from pd_dflash.schema import Row
from pd_dflash.spec import Gates, expand, parse_spec
from pd_dflash.stopping import (
    ALPHA,
    CELL_FAILURES,
    DECIDED,
    MAX_REACHED,
    AdaptiveRepeats,
    look_coverage,
    planned_looks,
    stop_reason,
)
from tests.core.helpers import base_spec, jittered

GROUPS = 4000
BOUNDS = AdaptiveRepeats(min=2, max=8)
#: Three binomial standard errors of a 5 % rate over GROUPS groups.
MARGIN = 3 * math.sqrt(ALPHA * (1 - ALPHA) / GROUPS)


def simulate(draws: np.ndarray, threshold: float, coverage: float, bounds: AdaptiveRepeats):
    """(decision per group: +1 PASS, -1 FAIL, 0 none; repeats used per group) of the looks min..max."""
    n = draws.shape[0]
    decision = np.zeros(n, dtype=int)
    used = np.full(n, bounds.max)
    open_ = np.ones(n, dtype=bool)
    for k in range(bounds.min, bounds.max + 1):
        x = draws[:, :k]
        mean, sd = x.mean(axis=1), x.std(axis=1, ddof=1)
        half = t_quantile(k - 1, coverage) * sd / math.sqrt(k)
        passed, failed = mean - half >= threshold, mean + half < threshold
        newly = open_ & (passed | failed)
        decision[newly & passed] = 1
        decision[newly & failed] = -1
        used[newly] = k
        open_ &= ~newly
    return decision, used


def test_planned_looks_and_their_coverage():
    assert planned_looks(BOUNDS) == 7
    assert look_coverage(AdaptiveRepeats(min=2, max=4)) == pytest.approx(1 - 0.05 / 3)
    assert look_coverage(AdaptiveRepeats(min=3, max=3)) == pytest.approx(
        0.95
    )  # one look: the fixed-n interval


def test_stop_reasons():
    b = AdaptiveRepeats(min=2, max=4)
    assert stop_reason(["PASS", "FAIL", "disabled"], 2, b, failed=False) == DECIDED
    assert stop_reason(["PASS", "INCONCLUSIVE"], 3, b, failed=False) is None
    assert stop_reason(["PASS", "INCONCLUSIVE"], 4, b, failed=False) == MAX_REACHED
    assert stop_reason(["PASS", "INCONCLUSIVE"], 2, b, failed=True) == CELL_FAILURES


def test_at_the_threshold_the_rule_decides_at_most_alpha_of_the_groups_whatever_look_it_stops_at():
    rng = np.random.default_rng(1408)
    threshold = 0.8
    draws = rng.normal(threshold, 0.1, size=(GROUPS, BOUNDS.max))
    decision, _ = simulate(draws, threshold, look_coverage(BOUNDS), BOUNDS)
    rate = float(np.mean(decision != 0))
    assert rate <= ALPHA + MARGIN, f"decided {rate:.3%} of groups at the threshold"
    # Without the correction, the same looks on 95 % intervals decide far more often: optional stopping
    # inflates the error, and this simulation sees it.
    naive, _ = simulate(draws, threshold, 0.95, BOUNDS)
    assert float(np.mean(naive != 0)) > ALPHA + MARGIN


def test_a_clear_effect_stops_well_below_max():
    rng = np.random.default_rng(7)
    threshold = 0.8
    draws = rng.normal(threshold + 0.3, 0.1, size=(GROUPS, BOUNDS.max))  # three standard deviations clear
    decision, used = simulate(draws, threshold, look_coverage(BOUNDS), BOUNDS)
    assert float(np.mean(decision == 1)) > 0.99 and not np.any(decision == -1)
    mean_used = float(used.mean())
    assert mean_used <= 0.6 * BOUNDS.max, f"mean repeats {mean_used:.2f} of max {BOUNDS.max}"


def _coverage_rows(spec, values):
    """A row per cell of the gate group whose OURS coverage at repeat r is ``values[r]`` (all else passes)."""
    rows = []
    for cell in expand(spec):
        over = {}
        if cell.baseline == "OURS":
            over["route_ahead_prefetch_coverage"] = float(values[cell.repeat])
        rows.append(Row.from_result(cell, jittered(cell.baseline, cell.repeat, **over)))
    return rows


def test_the_report_takes_the_simulated_rules_looks_on_real_rows():
    """The simulation's decisions are those of the real looks (rows → matrix → confidence gates)."""
    bounds = AdaptiveRepeats(min=2, max=5)
    spec = parse_spec(
        base_spec(
            baselines=["B0", "B1", "B3", "OURS"],
            block_sizes=[8],
            concurrency=[1],
            repeats=bounds.model_dump(),
        )
    )
    gates = Gates()
    rng = np.random.default_rng(3)
    draws = np.clip(rng.normal(0.86, 0.05, size=(12, bounds.max)), 0.0, 1.0)
    decision, used = simulate(draws, gates.min_coverage, look_coverage(bounds), bounds)
    design = Design(spec)
    for i in range(len(draws)):
        (run,) = replay(design, _coverage_rows(spec, draws[i]), gates).values()
        assert run.looks[-1].repeats == used[i]
        assert run.stop == (DECIDED if decision[i] else MAX_REACHED)
        status = run.looks[-1].gates["coverage"]["status"]
        assert status == {1: "PASS", -1: "FAIL", 0: "INCONCLUSIVE"}[int(decision[i])]
