"""Preparing the loader's destination buffers ahead of the reads, in a background thread.

Fresh host memory is zeroed by the kernel when first used; done inline, while a read copies into it, that costs
several times the read (benchmarks/load.py). One thread allocates or populates the buffers in the order the
reads will need them, at most ``LOOKAHEAD_BYTES`` ahead of the reader, so that overlaps I/O (both release the
GIL).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from typing import Any

#: How far (bytes) buffers are prepared ahead of the reader: also the most non-expert weights in host memory at
#: once while they travel to the device.
LOOKAHEAD_BYTES = 2 << 30


class Preallocator:
    def __init__(
        self, jobs: list[tuple[Hashable, int, Callable[[], Any]]], lookahead_bytes: int = LOOKAHEAD_BYTES
    ) -> None:
        """``jobs``: (key, bytes, allocate) in the order the reader will ``take`` them."""
        self._futures: dict[Hashable, Future] = {key: Future() for key, _, _ in jobs}
        self._sizes = {key: nbytes for key, nbytes, _ in jobs}
        self._ahead = 0  # allocated bytes not yet taken
        self._limit = lookahead_bytes
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(
            target=self._run, args=(jobs,), name="pd-dflash-prealloc", daemon=True
        )
        self._thread.start()

    def _run(self, jobs) -> None:
        for key, nbytes, allocate in jobs:
            with self._cond:
                self._cond.wait_for(
                    lambda n=nbytes: self._stop or self._ahead == 0 or self._ahead + n <= self._limit
                )
                if self._stop:
                    return
                self._ahead += nbytes
            try:
                self._futures[key].set_result(allocate())
            except BaseException as exc:  # surfaced to the reader by take()
                self._futures[key].set_exception(exc)

    def take(self, key: Hashable) -> Any:
        """The buffer for ``key`` (waits for its allocation); frees its share of the lookahead."""
        value = self._futures[key].result()
        with self._cond:
            self._ahead -= self._sizes.pop(key, 0)
            self._cond.notify_all()
        return value

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join()
