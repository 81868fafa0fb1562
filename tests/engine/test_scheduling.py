"""Deficit schedulers: the admission rule on hand-built steps and hypothesis properties (issue 4 acceptance:
liveness, budgets respected, carried in [0, cap], no starvation under adversarial arrival orders, cap error)."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pd_dflash.engine.reference.decoding.deficit import (
    DeficitScheduler,
    TokenDeficitScheduler,
    TwoDimDeficitScheduler,
    VerifyDemand,
)


def D(rid, tokens, nbytes=0, in_flight=False, arrival=0):
    return VerifyDemand(rid, tokens, nbytes, in_flight, arrival)


def test_two_dim_rule_by_hand():
    s = TwoDimDeficitScheduler(budget_tokens=16, budget_bytes=100, cap_tokens=32, cap_bytes=300)
    a = s.step([D("a", 8, 60, in_flight=True, arrival=0), D("b", 8, 30, arrival=1), D("c", 8, 30, arrival=2)])
    # seated a -> pool (8, 40); b fits -> (0, 10); c does not fit (tokens) -> stop
    assert a.seated == ("a",) and a.admitted == ("a", "b") and a.deferred == ("c",)
    assert a.available == (16, 100) and a.used == (16, 90) and a.carried == (0, 10)
    a = s.step([D("c", 8, 30, arrival=2)])
    assert a.admitted == ("c",) and a.available == (16, 110) and a.carried == (8, 80)
    a = s.step([])  # idle steps carry the unused budget, up to the cap
    assert a.carried == (24, 180)
    a = s.step([])
    assert a.carried == (32, 280)
    a = s.step([])
    assert a.carried == (32, 300)


def test_bytes_gate_the_verify_in_ours_but_not_in_b2():
    demands = [D("x", 4, 500, arrival=0)]
    ours = TwoDimDeficitScheduler(budget_tokens=16, budget_bytes=100, cap_tokens=16, cap_bytes=500)
    b2 = TokenDeficitScheduler(budget_tokens=16, cap_tokens=16)
    assert b2.step(demands).admitted == ("x",)  # no expert-byte coupling
    steps = 0
    while not ours.step(demands).admitted:
        steps += 1
    assert steps == 4  # carried bytes 100, 200, 300, 400 -> available 500 on the 5th step


def test_in_flight_seated_even_past_the_budget_and_carry_clamps_at_zero():
    s = TokenDeficitScheduler(budget_tokens=8, cap_tokens=16)
    a = s.step([D("a", 16, in_flight=True), D("b", 1, arrival=1)])
    assert a.admitted == ("a",) and a.deferred == ("b",) and a.carried == (0,)


def test_head_of_line_blocks_younger_demands():
    s = TokenDeficitScheduler(budget_tokens=8, cap_tokens=24)
    a = s.step([D("small", 2, arrival=5), D("big", 20, arrival=1)])
    assert a.admitted == () and a.deferred == ("big", "small")


@pytest.mark.parametrize("dimension", ["tokens", "expert_bytes"])
def test_cap_below_largest_single_demand_raises_naming_the_dimension(dimension):
    s = TwoDimDeficitScheduler(budget_tokens=8, budget_bytes=8, cap_tokens=10, cap_bytes=10)
    big = D("r", 11, 1) if dimension == "tokens" else D("r", 1, 11)
    with pytest.raises(ValueError, match=f"{dimension} cap 10 .* single demand of 11"):
        s.step([D("ok", 1, 1), big])
    assert s.carried == {"tokens": 0, "expert_bytes": 0}  # a refused step changes nothing


def test_bad_configuration_and_demands_raise():
    with pytest.raises(ValueError, match="budget tokens"):
        TokenDeficitScheduler(budget_tokens=0, cap_tokens=8)
    with pytest.raises(ValueError, match="cap expert_bytes"):
        TwoDimDeficitScheduler(budget_tokens=1, budget_bytes=1, cap_tokens=1, cap_bytes=-1)
    with pytest.raises(ValueError, match="tokens must be an int"):
        D("r", -1)
    with pytest.raises(ValueError, match="duplicated request ids"):
        TokenDeficitScheduler(budget_tokens=8, cap_tokens=8).step([D("r", 1), D("r", 2)])
    with pytest.raises(TypeError):
        DeficitScheduler({}, {})


# -- properties --------------------------------------------------------------------------------------------

request_st = st.tuples(
    st.integers(0, 3),  # arrival gap (steps after the previous request's arrival)
    st.lists(st.tuples(st.integers(1, 40), st.integers(0, 400)), min_size=1, max_size=5),  # rounds
)


def simulate(scheduler, requests, shuffle_seed):
    """Run requests (in arrival order) to completion; an admitted request stays in flight until done.

    Checks per step: budgets respected, carried in [0, cap]. Returns per-request (arrival step, queue position
    at arrival, admission step, finish step)."""
    dims = scheduler.dimensions
    rng = random.Random(shuffle_seed)
    arrive, t = [], 0
    for gap, _ in requests:
        t += gap
        arrive.append(t)
    pos = [0] * len(requests)
    admitted_at, finished_at, queue_pos = {}, {}, {}
    rounds_max = max(len(r) for _, r in requests)
    carry_steps = max(math.ceil(c / b) for c, b in zip(scheduler.cap, scheduler.budget, strict=True))
    horizon = arrive[-1] + len(requests) * (rounds_max + carry_steps + 1) + 1
    for step in range(horizon + 1):
        for i, at in enumerate(arrive):
            if at == step:
                queue_pos[i] = 1 + sum(1 for j in range(i) if j not in admitted_at)
        demands = []
        for i, (_, rounds) in enumerate(requests):
            if arrive[i] <= step and i not in finished_at:
                tok, nb = rounds[pos[i]]
                demands.append(VerifyDemand(i, tok, nb, in_flight=i in admitted_at, arrival=i))
        rng.shuffle(demands)  # list order must not matter, only arrival
        carried_in = scheduler._carried
        out = scheduler.step(demands)
        by_id = {d.request_id: d for d in demands}
        seated = [sum(getattr(by_id[r], d) for r in out.seated) for d in dims]
        new = [sum(getattr(by_id[r], d) for r in out.admitted if r not in out.seated) for d in dims]
        for k in range(len(dims)):
            assert out.available[k] == scheduler.budget[k] + carried_in[k]
            assert new[k] <= max(0, out.available[k] - seated[k])  # budgets respected
            if len(out.admitted) > len(out.seated):  # something new: the whole batch fits budget + carried
                assert out.used[k] <= out.available[k]
            assert 0 <= out.carried[k] <= scheduler.cap[k]  # carried within [0, cap]
        assert set(out.seated) == {i for i in by_id if i in admitted_at}  # in-flight always seated
        for r in out.admitted:
            admitted_at.setdefault(r, step)
            pos[r] += 1
            if pos[r] == len(requests[r][1]):
                finished_at[r] = step
        if len(finished_at) == len(requests):
            break
    return arrive, queue_pos, admitted_at, finished_at, rounds_max, carry_steps


def caps_for(requests):
    return (max(t for _, r in requests for t, _ in r), max(b for _, r in requests for _, b in r))


@settings(max_examples=150, deadline=None)
@given(
    requests=st.lists(request_st, min_size=1, max_size=12),
    budget_tokens=st.integers(1, 48),
    budget_bytes=st.integers(1, 500),
    cap_slack=st.tuples(st.integers(0, 50), st.integers(0, 500)),
    shuffle_seed=st.integers(0, 2**16),
)
def test_two_dim_liveness_budgets_and_bounded_wait(
    requests, budget_tokens, budget_bytes, cap_slack, shuffle_seed
):
    max_tok, max_bytes = caps_for(requests)
    s = TwoDimDeficitScheduler(budget_tokens, budget_bytes, max_tok + cap_slack[0], max_bytes + cap_slack[1])
    arrive, queue_pos, admitted_at, finished_at, rounds_max, carry_steps = simulate(s, requests, shuffle_seed)
    assert len(finished_at) == len(requests)  # liveness: every request finishes
    for i in range(len(requests)):
        wait = admitted_at[i] - arrive[i]
        assert wait <= queue_pos[i] * (rounds_max + carry_steps + 1)  # no starvation: bounded wait
    # FIFO admission: nothing younger is admitted before an older request
    order = sorted(admitted_at, key=lambda r: (admitted_at[r], r))
    assert order == sorted(order)


@settings(max_examples=100, deadline=None)
@given(
    requests=st.lists(request_st, min_size=1, max_size=12),
    budget_tokens=st.integers(1, 48),
    cap_slack=st.integers(0, 50),
    shuffle_seed=st.integers(0, 2**16),
)
def test_token_deficit_liveness_and_budgets(requests, budget_tokens, cap_slack, shuffle_seed):
    s = TokenDeficitScheduler(budget_tokens, caps_for(requests)[0] + cap_slack)
    arrive, queue_pos, admitted_at, finished_at, rounds_max, carry_steps = simulate(s, requests, shuffle_seed)
    assert len(finished_at) == len(requests)
    for i in range(len(requests)):
        assert admitted_at[i] - arrive[i] <= queue_pos[i] * (rounds_max + carry_steps + 1)


@settings(max_examples=50, deadline=None)
@given(big=st.integers(2, 10), budget=st.integers(1, 8))
def test_large_demand_not_starved_by_a_stream_of_small_ones(big, budget):
    """Adversarial order: one demand of big×budget tokens, then a small request arriving every step."""
    s = TokenDeficitScheduler(budget_tokens=budget, cap_tokens=big * budget)
    pending = [D("big", big * budget, arrival=0)]
    admitted_big_at = None
    for step in range(3 * big):
        pending.append(D(f"small{step}", 1, arrival=step + 1))
        out = s.step(pending)
        if "big" in out.admitted:
            admitted_big_at = step
            break
        assert out.admitted == ()  # the small ones never overtake the head
    # step s offers (s+1)·budget: the big demand is admitted after exactly ⌈cap/budget⌉ − 1 = big − 1 steps
    assert admitted_big_at == big - 1
