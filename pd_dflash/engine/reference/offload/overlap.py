"""BM4 from the engine's own timestamps: how much of each host→device transfer ran while compute was running.

One basis on both devices: every transfer span and every compute stall is on the host clock (``offload/link.py``: the
CPU link's emulated timeline; CUDA events placed through a per-synchronization reference event), and so are
the rounds' compute windows. A transfer hides behind compute only while compute is not itself waiting for a
transfer, so each window kind (draft, router, verify) is the union of its rounds' windows minus the intervals
compute stalled on the link. Issue windows do not hide (as upstream's nsys parser). Bytes are weighted like
BM4: a transfer contributes bytes × overlapped / duration. Link time is the union of the transfer spans.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pd_dflash.intervals import Interval, covered, merge, subtract, union_seconds

if TYPE_CHECKING:
    from pd_dflash.engine.reference.decoding.loop import RoundRecord

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
            ov = covered(start, end, windows[k], starts[k])
            seconds[k] += ov
            hidden_bytes[k] += nbytes * (ov / duration if duration > 0 else float(ov > 0))
    return {
        "source": "engine timestamps: link timeline of each transfer vs the rounds' compute windows",
        "h2d_bytes": total_bytes,
        "h2d_link_seconds": union_seconds((s, e) for s, e, _, _ in transfers),
        "transfers": len(transfers),
        "demand_transfers": sum(1 for *_, demand in transfers if demand),
        "overlapped_seconds": seconds,
        "overlap_fraction": {k: (v / total_bytes if total_bytes else None) for k, v in hidden_bytes.items()},
        "stall_seconds": union_seconds(cache.stall_log),
    }


def compute_windows(rounds: list[RoundRecord], stalls: list[Interval]) -> dict[str, list[Interval]]:
    """Per compute kind, and for their union (``any_compute``): the sorted disjoint intervals compute ran."""
    windows = {
        k: subtract([(a, b) for rec in rounds for (w, a, b) in rec.windows if w == k], stalls)
        for k in COMPUTE_KINDS
    }
    windows["any_compute"] = merge([iv for k in COMPUTE_KINDS for iv in windows[k]])
    return windows
