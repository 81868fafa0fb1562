"""The host→device link that moves experts into cache slots.

- ``CudaLink``: real transfers. Non-blocking copies from pinned host memory on dedicated copy streams (a
  high-priority one for on-demand fetches, one for prefetches), timed with CUDA events. Compute waits only for
  the experts it needs (``wait_event`` on the compute stream); the stall is measured by an event pair around
  that wait, so exposed fetch time is GPU time the compute stream spent blocked.
- ``HostLink``: the CPU engine's link: a real copy into the slot and, with emulation (``gbps``,
  ``latency_us``), a link that serves transfers one at a time (on-demand before queued prefetches), each taking
  bytes/BW + latency of wall time, so a prefetch really overlaps compute and an on-demand fetch really exposes
  its wait (compute sleeps: no CPU). The link's timeline is simulated, not driven by a helper thread: a thread
  that must win the GIL and the OS scheduler to signal a completion delivered 1 GB/s as 0.03 GB/s here.
"""

from __future__ import annotations

import itertools
import time

import torch

from pd_dflash.engine.nvtx_ranges import nvtx_range


class Transfer:
    """One expert's host→device copy."""

    __slots__ = (
        "demand",
        "dst",
        "end",
        "end_event",
        "nbytes",
        "priority",
        "scheduled",
        "seq",
        "src",
        "start",
        "start_event",
        "submitted",
    )

    def __init__(self, nbytes: int, demand: bool, dst=None, src=None, seq: int = 0) -> None:
        self.nbytes, self.demand, self.dst, self.src, self.seq = nbytes, demand, dst, src, seq
        self.priority = 0 if demand else 1
        self.submitted = time.perf_counter()
        self.start: float | None = None
        self.end: float | None = None
        self.scheduled = False
        self.start_event = self.end_event = None  # CUDA events


class HostLink:
    """The CPU engine's link: a real copy into the slot, optionally paced as an emulated link.

    Emulated (``gbps`` set): one transfer at a time, on-demand before queued prefetches, each occupying the
    link for ``nbytes / BW + latency`` of wall time. The link keeps its own timeline (a single-server priority
    queue simulated lazily whenever compute looks at it), so nothing depends on when a helper thread gets the
    GIL or the OS scheduler: a prefetch issued early is really done by the time compute needs it, and
    compute that needs an expert still on the link really sleeps until its completion time (no CPU spent).
    A transfer's copy is performed when the link starts it. Not emulated (kind "host"): the copy happens at once
    (a host memcpy, not a host-to-device transfer) and its measured duration is the transfer time.
    """

    def __init__(self, gbps: float | None = None, latency_us: float = 0.0) -> None:
        self.gbps, self.latency_us = gbps, float(latency_us)
        #: "host": not a device link at all, a host-to-host memcpy (rows must not claim a real H2D link).
        self.kind = "emulated" if gbps else "host"
        self._pending: list[Transfer] = []
        self._free_at = 0.0
        self._seq = itertools.count()

    def describe(self) -> dict:
        if self.gbps:
            return {
                "link": "emulated",
                "emulated_h2d_gbps": self.gbps,
                "emulated_latency_us": self.latency_us,
            }
        return {"link": "host memcpy (CPU, not emulated)"}

    def submit(self, dst: list[torch.Tensor], src: list[torch.Tensor], nbytes: int, demand: bool, after=None):
        t = Transfer(nbytes, demand, dst, src, next(self._seq))
        if not self.gbps:
            self._run(t, time.perf_counter())
            t.end = time.perf_counter()
            return t
        self._pending.append(t)
        self._advance(t.submitted)
        return t

    def promote(self, t: Transfer) -> None:
        """Compute now needs a queued prefetch: serve it with on-demand priority."""
        if not t.scheduled:
            t.priority = 0

    def done(self, t: Transfer) -> bool:
        now = time.perf_counter()
        if not t.scheduled:  # a started transfer's end is known: no need to simulate the queue
            self._advance(now)
        return t.scheduled and t.end <= now

    def wait(self, t: Transfer) -> float:
        """Block until ``t`` is in its slot; returns the seconds compute waited (exposed)."""
        while not t.scheduled:
            if not self._pending:
                raise RuntimeError("waiting for a transfer this link no longer holds (link closed?)")
            self._advance(float("inf"), stop_after_one=True)
        start = time.perf_counter()
        if t.end > start:
            time.sleep(t.end - start)
            return time.perf_counter() - start
        return 0.0

    host_wait = wait

    def seconds(self, t: Transfer) -> float:
        return t.end - t.start

    def harvest_exposed(self) -> float:
        return 0.0  # CPU waits are measured where they happen

    def record_use(self, slot: int) -> None:
        pass

    def close(self) -> None:
        self._pending.clear()

    def _advance(self, until: float, stop_after_one: bool = False) -> None:
        """Start, in link time, every queued transfer whose start time is at or before ``until``."""
        while self._pending:
            ready = max(self._free_at, min(t.submitted for t in self._pending))
            if ready > until:
                return
            t = min((t for t in self._pending if t.submitted <= ready), key=lambda t: (t.priority, t.seq))
            self._pending.remove(t)
            self._run(t, ready)
            t.end = self._free_at = ready + t.nbytes / (self.gbps * 1e9) + self.latency_us * 1e-6
            if stop_after_one:
                return

    def _run(self, t: Transfer, start: float) -> None:
        with nvtx_range("expert_h2d"):
            for d, s in zip(t.dst, t.src, strict=True):
                d.copy_(s)
        t.start, t.scheduled, t.dst, t.src = start, True, None, None


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
        t.scheduled = True
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
