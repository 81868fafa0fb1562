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

Pure Python (no torch): the engine's ``ExpertCache`` and ``benchmarks/cache_policy.py``'s offline replay use
the same ranking.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

Key = tuple[int, int]  # (layer, expert)
NOT_WANTED, COMPUTED, HISTORY, PREDICTED, NOW = range(5)
#: Classes a prefetch may evict (``prefetch_may_evict``; a speculative one: NOT_WANTED only).
PREFETCH_VICTIMS = frozenset({NOT_WANTED, COMPUTED})


class RoundPlan:
    """What the cache knows about the round it serves: the layer order, how far the verify got, this round's
    prediction (reservations), the keys it has used, and the last round's keys (history)."""

    def __init__(self, layer_ids: Sequence[int]) -> None:
        self.position = {layer: i for i, layer in enumerate(layer_ids)}
        #: Position of the layer computing now (−1: no layer of this round has started).
        self.current = -1
        self.predicted: set[Key] = set()
        self.history: set[Key] = set()
        self.used: set[Key] = set()
        self.now: set[Key] = set()

    # -- lifecycle (driven by the offload runtime) -------------------------------------------------------------
    def predict(self, keys: Iterable[Key]) -> None:
        """Reserve keys for the coming (or current) round: a prefetch or a prediction names them."""
        self.predicted.update(keys)

    def layer_started(self, layer: int, needed: Iterable[Key]) -> None:
        self.current = self.position[layer]
        self.now = set(needed)

    def record_use(self, key: Key) -> None:
        self.used.add(key)
        self.now.discard(key)

    def end_round(self) -> None:
        """The round's keys become the history; the next round starts with nothing predicted but that."""
        self.history, self.used, self.predicted, self.now = self.used, set(), set(), set()
        self.current = -1

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

    def prefetch_may_evict(self, victim: tuple[int, int], target: Key, *, speculative: bool = False) -> bool:
        """A prefetch of ``target`` may evict a victim of this class: not wanted, or computed this round. A
        ``speculative`` prefetch (a guess less likely to be used than a computed key is to come back next round:
        the AR prefetcher's) may evict only what is not wanted."""
        cls, _ = victim
        if cls == NOT_WANTED:
            return True
        if speculative:
            return False
        return cls in PREFETCH_VICTIMS

    def choose(
        self, candidates: Iterable[tuple[Key, int]], target: Key | None, *, speculative: bool = False
    ) -> Key | None:
        """The victim among ``(key, last use tick)`` candidates (unpinned, not in flight): the lowest class, then
        the class order, then least recently used. ``target`` is the prefetched key (None: on demand)."""
        best, best_rank = None, None
        for key, tick in candidates:
            cls = self.classify(key)
            if target is not None and not self.prefetch_may_evict(cls, target, speculative=speculative):
                continue
            rank = (*cls, tick)
            if best_rank is None or rank < best_rank:
                best, best_rank = key, rank
        return best
