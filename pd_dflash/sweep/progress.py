"""What the user watches: a one-line progress bar on a terminal, plain log lines elsewhere (``ray job logs``)."""

from __future__ import annotations

import contextlib
import sys
import time
from typing import TextIO


def format_duration(seconds: float | None) -> str:
    if seconds is None or seconds != seconds or seconds < 0:
        return "?"
    seconds = round(seconds)
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}h{m:02d}m" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


class Progress:
    """Done/total, cells running per box, failures and an ETA.

    On a terminal the status line is redrawn in place (events are printed above it); otherwise every event is
    a log line and the status is logged every ``every_s`` seconds and at each tenth of the sweep.
    """

    def __init__(
        self, total: int, *, tty: bool | None = None, stream: TextIO | None = None, every_s: float = 15.0
    ) -> None:
        self.total = total
        self.stream = stream or sys.stdout
        self.tty = self.stream.isatty() if tty is None else tty
        self.every_s = every_s
        self._last_log = 0.0
        self._last_decile = -1
        self._last_draw = 0.0
        self._line = ""
        self._drawn = False

    def _write(self, text: str) -> None:
        # A log that can no longer be written (a dropped terminal, a closed pipe) must not stop a sweep: its
        # results and events go to OUT regardless.
        with contextlib.suppress(OSError, ValueError):
            self.stream.write(text)
            self.stream.flush()

    def event(self, message: str) -> None:
        stamp = time.strftime("%H:%M:%S")
        if self.tty and self._drawn:
            self._write("\r\x1b[2K")
        self._write(f"[pd-dflash {stamp}] {message}\n")
        if self.tty and self._drawn:
            self._write(self._line)

    def status_line(
        self, *, done: int, failed: int, running: dict[str, int], eta_s: float | None, bar: bool
    ) -> str:
        pct = 100.0 * done / self.total if self.total else 100.0
        boxes = " ".join(f"{box}:{n}" for box, n in sorted(running.items())) or "-"
        head = f"{done}/{self.total}"
        if bar:
            width = 24
            filled = int(width * done / self.total) if self.total else width
            head += f" [{'#' * filled}{'.' * (width - filled)}]"
        return f"{head} {pct:.0f}% | running {boxes} | failed {failed} | ETA {format_duration(eta_s)}"

    def update(
        self,
        *,
        done: int,
        failed: int,
        running: dict[str, int],
        eta_s: float | None,
        force: bool = False,
    ) -> None:
        now = time.monotonic()
        if self.tty:
            if not force and now - self._last_draw < 0.2:
                return
            self._last_draw = now
            self._line = self.status_line(done=done, failed=failed, running=running, eta_s=eta_s, bar=True)
            self._write("\r\x1b[2K" + self._line)
            self._drawn = True
            return
        decile = int(10 * done / self.total) if self.total else 10
        if force or decile != self._last_decile or now - self._last_log >= self.every_s:
            self._last_decile = decile
            self._last_log = now
            line = self.status_line(done=done, failed=failed, running=running, eta_s=eta_s, bar=False)
            self.event(f"progress {line}")

    def close(self) -> None:
        if self.tty and self._drawn:
            self._write("\n")
            self._drawn = False
