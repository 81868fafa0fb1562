"""Scheduling policy (pure): model affinity, longest first, stealing only when it pays, measured estimates."""

from __future__ import annotations

import heapq

from pd_dflash.spec import expand
from pd_dflash.sweep.scheduler import Estimator, Scheduler, Task, load_key
from tests.sweep.helpers import FIXED, make_spec


def scheduler_for(spec):
    sched = Scheduler(spec.engine, Estimator(spec))
    for cell in expand(spec):
        sched.add(Task(cell=cell, attempt=1))
    return sched


def test_longest_cell_first_within_a_key():
    spec = make_spec(concurrency=[1, 4, 16], baselines=["B0", "B1"])
    sched = scheduler_for(spec)
    key = ("m1", "shared")
    estimates = []
    while (task := sched.take(key)) is not None:
        estimates.append(sched.estimator.estimate(task.cell))
        assert task.cell.model == "m1"
    assert estimates == sorted(estimates, reverse=True) and len(estimates) == 6


def test_measured_times_refine_estimates():
    spec = make_spec(repeats=2)
    est = Estimator(spec)
    cells = expand(spec)
    a = next(c for c in cells if c.baseline == "B1" and c.concurrency == 1 and c.repeat == 0)
    twin = next(c for c in cells if c.baseline == "B1" and c.concurrency == 1 and c.repeat == 1)
    sibling = next(c for c in cells if c.model == a.model and c.baseline == "B1" and c.concurrency == 2)
    est.observe(a, 10.0)
    assert est.estimate(twin) == 10.0  # same coordinates, another repeat
    assert est.estimate(sibling) == est.raw(sibling) * 10.0 / est.raw(a)  # (model, baseline) ratio
    other = next(c for c in cells if c.model != a.model)
    assert est.estimate(other) == est.raw(other) * 10.0 / est.raw(a)  # sweep-wide ratio


def test_choose_key_prefers_unheld_keys_then_steals_in_proportion_to_work():
    spec = make_spec()
    sched = scheduler_for(spec)
    assert sched.choose_key({}) is not None
    held = {("m1", "shared"): 1}
    assert sched.choose_key(held) == ("m2", "shared")  # an unheld key: its load is unavoidable
    # Both held: steal from the key with the most pending work per holder.
    assert sched.choose_key({("m1", "shared"): 1, ("m2", "shared"): 3}) == ("m1", "shared")
    # A runner keeps its own key while the key has work.
    assert sched.choose_key({("m1", "shared"): 5}, current=("m2", "shared")) == ("m2", "shared")


def test_no_steal_when_a_load_costs_more_than_it_saves_or_no_cell_would_be_left():
    spec = make_spec()
    sched = scheduler_for(spec)
    est = sched.estimator
    for cell in expand(spec)[:1]:
        est.observe(cell, 1.0)
    pending_m1 = sched.pending_work(("m1", "shared"))
    est.observe_load(("m1", "shared"), pending_m1)  # loading costs as much as all its work
    assert sched.choose_key({("m1", "shared"): 1, ("m2", "shared"): 100}) is None
    # With cheap loads, a key with 6 pending cells takes at most 6 runners.
    est._loads.clear()
    est.observe_load(("m1", "shared"), 0.0)
    assert sched.choose_key({("m1", "shared"): 5, ("m2", "shared"): 6}) == ("m1", "shared")
    assert sched.choose_key({("m1", "shared"): 6, ("m2", "shared"): 6}) is None


def simulate(spec, runners: int, load_s: float, duration):
    """Discrete-event run of the policy as the driver applies it: returns (makespan, loads)."""
    sched = scheduler_for(spec)
    holding: list = [None] * runners
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
        key = sched.choose_key(others, holding[r])
        if key is None:
            holding[r] = None if not sched.has_pending() else holding[r]
            continue
        if key != holding[r]:
            holding[r] = key
            loads += 1
            sched.estimator.observe_load(key, load_s)
            now += load_s
        task = sched.take(key)
        seconds = duration(task.cell)
        sched.estimator.observe(task.cell, seconds)
        heapq.heappush(events, (now + seconds, r))
    return makespan, loads


def test_simulated_sweep_is_near_the_bound_with_few_loads():
    spec = make_spec(
        engine=FIXED,
        baselines=["B0", "B1", "B2", "B3", "OURS"],
        block_sizes=[8, 16],
        concurrency=[1, 2, 4, 8, 16, 32],
        repeats=3,
    )
    cells = expand(spec)

    def duration(cell):
        return 1.0 + 0.5 * cell.concurrency**0.5 + (0.3 if cell.baseline == "B0" else 0.0)

    runners, load_s = 6, 2.0
    makespan, loads = simulate(spec, runners, load_s, duration)
    keys = len({load_key(spec.engine, c) for c in cells})
    work = sum(duration(c) for c in cells)
    bound = max(work / runners, max(duration(c) for c in cells)) + load_s
    assert loads <= runners + keys - 1
    assert makespan <= 1.05 * bound, (makespan, bound)
