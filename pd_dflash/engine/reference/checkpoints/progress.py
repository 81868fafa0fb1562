"""Load progress as log lines (bytes, rate, ETA), not a progress bar: a runner's output is a log file."""

from __future__ import annotations

import logging
import sys
import time

logger = logging.getLogger("pd_dflash.load")
if not logger.handlers:  # a runner process configures no logging: print INFO lines to stderr
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


class LoadProgress:
    """Counts bytes as they land and logs at most every ``every_s`` seconds, and once at the end."""

    def __init__(self, name: str, total_bytes: int, every_s: float = 5.0) -> None:
        self.name, self.total, self.every_s = name, max(1, total_bytes), every_s
        self.done = 0
        self.start = self._last = time.perf_counter()
        logger.info("loading %s: %s to read", name, _gb(total_bytes))

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.perf_counter()
        if now - self._last >= self.every_s:
            self._last = now
            rate = self.done / max(now - self.start, 1e-9)
            eta = (self.total - self.done) / rate if rate > 0 else float("inf")
            logger.info(
                "loading %s: %s / %s (%.0f%%), %.2f GB/s, ETA %.0f s",
                self.name,
                _gb(self.done),
                _gb(self.total),
                100 * self.done / self.total,
                rate / 1e9,
                eta,
            )

    def finish(self) -> float:
        seconds = time.perf_counter() - self.start
        logger.info(
            "loaded %s: %s in %.1f s (%.2f GB/s)",
            self.name,
            _gb(self.done),
            seconds,
            self.done / max(seconds, 1e-9) / 1e9,
        )
        return seconds


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"
