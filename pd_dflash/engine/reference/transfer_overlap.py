"""BM4 from the engine's own timestamps: how much of each host→device transfer ran while compute was running.

A transfer hides behind compute only while compute is not itself waiting for a transfer, so each window kind
(draft, router, verify) is the union of its rounds' windows minus the intervals compute stalled on the link.
Issue windows do not hide (as upstream's nsys parser). Bytes are weighted like BM4: a transfer contributes
bytes × overlapped / duration. Used on the CPU link, whose transfers run on a host timeline; CUDA copies have
none (``metrics.py`` falls back to the link time not spent stalled).
"""

from __future__ import annotations

import bisect
from typing import Any

from pd_dflash.engine.reference.serving import RoundRecord

Interval = tuple[float, float]
#: The compute windows a transfer can hide behind.
COMPUTE_KINDS = ("draft", "router", "verify")


def transfer_overlap(cache, rounds: list[RoundRecord]) -> dict[str, Any]:
    """The overlap of ``cache.transfer_log`` (start, end, bytes, demand) with the rounds' compute windows."""
    windows = compute_windows(rounds, cache.stall_log)
    starts = {k: [a for a, _ in v] for k, v in windows.items()}
    transfers = cache.transfer_log
    total_bytes = sum(n for _, _, n, _ in transfers)
    seconds = dict.fromkeys(windows, 0.0)
    hidden_bytes = dict.fromkeys(windows, 0.0)
    for start, end, nbytes, _ in transfers:
        duration = end - start
        for k in windows:
            ov = _covered(start, end, windows[k], starts[k])
            seconds[k] += ov
            hidden_bytes[k] += nbytes * (ov / duration if duration > 0 else float(ov > 0))
    return {
        "source": "engine timestamps: link timeline of each transfer vs the rounds' compute windows",
        "h2d_bytes": total_bytes,
        "h2d_link_seconds": sum(e - s for s, e, _, _ in transfers),
        "transfers": len(transfers),
        "demand_transfers": sum(1 for *_, demand in transfers if demand),
        "overlapped_seconds": seconds,
        "overlap_fraction": {k: (v / total_bytes if total_bytes else None) for k, v in hidden_bytes.items()},
        "stall_seconds": sum(b - a for a, b in _merge(cache.stall_log)),
    }


def compute_windows(rounds: list[RoundRecord], stalls: list[Interval]) -> dict[str, list[Interval]]:
    """Per compute kind, and for their union (``any_compute``): the sorted disjoint intervals compute ran."""
    windows = {
        k: _subtract([(a, b) for rec in rounds for (w, a, b) in rec.windows if w == k], stalls)
        for k in COMPUTE_KINDS
    }
    windows["any_compute"] = _merge([iv for k in COMPUTE_KINDS for iv in windows[k]])
    return windows


def _merge(intervals: list[Interval]) -> list[Interval]:
    out: list[Interval] = []
    for a, b in sorted(intervals):
        if b <= a:
            continue
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _subtract(intervals: list[Interval], holes: list[Interval]) -> list[Interval]:
    out = []
    holes = _merge(holes)
    for a, b in _merge(intervals):
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


def _covered(start: float, end: float, merged: list[Interval], starts: list[float]) -> float:
    """Length of [start, end] inside the union ``merged`` (sorted, disjoint)."""
    total = 0.0
    i = max(0, bisect.bisect_right(starts, start) - 1)
    while i < len(merged) and merged[i][0] < end:
        a, b = merged[i]
        total += max(0.0, min(b, end) - max(a, start))
        i += 1
    return total
