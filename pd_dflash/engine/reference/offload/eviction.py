"""The round plan of the expert cache: which resident expert to evict, knowing the verify's layer order.

A verify round sweeps the MoE layers in order and the next round sweeps them again with mostly the same experts
(81-91 % of a round's keys on the reference presets). LRU evicts exactly those: the least recently used key is
the one needed soonest in the next sweep. The plan ranks a victim by when it is next needed, from what the cache
knows at the moment it evicts (Belady's rule on an estimate of the future):

0. **not wanted**: a key of a layer still to run that is neither predicted nor in the last round's set, or a key
   of a layer this round has already computed that this round did not use (least recently used first);
1. **computed**: a key this round has already used, at a layer that has run: needed again next round at the
   earliest. Keys the last round did not use go first (less stable), then the most recently computed layer's
   (needed last of all in the next sweep: the classic cyclic-sweep rule);
2. **history**: a key of a layer still to run that the last round used but nobody predicted (farthest layer
   first);
3. **predicted** (reserved): a key of a layer still to run that this round's prediction names (route-ahead,
   history, or a prefetch issued for this round); farthest layer first;
4. **now**: a key the layer computing now still has to acquire (a streaming layer).

A prefetch may evict classes 0-1 only: never a key the last round used at a layer still to run, nor a predicted
key of a layer still to run (it waits for the next layer instead). An on-demand fetch may evict
anything unpinned, in class order, so compute always progresses. B0/B1/B2 know no route-ahead prediction: their
"prediction" is the last round's set plus what their AR prefetcher issued for this round (the history-only plan).

**The index** (``Evictor``): the victim is the evictable key of the smallest rank — (class, order within the class,
last-use tick, LRU position) for the plan, (uses, tick, position) for LFU, (position,) for LRU — found in a heap
kept current incrementally instead of a scan of every slot (≈ 1.5 ms per eviction at 1,536 slots). A key's plan
rank changes only when the plan changes what it knows of that key, and ``RoundPlan`` names exactly those keys
(``on_change``): a prediction or a use names its keys; a layer start the old and new ``now`` keys and, per layer
the verify crosses, that layer's keys in predicted ∪ history ∪ used (any other key of it is class 0 before and
after); a round end the used and ``now`` keys and the marked keys of the layers it did not reach (any other key
is class 0 before and after). A rank that rises is only noted (fixed when its heap item surfaces), one that
falls is pushed at once. So every update is O(log slots) per key named, amortised over the predictions and
acquires that named it.

Pure Python (no torch): the engine's ``ExpertCache`` and ``cache_replay``'s offline replay use the same
``Evictor`` (``benchmarks/cache_bookkeeping.py`` times it against the scan it replaced).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Iterable, Sequence

Key = tuple[int, int]  # (layer, expert)
NOT_WANTED, COMPUTED, HISTORY, PREDICTED, NOW = range(5)
#: Classes a prefetch may evict (``prefetch_may_evict``; a speculative one: NOT_WANTED only). Both sets are a
#: prefix of the class order, so the best key a prefetch may take is the best key overall or none (``Evictor``).
PREFETCH_VICTIMS = frozenset({NOT_WANTED, COMPUTED})
POLICIES = ("plan", "lru", "lfu")


class RoundPlan:
    """What the cache knows about the round it serves: the layer order, how far the verify got, this round's
    prediction (reservations), the keys it has used, and the last round's keys (history). Change it only
    through its methods: they name the keys whose class they may change (``on_change``)."""

    def __init__(self, layer_ids: Sequence[int]) -> None:
        self.layer_ids = list(layer_ids)
        self.position = {layer: i for i, layer in enumerate(self.layer_ids)}
        #: Position of the layer computing now (−1: no layer of this round has started).
        self.current = -1
        self.predicted: set[Key] = set()
        self.history: set[Key] = set()
        self.used: set[Key] = set()
        self.now: set[Key] = set()
        #: Per layer, its keys in predicted ∪ history ∪ used: what a layer start re-ranks when it crosses it.
        self._marked: dict[int, set[Key]] = {}
        #: Called with the keys whose class may have changed (the ``Evictor`` re-ranks those it holds);
        #: ``rising=True``: their rank can only have risen (or stayed).
        self.on_change: Callable[..., None] | None = None

    # -- lifecycle (driven by the offload runtime) -------------------------------------------------------------
    def predict(self, keys: Iterable[Key]) -> None:
        """Reserve keys for the coming (or current) round: a prefetch or a prediction names them."""
        new = [k for k in keys if k not in self.predicted]
        if new:
            self.predicted.update(new)
            self._mark(new)
            if self.on_change is not None:  # to PREDICTED at a layer still to run, else unchanged
                self.on_change(new, rising=True)

    def layer_started(self, layer: int, needed: Iterable[Key]) -> None:
        old, self.current = self.current, self.position[layer]
        before, self.now = self.now, set(needed)
        if self.on_change is not None:
            lo, hi = sorted((old, self.current))
            crossed = [self._marked.get(self.layer_ids[p], ()) for p in range(lo + 1, hi + 1)]
            self.on_change(self.now, rising=True)  # to NOW, the last class
            self.on_change(itertools.chain(before, *crossed))

    def record_use(self, key: Key) -> None:
        self.used.add(key)
        self.now.discard(key)
        self._marked.setdefault(key[0], set()).add(key)
        self._changed((key,))

    def end_round(self) -> None:
        """The round's keys become the history; the next round starts with nothing predicted but that."""
        # Any other key is NOT_WANTED before and after: at a layer that ran and unused, or at a layer still to
        # run and neither predicted, nor in the history, nor used.
        # A used key of a layer that ran goes from COMPUTED to HISTORY (a rise); one of a layer not reached is in
        # that layer's marked keys.
        changed, used = (), self.used
        if self.on_change is not None:
            still = [self._marked.get(layer, ()) for layer in self.layer_ids[self.current + 1 :]]
            changed = list(itertools.chain(self.now, *still))
        self.history, self.used, self.predicted, self.now = self.used, set(), set(), set()
        self.current = -1
        self._marked = {}
        self._mark(self.history)
        if self.on_change is not None:
            self.on_change(used, rising=True)
            self.on_change(changed)

    def _mark(self, keys: Iterable[Key]) -> None:
        for k in keys:
            self._marked.setdefault(k[0], set()).add(k)

    def _changed(self, keys: Iterable[Key]) -> None:
        if self.on_change is not None:
            self.on_change(keys)

    # -- ranking ---------------------------------------------------------------------------------------------
    def classify(self, key: Key) -> tuple[int, int]:
        """(class, order within the class): smaller is evicted first."""
        pos = self.position[key[0]]
        if key in self.now:
            return NOW, -pos
        if pos <= self.current:
            if key not in self.used:
                return NOT_WANTED, 0
            # Needed next round: a key the last round did not use either is the less stable one, then the most
            # recently computed layer's.
            return COMPUTED, -pos + (len(self.position) if key in self.history else 0)
        if key in self.predicted:
            return PREDICTED, -pos
        if key in self.history:
            return HISTORY, -pos
        return NOT_WANTED, 0

    def prefetch_may_evict(self, victim: tuple[int, int], *, speculative: bool = False) -> bool:
        """A prefetch may evict a victim of this class: not wanted, or computed this round. A
        ``speculative`` prefetch (a guess less likely to be used than a computed key is to come back next round:
        the AR prefetcher's) may evict only what is not wanted."""
        cls, _ = victim
        if cls == NOT_WANTED:
            return True
        if speculative:
            return False
        return cls in PREFETCH_VICTIMS


#: What a key's rank is computed from: (uses, last-use tick, position in LRU order). The position is unique
#: per key (an insert or a touch takes the next one), so no two keys ever rank equal.
Stamp = tuple[int, int, int]


class Evictor:
    """The victim rule of the engine's cache and of the offline replay: the evictable keys (unpinned; a key
    still in flight is held too and skipped while ``ready`` says it has not landed) in a heap by the policy's
    rank, with lazy invalidation (a re-ranked or discarded key's old heap item is dropped when it surfaces).

    The victim is the smallest rank among the ready keys: plan (class, order, tick, position), LFU (uses, tick,
    position), LRU (position) — the scan it replaced, whose ties fell to LRU order. A prefetch may take only a
    key of ``PREFETCH_VICTIMS`` (speculative: NOT_WANTED), a prefix of the class order: if the best key's class
    is refused, so is every later key's.

    Invariant: a held key's heap item ranks it no higher than its true rank, and exactly unless the key is in
    ``_rising``. A rank that falls is pushed at once; one that rises (a touch, a reservation, the plan's ``now``,
    a round end) is only noted, and fixed when its item reaches the top. So the top item, once not rising, is
    the true minimum. The keys the plan names are classified before the next victim (``_dirty``: one pinned
    meanwhile costs nothing). Cost: O(log n) per push and per stale item popped (each pushed once), plus per
    in-flight key ranked before the victim (skipped, pushed back)."""

    def __init__(self, policy: str, plan: RoundPlan) -> None:
        if policy not in POLICIES:
            raise ValueError(f"eviction policy must be one of {POLICIES}, got {policy!r}")
        self.policy, self.plan = policy, plan
        self._heap: list[tuple[tuple, int, Key]] = []
        #: key -> (token of its heap item, stamp, the rank its heap item holds)
        self._live: dict[Key, tuple[int, Stamp, tuple]] = {}
        self._dirty: set[Key] = set()
        self._rising: set[Key] = set()
        #: LRU only: pinned keys keep their heap items (a pinned key is the most recently used, so its fixed item
        #: sits at the bottom) and are skipped; a hit then costs no push.
        self._held: set[Key] = set()
        self._tokens = itertools.count()
        if policy == "plan":
            plan.on_change = self.rerank

    def rank(self, key: Key, stamp: Stamp) -> tuple:
        uses, tick, seq = stamp
        if self.policy == "plan":
            return (*self.plan.classify(key), tick, seq)
        if self.policy == "lfu":
            return (uses, tick, seq)
        return (seq,)

    def add(self, key: Key, stamp: Stamp) -> None:
        """``key`` is (again) a candidate, ranked from ``stamp`` (it replaces the key's earlier stamp)."""
        self._held.discard(key)
        rank, held = self.rank(key, stamp), self._live.get(key)
        if held is not None and rank >= held[2]:
            self._live[key] = (held[0], stamp, held[2])
            self._rising.add(key)
        else:
            self._push(key, stamp, rank)

    def add_new(self, items: list[tuple[Key, Stamp]]) -> None:
        """``add`` of keys the evictor does not hold (a batch of new entries), in one heap update."""
        rank_of, live, tokens, new = self.rank, self._live, self._tokens, []
        for key, stamp in items:
            if key in live or key in self._held:
                self.add(key, stamp)
                continue
            rank, token = rank_of(key, stamp), next(tokens)
            live[key] = (token, stamp, rank)
            new.append((rank, token, key))
        if len(new) > len(self._heap) // 4:
            self._heap += new
            heapq.heapify(self._heap)
        else:
            for item in new:
                heapq.heappush(self._heap, item)

    def hold(self, key: Key) -> None:
        """``key`` is pinned (and touched): no candidate until ``add`` offers it again."""
        if self.policy != "lru":
            self.discard(key)
        elif key in self._live:
            self._held.add(key)
            self._rising.add(key)

    def discard(self, key: Key) -> None:
        """``key`` is no candidate (evicted)."""
        self._live.pop(key, None)
        self._rising.discard(key)
        self._held.discard(key)

    def rerank(self, keys: Iterable[Key], *, rising: bool = False) -> None:
        """The plan's knowledge of ``keys`` changed: those held are re-ranked before the next victim is chosen
        (``rising``: their rank did not fall, so their heap items still rank them no higher: just noted)."""
        if rising:  # one membership test per named key
            live = self._live
            self._rising.update(k for k in keys if k in live)
        else:
            self._dirty.update(keys)

    def _refresh(self) -> None:
        live, rank_of, rising = self._live, self.rank, self._rising
        keys, self._dirty = self._dirty, set()
        for key in keys:
            held = live.get(key)
            if held is not None:
                rank = rank_of(key, held[1])
                if rank < held[2]:
                    self._push(key, held[1], rank)
                elif rank > held[2]:
                    rising.add(key)

    def victim(
        self, *, prefetch: bool = False, speculative: bool = False, ready: Callable[[Key], bool] | None = None
    ) -> Key | None:
        """The key to evict (it stays held until ``discard``); None: no candidate, or none a prefetch may take."""
        if self._dirty:
            self._refresh()
        heap, live, rising, held_keys = self._heap, self._live, self._rising, self._held
        skipped, found = [], None
        while heap:
            rank, token, key = heap[0]
            held = live.get(key)
            if held is None or held[0] != token:
                heapq.heappop(heap)  # stale: discarded or re-ranked since
                continue
            if key in rising:  # its true rank is higher: put it there, look again
                rising.discard(key)
                true = self.rank(key, held[1])
                if true != rank:
                    token = next(self._tokens)
                    live[key] = (token, held[1], true)
                    heapq.heapreplace(heap, (true, token, key))
                continue
            if key in held_keys:
                skipped.append(heapq.heappop(heap))  # pinned
                continue
            restricted = prefetch and self.policy == "plan"
            if restricted and not self.plan.prefetch_may_evict(rank[:2], speculative=speculative):
                break  # every later key's class is refused too
            if ready is None or ready(key):
                found = key
                break
            skipped.append(heapq.heappop(heap))  # still in flight
        for item in skipped:
            heapq.heappush(heap, item)
        return found

    def _push(self, key: Key, stamp: Stamp, rank: tuple) -> None:
        token = next(self._tokens)
        self._live[key] = (token, stamp, rank)
        self._rising.discard(key)
        heapq.heappush(self._heap, (rank, token, key))
        if len(self._heap) > 2 * len(self._live) + 64:  # mostly stale: rebuild (amortised O(1) per push)
            live = self._live
            self._heap = [item for item in self._heap if live.get(item[2], (None,))[0] == item[1]]
            heapq.heapify(self._heap)
