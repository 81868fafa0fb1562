"""The host→device link that moves experts into cache slots.

- ``CudaLink``: real transfers. Non-blocking copies from pinned host memory on dedicated copy streams (a
  high-priority one for on-demand fetches, one for prefetches), timed with CUDA events. Compute waits only for
  the experts it needs (``wait_event`` on the compute stream); the stall is measured by an event pair around
  that wait, so exposed fetch time is GPU time the compute stream spent blocked.
- ``ThreadLink``: the CPU engine's link. A background thread serves a transfer queue in order (on-demand
  before queued prefetches), doing the real copy into the slot; with emulation (``gbps``, ``latency_us``) each
  transfer occupies the link for bytes/BW + latency of wall time (it sleeps: no CPU), so a prefetch really
  overlaps compute and an on-demand fetch really exposes its wait.
"""

from __future__ import annotations

import itertools
import queue
import threading
import time

import torch

from pd_dflash.engine.nvtx_ranges import nvtx_range


class Transfer:
    """One expert's host→device copy."""

    __slots__ = (
        "_done",
        "demand",
        "dst",
        "end",
        "end_event",
        "nbytes",
        "promoted",
        "src",
        "start",
        "start_event",
        "started",
    )

    def __init__(self, nbytes: int, demand: bool, dst=None, src=None) -> None:
        self.nbytes, self.demand, self.dst, self.src = nbytes, demand, dst, src
        self.start: float | None = None
        self.end: float | None = None
        self.started = self.promoted = False
        self._done = threading.Event()
        self.start_event = self.end_event = None  # CUDA events


class ThreadLink:
    """CPU link: a thread copying host tensors into slots, optionally paced at an emulated bandwidth."""

    def __init__(self, gbps: float | None = None, latency_us: float = 0.0) -> None:
        self.gbps, self.latency_us = gbps, float(latency_us)
        self.kind = "emulated" if gbps else "real"
        self._queue: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()
        self._busy_until = 0.0  # the emulated link's timeline: sleep overshoot does not accumulate
        self._thread = threading.Thread(target=self._serve, name="pd-dflash-link", daemon=True)
        self._thread.start()

    def describe(self) -> dict:
        if self.gbps:
            return {
                "link": "emulated",
                "emulated_h2d_gbps": self.gbps,
                "emulated_latency_us": self.latency_us,
            }
        return {"link": "host memcpy on a link thread (CPU, not emulated)"}

    def submit(self, dst: list[torch.Tensor], src: list[torch.Tensor], nbytes: int, demand: bool, after=None):
        t = Transfer(nbytes, demand, dst, src)
        self._queue.put((0 if demand else 1, next(self._seq), t))
        return t

    def promote(self, t: Transfer) -> None:
        """Compute now needs a queued prefetch: serve it with on-demand priority."""
        if not t.started and not t.promoted:
            t.promoted = True
            self._queue.put((0, next(self._seq), t))

    def done(self, t: Transfer) -> bool:
        return t._done.is_set()

    def wait(self, t: Transfer) -> float:
        """Block until ``t`` is in its slot; returns the seconds compute waited (exposed)."""
        if t._done.is_set():
            return 0.0
        start = time.perf_counter()
        t._done.wait()
        return time.perf_counter() - start

    host_wait = wait

    def seconds(self, t: Transfer) -> float:
        return t.end - t.start

    def harvest_exposed(self) -> float:
        return 0.0  # CPU waits are measured where they happen

    def record_use(self, slot: int) -> None:
        pass

    def close(self) -> None:
        self._queue.put((-1, next(self._seq), None))
        self._thread.join(timeout=10)

    def _serve(self) -> None:
        while True:
            _, _, t = self._queue.get()
            if t is None:
                return
            if t.started:  # a promoted prefetch is queued twice; serve it once
                continue
            t.started = True
            self._copy(t)

    def _copy(self, t: Transfer) -> None:
        with nvtx_range("expert_h2d"):
            t.start = time.perf_counter()
            for d, s in zip(t.dst, t.src, strict=True):
                d.copy_(s)
            if self.gbps:
                begin = max(t.start, self._busy_until)
                self._busy_until = begin + t.nbytes / (self.gbps * 1e9) + self.latency_us * 1e-6
                delay = self._busy_until - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)
            t.end = time.perf_counter()
        t.dst = t.src = None
        t._done.set()


class CudaLink:
    """Real host→device transfers on dedicated CUDA copy streams (not exercised without a GPU)."""

    kind = "real"

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.demand_stream = torch.cuda.Stream(device=device, priority=-1)
        self.prefetch_stream = torch.cuda.Stream(device=device)
        self._stalls: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._slot_free: dict[int, torch.cuda.Event] = {}

    def describe(self) -> dict:
        return {"link": "cuda copy streams (pinned host memory, non-blocking)"}

    def submit(self, dst, src, nbytes: int, demand: bool, after: int | None = None) -> Transfer:
        """Copy into slot ``after``'s tensors once compute has finished reading the slot's previous expert."""
        t = Transfer(nbytes, demand)
        stream = self.demand_stream if demand else self.prefetch_stream
        t.start_event = torch.cuda.Event(enable_timing=True)
        t.end_event = torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream), nvtx_range("expert_h2d"):
            freed = self._slot_free.get(after) if after is not None else None
            if freed is not None:
                stream.wait_event(freed)
            t.start_event.record(stream)
            for d, s in zip(dst, src, strict=True):
                d.copy_(s, non_blocking=True)
            t.end_event.record(stream)
        t.started = True
        return t

    def promote(self, t: Transfer) -> None:
        pass  # already enqueued on its stream

    def done(self, t: Transfer) -> bool:
        return bool(t.end_event.query())

    def wait(self, t: Transfer) -> float:
        """Make the compute stream wait for ``t``; the stall is measured on the GPU (``harvest_exposed``)."""
        if t.end_event.query():
            return 0.0
        stream = torch.cuda.current_stream(self.device)
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record(stream)
        stream.wait_event(t.end_event)
        after.record(stream)
        self._stalls.append((before, after))
        return 0.0

    def host_wait(self, t: Transfer) -> float:
        start = time.perf_counter()
        t.end_event.synchronize()
        return time.perf_counter() - start

    def seconds(self, t: Transfer) -> float:
        return t.start_event.elapsed_time(t.end_event) / 1e3

    def record_use(self, slot: int) -> None:
        """Compute that reads ``slot`` has been enqueued: a later copy into it must wait for it."""
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        self._slot_free[slot] = ev

    def harvest_exposed(self) -> float:
        torch.cuda.synchronize(self.device)
        total = sum(a.elapsed_time(b) for a, b in self._stalls) / 1e3
        self._stalls.clear()
        return total

    def close(self) -> None:
        torch.cuda.synchronize(self.device)
