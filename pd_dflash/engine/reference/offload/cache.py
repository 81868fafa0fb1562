"""The bounded device expert cache: slots, eviction (the round plan, LRU or LFU), pinning, and exact accounting.

Capacity is in bytes and becomes ``capacity // expert_nbytes`` slots preallocated on the device, so occupancy
can never exceed it. An entry is pinned while a step computes with it and cannot be evicted while its transfer
is in flight. The default eviction, ``plan``, ranks victims by the round plan (``offload/eviction.py``): what this
round predicted (reservations: a prefetch names its key for the round), what it has already computed and what
the last round used; the unpinned entries are kept in its ``Evictor`` by rank, so a victim costs O(log slots),
not a scan. Every access is classified at the moment compute asks for the expert:

- hit: resident and ready (its transfer, if any, has landed);
- in-flight hit: in the cache but still on the link (an earlier prefetch): no new transfer, compute waits;
- miss: not in the cache, fetched on demand;
- resident at round start: it was in the cache before the current round began (the hide inequality's r).

Exposed fetch seconds are the time compute waited for a transfer (on-demand or in-flight prefetch). Link time
is the union of the transfers' spans on the host clock (``offload/link.py``: one basis on both devices).

**The slot pool** (``slots``, ``offload/slot_pool.py``): one ``[slots, ...]`` device tensor per compute tensor and a
device-side ``(layer, expert) → slot`` table that every insert, eviction and the resident load keep current, so a
MoE layer computes all its routed pairs in one grouped GEMM per projection (``offload/grouped.py``). Quantised experts
are dequantised once, when they land in a slot. **Capacity counts stored bytes** (``capacity // expert_nbytes``
slots, what the store holds and the link moves); the device bytes per slot are ``slots.device_slot_nbytes``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pd_dflash.engine.reference.offload.batching import Batching
from pd_dflash.engine.reference.offload.eviction import POLICIES, Evictor, RoundPlan
from pd_dflash.engine.reference.offload.link import ROUTE_AHEAD, Link
from pd_dflash.engine.reference.offload.slot_pool import SlotPool
from pd_dflash.engine.reference.offload.store import HostExpertStore
from pd_dflash.intervals import SpanUnion

Key = tuple[int, int]  # (layer, expert)


@dataclass
class CacheCounters:
    accesses: int = 0
    hits: int = 0
    inflight_hits: int = 0
    misses: int = 0
    resident_at_round_start: int = 0
    demand_transfers: int = 0
    demand_bytes: int = 0
    prefetch_transfers: int = 0
    prefetch_bytes: int = 0
    #: Prefetches not issued because every slot was pinned or in flight.
    prefetch_dropped: int = 0
    #: Prefetched experts evicted before any access (transfer-level waste).
    prefetch_unused_evicted_bytes: int = 0
    evictions: int = 0
    exposed_seconds: float = 0.0
    #: Part of exposed_seconds: an on-demand fetch found every unpinned slot still being written by a
    #: prefetch and waited for one (a cache too small for what is in flight).
    slot_waits: int = 0
    slot_wait_seconds: float = 0.0
    #: Completed transfers: bytes, and link seconds = the union of their spans (time the link was copying; two
    #: streams copying at once count once).
    h2d_bytes: int = 0
    h2d_seconds: float = 0.0
    h2d_transfers: int = 0
    peak_occupancy_bytes: int = 0
    #: Experts dequantised into a slot (once per landing; 0 when the storage is the compute format).
    dequantized_landings: int = 0

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.accesses if self.accesses else None


@dataclass
class _Entry:
    key: Key
    slot: int
    transfer: object | None  # link Transfer while not harvested
    inserted_round: int
    prefetched: bool
    pins: int = 0
    used: bool = False
    last_tick: int = 0
    #: Position in LRU order: taken from the tick counter at insert and at every touch (the eviction tie-break).
    seq: int = 0
    #: The last access found it resident and its transfer landed (a hit, not an in-flight hit or a miss).
    ready_at_access: bool = False


@dataclass
class ExpertCache:
    store: HostExpertStore
    capacity_bytes: int
    device: torch.device
    compute_dtype: torch.dtype
    policy: str = "plan"
    #: The host→device link (``link.Link``); None = resident: every expert is loaded up front, nothing moves.
    link: Link | None = None
    counters: CacheCounters = field(default_factory=CacheCounters)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"eviction policy must be one of {POLICIES}, got {self.policy!r}")
        self.num_slots = min(self.capacity_bytes // self.store.expert_nbytes, self.store.num_entries)
        if self.num_slots < 1:
            raise ValueError(
                f"expert cache capacity {self.capacity_bytes} B holds no expert of {self.store.expert_nbytes} B"
            )
        #: The slot pool, its stored-format buffers and the (layer, expert) → slot table (``offload/slot_pool.py``).
        self.slots = SlotPool(
            self.store, self.num_slots, self.device, self.compute_dtype, self.link is not None
        )
        self.entries: dict[Key, _Entry] = {}
        self.free = list(range(self.num_slots - 1, -1, -1))
        self.frequency: dict[Key, int] = {}
        self.inflight: list[_Entry] = []
        self.round = 0
        self._tick = 0
        #: What the cache knows of the round it serves (every policy keeps it; ``plan`` evicts by it).
        self.plan = RoundPlan(self.store.layer_ids)
        #: The unpinned entries by the policy's rank (those in flight are skipped until they land).
        self.evictor = Evictor(self.policy, self.plan)
        #: Host-clock intervals of the link's completed transfers ``(start, end, nbytes, demand)`` and of compute
        #: waiting for a transfer ``(start, end)``, on both devices; BM4 and the link time from them.
        self.transfer_log: list[tuple[float, float, int, bool]] = []
        self.stall_log: list[tuple[float, float]] = []
        self._link_busy = SpanUnion()
        #: The batched issue (``offload/batching.py``): a layer's prefetches on the link as one batch.
        self.batching = Batching(self, _Entry)
        if self.link is None:
            self._load_all()

    # -- state -------------------------------------------------------------------------------------------------
    @property
    def resident(self) -> bool:
        return self.link is None

    @property
    def occupancy_bytes(self) -> int:
        return len(self.entries) * self.store.expert_nbytes

    def contains(self, key: Key) -> bool:
        return key in self.entries

    def begin_round(self) -> None:
        self.round += 1

    def begin_layer(self, layer: int, needed: list[Key]) -> None:
        """A verify layer starts: the plan now knows which layers have run and what this one still needs."""
        self.plan.layer_started(layer, needed)

    def end_round(self) -> None:
        """The verify round is over: its keys become the plan's history."""
        self.plan.end_round()

    # -- compute side --------------------------------------------------------------------------------------------
    def acquire(self, key: Key) -> _Entry | None:
        """Pin ``key`` for compute, fetching it on demand if absent. None when no slot can be freed right now
        (every slot pinned by this step): compute with what is pinned, release, then retry."""
        entry = self.entries.get(key)
        if entry is None:
            slot = self._slot_for(demand=True)
            if slot is None:
                return None
            entry = self._insert(key, slot, demand=True)
            self.counters.misses += 1
        else:
            if entry.pins == 0:
                self.evictor.hold(key)
            if entry.inserted_round < self.round:
                self.counters.resident_at_round_start += 1
            entry.ready_at_access = entry.transfer is None or self.link.done(entry.transfer)
            if entry.ready_at_access:
                self.counters.hits += 1
            else:
                self.counters.inflight_hits += 1
                self.link.promote(entry.transfer)
        self.plan.record_use(key)
        self.counters.accesses += 1
        self.frequency[key] = self.frequency.get(key, 0) + 1
        entry.used = True
        entry.pins += 1
        self._touch(entry)
        return entry

    def ready(self, entry: _Entry) -> None:
        """Compute may read the entry's slot once this returns (CPU: the transfer has landed; CUDA: the compute
        stream waits for it); waiting counts as exposed."""
        if entry.transfer is not None:
            self.counters.exposed_seconds += self._wait(self.link.wait, entry.transfer)

    def weights(self, entry: _Entry) -> list[torch.Tensor]:
        """The entry's compute-dtype tensors (views of its pool slot) once its transfer has landed."""
        self.ready(entry)
        return self.slots.weights(entry.slot)

    def release(self, entry: _Entry) -> None:
        self.release_all([entry])

    def release_all(self, entries: list[_Entry]) -> None:
        """Unpin entries a layer has computed with (one slot-use record for all of them); an entry no step pins
        any more becomes a victim candidate again."""
        for entry in entries:
            entry.pins -= 1
        if self.link is not None and entries:
            self.link.record_use([e.slot for e in entries])
            for entry in entries:
                if entry.pins == 0:
                    self._offer(entry)

    def pin(self, key: Key) -> bool:
        """Keep a cached expert from eviction (e.g. route-ahead pins its predicted set across a verify)."""
        entry = self.entries.get(key)
        if entry is None:
            return False
        if entry.pins == 0:
            self.evictor.hold(key)
        entry.pins += 1
        return True

    def unpin(self, key: Key) -> None:
        entry = self.entries[key]
        entry.pins -= 1
        if entry.pins == 0:
            self._offer(entry)

    # -- prefetch side -------------------------------------------------------------------------------------------
    def prefetch(self, key: Key, *, speculative: bool = False) -> bool:
        """Start fetching ``key`` unless cached, and reserve it for the round (the plan protects it until its
        layer runs); refreshes recency if cached. False when no slot can be taken without evicting a reserved
        key (counted as dropped: the caller may retry once a layer has run). ``speculative``: a low-confidence
        guess (the AR prefetcher's) that may displace only keys the plan does not want."""
        entry = self.entries.get(key)
        if entry is not None:
            self._touch(entry)
            if entry.pins == 0:
                self._offer(entry)
            self.plan.predict((key,))
            return True
        if self.link is None:
            return True  # resident: everything is cached
        slot = self._slot_for(demand=False, speculative=speculative)
        if slot is None:
            self.counters.prefetch_dropped += 1
            return False
        entry = self._insert(key, slot, demand=False)
        self.plan.predict((key,))
        self._tick += 1
        entry.seq = self._tick
        self._offer(entry)
        return True

    def batched(self, band: int = ROUTE_AHEAD):
        """A context: prefetches made inside go on the link in ``band`` as ONE batch per layer (one copy
        dispatch, one landing call, one event pair; ``offload/batching.py``)."""
        return self.batching.batched(band)

    def prefetch_many(
        self, keys: Sequence[Key], *, speculative: bool = False, band: int = ROUTE_AHEAD
    ) -> tuple[int, int]:
        """``prefetch`` of each key in order as one batched issue, stopping at the first key that finds no slot;
        returns (keys handled, transfers started)."""
        return self.batching.prefetch_many(keys, speculative, band)

    def is_ready(self, key: Key) -> bool:
        """Resident and its transfer landed."""
        entry = self.entries.get(key)
        return entry is not None and (entry.transfer is None or self.link.done(entry.transfer))

    # -- accounting ----------------------------------------------------------------------------------------------
    def collect(self) -> None:
        """Fold completed transfers and measured stalls into the counters (call once per round)."""
        if self.link is None:
            return
        still = []
        for entry in self.inflight:
            t = entry.transfer
            if t is not None and self.link.done(t):
                self._harvest(entry)
            elif t is not None:
                still.append(entry)
        self.inflight = still
        self.counters.exposed_seconds += self.link.harvest_exposed(self.stall_log)

    def drain(self) -> None:
        """Wait for every transfer in flight, then collect (a clean boundary between warm-up and timing)."""
        for entry in self.inflight:
            if entry.transfer is not None:
                self.link.host_wait(entry.transfer)
        self.collect()

    def reset_counters(self) -> None:
        self.drain()
        self.counters = CacheCounters(peak_occupancy_bytes=self.occupancy_bytes)
        self.transfer_log, self.stall_log, self._link_busy = [], [], SpanUnion()

    def close(self) -> None:
        if self.link is not None:
            self.drain()
            self.link.close()
        self.slots.close()
        self.entries.clear()

    # -- internals -----------------------------------------------------------------------------------------------
    def _load_all(self) -> None:
        slot = 0
        for layer in self.store.layer_ids:
            for e in range(self.store.num_experts):
                self.counters.dequantized_landings += self.slots.load(slot, self.store.payload(layer, e))
                self.entries[(layer, e)] = _Entry((layer, e), slot, None, inserted_round=0, prefetched=False)
                slot += 1
            self.slots.place_layer(layer, slot - self.store.num_experts)
        self.free = []
        self.counters.peak_occupancy_bytes = self.occupancy_bytes

    def _insert(self, key: Key, slot: int, demand: bool) -> _Entry:
        nbytes = self.store.expert_nbytes
        if demand and self.batching.demand is not None:
            transfer = self.batching.add_demand(key, slot)
            self.counters.dequantized_landings += not self.slots.direct
        elif demand or self.batching.band is None:
            self.batching.flush()
            land = self.slots.lander(slot)
            self.counters.dequantized_landings += land is not None
            transfer = self.link.submit(
                self.slots.slot_views[slot], self.slots.payload(key), nbytes, demand, after=slot, land=land
            )
        else:
            transfer = self.batching.add(key, slot)
            self.counters.dequantized_landings += not self.slots.direct
        self.slots.set(key, slot)
        entry = _Entry(key, slot, transfer, inserted_round=self.round, prefetched=not demand)
        self.entries[key] = entry
        self.inflight.append(entry)
        if demand:
            self.counters.demand_transfers += 1
            self.counters.demand_bytes += nbytes
        else:
            self.counters.prefetch_transfers += 1
            self.counters.prefetch_bytes += nbytes
        self.counters.peak_occupancy_bytes = max(self.counters.peak_occupancy_bytes, self.occupancy_bytes)
        return entry

    def _harvest(self, entry: _Entry) -> None:
        t = entry.transfer
        start, end = self.link.span(t)
        self._link_busy.add(start, end)
        self.counters.h2d_bytes += t.nbytes
        self.counters.h2d_seconds = self._link_busy.total
        self.counters.h2d_transfers += 1
        self.transfer_log.append((start, end, t.nbytes, t.demand))
        entry.transfer = None

    def _wait(self, wait, transfer) -> float:
        start = time.perf_counter()
        waited = wait(transfer)
        if waited > 0:
            self.stall_log.append((start, start + waited))
        return waited

    def _touch(self, entry: _Entry) -> None:
        self._tick += 1
        entry.last_tick = entry.seq = self._tick

    def _offer(self, entry: _Entry) -> None:
        """An unpinned entry becomes (again) a candidate for eviction, ranked as it is now."""
        if self.link is not None:
            self.evictor.add(entry.key, (self.frequency.get(entry.key, 0), entry.last_tick, entry.seq))

    def _landed(self, key: Key) -> bool:
        t = self.entries[key].transfer
        return t is None or self.link.done(t)

    def _victim(self, prefetch: bool, speculative: bool) -> _Entry | None:
        """The entry to evict (None: nothing evictable, or nothing a prefetch may take)."""
        key = self.evictor.victim(prefetch=prefetch, speculative=speculative, ready=self._landed)
        return None if key is None else self.entries[key]

    def _slot_for(self, demand: bool, speculative: bool = False) -> int | None:
        if self.free:
            return self.free.pop()
        victim = self._victim(prefetch=not demand, speculative=speculative)
        if victim is None and demand:
            # Every unpinned slot is still being written by a prefetch: wait for the oldest, then take it.
            waiting = [e for e in self.inflight if e.pins == 0 and e.transfer is not None]
            if waiting:
                waited = self._wait(self.link.host_wait, waiting[0].transfer)
                self.counters.exposed_seconds += waited
                self.counters.slot_waits += 1
                self.counters.slot_wait_seconds += waited
                victim = waiting[0]
        if victim is None:
            return None
        return self._evict(victim)

    def _evict(self, entry: _Entry) -> int:
        if entry.transfer is not None:
            self._harvest(entry)  # its transfer is None now: every reader of ``inflight`` skips it
        if entry.prefetched and not entry.used:
            self.counters.prefetch_unused_evicted_bytes += self.store.expert_nbytes
        self.counters.evictions += 1
        self.slots.set(entry.key, -1)
        del self.entries[entry.key]
        self.evictor.discard(entry.key)
        return entry.slot
