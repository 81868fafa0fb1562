"""Cost-aware verify width and OURS's byte budget as a rate, on hand-built numbers (each figure computed a second
way by hand)."""

from __future__ import annotations

import pytest

from pd_dflash.engine.reference.decoding.admission import ByteRate, DeficitAdmission
from pd_dflash.engine.reference.decoding.deficit import TwoDimDeficitScheduler, VerifyDemand
from pd_dflash.engine.reference.offload.verify_width import CostAwareWidth, new_bytes_per_row


def test_survival_counts_a_cut_block_only_for_the_rows_it_verified():
    w = CostAwareWidth(1e6)
    # (accepted drafts, verified rows): a full 4-row block rejecting d1; one accepting d1 then rejecting d2; a
    # block cut to 2 rows that accepted its only draft (censored: says nothing about d2).
    w.observe([(0, 4), (1, 4), (1, 2)], seconds=0.3, committed=1 + 2 + 2)
    # d1: reached 3 times, accepted twice; d2: reached once (the full block that accepted d1), rejected.
    assert w.survival(1) == pytest.approx(2 / 3)
    assert w.survival(2) == pytest.approx(2 / 3 * 0)
    assert w.seconds_per_token == pytest.approx(0.3 / 5)


def test_the_block_is_cut_before_the_first_row_not_worth_its_bytes():
    w = CostAwareWidth(link_bytes_per_second=1000.0)
    assert w.width([0, 5000, 5000]) == 3  # nothing measured yet: never cut
    w.observe([(3, 4), (3, 4), (1, 4), (0, 4)], seconds=0.8, committed=16)  # 50 ms per committed token
    # p1 = 3/4, p2 = 3/4 · 2/3 = 1/2, p3 = 1/2 · 1 = 1/2 (d3 reached twice, accepted twice).
    # Row 2 costs (1 − 1/2) · 40 B / 1000 B/s = 20 ms ≤ 1/2 · 50 ms: kept. Row 3: (1/2) · 200 B / 1000 = 100 ms
    # > 25 ms: cut before it (the anchor and the first draft always stay).
    assert w.width([999, 10**9, 40, 200]) == 3
    assert (w.blocks_cut, w.rows_cut) == (1, 1)
    assert w.width([0, 0, 0, 0]) == 4
    # A look-ahead (route-ahead's early issue) gives the same answer and leaves the counters alone.
    assert w.width([999, 10**9, 40, 200], count=False) == 3
    assert (w.blocks, w.blocks_cut, w.rows_cut) == (3, 1, 1)


def test_new_bytes_per_row_counts_each_missing_key_once():
    rows = [{(0, 1)}, {(0, 1), (0, 2), (1, 5)}, {(0, 2), (1, 6)}]
    cached = {(1, 5)}
    assert new_bytes_per_row(rows, cached.__contains__, 10) == [10, 10, 10]
    # With 3 slots: rows 0-1 need 3 distinct keys (they fit), row 2 makes it 5: its new key also displaces one
    # the round or the next needs again, so it counts twice.
    assert new_bytes_per_row(rows, cached.__contains__, 10, slots=3) == [10, 10, 20]


class Clock:
    def __init__(self) -> None:
        self.now, self.slept = 0.0, []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_byte_budget_is_the_link_rate_over_the_elapsed_time():
    clock = Clock()
    rate = ByteRate(1000.0, clock=clock, sleep=clock.sleep)
    rate.reset()
    clock.now = 0.25
    assert rate.budget() == 250
    assert rate.budget() == 1  # no time passed: at least one byte (a budget is ≥ 1)
    rate.idle(500)
    assert clock.slept == [0.5] and rate.waited_seconds == 0.5
    assert rate.budget() == 500


def test_an_idle_admission_step_costs_link_time():
    clock = Clock()
    sched = TwoDimDeficitScheduler(budget_tokens=8, budget_bytes=1, cap_tokens=16, cap_bytes=10_000)
    admission = DeficitAdmission(sched, byte_rate=ByteRate(1000.0, clock=clock, sleep=clock.sleep))
    admission.reset()

    class Req:
        rid = "a"

    class Blk:
        request, tokens, ready_step = Req(), [0] * 8, 0

    admission.fetch_keys = lambda rid: {(0, 1), (0, 2)}
    admission.is_resident = lambda key: False
    admission.expert_nbytes = 300  # the demand: 600 B
    clock.now = 0.1  # 100 B accrued: not enough
    assert admission.select([Blk()]) == []
    # Second way: missing = 600 − 100 = 500 B at 1000 B/s → the step slept 0.5 s; carried 100 B.
    assert clock.slept == [pytest.approx(0.5)]
    assert [b.request.rid for b in admission.select([Blk()])] == ["a"]  # 100 carried + 500 accrued = 600
    info = admission.describe()
    assert info["expert_bytes_budget"] == "rate" and info["idle_steps"] == 1


def test_a_step_budget_override_replaces_the_fixed_budget_in_that_dimension():
    s = TwoDimDeficitScheduler(budget_tokens=8, budget_bytes=100, cap_tokens=16, cap_bytes=1000)
    demands = [VerifyDemand("a", 8, 300, arrival=0)]
    assert s.step(demands).admitted == ()  # 100 B available
    assert s.step(demands, {"expert_bytes": 250}).admitted == ("a",)  # 100 carried + 250 ≥ 300
    with pytest.raises(ValueError, match="must be an int ≥ 1"):
        s.step(demands, {"expert_bytes": 0})
    with pytest.raises(ValueError, match="unknown dimension"):
        s.step(demands, {"seconds": 3})
