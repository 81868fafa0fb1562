"""Intervals on a clock: unions, differences and coverage (pure Python): the one interval-union helper.

Transfer time is the union of transfer spans, never their sum: two streams copying at once share the link, so
a sum would count the shared time twice. The same helpers give the BM4 overlap, from the reference engine's own
timestamps (``engine/reference/offload/overlap.py``) and from nsys exports (``overlap.py``).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable

Interval = tuple[float, float]


def merge(intervals: Iterable[Interval], *, keep_empty: bool = False) -> list[Interval]:
    """The union as sorted, disjoint intervals (touching ones joined; empty ones dropped unless ``keep_empty``:
    nsys's zero-length ranges, which an instant memcpy may hit)."""
    out: list[Interval] = []
    for a, b in sorted(intervals):
        if b <= a and not keep_empty:
            continue
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def union_seconds(intervals: Iterable[Interval]) -> float:
    return sum(b - a for a, b in merge(intervals))


def subtract(intervals: Iterable[Interval], holes: Iterable[Interval]) -> list[Interval]:
    """The union of ``intervals`` minus the union of ``holes``, sorted and disjoint."""
    out = []
    holes = merge(holes)
    for a, b in merge(intervals):
        cur = a
        for h0, h1 in holes:
            if h1 <= cur or h0 >= b:
                continue
            if h0 > cur:
                out.append((cur, h0))
            cur = max(cur, h1)
        if cur < b:
            out.append((cur, b))
    return out


def covered(start: float, end: float, merged: list[Interval], starts: list[float] | None = None) -> float:
    """Length of ``[start, end]`` inside ``merged`` (sorted, disjoint; ``starts`` = their starts, if known)."""
    starts = starts if starts is not None else [a for a, _ in merged]
    total = 0.0
    i = max(0, bisect.bisect_right(starts, start) - 1)
    while i < len(merged) and merged[i][0] < end:
        a, b = merged[i]
        total += max(0.0, min(b, end) - max(a, start))
        i += 1
    return total


class SpanUnion:
    """A growing union of intervals and its total length (spans arrive roughly in time order)."""

    def __init__(self) -> None:
        self._starts: list[float] = []
        self._ends: list[float] = []
        self.total = 0.0

    def add(self, a: float, b: float) -> None:
        if b <= a:
            return
        i = bisect.bisect_left(self._ends, a)  # first interval that ends at or after a
        j = bisect.bisect_right(self._starts, b)  # intervals before j start at or before b
        if i < j:  # [a, b] touches intervals i..j-1: replace them by their union with it
            a, b = min(a, self._starts[i]), max(b, self._ends[j - 1])
            self.total -= sum(e - s for s, e in zip(self._starts[i:j], self._ends[i:j], strict=True))
        self._starts[i:j], self._ends[i:j] = [a], [b]
        self.total += b - a

    @property
    def intervals(self) -> list[Interval]:
        return list(zip(self._starts, self._ends, strict=True))
