"""The link's policy on the CPU's emulated link, on a simulated clock so every time is exact.

The policy (``offload/link.py``) is the CUDA link's: demand copies on their own stream, at most ``window`` prefetches
on the prefetch stream with the rest queued on the host, a prefetch issued after demand copies waits for them,
the two streams share the bandwidth, and ``promote`` re-issues a queued prefetch on the demand stream. 1000 B
take 1 s on these links.
"""

from __future__ import annotations

import pytest
import torch

from pd_dflash.engine.reference.offload.link import HostLink
from tests.engine.reference.helpers import SimClock

GBPS = 1000 / 1e9  # 1000 B per second


def link(window=2):
    clock = SimClock()
    return HostLink(GBPS, window=window, clock=clock, sleep=clock.sleep), clock


def submit(lnk, nbytes=1000, demand=False):
    return lnk.submit([torch.empty(1)], [torch.ones(1)], nbytes, demand=demand)


def test_a_backlog_of_prefetches_waits_on_the_host_beyond_the_window():
    lnk, clock = link(window=2)
    ps = [submit(lnk) for _ in range(5)]
    assert lnk.pending() == {"queued": 3, "prefetch_stream": 2, "demand": 0}
    clock.now = 1.0  # the first prefetch lands; the next one leaves the host queue at once
    assert lnk.done(ps[0]) and not lnk.done(ps[1])
    assert lnk.pending()["queued"] == 2
    for t in ps:
        lnk.wait(t)
    assert [lnk.span(t) for t in ps] == [(float(i), float(i + 1)) for i in range(5)]


def test_a_demand_copy_shares_the_link_with_the_prefetch_on_it_instead_of_queueing_behind_it():
    lnk, clock = link()
    p = submit(lnk)
    clock.now = 0.5
    d = submit(lnk, nbytes=250, demand=True)  # 0.25 s of link time, at half the bandwidth from 0.5 s
    assert lnk.wait(d) == pytest.approx(0.5)
    assert lnk.span(d) == pytest.approx((0.5, 1.0))
    lnk.wait(p)
    assert lnk.span(p) == pytest.approx((0.0, 1.25))  # slowed by the demand copy while it shared the link


def test_a_prefetch_issued_after_demand_copies_waits_for_them():
    lnk, clock = link(window=1)
    p1, p2 = submit(lnk), submit(lnk)
    clock.now = 0.25
    d = submit(lnk, demand=True)
    lnk.wait(p2)
    # p1 and d share the link from 0.25 s; p2 leaves the host queue when p1 lands (1.75 s), after d was
    # submitted, so it waits for d (alone from 1.75 s to 2.0 s) instead of sharing the link with it.
    assert lnk.span(p1) == pytest.approx((0.0, 1.75))
    assert lnk.span(d) == pytest.approx((0.25, 2.0))
    assert lnk.span(p2) == pytest.approx((2.0, 3.0))


def test_the_window_is_not_overtaken_only_the_host_queue_is():
    lnk, clock = link(window=2)
    ps = [submit(lnk) for _ in range(4)]
    clock.now = 0.5
    d = submit(lnk, demand=True)
    for t in ps:
        lnk.wait(t)
    spans = [lnk.span(t) for t in ps]
    # p0 shares with d from 0.5 s (ends 1.5 s); p1 was already on the stream, so d shares with it too; p2
    # left the host queue while d was copying, so it waits for d; p3 follows on the prefetch stream.
    assert spans[0] == pytest.approx((0.0, 1.5))
    assert lnk.span(d) == pytest.approx((0.5, 2.5))
    assert spans[1] == pytest.approx((1.5, 3.0))
    assert spans[2] == pytest.approx((3.0, 4.0))
    assert spans[3] == pytest.approx((4.0, 5.0))


def test_promote_reissues_a_queued_prefetch_on_the_demand_stream():
    lnk, clock = link(window=1)
    p1, p2, p3 = submit(lnk), submit(lnk), submit(lnk)
    clock.now = 0.5
    lnk.promote(p3)  # compute needs p3 now: it leaves the host queue ahead of p2
    assert lnk.pending() == {"queued": 1, "prefetch_stream": 1, "demand": 1}
    assert lnk.wait(p3) == pytest.approx(1.5)
    assert lnk.span(p3) == pytest.approx((0.5, 2.0))
    lnk.wait(p2)
    assert lnk.span(p1) == pytest.approx((0.0, 1.5))
    assert lnk.span(p2) == pytest.approx((2.0, 3.0))  # waited for the promoted copy, then alone


def test_waiting_for_a_queued_prefetch_promotes_it():
    lnk, clock = link(window=1)
    _, p2 = submit(lnk), submit(lnk)
    clock.now = 0.5
    assert lnk.wait(p2) == pytest.approx(1.5)  # shares with p1 from 0.5 s: 1 s of work at half rate
    assert lnk.span(p2) == pytest.approx((0.5, 2.0))


def test_a_prefetch_on_the_stream_keeps_its_place_when_promoted():
    lnk, clock = link(window=2)
    _, p2 = submit(lnk), submit(lnk)
    clock.now = 0.1
    lnk.promote(p2)
    lnk.wait(p2)
    assert lnk.span(p2) == pytest.approx((1.0, 2.0))


def test_completion_is_remembered_after_the_first_positive_query():
    lnk, clock = link()
    t = submit(lnk)
    clock.now = 2.0
    assert lnk.done(t)
    reads = clock.reads
    for _ in range(100):
        assert lnk.done(t)
    assert clock.reads == reads  # no look at the link again


def test_a_transfer_is_copied_when_the_link_starts_it():
    lnk, _ = link(window=1)
    dst = [torch.zeros(3)]
    submit(lnk)
    t = lnk.submit(dst, [torch.ones(3)], 1000, demand=False)
    assert torch.equal(dst[0], torch.zeros(3))  # still in the host queue
    lnk.wait(t)
    assert torch.equal(dst[0], torch.ones(3))


def test_the_window_must_hold_a_transfer():
    with pytest.raises(ValueError, match="window"):
        HostLink(GBPS, window=0)


def test_the_reference_engine_never_synchronizes_the_whole_device():
    """Waits are on the compute stream or an event, never ``torch.cuda.synchronize()`` (which would also wait for
    the copy streams' prefetches and hide the overlap being measured). The waits themselves are exercised by the
    GPU tests (``test_gpu.py::test_the_next_draft_starts_before_cross_round_prefetches_finish``)."""
    from pathlib import Path

    import pd_dflash.engine.reference as reference

    root = Path(reference.__file__).parent
    device_wide = [
        f"{path.relative_to(root)}:{n}"
        for path in sorted(root.rglob("*.py"))
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if "cuda.synchronize(" in line.replace(" ", "")
    ]
    assert device_wide == []


def batch(lnk, n=2, nbytes=1000, band=1, land=None, dst=None):
    b = lnk.batch(band)
    members = [b.add(dst[i] if dst else [torch.empty(1)], [torch.ones(1)], nbytes, slot=i) for i in range(n)]
    lnk.submit_batch(b, land)
    return members


def test_a_batch_moves_as_one_item_whose_transfers_land_together_at_its_end():
    lnk, clock = link(window=1)
    ms = batch(lnk, n=3)
    p = submit(lnk)
    assert lnk.pending() == {"queued": 1, "prefetch_stream": 1, "demand": 0}  # the batch takes one place
    clock.now = 2.5
    assert not any(lnk.done(m) for m in ms)
    lnk.wait(ms[0])
    lnk.wait(p)
    assert [lnk.span(m) for m in ms] == [pytest.approx((0.0, 3.0))] * 3  # the bytes' time, unchanged
    assert lnk.span(p) == pytest.approx((3.0, 4.0))


def test_a_batch_is_one_copy_and_one_landing_call_for_all_its_slots():
    lnk, _ = link()
    dst, landed = [[torch.zeros(2)] for _ in range(3)], []
    ms = batch(lnk, n=3, dst=dst, land=landed.append)
    lnk.wait(ms[-1])
    assert landed == [[0, 1, 2]]
    assert all(torch.equal(d[0], torch.ones(2)) for d in dst)


def test_the_host_queue_serves_route_ahead_before_background():
    lnk, clock = link(window=1)
    first = submit(lnk)
    background = lnk.submit([torch.empty(1)], [torch.ones(1)], 1000, demand=False, band=2)
    route = batch(lnk, n=1, band=1)[0]
    clock.now = 10.0
    assert lnk.done(background) and lnk.done(route)
    assert lnk.span(first) == (0.0, 1.0)
    assert lnk.span(route) == pytest.approx((1.0, 2.0))  # submitted later, served first
    assert lnk.span(background) == pytest.approx((2.0, 3.0))


def test_an_on_demand_band_batch_goes_on_the_demand_stream_at_once():
    lnk, _ = link(window=1)
    submit(lnk)
    ms = batch(lnk, n=2, band=0)
    assert lnk.pending() == {"queued": 0, "prefetch_stream": 1, "demand": 1}
    lnk.wait(ms[0])
    assert lnk.span(ms[0]) == pytest.approx((0.0, 3.0))  # shares the link with p from the start
    assert not ms[0].demand  # still a prefetch to the cache's accounting


def test_promoting_a_transfer_of_a_queued_batch_takes_it_out_alone():
    lnk, clock = link(window=1)
    submit(lnk)
    landed = []
    ms = batch(lnk, n=3, land=landed.append)
    clock.now = 0.5
    assert lnk.wait(ms[1]) == pytest.approx(1.5)  # on the demand stream, sharing with the first prefetch
    assert landed == [[1]]
    lnk.wait(ms[0])
    assert landed == [[1], [0, 2]]
    assert lnk.span(ms[0]) == lnk.span(ms[2]) == pytest.approx((2.0, 4.0))  # the rest: two transfers' time


def test_bands_are_checked():
    lnk, _ = link()
    with pytest.raises(ValueError, match="band"):
        lnk.batch(3)


def test_without_emulation_a_batch_is_copied_and_landed_at_submit():
    lnk = HostLink(None)
    dst, landed = [[torch.zeros(1)] for _ in range(2)], []
    ms = batch(lnk, n=2, dst=dst, land=landed.append)
    assert all(lnk.done(m) for m in ms) and landed == [[0, 1]]
    assert all(torch.equal(d[0], torch.ones(1)) for d in dst)
