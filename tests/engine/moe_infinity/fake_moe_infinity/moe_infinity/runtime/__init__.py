"""Fake ``OffloadEngine`` / ``ExpertPrefetcher``: an LRU expert cache with the documented native accessors."""

from __future__ import annotations

from collections import OrderedDict

from moe_infinity import FEATURES
from moe_infinity._world import EXPERT_NBYTES, EXPERTS, LAYERS, LINK_BYTES_PER_SECOND


class ExpertDispatcher:
    def __init__(self, engine: OffloadEngine) -> None:
        self._engine = engine

    def clear_expert_cache_counts(self) -> None:
        self._engine.hits = self._engine.visits = 0


class ExpertPrefetcher:
    def __init__(self, engine: OffloadEngine) -> None:
        self._engine = engine
        self.expert_nbytes_map = {
            (layer, e): EXPERT_NBYTES for layer in range(LAYERS) for e in range(EXPERTS)
        }
        self.expert_dispatcher = ExpertDispatcher(engine)
        self.route_ahead_priority = 1

    @property
    def num_offloaded_experts(self) -> int:
        return self._engine.num_offloaded_experts

    def prefetch(self, layer: int, experts) -> None:
        for e in experts:
            self._engine.load((layer, e), prefetched=True)

    def get_hit_rate(self) -> float | None:
        e = self._engine
        return e.hits / e.visits if e.visits else None

    def expert_occupancy_bytes(self) -> int:
        return len(self._engine.cache) * EXPERT_NBYTES

    def wasted_prefetch_bytes(self) -> int:
        return self._engine.wasted_bytes


class OffloadEngine:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.cache: OrderedDict[tuple[int, int], bool] = OrderedDict()  # value: prefetched and not yet used
        self.hits = self.visits = 0
        self.wasted_bytes = 0
        self.exposed = 0.0
        self.expert_prefetcher = ExpertPrefetcher(self)

    @property
    def num_offloaded_experts(self) -> int:
        return LAYERS * EXPERTS - self.capacity

    def load(self, key: tuple[int, int], *, prefetched: bool) -> None:
        if key in self.cache:
            self.cache.move_to_end(key)
            return
        while len(self.cache) >= self.capacity:
            _, unused_prefetch = self.cache.popitem(last=False)
            if unused_prefetch:
                self.wasted_bytes += EXPERT_NBYTES
        self.cache[key] = prefetched
        if not prefetched:
            self.exposed += EXPERT_NBYTES / LINK_BYTES_PER_SECOND

    def access(self, layer: int, expert: int) -> None:
        key = (layer, expert)
        self.visits += 1
        if key in self.cache:
            self.hits += 1
            self.cache[key] = False
            self.cache.move_to_end(key)
        else:
            self.load(key, prefetched=False)
            self.cache[key] = False

    @property
    def expert_cache_hit_rate(self) -> float | None:
        return self.expert_prefetcher.get_hit_rate()

    @property
    def expert_occupancy_bytes(self) -> int:
        return len(self.cache) * EXPERT_NBYTES

    @property
    def kv_occupancy_bytes(self) -> None:
        return None  # upstream: Optional, absent on the serving path

    def get_exposed_fetch_seconds(self) -> float:
        return self.exposed

    def reset_exposed_fetch_seconds(self) -> None:
        self.exposed = 0.0


if "hit_rate" not in FEATURES:
    del ExpertPrefetcher.get_hit_rate, OffloadEngine.expert_cache_hit_rate
if "occupancy" not in FEATURES:
    del ExpertPrefetcher.expert_occupancy_bytes, OffloadEngine.expert_occupancy_bytes
if "clear_counts" not in FEATURES:
    del ExpertDispatcher.clear_expert_cache_counts
if "exposed_fetch" not in FEATURES:
    del OffloadEngine.get_exposed_fetch_seconds, OffloadEngine.reset_exposed_fetch_seconds
if "wasted_bytes" not in FEATURES:
    del ExpertPrefetcher.wasted_prefetch_bytes
