"""Fake ``OffloadEngine`` / ``ExpertPrefetcher`` over native handles, with the real getters' 0.0 fallbacks.

The Python wrappers always exist and return 0.0 when the native getter behind them is missing or raises, as in
the real library; a build without a native getter is modelled by removing the *native* method
(FAKE_MOE_INFINITY_DISABLE), never the wrapper:

- ``OffloadEngine.expert_cache_hit_rate`` / ``expert_occupancy_bytes`` / ``get_exposed_fetch_seconds`` /
  ``num_offloaded_experts``: TorchMoE/MoE-Infinity@0690efefe42477164031e6020c986650d9f89e6a
  ``moe_infinity/runtime/model_offload.py`` (``OffloadEngine`` properties; ``_exposed_fetch_seconds`` is set in
  ``__init__`` and grows only in ``_fetch_tensors_timed``, so fetches issued elsewhere leave it at 0.0; without
  ``exposed_fetch`` no fetch goes through the timer).
- ``ExpertPrefetcher.get_hit_rate`` / ``expert_occupancy_bytes()`` / ``wasted_prefetch_bytes()``:
  TorchMoE/MoE-Infinity@4dac1bbcf69fbfe35aaee960001f185f9d7086ea ``moe_infinity/memory/expert_prefetcher.py``
  (dispatcher ``get_cache_hit_rate`` unless it is 0.0, then the archer engine's counts, else 0.0; occupancy sums
  the native getters that exist; waste reads ``get_wasted_prefetch_bytes``, 0.0 when missing or raising).
- ``route_ahead_seam``: TorchMoE/MoE-Infinity@0690efefe42477164031e6020c986650d9f89e6a
  ``moe_infinity/distributed/expert_executor.py`` ``_maybe_route_ahead_prefetch``: inside a verify, pin and
  prefetch the layer's ACTUAL routed union through the bound prefetcher, and report predicted = that union when
  the prefetch fired (else ``[]``), the routed rows, and per-expert bytes from ``expert_nbytes_map``.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Any

from moe_infinity import FAULTS, FEATURES
from moe_infinity._world import EXPERT_NBYTES, EXPERTS, LAYERS, LINK_BYTES_PER_SECOND


class NativeDispatcher:
    """The ``_store`` expert dispatcher: cache hit counters and device occupancy."""

    def __init__(self, engine: OffloadEngine) -> None:
        self._engine = engine

    def get_cache_hit_rate(self) -> float:
        e = self._engine
        if "hit_counters_stalled" in FAULTS:
            return 0.0
        return e.hits / e.visits if e.visits else 0.0

    def get_cache_occupancy_bytes(self) -> int:
        return len(self._engine.cache) * EXPERT_NBYTES

    def clear_expert_cache_counts(self) -> None:
        self._engine.hits = self._engine.visits = 0


class NativeArcher:
    """The ``_store`` archer engine handle: the wasted-prefetch counter."""

    def __init__(self, engine: OffloadEngine) -> None:
        self._engine = engine

    def get_wasted_prefetch_bytes(self) -> int:
        return self._engine.wasted_bytes


class ExpertPrefetcher:
    def __init__(self, engine: OffloadEngine) -> None:
        self._engine = engine
        self.archer_engine = NativeArcher(engine)
        self.expert_dispatcher = NativeDispatcher(engine)
        self.expert_nbytes_map = {
            (layer, e): EXPERT_NBYTES for layer in range(LAYERS) for e in range(EXPERTS)
        }
        self.route_ahead_priority = 1

    @property
    def num_offloaded_experts(self) -> int:
        return self._engine.num_offloaded

    def prefetch(self, layer: int, experts) -> None:
        for e in experts:
            self._engine.load((layer, e), prefetched=True)

    def get_hit_rate(self) -> float:
        getter = getattr(self.expert_dispatcher, "get_cache_hit_rate", None)
        if callable(getter):
            try:
                rate = float(getter())
            except Exception:
                rate = 0.0
            if rate:
                return rate
        return 0.0  # the archer engine's visit counts are not modelled: the real fallback ends at 0.0 too

    def expert_occupancy_bytes(self) -> float:
        total = 0.0
        getter = getattr(self.expert_dispatcher, "get_cache_occupancy_bytes", None)
        if callable(getter):
            with contextlib.suppress(Exception):
                total += float(getter())
        return total

    def wasted_prefetch_bytes(self) -> float:
        getter = getattr(self.archer_engine, "get_wasted_prefetch_bytes", None)
        if callable(getter):
            try:
                return float(getter())
            except Exception:
                return 0.0
        return 0.0


class OffloadEngine:
    """An LRU expert cache of ``capacity`` experts in front of host memory (every expert is M bytes)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.num_offloaded = LAYERS * EXPERTS - capacity
        self.cache: OrderedDict[tuple[int, int], bool] = OrderedDict()  # value: prefetched and not yet used
        self.hits = self.visits = 0
        self.wasted_bytes = 0
        self._exposed_fetch_seconds = 0.0
        self.expert_prefetcher = ExpertPrefetcher(self)
        if capacity >= LAYERS * EXPERTS:  # a resident load places every expert on the device at load time
            self.cache.update(((layer, e), False) for layer in range(LAYERS) for e in range(EXPERTS))

    @property
    def num_offloaded_experts(self) -> int:
        prefetcher = getattr(self, "expert_prefetcher", None)
        return 0 if prefetcher is None else int(getattr(prefetcher, "num_offloaded_experts", 0))

    @property
    def expert_cache_hit_rate(self) -> float:
        getter = getattr(self.expert_prefetcher, "get_hit_rate", None)
        return float(getter()) if callable(getter) else 0.0

    @property
    def expert_occupancy_bytes(self) -> float:
        getter = getattr(self.expert_prefetcher, "expert_occupancy_bytes", None)
        return float(getter()) if callable(getter) else 0.0

    @property
    def kv_occupancy_bytes(self) -> None:
        return None  # no native KV cache manager on the serving path

    def get_exposed_fetch_seconds(self) -> float:
        return float(getattr(self, "_exposed_fetch_seconds", 0.0))

    def reset_exposed_fetch_seconds(self) -> None:
        self._exposed_fetch_seconds = 0.0

    def load(self, key: tuple[int, int], *, prefetched: bool) -> None:
        if key in self.cache:
            self.cache.move_to_end(key)
            return
        while len(self.cache) >= self.capacity:
            _, unused_prefetch = self.cache.popitem(last=False)
            if unused_prefetch:
                self.wasted_bytes += EXPERT_NBYTES
        self.cache[key] = prefetched
        if not prefetched and "exposed_fetch" in FEATURES:  # a timed on-demand fetch (_fetch_tensors_timed)
            self._exposed_fetch_seconds += EXPERT_NBYTES / LINK_BYTES_PER_SECOND

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


def route_ahead_seam(layer: int, rows: list[set[int]], prefetcher: Any, stats: Any) -> None:
    """The executor's route-ahead seam for one MoE layer of a verify forward (see the module docstring)."""
    union = sorted(set().union(*rows))
    fired = prefetcher is not None and bool(union)
    if fired:
        prefetcher.prefetch(layer, union)
    if stats is None:
        return
    nbytes_map = getattr(prefetcher, "expert_nbytes_map", None) if "wasted_bytes" in FEATURES else None
    nbytes = {e: nbytes_map[(layer, e)] for e in union if (layer, e) in nbytes_map} if nbytes_map else None
    stats.observe_layer(layer, union if fired else [], rows, expert_nbytes=nbytes if fired else None)


if "hit_rate" not in FEATURES:
    del NativeDispatcher.get_cache_hit_rate
if "occupancy" not in FEATURES:
    del NativeDispatcher.get_cache_occupancy_bytes
if "clear_counts" not in FEATURES:
    del NativeDispatcher.clear_expert_cache_counts
if "wasted_bytes" not in FEATURES:
    del NativeArcher.get_wasted_prefetch_bytes
