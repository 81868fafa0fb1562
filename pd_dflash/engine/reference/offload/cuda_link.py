"""``CudaLink``: the link of ``offload/link.py`` (its policy and interface are documented there) on a CUDA device.

Two copy streams from pinned host memory (the arena of ``offload/store.py``): demand copies (band 0) on one, at
most ``window`` prefetches on the other with the rest queued on the host by band (route-ahead before
background), each prefetch issued after a demand copy waiting for the event recorded after it. A batch is one
``torch._foreach_copy_`` and one landing call between ONE event pair, after one wait per distinct slot-free event
of its slots. Every call pumps the host queue (retires landed prefetches, issues
the next), and so does every host wait that goes through the link (``synchronize``, ``host_wait``): while
prefetches wait on the host, the link polls instead of blocking. Compute waits only for the experts it needs
(``wait_event`` on the compute stream) and the stall is measured on the GPU by an event pair around the wait.
Event times are placed on the host clock through a reference event recorded on the idle compute stream after
each ``synchronize``, so transfers, stalls and compute windows share one clock with the CPU link's.
"""

from __future__ import annotations

import itertools
import time
from collections import deque

import torch

from pd_dflash.engine.nvtx_ranges import nvtx_range
from pd_dflash.engine.reference.offload.link import PREFETCH_WINDOW
from pd_dflash.engine.reference.offload.transfer import (
    BACKGROUND,
    ON_DEMAND,
    ROUTE_AHEAD,
    Batch,
    Transfer,
    check_band,
    copy_members,
    copy_one,
    detach,
)


class CudaLink:
    """Real host→device transfers on two CUDA copy streams from pinned host memory (the policy of ``offload/link.py``)."""

    kind = "real"

    def __init__(self, device: torch.device, window: int = PREFETCH_WINDOW, *, clock=time.perf_counter):
        if window < 1:
            raise ValueError(f"the prefetch window must be at least 1 transfer, got {window}")
        self.device, self.window, self._clock = device, window, clock
        self.demand_stream = torch.cuda.Stream(device=device)
        self.prefetch_stream = torch.cuda.Stream(device=device)
        self._bands: dict[int, deque[Transfer]] = {ROUTE_AHEAD: deque(), BACKGROUND: deque()}  # host queue
        self._window: deque[Transfer] = deque()  # issued on the prefetch stream, not yet known landed
        self._last_demand: torch.cuda.Event | None = None  # after the last demand copy
        self._gated: torch.cuda.Event | None = None  # the demand event the prefetch stream already waits for
        self._slot_free: dict[int, torch.cuda.Event] = {}
        self._stalls: list[tuple[torch.cuda.Event, torch.cuda.Event, tuple]] = []
        self._seq = itertools.count()
        torch.cuda.current_stream(device).synchronize()
        self._ref = self._reference()

    def describe(self) -> dict:
        return {
            "link": "cuda copy streams (pinned host memory, non-blocking)",
            "prefetch_window": self.window,
        }

    def submit(
        self,
        dst,
        src,
        nbytes: int,
        demand: bool,
        after: int | None = None,
        land=None,
        band: int | None = None,
    ) -> Transfer:
        t = Transfer(nbytes, demand, dst, src, next(self._seq), after, self._clock(), land)
        if band is not None:
            t.band = ON_DEMAND if demand else check_band(band)
        return self._put(t)

    def batch(self, band: int = ROUTE_AHEAD) -> Batch:
        return Batch(self._seq, self._clock, band)

    def submit_batch(self, batch: Batch, land_many=None, copy_many=None) -> Transfer | None:
        return self._put(batch.transfer(land_many, copy_many)) if batch.members else None

    def _put(self, t: Transfer) -> Transfer:
        if t.band == ON_DEMAND:
            self._issue(t, self.demand_stream)
        else:
            self._bands[t.band].append(t)
        self._pump()
        return t

    def promote(self, t: Transfer) -> None:
        if not t.issued:
            if t.batch is not None:
                empty = detach(t)
                if empty is not None:
                    self._bands[empty.band].remove(empty)
            else:
                self._bands[t.band].remove(t)
            t.promoted = True
            self._issue(t, self.demand_stream)

    def done(self, t: Transfer) -> bool:
        if not t.issued:
            self._pump()
        return self._landed(t)

    def wait(self, t: Transfer) -> float:
        """The compute stream waits for ``t`` (the host does not); the stall is measured by an event pair."""
        if not t.issued:
            self.promote(t)
        self._pump()
        if self._landed(t):
            return 0.0
        stream = torch.cuda.current_stream(self.device)
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(stream)
        stream.wait_event(t.end_event)
        after.record(stream)
        self._stalls.append((before, after, self._ref))
        return 0.0

    def host_wait(self, t: Transfer) -> float:
        if not t.issued:
            self.promote(t)
        start = self._clock()
        self._host_wait_event(t.end_event)
        t.complete = True
        self._pump()
        return self._clock() - start

    def synchronize(self, event: torch.cuda.Event | None = None) -> None:
        """Block until ``event`` (default: everything enqueued on the compute stream) has completed."""
        idle = event is None
        if idle:
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.device))
        self._host_wait_event(event)
        if idle:
            self._ref = self._reference()

    def span(self, t: Transfer) -> tuple[float, float]:
        return self._host_time(t.ref, t.start_event), self._host_time(t.ref, t.end_event)

    def seconds(self, t: Transfer) -> float:
        return t.start_event.elapsed_time(t.end_event) / 1e3

    def record_use(self, slots) -> None:
        """Compute that reads ``slots`` (one or a list) has been enqueued: a later copy into one must wait for
        it (one event for all of them)."""
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        for slot in slots if isinstance(slots, (list, tuple)) else (slots,):
            self._slot_free[slot] = ev

    def harvest_exposed(self, spans: list | None = None) -> float:
        """Stalls whose end has completed (no synchronization: the others are kept for a later call)."""
        total, keep = 0.0, []
        for before, after, ref in self._stalls:
            if not after.query():
                keep.append((before, after, ref))
                continue
            a, b = self._host_time(ref, before), self._host_time(ref, after)
            total += b - a
            if spans is not None:
                spans.append((a, b))
        self._stalls = keep
        return total

    def pending(self) -> dict[str, int]:
        self._pump()
        return {"queued": sum(len(q) for q in self._bands.values()), "prefetch_stream": len(self._window)}

    def close(self) -> None:
        for q in self._bands.values():
            q.clear()
        self.demand_stream.synchronize()
        self.prefetch_stream.synchronize()

    # -- internals ---------------------------------------------------------------------------------------------
    def _issue(self, t: Transfer, stream: torch.cuda.Stream) -> None:
        """Enqueue ``t``'s copies (``expert_h2d`` spans the enqueue; the copy is the GPU trace's memcpy)."""
        t.ref = self._ref
        t.start_event = torch.cuda.Event(enable_timing=True)
        t.end_event = torch.cuda.Event(enable_timing=True)
        members = t.members
        with torch.cuda.stream(stream), nvtx_range("expert_h2d"):
            self._wait_slots_free(stream, [m.slot for m in members] if members is not None else [t.slot])
            if stream is self.prefetch_stream and self._last_demand is not self._gated:
                stream.wait_event(self._last_demand)  # yield to the demand copies submitted before
                self._gated = self._last_demand
            t.start_event.record(stream)
            if members is not None:  # a batch: one copy dispatch, one landing call
                copy_members(t, non_blocking=True)
                if t.land_many is not None:
                    t.land_many([m.slot for m in members])
            else:
                copy_one(t, non_blocking=True)
                if t.land is not None:
                    t.land()  # dequantise into the slot pool on the copy stream, after the copy
            t.end_event.record(stream)
        t.dst = t.src = t.land = t.land_many = t.copy_many = None
        t.issued = True
        for m in members or ():
            m.dst = m.src = None
            m.ref, m.start_event, m.end_event, m.issued = t.ref, t.start_event, t.end_event, True
        if stream is self.demand_stream:
            self._last_demand = t.end_event
        else:
            self._window.append(t)

    def _wait_slots_free(self, stream: torch.cuda.Stream, slots: list[int | None]) -> None:
        """The copy stream waits for the compute that last read each slot: each distinct event once (a layer's
        slots share one ``record_use`` event)."""
        waited: set[int] = set()
        for slot in slots:
            freed = self._slot_free.get(slot) if slot is not None else None
            if freed is not None and id(freed) not in waited:
                waited.add(id(freed))
                stream.wait_event(freed)

    def _pump(self) -> None:
        """Retire landed prefetches (FIFO on one stream) and issue queued ones while the window has room."""
        while self._window and self._landed(self._window[0]):
            self._window.popleft()
        for queue in self._bands.values():
            while queue and len(self._window) < self.window:
                self._issue(queue.popleft(), self.prefetch_stream)

    def _landed(self, t: Transfer) -> bool:
        if not t.complete and t.issued and t.end_event.query():
            t.complete = True
        return t.complete

    def _host_wait_event(self, event: torch.cuda.Event) -> None:
        """Block the host until ``event``; while prefetches wait on the host, keep issuing them (polling)."""
        while any(self._bands.values()) and not event.query():
            self._pump()
            time.sleep(0)
        event.synchronize()

    def _reference(self) -> tuple[torch.cuda.Event, float]:
        """An event on the idle compute stream and the host time it completes at (the clock's anchor)."""
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev, self._clock()

    @staticmethod
    def _host_time(ref: tuple[torch.cuda.Event, float], ev: torch.cuda.Event) -> float:
        return ref[1] + ref[0].elapsed_time(ev) / 1e3
