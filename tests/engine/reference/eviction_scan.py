"""The eviction the ``Evictor`` replaced, kept as the reference it is tested and timed against: a scan of every
slot per victim (``ExpertCache._victim`` and ``RoundPlan.choose`` before issue 20, ``cache_replay.replay``'s
scans), over the cache's entries in LRU order kept independently here (an OrderedDict moved on every touch, as
the cache kept it). ``tests/engine/reference/test_eviction_index.py`` and ``benchmarks/cache_bookkeeping.py``
use it; the engine does not."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from pd_dflash.engine.reference.offload.cache import ExpertCache, _Entry
from pd_dflash.engine.reference.offload.eviction import RoundPlan
from pd_dflash.engine.reference.offload.replay import POLICIES, _advance_plan, _next_uses, accesses

Key = tuple[int, int]


def choose(
    plan: RoundPlan, candidates: Iterable[tuple[Key, int]], target: Key | None, *, speculative: bool = False
) -> Key | None:
    """The victim among ``(key, last use tick)`` candidates: the lowest class, then the class order, then least
    recently used; the first such in the candidates' order. ``target``: the prefetched key (None: on demand)."""
    best, best_rank = None, None
    for key, tick in candidates:
        cls = plan.classify(key)
        if target is not None and not plan.prefetch_may_evict(cls, speculative=speculative):
            continue
        rank = (*cls, tick)
        if best_rank is None or rank < best_rank:
            best, best_rank = key, rank
    return best


class ScanCache(ExpertCache):
    """An ``ExpertCache`` whose victims come from a scan of every entry in LRU order (its ``Evictor`` is left
    empty and unhooked, so it costs what the cache cost before)."""

    def __post_init__(self) -> None:
        self.lru: OrderedDict[Key, None] = OrderedDict()
        super().__post_init__()
        self.plan.on_change = None

    def _offer(self, entry: _Entry) -> None:
        pass

    def _insert(self, key: Key, slot: int, demand: bool) -> _Entry:
        self.lru[key] = None
        return super()._insert(key, slot, demand)

    def _touch(self, entry: _Entry) -> None:
        super()._touch(entry)
        self.lru.move_to_end(entry.key)

    def _evict(self, entry: _Entry) -> int:
        del self.lru[entry.key]
        return super()._evict(entry)

    def _evictable(self, entry: _Entry) -> bool:
        return entry.pins == 0 and (entry.transfer is None or self.link.done(entry.transfer))

    def _victim(self, prefetch: bool, speculative: bool) -> _Entry | None:
        entries = (self.entries[k] for k in self.lru)
        if self.policy == "plan":
            candidates = [(e.key, e.last_tick) for e in entries if self._evictable(e)]
            target = (-1, -1) if prefetch else None
            key = choose(self.plan, candidates, target, speculative=speculative)
            return None if key is None else self.entries[key]
        if self.policy == "lru":
            return next((e for e in entries if self._evictable(e)), None)
        candidates = [e for e in entries if self._evictable(e)]
        if not candidates:
            return None
        return min(candidates, key=lambda e: (self.frequency.get(e.key, 0), e.last_tick))


def scan_replay(trace, slots: int, policy: str) -> int:
    """``cache_replay.replay`` as it was: a scan of every resident key per victim."""
    assert policy in POLICIES
    flat = accesses(trace)
    layer_ids = sorted({layer for rnd in trace for layer, _, _ in rnd})
    plan = RoundPlan(layer_ids) if policy.startswith("plan") else None
    next_use = _next_uses(flat) if policy == "belady" else None
    resident: dict[Key, list[int]] = {}
    misses, pinned, where = 0, set(), None
    for t, (r, i, key) in enumerate(flat):
        if where != (r, i):
            if plan is not None:
                _advance_plan(plan, trace, r, i, where, use_prediction=policy == "plan+prediction")
            where, pinned = (r, i), set()
            if plan is not None:
                plan.layer_started(key[0], [(key[0], e) for e in trace[r][i][1]])
        if key not in resident:
            misses += 1
            if len(resident) >= slots:
                candidates = [k for k in resident if k not in pinned] or list(resident)
                if policy == "lru":
                    victim = min(candidates, key=lambda k: resident[k][0])
                elif policy == "lfu":
                    victim = min(candidates, key=lambda k: (resident[k][1], resident[k][0]))
                elif policy == "belady":
                    victim = max(candidates, key=lambda k: next_use[resident[k][0]])
                else:
                    victim = choose(plan, [(k, resident[k][0]) for k in candidates], None)
                del resident[victim]
            resident[key] = [t, 0]
        resident[key][0] = t
        resident[key][1] += 1
        pinned.add(key)
        if plan is not None:
            plan.record_use(key)
    return misses
