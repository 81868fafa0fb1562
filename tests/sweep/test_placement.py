"""Scheduling policy (pure): model affinity, longest first, stealing only when it pays, measured estimates."""

from __future__ import annotations

import heapq

import pytest

from pd_dflash.spec import expand
from pd_dflash.sweep.placement import Estimator, Placement, Task, load_key
from tests.sweep.helpers import FIXED, make_spec


def placement_for(spec):
    placement = Placement(spec.engine, Estimator(spec))
    for cell in expand(spec):
        placement.add(Task(cell=cell, attempt=1))
    return placement


def test_longest_cell_first_within_a_key():
    spec = make_spec(concurrency=[1, 4, 16], baselines=["B0", "B1"])
    placement = placement_for(spec)
    key = ("m1", "shared")
    estimates = []
    while (task := placement.take(key)) is not None:
        estimates.append(placement.estimator.estimate(task.cell))
        assert task.cell.model == "m1"
    assert estimates == sorted(estimates, reverse=True) and len(estimates) == 6


def test_measured_times_refine_estimates():
    spec = make_spec(repeats=2, concurrency=[1, 2, 4])
    est = Estimator(spec)
    cells = expand(spec)

    def cell(model, baseline, c, repeat=0):
        return next(
            x for x in cells if (x.model, x.baseline, x.concurrency, x.repeat) == (model, baseline, c, repeat)
        )

    a = cell("m1", "B1", 1)
    est.observe(a, 10.0)
    assert est.estimate(cell("m1", "B1", 1, repeat=1)) == 10.0  # same coordinates, another repeat
    # Same group, another concurrency: the group's scale with the default exponent -0.5.
    assert est.estimate(cell("m1", "B1", 4)) == pytest.approx(10.0 * 4**-0.5)
    # Time really scales as c^-0.25: two levels of one group fit the exponent.
    est.observe(cell("m1", "B1", 2), 10.0 * 2**-0.25)
    assert est.slope == pytest.approx(-0.25)
    assert est.estimate(cell("m1", "B1", 4)) == pytest.approx(10.0 * 4**-0.25)
    # An unmeasured group borrows its model's scale, else the sweep-wide one (bases differ by baseline factor).
    b0 = cell("m1", "B0", 1)
    assert est.estimate(b0) == pytest.approx(10.0 * est._base(b0) / est._base(a))
    before = est.estimate(b0)
    est.observe(cell("m1", "OURS", 1), 40.0)  # m1 turns out heavier: its unmeasured B0 follows
    assert est.estimate(b0) > before
    # Loads: measured, else another key's, else a typical cell.
    assert est.load_estimate(("m1", "shared")) == pytest.approx((10.0 + 10.0 * 2**-0.25 + 40.0) / 3)
    est.observe_load(("m2", "shared"), 3.0)
    assert est.load_estimate(("m1", "shared")) == 3.0


def test_choose_key_prefers_unheld_keys_then_steals_in_proportion_to_work():
    spec = make_spec()
    placement = placement_for(spec)
    assert placement.choose_key({}) is not None
    held = {("m1", "shared"): 1}
    assert placement.choose_key(held) == ("m2", "shared")  # an unheld key: its load is unavoidable
    # Both held: steal from the key with the most pending work per holder.
    assert placement.choose_key({("m1", "shared"): 1, ("m2", "shared"): 3}) == ("m1", "shared")
    # A runner keeps its own key while the key has work.
    assert placement.choose_key({("m1", "shared"): 5}, current=("m2", "shared")) == ("m2", "shared")


def test_no_steal_when_a_load_costs_more_than_it_saves_or_no_cell_would_be_left():
    spec = make_spec()
    placement = placement_for(spec)
    est = placement.estimator
    for cell in expand(spec)[:1]:
        est.observe(cell, 1.0)
    pending_m1 = placement.pending_work(("m1", "shared"))
    est.observe_load(("m1", "shared"), pending_m1)  # loading costs as much as all its work
    assert placement.choose_key({("m1", "shared"): 1, ("m2", "shared"): 100}) is None
    # With cheap loads, a key with 6 pending cells takes at most 6 runners.
    est._loads.clear()
    est.observe_load(("m1", "shared"), 0.0)
    assert placement.choose_key({("m1", "shared"): 5, ("m2", "shared"): 6}) == ("m1", "shared")
    assert placement.choose_key({("m1", "shared"): 6, ("m2", "shared"): 6}) is None


def simulate(spec, runners: int, load_s: float, duration):
    """Discrete-event run of the policy as the driver applies it: returns (makespan, loads)."""
    placement = placement_for(spec)
    holding: list = [None] * runners
    moved = [False] * runners
    events = [(0.0, r) for r in range(runners)]
    heapq.heapify(events)
    loads, makespan = 0, 0.0
    while events:
        now, r = heapq.heappop(events)
        makespan = max(makespan, now)
        others: dict = {}
        for i, k in enumerate(holding):
            if i != r and k is not None:
                others[k] = others.get(k, 0) + 1
        key = placement.choose_key(others, holding[r], rebalance=not moved[r])
        if key is None:
            holding[r] = None if not placement.has_pending() else holding[r]
            continue
        if key != holding[r]:
            if holding[r] is not None and placement.pending.get(holding[r]):
                moved[r] = True
            holding[r] = key
            loads += 1
            placement.estimator.observe_load(key, load_s)
            now += load_s
        task = placement.take(key)
        seconds = duration(task.cell)
        placement.estimator.observe(task.cell, seconds)
        heapq.heappush(events, (now + seconds, r))
    return makespan, loads


def test_a_runner_moves_to_a_heavier_model_once_measurements_show_it():
    spec = make_spec(concurrency=[1, 2, 4, 8], repeats=3)
    m1, m2 = ("m1", "shared"), ("m2", "shared")

    def measured(cost_m1):
        placement = placement_for(spec)
        first = {m: next(c for c in expand(spec) if c.model == m) for m in ("m1", "m2")}
        placement.estimator.observe(first["m1"], cost_m1)
        placement.estimator.observe(first["m2"], 1.0)
        return placement

    heavy = measured(3.0)
    # 3 runners on each model, this one on m2: m1 is 3x heavier, one of m2's runners should finish on m1.
    assert heavy.rebalance_target({m1: 3, m2: 2}, m2) == m1
    assert heavy.choose_key({m1: 3, m2: 2}, m2, rebalance=True) == m1
    assert heavy.choose_key({m1: 3, m2: 2}, m2) == m2  # the driver allows one move per runner
    assert heavy.rebalance_target({m1: 3, m2: 0}, m2) is None  # never the last runner of a model
    # Equal costs: 3/3 is the right split, nobody moves.
    assert measured(1.0).rebalance_target({m1: 3, m2: 2}, m2) is None
    # Before m1 is measured its cost is unknown: no move.
    fresh = placement_for(spec)
    fresh.estimator.observe(next(c for c in expand(spec) if c.model == "m2"), 1.0)
    assert fresh.rebalance_target({m1: 3, m2: 2}, m2) is None


PHASE_A_SHAPE = {
    "baselines": ["B0", "B1", "B2", "B3", "OURS"],
    "block_sizes": [8, 16],
    "concurrency": [1, 2, 4, 8, 16, 32],
    "repeats": 3,
}
FACTOR = {"B0": 1.5, "B1": 1.0, "B2": 0.9, "B3": 0.6, "OURS": 0.8}


@pytest.mark.parametrize(
    ("name", "duration"),
    [
        ("equal models", lambda c: 1.0 + 0.5 * c.concurrency**0.5 + (0.3 if c.baseline == "B0" else 0.0)),
        (
            "model m2 1.3x heavier",
            lambda c: (1.3 if c.model == "m2" else 1.0) * FACTOR[c.baseline] * c.concurrency**-0.25,
        ),
    ],
)
@pytest.mark.parametrize(("runners", "load_s"), [(6, 6.0), (6, 0.5), (4, 3.0)])
def test_simulated_sweep_is_near_the_bound_with_few_loads(name, duration, runners, load_s):
    spec = make_spec(engine=FIXED, **PHASE_A_SHAPE)
    cells = expand(spec)
    makespan, loads = simulate(spec, runners, load_s, duration)
    keys = len({load_key(spec.engine, c) for c in cells})
    work = sum(duration(c) for c in cells)
    # Every runner loads once before its first cell: the bound includes one load.
    bound = max(work / runners, max(duration(c) for c in cells)) + load_s
    assert loads <= runners + keys - 1, (name, loads)
    assert makespan <= 1.05 * bound, (name, makespan, bound)
