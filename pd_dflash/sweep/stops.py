"""How a signal stops a sweep: the handler only records it; the driver acts on it between Ray calls.

A handler that raised (``SweepInterrupted`` from inside the handler) made the outcome depend on where the
signal landed: inside ``ray.wait`` or ``ray.get`` Ray's Cython code returned with the exception set, which
surfaces as ``SystemError`` and exit 1, with sweep.json saying "finished". Here the handler sets
``StopRequest.signum`` and returns, so nothing ever raises inside Ray, and the driver looks at the request at
each step it controls (``StopRequest.check``): every pass of the loop (whose ``ray.wait`` returns within
``poll_s``), after preflight, after the directory is opened, and before the outcome is recorded. ``wait`` and
``get`` below slice the driver's longer waits so a stop is seen within ``SLICE_S``.

A signal that arrives once the outcome is recorded changes nothing: the sweep has ended as recorded. A second
signal while stopping is reported and ignored. SIGHUP ignored when the driver starts (``nohup``) stays ignored.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import ray
from ray.exceptions import GetTimeoutError

from pd_dflash.sweep.options import SweepInterrupted

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
#: The longest a sliced wait blocks in one Ray call before it looks at the stop request again.
SLICE_S = 0.2


class StopRequest:
    """The first stop signal that arrived (its number), or None. Set by the handler, read by the driver."""

    def __init__(self) -> None:
        self.signum: int | None = None

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def check(self) -> None:
        """Raise ``SweepInterrupted`` (here, outside any Ray call) once a stop was asked for."""
        if self.signum is not None:
            raise SweepInterrupted(self.signum)

    def interrupted(self) -> SweepInterrupted | None:
        return SweepInterrupted(self.signum) if self.signum is not None else None


def _say(text: str) -> None:
    """A line on stderr from inside a handler: one ``os.write`` (Python's buffered streams are not reentrant)."""
    with contextlib.suppress(OSError):
        os.write(2, text.encode("utf-8", "replace"))


@contextlib.contextmanager
def stop_on_signals() -> Iterator[StopRequest]:
    """SIGINT, SIGTERM and SIGHUP set the request (a later one is reported and ignored); the previous handlers
    come back on exit. Outside the main thread nothing is installed (signals reach the main thread only)."""
    request = StopRequest()
    if threading.current_thread() is not threading.main_thread():
        yield request
        return

    def handler(signum: int, _frame: Any) -> None:
        name = signal.Signals(signum).name
        if request.signum is not None:
            _say(f"pd-dflash run: {name} again: already stopping\n")
            return
        request.signum = signum
        if signum == signal.SIGHUP:
            _detach_from_lost_terminal()

    # nohup (SIGHUP ignored when the driver starts) asks to outlive the terminal: the sweep then finishes.
    handled = [s for s in STOP_SIGNALS if not (s == signal.SIGHUP and signal.getsignal(s) == signal.SIG_IGN)]
    previous = {s: signal.signal(s, handler) for s in handled}
    try:
        yield request
    finally:
        for s, old in previous.items():
            signal.signal(s, old)


def _detach_from_lost_terminal() -> None:
    """After a hangup the terminal is gone and writing to it fails (EIO): point stdout/stderr that were a
    terminal at /dev/null, so the stop goes on as after SIGTERM (its lines are in sweep.json and events.jsonl)."""
    for fd in (1, 2):
        with contextlib.suppress(OSError):
            if os.isatty(fd):
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, fd)
                os.close(null)


def wait(refs: list[Any], timeout_s: float, stop: StopRequest | None = None) -> list[Any]:
    """The refs done within ``timeout_s`` (all of them, or fewer at the deadline), waiting in slices of at most
    ``SLICE_S``; with ``stop``, returns early once a stop is asked for."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        slice_s = max(0.0, min(SLICE_S, left))
        ready, pending = ray.wait(refs, num_returns=len(refs), timeout=slice_s)
        if not pending or left <= 0 or (stop is not None and stop.requested):
            return ready


def get(ref: Any, timeout_s: float | None = None, stop: StopRequest | None = None) -> Any:
    """``ray.get(ref)`` once the result is there, waiting in slices (``GetTimeoutError`` after ``timeout_s``);
    with ``stop``, ``SweepInterrupted`` is raised between two slices once a stop is asked for."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    while True:
        left = SLICE_S if deadline is None else deadline - time.monotonic()
        ready, _ = ray.wait([ref], timeout=max(0.0, min(SLICE_S, left)))
        if ready:
            return ray.get(ref)
        if stop is not None:
            stop.check()
        if deadline is not None and time.monotonic() >= deadline:
            raise GetTimeoutError(f"not ready within {timeout_s:g} s")
