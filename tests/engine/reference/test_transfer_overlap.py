"""Link time and the BM4 overlap on hand-built spans with known answers, and the union against a grid oracle."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pd_dflash.engine.reference.decoding.loop import RoundRecord
from pd_dflash.engine.reference.offload.cache import ExpertCache
from pd_dflash.engine.reference.offload.link import HostLink
from pd_dflash.engine.reference.offload.overlap import transfer_overlap
from pd_dflash.intervals import SpanUnion, merge, subtract, union_seconds
from tests.engine.reference.helpers import SimClock, store


def grid_cells(intervals):
    """Independent oracle: the unit cells [i, i+1) covered by integer intervals."""
    return {i for a, b in intervals for i in range(a, b)}


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 40), st.integers(0, 12)), max_size=25))
def test_span_union_matches_a_grid_oracle(pairs):
    intervals = [(a, a + n) for a, n in pairs]
    u = SpanUnion()
    for a, b in intervals:
        u.add(a, b)
    cells = grid_cells(intervals)
    assert u.total == len(cells) == union_seconds(intervals)
    assert grid_cells(u.intervals) == cells == grid_cells(merge(intervals))
    assert all(b0 < a1 for (_, b0), (a1, _) in zip(u.intervals, u.intervals[1:], strict=False))


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.integers(0, 40), st.integers(0, 12)), max_size=12),
    st.lists(st.tuples(st.integers(0, 40), st.integers(0, 12)), max_size=12),
)
def test_subtract_matches_a_grid_oracle(pairs, hole_pairs):
    intervals = [(a, a + n) for a, n in pairs]
    holes = [(a, a + n) for a, n in hole_pairs]
    assert grid_cells(subtract(intervals, holes)) == grid_cells(intervals) - grid_cells(holes)


def test_union_of_two_overlapping_streams_counts_the_shared_time_once():
    assert union_seconds([(1.0, 4.0), (2.0, 5.0)]) == 4.0  # a sum would say 6
    assert union_seconds([(1.0, 2.0), (2.0, 3.0), (5.0, 5.0)]) == 2.0


def rounds_with(windows):
    record = RoundRecord(
        start=0.0, seconds=0.0, forward_seconds=0.0, requests=1, tokens=1, committed=[1], kv_bytes=0
    )
    record.windows = windows
    return [record]


def test_overlap_on_hand_built_spans():
    log = SimpleNamespace(
        transfer_log=[
            (1.0, 4.0, 100, True),
            (8.0, 12.0, 200, False),
            (15.0, 16.0, 50, False),
            (2.0, 5.0, 0, False),
        ],
        stall_log=[(2.0, 3.0)],
    )
    rounds = rounds_with([("draft", 11.0, 13.0), ("issue", 13.0, 14.0), ("verify", 0.0, 10.0)])
    got = transfer_overlap(log, rounds)
    # verify minus the stall: (0, 2) ∪ (3, 10); draft: (11, 13).
    assert got["overlapped_seconds"]["verify"] == pytest.approx(1 + 1 + 2 + 0 + (0 + 2))  # 6
    assert got["overlapped_seconds"]["draft"] == pytest.approx(1.0)
    assert got["overlapped_seconds"]["any_compute"] == pytest.approx(7.0)
    assert got["overlap_fraction"]["verify"] == pytest.approx((100 * 2 / 3 + 200 * 2 / 4) / 350)
    assert got["overlap_fraction"]["draft"] == pytest.approx((200 * 1 / 4) / 350)
    assert got["h2d_link_seconds"] == pytest.approx(4.0 + 4.0 + 1.0)  # [1, 5] ∪ [8, 12] ∪ [15, 16]
    assert got["stall_seconds"] == pytest.approx(1.0)
    assert got["transfers"] == 4 and got["demand_transfers"] == 1 and got["h2d_bytes"] == 350


def test_cache_link_time_is_the_union_of_transfer_spans():
    s = store()
    clock = SimClock()
    link = HostLink(s.expert_nbytes / 1e9, clock=clock, sleep=clock.sleep)  # one expert per second
    cache = ExpertCache(s, 4 * s.expert_nbytes, torch.device("cpu"), torch.float32, link=link)
    cache.prefetch((0, 1))
    clock.now = 0.5
    cache.weights(cache.acquire((0, 0)))  # demand: shares the link with the prefetch from 0.5 s
    cache.drain()
    spans = sorted(x for a, b, _, _ in cache.transfer_log for x in (a, b))
    assert spans == pytest.approx([0.0, 0.5, 1.5, 2.0])  # the prefetch (0, 1.5), the demand (0.5, 2.0)
    assert cache.counters.h2d_seconds == pytest.approx(2.0)  # Σ durations would be 3.0
    assert cache.counters.exposed_seconds == pytest.approx(1.5)
    cache.close()
