"""The host→device link that moves experts into cache slots: one interface, one policy, two devices.

**The policy** (``CudaLink`` in ``offload/cuda_link.py`` does it with CUDA streams and events; the CPU ``HostLink``
here emulates the same):

- Two streams share the link. A *demand* transfer (compute needs the expert now) goes on the demand stream at
  once, behind earlier demand transfers only. A *prefetch* waits in a host queue (FIFO); at most ``window``
  (default 2) prefetches are on the prefetch stream at a time, and the next is issued when one lands.
- A prefetch issued after a demand transfer starts only once every demand transfer submitted before it has
  landed (CUDA: the prefetch stream waits for the event recorded after the last demand copy). So a layer's
  demand copies share the link only with the ≤ ``window`` prefetches already on the stream, never with the
  backlog: CUDA stream priorities do not order copies, so the backlog stays on the host instead.
- While both streams copy, each gets half the bandwidth (CUDA: two copy streams on one PCIe direction; the
  emulated link: processor sharing).
- ``promote(t)``: compute now needs a prefetch. If it is still in the host queue it is re-issued on the demand
  stream (behind earlier demand transfers, ahead of every prefetch); one already on the prefetch stream keeps
  its place (at most ``window`` transfers are ahead of it there).
- **Bands** (upstream's priority band, BM3): on-demand 0 < route-ahead 1 < background 2. Band 0 goes on the
  demand stream at once (a demand transfer, or a prefetch served at on-demand priority); the host queue serves
  band 1 before band 2, FIFO within a band. Background is the prediction made before the router pass has run:
  the AR prefetcher's next-layer guesses and route-ahead's history issue at the end of a verify.
- **Batches** (``batch`` + ``submit_batch``, BM2's batched mode): a layer's prefetches go on the link as ONE item:
  one copy dispatch (``torch._foreach_copy_``), one landing call for all their slots (``SlotPool.lander``), one
  event pair on CUDA, the slot-free waits of its slots folded into it (each distinct event once). Its link time
  is the sum of its transfers' (the byte timing is unchanged); its transfers land together, at its end. A batch
  takes one place in the window; promoting a transfer of a batch still in the host queue takes it out of the
  batch onto the demand stream (the rest of the batch keeps its place).
- A copy into a slot starts only after the compute that last read the slot has finished (``record_use``).
- Every span is on the host's ``perf_counter`` clock: CPU transfers run on the emulated timeline; CUDA events
  are placed on it through a reference event recorded at each compute synchronization (the compute stream is
  idle then), so transfer spans, stalls and the rounds' compute windows are compared on one clock.

**The interface** is the ``Link`` protocol below (both links implement it; ``ExpertCache`` is the only caller
besides the runtime's ``synchronize``).

Without emulation (``HostLink(None)``, kind "host") a transfer is a host memcpy done at submit, no policy.
"""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from typing import Protocol

import torch

from pd_dflash.engine.nvtx_ranges import nvtx_range
from pd_dflash.engine.reference.offload.transfer import (
    BACKGROUND,
    BANDS,
    ON_DEMAND,
    ROUTE_AHEAD,
    Batch,
    Transfer,
    check_band,
    copy_members,
    copy_one,
    detach,
    mark_issued,
    mark_landed,
    started,
)

__all__ = ["BACKGROUND", "BANDS", "ON_DEMAND", "PREFETCH_WINDOW", "ROUTE_AHEAD", "Batch", "Link", "Transfer"]

#: Prefetches (or batches) on the prefetch stream at once: enough to keep the link busy while the host reacts to
#: a completion, few enough that a demand copy shares the link with little.
PREFETCH_WINDOW = 2


class Link(Protocol):
    """What the expert cache asks of a host→device link (``HostLink`` here, ``CudaLink`` in offload/cuda_link.py)."""

    #: "real" (CUDA), "emulated" (CPU pacing), "host" (an un-emulated CPU host-to-host copy).
    kind: str

    def describe(self) -> dict: ...

    def submit(
        self,
        dst: list[torch.Tensor],
        src: list[torch.Tensor],
        nbytes: int,
        demand: bool,
        after=None,
        land=None,
    ):
        """Copy ``src`` into ``dst`` (the tensors of slot ``after``), then run ``land()`` (the cache's
        dequantisation into its slot pool; on CUDA on the copy stream, before the transfer's end event), so a
        transfer has landed only once its slot holds compute weights; returns the ``Transfer``. A demand transfer
        goes on the demand stream at once, a prefetch into the host queue (the policy above)."""
        ...

    def batch(self, band: int = ROUTE_AHEAD) -> Batch:
        """An empty batch of prefetches in ``band`` (``Batch.add`` each, then ``submit_batch``)."""
        ...

    def submit_batch(self, batch: Batch, land_many=None, copy_many=None) -> Transfer | None:
        """Put ``batch`` on the link as one item (the module doc's batches): its copies in one call
        (``copy_many(members, non_blocking)``, else one ``_foreach_copy_``), then its members' slots landed with
        ONE ``land_many(slots)`` call; in band 0 it goes on the demand stream at once, else into the host queue.
        Returns the item (None for an empty batch)."""
        ...

    def promote(self, t: Transfer) -> None:
        """Compute now needs a prefetch: still in the host queue, it is re-issued on the demand stream (behind
        earlier demand transfers, ahead of every prefetch); already on the prefetch stream, it keeps its place."""
        ...

    def done(self, t: Transfer) -> bool:
        """``t`` has landed. Remembered on the transfer after the first True (no repeated event queries, e.g. by
        LFU's scan). A transfer still in the host queue is not done."""
        ...

    def wait(self, t: Transfer) -> float:
        """Compute needs ``t`` (a queued ``t`` is promoted first). CPU: blocks until it lands and returns the
        seconds waited. CUDA: the compute stream waits for it (the host does not) and 0.0 is returned; the stall
        is measured on the GPU and returned later by ``harvest_exposed``."""
        ...

    def host_wait(self, t: Transfer) -> float:
        """The host blocks until ``t`` has landed (a slot it must reuse); returns the seconds."""
        ...

    def synchronize(self, event=None) -> None:
        """The host blocks until compute has finished (or ``event``), never the whole device; prefetches keep
        flowing from the host queue meanwhile; takes a new time reference."""
        ...

    def span(self, t: Transfer) -> tuple[float, float]:
        """A landed transfer's link interval on the host clock."""
        ...

    def seconds(self, t: Transfer) -> float:
        """A landed transfer's link seconds."""
        ...

    def record_use(self, slots: int | list[int]) -> None:
        """Compute reading ``slots`` (one slot or a list) has been enqueued: a later copy into one of them must
        wait for it."""
        ...

    def harvest_exposed(self, spans: list | None = None) -> float:
        """Compute stalls measured since the last call and complete now (seconds; their intervals are appended to
        ``spans``). The CPU link returns 0.0 (``wait`` returned them)."""
        ...

    def pending(self) -> dict[str, int]:
        """Transfers queued on the host, on the prefetch stream, on the demand stream."""
        ...

    def close(self) -> None:
        """Wait for the link's own streams and drop the queue."""
        ...


def _copy(t: Transfer) -> None:
    with nvtx_range("expert_h2d"):
        if t.members is not None:
            copy_members(t)
            if t.land_many is not None and t.members:
                t.land_many([m.slot for m in t.members])
            for m in t.members:
                m.dst = m.src = None
        else:
            copy_one(t)
            if t.land is not None:
                t.land()
    t.dst = t.src = t.land = t.land_many = t.copy_many = None


class HostLink:
    """The CPU engine's link: a real copy into the slot, paced as an emulated link when ``gbps`` is set.

    Emulated: the policy above, each transfer needing ``nbytes / BW + latency`` seconds of link time, shared
    equally while both streams copy. The timeline is simulated lazily whenever the link is called (no helper
    thread: one that had to win the GIL and the OS scheduler to signal completions delivered 1 GB/s as 0.03 GB/s
    on a 2-core VM). A prefetch leaves the host queue at the exact moment the window frees (CUDA: at the next
    link call or while the host waits through the link). A transfer's copy is made when the link starts it;
    compute that needs a transfer still on the link sleeps until its completion (no CPU spent). ``clock`` and
    ``sleep`` are the host's (a test may pass a simulated pair).
    """

    def __init__(
        self,
        gbps: float | None = None,
        latency_us: float = 0.0,
        window: int = PREFETCH_WINDOW,
        *,
        clock=time.perf_counter,
        sleep=time.sleep,
    ) -> None:
        if window < 1:
            raise ValueError(f"the prefetch window must be at least 1 transfer, got {window}")
        self.gbps, self.latency_us, self.window = gbps, float(latency_us), window
        #: "host": not a device link at all, a host-to-host memcpy (rows must not claim a real H2D link).
        self.kind = "emulated" if gbps else "host"
        self._clock, self._sleep = clock, sleep
        #: The host queue (prefetches not yet on a stream), one FIFO per band after on-demand, served in order.
        self._bands: dict[int, deque[Transfer]] = {ROUTE_AHEAD: deque(), BACKGROUND: deque()}
        self._stream: deque[Transfer] = deque()  # the prefetch stream (≤ window)
        self._demand: deque[Transfer] = deque()  # the demand stream
        self._now = clock()  # the simulated timeline is known up to here
        self._seq = itertools.count()

    def describe(self) -> dict:
        if self.gbps:
            return {
                "link": "emulated",
                "emulated_h2d_gbps": self.gbps,
                "emulated_latency_us": self.latency_us,
                "prefetch_window": self.window,
            }
        return {"link": "host memcpy (CPU, not emulated)"}

    def submit(
        self,
        dst: list[torch.Tensor],
        src: list[torch.Tensor],
        nbytes: int,
        demand: bool,
        after=None,
        land=None,
        band: int | None = None,
    ):
        now = self._clock()
        t = Transfer(nbytes, demand, dst, src, next(self._seq), after, now, land)
        if band is not None:
            t.band = ON_DEMAND if demand else check_band(band)
        return self._put(t, now)

    def batch(self, band: int = ROUTE_AHEAD) -> Batch:
        return Batch(self._seq, self._clock, band)

    def submit_batch(self, batch: Batch, land_many=None, copy_many=None) -> Transfer | None:
        if not batch.members:
            return None
        b = batch.transfer(land_many, copy_many)
        return self._put(b, b.submitted)

    def _put(self, t: Transfer, now: float) -> Transfer:
        if not self.gbps:
            started(t, now)
            _copy(t)
            mark_landed(t, self._clock())
            for m in (t, *(t.members or ())):
                m.issued = m.complete = True
            return t
        self._advance(now)
        per = 1.0 / (self.gbps * 1e9)
        for m in t.members or ():
            m.work = m.nbytes * per + self.latency_us * 1e-6
        t.work = sum(m.work for m in t.members) if t.members else t.nbytes * per + self.latency_us * 1e-6
        if t.band == ON_DEMAND:
            mark_issued(t)
            self._demand.append(t)
        else:
            self._bands[t.band].append(t)
        self._advance(now)
        return t

    def promote(self, t: Transfer) -> None:
        self._advance(self._clock())
        if not t.issued:
            if t.batch is not None:
                empty = detach(t)
                if empty is not None:
                    self._bands[empty.band].remove(empty)
            else:
                self._bands[t.band].remove(t)
            t.issued = t.promoted = True
            self._demand.append(t)
            self._advance(self._now)

    def done(self, t: Transfer) -> bool:
        if not t.complete:
            now = self._clock()
            self._advance(now)
            t.complete = t.end is not None and t.end <= now
        return t.complete

    def wait(self, t: Transfer) -> float:
        """Block until ``t`` is in its slot; returns the seconds compute waited (exposed)."""
        if t.complete:
            return 0.0
        if not t.issued:
            self.promote(t)
        # The host blocks until t lands, so nothing else can be submitted meanwhile: simulate up to it.
        self._advance(math.inf, stop=t)
        start = self._clock()
        t.complete = True
        if t.end > start:
            self._sleep(t.end - start)
            return self._clock() - start
        return 0.0

    host_wait = wait

    def synchronize(self, event=None) -> None:
        self._advance(self._clock())  # CPU compute is synchronous: nothing to wait for

    def span(self, t: Transfer) -> tuple[float, float]:
        return t.start, t.end

    def seconds(self, t: Transfer) -> float:
        return t.end - t.start

    def harvest_exposed(self, spans: list | None = None) -> float:
        return 0.0  # CPU waits are returned by ``wait`` where they happen

    def record_use(self, slots) -> None:
        pass  # CPU compute has finished reading a slot when it returns

    def pending(self) -> dict[str, int]:
        queued = sum(len(q) for q in self._bands.values())
        return {"queued": queued, "prefetch_stream": len(self._stream), "demand": len(self._demand)}

    def close(self) -> None:
        for q in self._bands.values():
            q.clear()
        self._stream.clear()
        self._demand.clear()

    # -- the emulated timeline ---------------------------------------------------------------------------------
    def _advance(self, until: float, stop: Transfer | None = None) -> None:
        """Run the link from its known time to ``until`` (or until ``stop`` lands): commit prefetches into the
        window, serve the head of each stream (sharing the bandwidth), retire what lands."""
        now = self._now
        while stop is None or stop.end is None:
            self._commit()
            active = self._active()
            if not active:
                if stop is not None:
                    raise RuntimeError("waiting for a transfer this link no longer holds (link closed?)")
                now = max(now, until)
                break
            for t in active:
                if t.start is None:
                    started(t, now)
                    _copy(t)
            least = min(t.work for t in active)
            finish = now + least * len(active)
            if finish > until:
                for t in active:
                    t.work -= (until - now) / len(active)
                now = until
                break
            now = finish
            for t in active:
                t.work -= least
                if t.work <= least * 1e-9:
                    t.work = 0.0
                    mark_landed(t, now)
                    (self._demand if t.band == ON_DEMAND or t.promoted else self._stream).remove(t)
        self._now = max(self._now, now)

    def _commit(self) -> None:
        """Fill the prefetch window from the host queue, band by band; each waits for the demand transfers
        before it."""
        for queue in self._bands.values():
            while len(self._stream) < self.window and queue:
                t = queue.popleft()
                mark_issued(t)
                t.gate = self._demand[-1] if self._demand else None
                self._stream.append(t)

    def _active(self) -> list[Transfer]:
        active = [self._demand[0]] if self._demand else []
        if self._stream and (self._stream[0].gate is None or self._stream[0].gate.end is not None):
            active.append(self._stream[0])
        return active
