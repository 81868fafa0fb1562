"""The expert cache's batched issue: a layer's prefetches go on the link as ONE batch (``offload/link.py``: one
copy dispatch, one landing call, one event pair), BM2's batched mode.

Inside ``batched(band)`` every prefetch the cache starts is collected into the open batch of its layer; the batch
goes on the link when a prefetch of another layer arrives, when a demand fetch is made (it must not wait behind
what is collected), and at exit. ``prefetch_many`` is the lean form route-ahead and the AR prefetcher call: what
``ExpertCache.prefetch`` does per key, with the new entries' reservation (``RoundPlan.predict``) and their victim
offers made once per batch, just before it goes on the link. Until then their transfers are not issued, so no
victim search may take their slots: the deferral changes no eviction.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from pd_dflash.engine.reference.offload.transfer import ON_DEMAND, ROUTE_AHEAD, Transfer

Key = tuple[int, int]


class Batching:
    """Part of ``ExpertCache`` (``cache.batching``): it reads and updates the cache's own tables."""

    def __init__(self, cache, entry_type) -> None:
        self.cache, self._entry = cache, entry_type
        #: The band of the open ``batched`` context (None: prefetches go on the link one by one).
        self.band: int | None = None
        self._layer: int | None = None
        self._batch = None
        self._new: list = []  # entries of ``prefetch_many`` still to reserve and offer
        #: Inside ``demand_batched``: a layer's misses, collected to go on the demand stream as one batch.
        self.demand = None

    @contextlib.contextmanager
    def demand_batched(self):
        """A MoE layer acquires its experts: its misses go on the demand stream as ONE batch at exit (one copy
        dispatch, one landing call: an MXFP4 layer's misses dequantise together), before compute waits for them."""
        link = self.cache.link
        if link is None or self.demand is not None:
            yield
            return
        self.flush()
        self.demand = link.batch(ON_DEMAND)
        try:
            yield
        finally:
            batch, self.demand = self.demand, None
            link.submit_batch(batch, self.cache.slots.land_many, self.cache.slots.copy_many)

    def add_demand(self, key: Key, slot: int) -> Transfer:
        cache = self.cache
        t = self.demand.add(cache.slots.slot_views[slot], None, cache.store.expert_nbytes, slot, key)
        t.demand = True
        return t

    @contextlib.contextmanager
    def batched(self, band: int = ROUTE_AHEAD):
        if self.cache.link is None or self.band is not None:
            yield self.cache
            return
        self.band = band
        try:
            yield self.cache
        finally:
            self.flush()
            self.band = None

    def add(self, key: Key, slot: int) -> Transfer:
        """A prefetch of ``key`` into ``slot`` joins its layer's batch (the previous layer's goes out)."""
        if self._batch is None or self._layer != key[0]:
            self.flush()
            self._layer, self._batch = key[0], self.cache.link.batch(self.band)
        cache = self.cache
        return self._batch.add(cache.slots.slot_views[slot], None, cache.store.expert_nbytes, slot, key)

    def flush(self) -> None:
        """The open batch goes on the link, its new entries reserved and offered first."""
        if self._batch is None:
            return
        cache, batch, new = self.cache, self._batch, list(self._new)
        self._batch, self._layer = None, None
        self._new.clear()  # in place: ``prefetch_many`` holds it
        if new:
            cache.plan.predict([e.key for e in new])
            uses = cache.frequency.get
            cache.evictor.add_new([(e.key, (uses(e.key, 0), e.last_tick, e.seq)) for e in new])
        cache.link.submit_batch(batch, cache.slots.land_many, cache.slots.copy_many)

    def prefetch_many(self, keys: Sequence[Key], speculative: bool, band: int) -> tuple[int, int]:
        """``ExpertCache.prefetch`` of each key in order, one link batch per layer, stopping at the first key
        that finds no slot (counted as dropped). Returns (keys handled, transfers started)."""
        cache = self.cache
        if cache.link is None:
            return len(keys), 0
        entries, free, slots, store = cache.entries, cache.free, cache.slots, cache.store
        views, nbytes, writes = slots.slot_views, store.expert_nbytes, slots.pending
        rnd, entry_type, inflight, new = cache.round, self._entry, cache.inflight, self._new
        handled = issued = 0
        with self.batched(band):
            for key in keys:
                if key in entries:
                    cache.prefetch(key, speculative=speculative)  # a touch and a reservation
                    handled += 1
                    continue
                slot = free.pop() if free else cache._slot_for(demand=False, speculative=speculative)
                if slot is None:
                    cache.counters.prefetch_dropped += 1
                    break
                if self._layer != key[0] or self._batch is None:
                    self.flush()
                    self._layer, self._batch = key[0], cache.link.batch(self.band)
                entry = entry_type(
                    key, slot, self._batch.add(views[slot], None, nbytes, slot, key), rnd, True
                )
                writes[key] = slot
                cache._tick += 1
                entry.seq = cache._tick
                entries[key] = entry
                inflight.append(entry)
                new.append(entry)
                handled += 1
                issued += 1
        c = cache.counters
        c.prefetch_transfers += issued
        c.prefetch_bytes += issued * store.expert_nbytes
        c.dequantized_landings += 0 if slots.direct else issued
        c.peak_occupancy_bytes = max(c.peak_occupancy_bytes, cache.occupancy_bytes)
        return handled, issued
