"""The eviction index (``offload/eviction.Evictor``) against the scan it replaced (``eviction_scan.py``), on random
traces: the same victims, so the same cache states and counters, for every policy, with pins, transfers still in
flight, prefetches (speculative ones included), layer starts and round ends; the offline replay likewise; and
route-ahead's issue queue against a sort of its keys."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from pd_dflash.engine.reference.offload.cache import ExpertCache
from pd_dflash.engine.reference.offload.eviction import NOT_WANTED, Evictor, RoundPlan
from pd_dflash.engine.reference.offload.link import HostLink
from pd_dflash.engine.reference.offload.replay import POLICIES as REPLAY_POLICIES
from pd_dflash.engine.reference.offload.replay import replay
from pd_dflash.engine.reference.offload.route_prefetch import IssueQueue
from tests.engine.reference.eviction_scan import ScanCache, choose, scan_replay
from tests.engine.reference.helpers import SimClock, store

CPU = torch.device("cpu")
LAYERS, EXPERTS = 4, 6


def make(cls, policy: str, slots: int):
    s = store(layers=LAYERS, experts=EXPERTS)
    clock = SimClock()
    link = HostLink(s.expert_nbytes / 1e-3 / 1e9, clock=clock, sleep=clock.sleep)  # 1 ms per expert
    return cls(s, slots * s.expert_nbytes, CPU, torch.float32, policy=policy, link=link), clock


def state(cache: ExpertCache) -> tuple:
    entries = {k: (e.slot, e.pins, e.last_tick, e.used, e.transfer is None) for k, e in cache.entries.items()}
    return entries, sorted(cache.free), dataclasses.asdict(cache.counters)


def run_trace(policy: str, seed: int, steps: int = 400) -> dict:
    """One random trace on both caches in lockstep; the state is compared after every step."""
    rng = random.Random(seed)
    slots = rng.randint(3, 10)
    (new, new_clock), (old, old_clock) = make(ExpertCache, policy, slots), make(ScanCache, policy, slots)
    held: list[tuple] = []  # acquired on both, not released yet
    pinned: list[tuple[int, int]] = []
    layer, needed = -1, []
    keys = [(la, e) for la in range(LAYERS) for e in range(EXPERTS)]
    new.begin_round(), old.begin_round()
    for _ in range(steps):
        op = rng.choices(
            ["round", "layer", "acquire", "release", "pin", "unpin", "prefetch", "wait", "tick", "collect"],
            [2, 6, 12, 8, 2, 2, 10, 2, 6, 1],
        )[0]
        if op == "round":
            for c in (new, old):
                c.end_round(), c.collect(), c.begin_round()
            layer = -1
        elif op == "layer" and layer < LAYERS - 1:
            layer = rng.randint(layer + 1, LAYERS - 1)
            needed = [(layer, e) for e in rng.sample(range(EXPERTS), rng.randint(0, EXPERTS))]
            for c in (new, old):
                c.begin_layer(layer, needed)
        elif op == "acquire":
            key = rng.choice(needed) if needed and rng.random() < 0.8 else rng.choice(keys)
            a, b = new.acquire(key), old.acquire(key)
            assert (a is None) == (b is None)
            if a is not None:
                held.append((a, b))
        elif op == "release" and held:
            a, b = held.pop(rng.randrange(len(held)))
            new.release(a), old.release(b)
        elif op == "pin":
            key = rng.choice(keys)
            assert new.pin(key) == old.pin(key)
            if new.contains(key):
                pinned.append(key)
        elif op == "unpin" and pinned:
            key = pinned.pop(rng.randrange(len(pinned)))
            new.unpin(key), old.unpin(key)
        elif op == "prefetch":
            key, speculative = rng.choice(keys), rng.random() < 0.4
            assert new.prefetch(key, speculative=speculative) == old.prefetch(key, speculative=speculative)
        elif op == "wait" and held:
            a, b = held[rng.randrange(len(held))]
            new.weights(a), old.weights(b)
        elif op == "tick":
            dt = rng.choice([1e-4, 5e-4, 1e-3, 3e-3])
            new_clock.now += dt
            old_clock.now += dt
        elif op == "collect":
            new.collect(), old.collect()
        assert state(new) == state(old), f"{policy} seed {seed}: diverged at {op}"
    assert new.evictor.victim() in {None, *new.entries}
    return dataclasses.asdict(new.counters)


@pytest.mark.parametrize("policy", ["plan", "lru", "lfu"])
def test_the_index_evicts_what_the_scan_evicts_on_random_traces(policy):
    totals: dict[str, float] = {}
    for seed in range(25):
        for k, v in run_trace(policy, seed).items():
            totals[k] = totals.get(k, 0) + v
    # The traces reach every path: evictions, hits on transfers still in flight, prefetches refused (every
    # slot pinned, in flight or, for the plan, reserved), prefetches evicted unused, waits for a slot.
    assert totals["evictions"] > 500 and totals["inflight_hits"] > 50
    assert totals["prefetch_dropped"] > 50 and totals["prefetch_unused_evicted_bytes"] > 0
    assert totals["slot_waits"] > 0


def random_trace(rng: random.Random) -> list:
    layers = rng.sample(range(8), rng.randint(1, 4))
    experts = rng.randint(2, 8)
    return [
        [
            (
                layer,
                tuple(rng.sample(range(experts), rng.randint(1, experts))),
                tuple(rng.sample(range(experts), rng.randint(0, experts))),
            )
            for layer in sorted(layers)
        ]
        for _ in range(rng.randint(1, 8))
    ]


@pytest.mark.parametrize("policy", REPLAY_POLICIES)
def test_the_replay_counts_the_misses_the_scan_counted(policy):
    rng = random.Random(policy)
    for _ in range(150):
        trace = random_trace(rng)
        slots = rng.randint(1, 12)  # down to fewer slots than a layer needs: pinned keys are evicted then
        assert replay(trace, slots, policy) == scan_replay(trace, slots, policy)


def test_the_index_follows_the_plan_through_a_round():
    """The hand-built order of ``test_cache_plan``'s round, popped from the index one victim at a time, agrees
    with the scan at every step; a prefetch takes only NOT_WANTED / COMPUTED keys, a speculative one NOT_WANTED."""
    plan = RoundPlan([0, 1, 2])
    evictor = Evictor("plan", plan)
    keys = [(0, 2), (0, 1), (1, 0), (1, 3), (2, 1), (2, 0), (2, 3)]
    for tick, key in enumerate(keys):
        evictor.add(key, (0, tick, tick))
    plan.layer_started(0, [(0, 1)])
    plan.record_use((0, 1))
    plan.layer_started(2, [])
    plan.record_use((2, 1))
    plan.record_use((2, 2))
    plan.end_round()  # history: (0, 1), (2, 1), (2, 2)
    plan.predict({(1, 0), (2, 0)})
    plan.layer_started(0, [(0, 0), (0, 1)])
    plan.record_use((0, 0))
    plan.record_use((0, 1))
    plan.layer_started(1, [(1, 0), (1, 3)])
    plan.record_use((1, 0))
    order, left = [], {k: t for t, k in enumerate(keys)}
    while left:
        victim = evictor.victim()
        assert victim == choose(plan, left.items(), None)
        for speculative in (False, True):
            got = evictor.victim(prefetch=True, speculative=speculative)
            assert got == choose(plan, left.items(), victim, speculative=speculative)
        order.append(victim)
        evictor.discard(victim)
        del left[victim]
    assert order == [(0, 2), (2, 3), (1, 0), (0, 1), (2, 1), (2, 0), (1, 3)]
    assert plan.classify((0, 2))[0] == NOT_WANTED


def test_the_issue_queue_walks_its_keys_in_layer_order():
    rng = random.Random(3)
    position = {layer: i for i, layer in enumerate([4, 1, 7, 2])}
    queue, want = IssueQueue(position), set()
    for _ in range(500):
        op = rng.random()
        if op < 0.5:
            keys = {(rng.choice(list(position)), rng.randrange(10)) for _ in range(rng.randint(0, 6))}
            queue.add(keys)
            want |= keys
        elif op < 0.7:
            p = rng.randrange(-1, 4)
            late = {k for k in want if position[k[0]] <= p}
            assert queue.drop_through(p) == len(late)
            want -= late
        elif op < 0.85:
            wanted = {k for k in want if rng.random() < 0.7}
            queue.retain(wanted)
            want &= wanted
        elif op < 0.9:
            queue.clear()
            want.clear()
        assert [k for _, _, k in queue.order] == sorted(want, key=lambda k: (position[k[0]], k[1]))
        assert queue.keys == want and bool(queue) == bool(want)
