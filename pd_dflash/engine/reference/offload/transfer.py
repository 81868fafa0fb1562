"""A transfer on the host→device link (``offload/link.py``), the batch prefetches move in, and the link's bands."""

from __future__ import annotations

from functools import partial

import torch

#: The link's bands, served in this order (module doc): on-demand, route-ahead, background.
ON_DEMAND, ROUTE_AHEAD, BACKGROUND = 0, 1, 2
BANDS = (ON_DEMAND, ROUTE_AHEAD, BACKGROUND)


def check_band(band: int) -> int:
    if band not in BANDS:
        raise ValueError(f"a link band is one of {BANDS} (on-demand, route-ahead, background), got {band!r}")
    return band


class Transfer:
    """One expert's host→device copy, or a batch of them (``members``: the link moves it as one item)."""

    __slots__ = (
        "band",
        "batch",
        "complete",
        "copy_many",
        "demand",
        "dst",
        "end",
        "end_event",
        "gate",
        "issued",
        "key",
        "land",
        "land_many",
        "members",
        "nbytes",
        "promoted",
        "ref",
        "seq",
        "slot",
        "src",
        "start",
        "start_event",
        "submitted",
        "work",
    )

    def __init__(
        self, nbytes: int, demand: bool, dst, src, seq: int, slot: int | None, submitted: float, land=None
    ):
        self.nbytes, self.demand, self.dst, self.src, self.seq, self.slot = (
            nbytes,
            demand,
            dst,
            src,
            seq,
            slot,
        )
        self.submitted = submitted
        self.land = land  # run after the copy (the cache's dequantisation into the slot pool), or None
        #: Left the host queue (on a stream); re-issued on the demand stream by ``promote``.
        self.issued = self.promoted = False
        #: Landed, remembered after the first positive query.
        self.complete = False
        self.start: float | None = None
        self.end: float | None = None
        self.work = 0.0  # emulated: link seconds still to serve
        self.gate: Transfer | None = None  # emulated: the demand transfer this prefetch waits for
        self.start_event = self.end_event = self.ref = None  # CUDA
        self.band = ON_DEMAND if demand else ROUTE_AHEAD
        #: A member: the batch it goes on the link with (None once it left it, or never in one).
        self.batch: Transfer | None = None
        #: A batch: its transfers, the landing of their slots (``land_many(slots)``) and their copy
        #: (``copy_many(members, non_blocking)``: consecutive experts into consecutive slots as one copy), or None.
        self.members: list[Transfer] | None = None
        self.land_many = self.copy_many = None
        self.key = None  # a member: the cache's (layer, expert), for ``copy_many``


class Batch:
    """Prefetches collected to go on the link as one item (``Link.batch``, then ``Link.submit_batch``). Each
    ``add`` returns its transfer at once: not issued, so not done, so no cache evicts its slot meanwhile."""

    def __init__(self, seq, clock, band: int) -> None:
        self._seq, self._clock, self.band = seq, clock, check_band(band)
        self.members: list[Transfer] = []
        self.opened = clock()

    def add(
        self, dst: list[torch.Tensor], src: list[torch.Tensor], nbytes: int, slot: int | None, key=None
    ) -> Transfer:
        t = Transfer(nbytes, False, dst, src, next(self._seq), slot, self.opened)
        t.key = key
        self.members.append(t)
        return t

    def transfer(self, land_many, copy_many=None) -> Transfer:
        """The item the link moves: its members' bytes, their copy and landing; the members point at it."""
        nbytes = sum(m.nbytes for m in self.members)
        b = Transfer(nbytes, self.band == ON_DEMAND, None, None, 0, None, self._clock())
        b.members, b.land_many, b.copy_many, b.band = self.members, land_many, copy_many, self.band
        for m in self.members:
            m.batch, m.band = b, self.band
        return b


def detach(t: Transfer) -> Transfer | None:
    """Take member ``t`` out of its batch (still on the host): it moves alone, landing its own slot. Returns the
    batch if it is empty now (the caller drops it from its queue), else None."""
    b, t.batch = t.batch, None
    b.members.remove(t)
    b.nbytes -= t.nbytes
    b.work -= t.work
    if b.land_many is not None:
        t.land = partial(b.land_many, [t.slot])
    t.copy_many = b.copy_many  # its source may be named by its key only (``copy_one``)
    return None if b.members else b


def copy_one(t: Transfer, non_blocking: bool = False) -> None:
    """A lone transfer's copies (one left its batch: ``copy_many`` of itself when its source is by key)."""
    if t.src is None:
        t.copy_many([t], non_blocking)
        return
    for d, s in zip(t.dst, t.src, strict=True):
        d.copy_(s, non_blocking=non_blocking)


def started(t: Transfer, now: float) -> None:
    t.start = now
    for m in t.members or ():
        m.start = now


def mark_issued(t: Transfer) -> None:
    t.issued = True
    for m in t.members or ():
        m.issued = True


def mark_landed(t: Transfer, now: float) -> None:
    t.end = now
    for m in t.members or ():
        m.end = now


def copy_members(t: Transfer, non_blocking: bool = False) -> None:
    """A batch's copies: ``copy_many`` where the cache gave one, else ONE ``_foreach_copy_`` of every tensor."""
    if not t.members:
        return
    if t.copy_many is not None:
        t.copy_many(t.members, non_blocking)
    else:
        dst = [d for m in t.members for d in m.dst]
        torch._foreach_copy_(dst, [s for m in t.members for s in m.src], non_blocking=non_blocking)
