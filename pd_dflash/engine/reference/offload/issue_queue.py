"""Route-ahead's queue of keys waiting to go on the link (``offload/route_prefetch.py``), in issue order."""

from __future__ import annotations

import bisect
from collections.abc import Iterable

Key = tuple[int, int]


class IssueQueue:
    """The keys waiting to go on the link, kept in issue order (layer position, then expert) as they arrive, so a
    pump walks them without sorting the queue: an add merges its new keys in (one C-level sort of an ordered list
    and the new run, no Python key function), a started layer drops a prefix found by bisection."""

    def __init__(self, position: dict[int, int]) -> None:
        self.position = position
        self.keys: set[Key] = set()
        #: ``(layer position, expert, key)`` for exactly the keys of ``keys``, ascending.
        self.order: list[tuple[int, int, Key]] = []

    def __bool__(self) -> bool:
        return bool(self.keys)

    def add(self, keys: Iterable[Key]) -> None:
        new = [(self.position[k[0]], k[1], k) for k in set(keys) - self.keys]
        if new:
            self.keys.update(k for _, _, k in new)
            self.order += new
            self.order.sort()

    def retain(self, wanted: set[Key]) -> None:
        self.keys &= wanted
        self.order = [item for item in self.order if item[2] in self.keys]

    def drop_through(self, position: int) -> int:
        """Drop the keys of the layers up to ``position`` (started: fetched on demand if routed); how many."""
        cut = bisect.bisect_left(self.order, (position + 1,))
        self.keys.difference_update(k for _, _, k in self.order[:cut])
        del self.order[:cut]
        return cut

    def clear(self) -> None:
        self.keys.clear()
        self.order.clear()
