"""The round plan's eviction order, the offline replay (LRU, LFU, plan, Belady) on hand-built traces, and the
metrics built on the cache: prefetched-in-time coverage and experts moved per token, each computed a second way."""

from __future__ import annotations

import pytest
import torch

from pd_dflash.engine.reference.offload.cache import ExpertCache
from pd_dflash.engine.reference.offload.eviction import (
    COMPUTED,
    HISTORY,
    NOT_WANTED,
    NOW,
    PREDICTED,
    Evictor,
    RoundPlan,
)
from pd_dflash.engine.reference.offload.link import HostLink
from pd_dflash.engine.reference.offload.replay import clairvoyant_in_time, replay
from pd_dflash.engine.reference.offload.runtime import OffloadRuntime
from pd_dflash.engine.reference.trace import experts_moved_per_token
from tests.engine.reference.helpers import SimClock, store

CPU = torch.device("cpu")


def with_history(plan: RoundPlan, keys: set) -> RoundPlan:
    """A round that used exactly ``keys``, then ended: they are the plan's history."""
    for layer in plan.layer_ids:
        plan.layer_started(layer, [])
        for key in sorted(k for k in keys if k[0] == layer):
            plan.record_use(key)
    plan.end_round()
    assert plan.history == keys
    return plan


def choose(plan: RoundPlan, candidates, target, *, speculative: bool = False):
    """The ``Evictor``'s victim among ``(key, last use tick)`` candidates (``target``: a prefetch's key)."""
    evictor = Evictor("plan", plan)
    for key, tick in candidates:
        evictor.add(key, (0, tick, tick))
    return evictor.victim(prefetch=target is not None, speculative=speculative)


def test_eviction_order_follows_the_round():
    plan = with_history(RoundPlan([0, 1, 2]), {(0, 1), (2, 1), (2, 2)})
    plan.predict({(1, 0), (2, 0)})
    plan.layer_started(0, [(0, 0), (0, 1)])
    plan.record_use((0, 0))
    plan.record_use((0, 1))
    plan.layer_started(1, [(1, 0), (1, 3)])
    plan.record_use((1, 0))
    assert plan.classify((0, 2)) == (NOT_WANTED, 0)  # computed layer, unused this round
    assert plan.classify((0, 1)) == (COMPUTED, 3)  # used by the last round too: kept longer
    assert plan.classify((1, 0)) == (COMPUTED, -1)  # new this round, and the layer computed last
    assert plan.classify((1, 3)) == (NOW, -1)  # this layer still has to acquire it
    assert plan.classify((2, 1)) == (HISTORY, -2)
    assert plan.classify((2, 0)) == (PREDICTED, -2)
    assert plan.classify((2, 3)) == (NOT_WANTED, 0)
    keys = [(0, 2), (0, 1), (1, 0), (1, 3), (2, 1), (2, 0), (2, 3)]
    order = []
    candidates = [(k, i) for i, k in enumerate(keys)]
    while candidates:
        victim = choose(plan, candidates, None)
        order.append(victim)
        candidates = [(k, t) for k, t in candidates if k != victim]
    assert order == [(0, 2), (2, 3), (1, 0), (0, 1), (2, 1), (2, 0), (1, 3)]


def test_a_prefetch_never_evicts_a_predicted_key_of_a_layer_still_to_run():
    plan = with_history(RoundPlan([0, 1, 2]), {(2, 1)})
    plan.predict({(1, 0), (2, 0)})
    only_predicted = [((1, 0), 0), ((2, 0), 1)]
    assert choose(plan, only_predicted, (1, 5)) is None
    assert choose(plan, only_predicted, None) == (2, 0)  # on demand: the farthest layer's, as a last resort
    # Nor a key the last round used at a layer still to run (the round will likely need it again).
    assert choose(plan, [((2, 1), 0)], (1, 5)) is None
    assert choose(plan, [((2, 1), 0)], None) == (2, 1)
    # A speculative guess (the AR prefetcher's) displaces only what the plan does not want.
    plan.layer_started(0, [])
    plan.record_use((0, 3))
    assert choose(plan, [((0, 3), 0)], (1, 5)) == (0, 3)
    assert choose(plan, [((0, 3), 0)], (1, 5), speculative=True) is None


def cyclic(rounds: int) -> list:
    """Every round needs the same 3 experts in each of 2 layers (6 keys; a 4-slot cache cannot hold them)."""
    return [[(0, (0, 1, 2), ()), (1, (0, 1, 2), ())] for _ in range(rounds)]


def test_replay_misses_by_hand_on_a_cyclic_sweep():
    trace = cyclic(3)  # 18 accesses
    # LRU evicts exactly the key needed next: every access misses.
    assert replay(trace, 4, "lru") == 18
    # Belady, by hand (a layer's acquired keys stay pinned until the layer ends). Round 1: 6 cold misses, and
    # B1, B2 evict A2, A1 (needed last), leaving {A0, B0, B1, B2}. Round 2: A0 hits; A1, A2 evict B2, B1 (B0 is
    # needed first); B0 hits; B1, B2 evict A2, A1: 4 misses, same state. Round 3: 4 again. 6 + 4 + 4.
    assert replay(trace, 4, "belady") == 14
    # The plan keeps the last round's keys of the layer still to run and evicts the most recently computed
    # layer's first (the cyclic-sweep rule): Belady's count here.
    assert replay(trace, 4, "plan") == 14
    assert replay(trace, 6, "lru") == replay(trace, 6, "belady") == 6  # everything fits: only cold misses


def test_replay_with_prediction_uses_the_reserved_keys():
    # Layer 1 alternates between two expert sets; the trace's prediction names the right one each round.
    trace = []
    for r in range(6):
        ones = (0, 1) if r % 2 == 0 else (2, 3)
        trace.append([(0, (0, 1), ()), (1, ones, tuple(ones))])
    with_pred, without = replay(trace, 4, "plan+prediction"), replay(trace, 4, "plan")
    assert replay(trace, 4, "belady") <= with_pred <= without


def test_experts_moved_per_token_counts_every_transfer():
    s = store()
    cache = ExpertCache(s, 2 * s.expert_nbytes, CPU, torch.float32, link=HostLink())
    # Hand count: (0,0) miss, (0,1) miss, (0,0) hit, prefetch (1,0) evicts the LRU... (plan: not-wanted (0,1)),
    # (1,0) hit: 3 transfers for 2 "tokens".
    for key in [(0, 0), (0, 1), (0, 0)]:
        entry = cache.acquire(key)
        cache.weights(entry)
        cache.release(entry)
    assert cache.prefetch((1, 0))
    entry = cache.acquire((1, 0))
    cache.weights(entry)
    cache.release(entry)
    cache.drain()
    c = cache.counters
    assert c.h2d_transfers == c.demand_transfers + c.prefetch_transfers == 3
    assert experts_moved_per_token(c.h2d_transfers, 2) == 1.5
    assert experts_moved_per_token(3, 0) is None
    cache.close()


class HandPrefetcher:
    """A prefetcher with a fixed prediction (``seams.Prefetcher``: every call, each a no-op but the prefetch)."""

    name = "hand"
    issue = True

    def __init__(self, predicted: dict[int, frozenset[int]], fetch: list[tuple[int, int]]) -> None:
        self.predicted, self.fetch = predicted, fetch
        self.counters: dict[str, int] = {}

    def describe(self) -> dict:
        return {"prefetcher": self.name}

    def route(self, blocks, cache) -> bool:
        return False

    def begin_round(self, cache, owners) -> None:
        for key in self.fetch:
            cache.prefetch(key)

    def after_layer(self, cache, layer, routed) -> None:
        pass

    def layer_done(self, cache, layer) -> None:
        pass

    def end_round(self, cache, kept_spans, finished) -> None:
        pass

    def keys(self, rid) -> set:
        return set()

    def in_flight(self, rid) -> bool:
        return False

    def forget(self, rid) -> None:
        pass


def test_prefetched_in_time_coverage_by_hand():
    s = store(layers=2, experts=4)
    gbps = s.expert_nbytes / 0.05 / 1e9  # 50 ms per expert on the link
    clock = SimClock()  # the link's own clock: 60 ms pass exactly, however long the host takes
    link = HostLink(gbps, clock=clock, sleep=clock.sleep)
    cache = ExpertCache(s, s.total_bytes - s.expert_nbytes, CPU, torch.float32, link=link)
    # Predicted: {0, 1} at layer 0, {2} at layer 1; prefetched at round start: (0, 0) (on the link 0-50 ms),
    # then (1, 2) (50-100 ms).
    prefetcher = HandPrefetcher({0: frozenset({0, 1}), 1: frozenset({2})}, [(0, 0), (1, 2)])
    runtime = OffloadRuntime(s, cache, prefetcher)
    runtime.begin_round([("r", 1)])
    clock.sleep(0.06)
    computed = []

    def compute(experts, whole):
        computed.extend(experts)

    runtime.run_layer(0, torch.tensor([[0]]), compute)  # (0, 0) landed: predicted and in time
    runtime.run_layer(
        1, torch.tensor([[2, 3]]), compute
    )  # (1, 2) still on the link: late; (1, 3) not predicted
    runtime.end_round(kept_rows=1)
    # Second way: of the 3 routed keys, only (0, 0) was predicted AND resident and ready when acquired; recall
    # counts (1, 2) as well.
    assert runtime.in_time == [1, 3]
    assert (runtime.stats.covered_experts, runtime.stats.actual_experts) == (2, 3)
    assert cache.counters.inflight_hits == 1 and cache.counters.misses == 1
    assert computed == [0, 2, 3]
    runtime.close()


def test_clairvoyant_in_time_by_hand():
    """Two layers, 2 slots, 1 s per expert on the link. By hand (t = 0 at the first layer, cache empty):
    p0 needs (0,0): absent, loaded 0-1 s, stall 1 s; while it computes (1-2.5 s) the link loads (1,0) (1-2 s), the
    next key needed. p1 (gap 0.5 s, starts at 3 s): (1,0) landed, predicted: in time. Nothing else beats its
    victim (the free keys are needed before (1,1)). p2's gap (4-6 s): (1,0) is never needed again, so (1,1)
    replaces it (4-5 s). p2 at 6 s: (0,0) in time. p3 at 7 s: (1,1) landed but not predicted: landed, not
    counted. 2 of 4 accesses in time, 3 landed, 3 loads, 1 s stalled."""
    trace = [
        [(0, (0,), (0,)), (1, (0,), (0,))],
        [(0, (0,), (0,)), (1, (1,), ())],
    ]
    timeline = [
        [(0.0, 2.5, 1.0), (3.0, 4.0, 0.0)],  # computes 1.5 s and 1 s; 0.5 s between them
        [(6.0, 7.0, 0.0), (7.0, 8.0, 0.0)],  # 2 s before the round (draft, router)
    ]
    got = clairvoyant_in_time(trace, timeline, 2, 1.0)
    assert got == {"in_time": 2, "landed": 3, "actual": 4, "loads": 3, "stall_seconds": 1.0}
    # 4 slots: (1,1) is loaded early (2-3 s, a free slot) instead of over (1,0): the same counts.
    assert clairvoyant_in_time(trace, timeline, 4, 1.0) == got
    # A link too slow to hide anything: every load stalls its layer.
    slow = clairvoyant_in_time(trace, timeline, 2, 10.0)
    assert (slow["in_time"], slow["landed"], slow["loads"]) == (1, 1, 3)


def test_the_runtime_records_each_layer_on_the_timeline():
    """One (start, end, waited) per MoE layer of the round, in order; the waits add up to the cache's exposed
    seconds (counted a second way, by the cache). The waits are on the emulated link's own clock (time passes
    only while the link sleeps), so they are exact whatever the machine's load."""
    s = store(layers=2, experts=4)
    gbps = s.expert_nbytes / 0.02 / 1e9  # 20 ms per expert on the link
    clock = SimClock()
    link = HostLink(gbps, clock=clock, sleep=clock.sleep)
    cache = ExpertCache(s, s.total_bytes - s.expert_nbytes, CPU, torch.float32, link=link)
    runtime = OffloadRuntime(s, cache, HandPrefetcher({}, []))
    runtime.begin_round([("r", 1)])
    runtime.run_layer(0, torch.tensor([[0]]), lambda *a: None)
    runtime.run_layer(1, torch.tensor([[2, 3]]), lambda *a: None)
    runtime.end_round(kept_rows=1)
    ((first, second),) = runtime.timeline
    assert first[0] <= first[1] <= second[0] <= second[1]
    # one expert, then two one after the other on the demand stream, fetched on demand
    assert first[2] == pytest.approx(0.02) and second[2] == pytest.approx(0.04)
    assert abs(first[2] + second[2] - cache.counters.exposed_seconds) < 1e-9
    runtime.close()
