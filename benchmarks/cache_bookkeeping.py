"""The expert cache's bookkeeping per miss at real slot counts: the eviction index against the scan it replaced.

A 25 % cache of 48 MoE layers (Qwen3-Coder-30B-A3B's 48 × 128 = 6,144 experts: 1,536 slots; and 48 × 512:
6,144 slots), tiny experts (the copy costs next to nothing), a host link (a transfer lands at submit). A round is
an AR token: each layer starts (``begin_layer``), acquires and releases its top-8 (85 % from a per-layer hot set
of E / 8 experts, the rest uniform), and before it starts the next layer's last-round experts are prefetched
(half of them speculative, as B0/B1's AR prefetcher issues them); then the round ends. The cache is filled first,
so every miss evicts. Both caches run the same trace in the same process: ``ExpertCache`` (the ``Evictor``) and
``tests/engine/reference/eviction_scan.ScanCache`` (the scan of every slot per victim, as before issue 20).

Printed per slot count and policy, in CPU µs of this thread (``time.thread_time``: the VM is shared, so wall time
mostly measures the other processes; the best of ``--repeats`` runs; each figure includes one clock read pair per
timed call, whose cost the header gives): per miss (the whole ``acquire`` of a missing expert: victim, eviction, transfer submit,
bookkeeping), of which the insert (``_insert``: the payload views, the link's submit and copy, the entry — the
data path, not the policy), per victim (``_victim`` alone, on demand and for prefetches; the index re-ranks there the keys the
plan named since the last victim), layer starts + round ends per miss, and every cache call of the timed rounds
(hits, prefetches, releases included) per miss; the ratio scan ÷ index per miss; the misses timed; and whether
both made the same victims (the same misses and cache contents after the scan's rounds).

    .venv/bin/python benchmarks/cache_bookkeeping.py
    .venv/bin/python benchmarks/cache_bookkeeping.py --slots 1536 --rounds 60 --scan-rounds 10
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

LAYERS, TOP_K = 48, 8
COLUMNS = ("per_miss", "insert", "per_victim", "upkeep", "all")


class Timed:
    """Mixin: the seconds spent choosing victims and inserting entries (the transfer submit: the data path,
    not the policy), and how many of each."""

    victim_seconds = insert_seconds = 0.0
    victim_calls = insert_calls = 0

    def _victim(self, prefetch, speculative):
        start = time.thread_time()
        try:
            return super()._victim(prefetch, speculative)
        finally:
            self.victim_seconds += time.thread_time() - start
            self.victim_calls += 1

    def _insert(self, key, slot, demand):
        start = time.thread_time()
        try:
            return super()._insert(key, slot, demand)
        finally:
            self.insert_seconds += time.thread_time() - start
            self.insert_calls += 1


def make_cache(cls, policy: str, slots: int, experts: int):
    import torch

    from pd_dflash.engine.reference.offload.link import HostLink
    from pd_dflash.engine.reference.offload.store import HostExpertStore

    store = HostExpertStore({layer: [torch.zeros(experts, 2)] for layer in range(LAYERS)})
    device = torch.device("cpu")
    return cls(store, slots * store.expert_nbytes, device, torch.float32, policy=policy, link=HostLink())


def trace(seed: int, experts: int, rounds: int) -> list[list[list[int]]]:
    """Per round, per layer, the experts the token routes to."""
    rng = random.Random(seed)
    hot = [rng.sample(range(experts), max(TOP_K, experts // 8)) for _ in range(LAYERS)]
    out = []
    for _ in range(rounds):
        rnd = []
        for layer in range(LAYERS):
            chosen: set[int] = set()
            while len(chosen) < TOP_K:
                chosen.add(rng.choice(hot[layer]) if rng.random() < 0.85 else rng.randrange(experts))
            rnd.append(sorted(chosen))
        out.append(rnd)
    return out


def fill(cache, experts: int) -> None:
    rng = random.Random(1)
    while cache.free:
        key = (rng.randrange(LAYERS), rng.randrange(experts))
        if not cache.contains(key):
            cache.release(cache.acquire(key))


def run(cache, rounds: list, check_at: int) -> dict:
    """Drive ``rounds``; the time of every miss's acquire, of the layer starts and round ends, and of the whole
    loop; the misses and the cache's contents after ``check_at`` rounds (to compare victims)."""
    miss_seconds, upkeep_seconds, misses, check = 0.0, 0.0, 0, None
    previous, start = rounds[0], time.thread_time()
    for r, rnd in enumerate(rounds):
        cache.begin_round()
        for layer, needed in enumerate(rnd):
            if layer + 1 < LAYERS:
                for i, e in enumerate(previous[layer + 1]):
                    cache.prefetch((layer + 1, e), speculative=i % 2 == 1)
            t0 = time.thread_time()
            cache.begin_layer(layer, [(layer, e) for e in needed])
            upkeep_seconds += time.thread_time() - t0
            entries = []
            for e in needed:
                miss = not cache.contains((layer, e))
                t0 = time.thread_time()
                entries.append(cache.acquire((layer, e)))
                if miss:
                    miss_seconds += time.thread_time() - t0
                    misses += 1
            for entry in entries:
                cache.release(entry)
        t0 = time.thread_time()
        cache.end_round()
        upkeep_seconds += time.thread_time() - t0
        cache.collect()
        previous = rnd
        if r + 1 == check_at:
            check = (misses, {k: e.slot for k, e in cache.entries.items()})
    total = time.thread_time() - start
    return {
        "misses": misses,
        "per_miss": 1e6 * miss_seconds / max(1, misses),
        "per_victim": 1e6 * getattr(cache, "victim_seconds", 0.0) / max(1, getattr(cache, "victim_calls", 0)),
        "insert": 1e6 * getattr(cache, "insert_seconds", 0.0) / max(1, getattr(cache, "insert_calls", 0)),
        "upkeep": 1e6 * upkeep_seconds / max(1, misses),
        "all": 1e6 * total / max(1, misses),
        "check": check,
    }


class CountingHeap:
    """``heapq`` for ``offload/eviction`` during the timed run: counts the index's heap operations."""

    def __init__(self, heapq) -> None:
        self.heapq, self.ops = heapq, 0

    def __getattr__(self, name):
        fn = getattr(self.heapq, name)

        def counted(*args):
            self.ops += 1
            return fn(*args)

        return counted


def measure(cls, policy: str, slots: int, experts: int, rounds: list, check_at: int, repeats: int) -> dict:
    """The best of ``repeats`` fresh runs, figure by figure (the VM is shared: the least disturbed run); the
    victim and insert figures and the heap operations from one more run with their counters (kept out of the
    others' figures)."""
    from pd_dflash.engine.reference.offload import eviction

    runs, heapq = [], eviction.heapq
    for timed in [False] * repeats + [True]:
        cache = make_cache(
            type(f"Timed{cls.__name__}", (Timed, cls), {}) if timed else cls, policy, slots, experts
        )
        fill(cache, experts)
        eviction.heapq = CountingHeap(heapq) if timed else heapq
        try:
            runs.append(run(cache, rounds, check_at))
            runs[-1]["heap_ops"] = eviction.heapq.ops / max(1, runs[-1]["misses"]) if timed else None
        finally:
            eviction.heapq = heapq
            cache.close()
    assert all(r["check"] == runs[0]["check"] for r in runs)  # deterministic: the same victims every time
    best = {c: min(r[c] for r in runs[:-1]) for c in ("per_miss", "upkeep", "all")}
    return {**runs[-1], **best}


def main() -> int:
    from pd_dflash.engine.reference.offload.cache import ExpertCache
    from tests.engine.reference.eviction_scan import ScanCache

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--slots", type=int, nargs="+", default=[1536, 6144])
    p.add_argument("--policies", nargs="+", default=["plan", "lru", "lfu"])
    p.add_argument("--rounds", type=int, default=40, help="timed rounds of the index")
    p.add_argument(
        "--scan-rounds", type=int, default=4, help="timed rounds of the scan (the first of the same)"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3, help="runs per figure; the best is printed")
    args = p.parse_args()
    if not 1 <= args.scan_rounds <= args.rounds:
        p.error("--scan-rounds must be between 1 and --rounds")
    for slots in args.slots:
        experts = 4 * slots // LAYERS  # a 25 % cache
        rounds = trace(args.seed, experts, args.rounds)
        clock = time.thread_time()
        for _ in range(10_000):
            time.thread_time()
        clock = (time.thread_time() - clock) / 10_000 * 1e6
        print(
            f"{slots} slots: {LAYERS} layers × {experts} experts, 25 % cache, top-{TOP_K}, AR rounds; load average "
            f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs; a clock read costs {clock:.2f} µs. CPU µs: per miss "
            "(its acquire), of which the insert (transfer submit, entry: the data path), per victim, layer starts + "
            "round ends per miss, every call per miss; scan ÷ index per miss; misses timed (index, scan); same victims; "
            "the index's heap operations (push, pop, replace, heapify) per miss, every call included"
        )
        for policy in args.policies:
            index = measure(ExpertCache, policy, slots, experts, rounds, args.scan_rounds, args.repeats)
            scan = measure(
                ScanCache, policy, slots, experts, rounds[: args.scan_rounds], args.scan_rounds, args.repeats
            )
            agree = index["check"] == scan["check"]
            print(
                f"  {policy:4s}  index "
                + " ".join(f"{index[c]:7.1f}" for c in COLUMNS)
                + "  | scan "
                + " ".join(f"{scan[c]:8.1f}" for c in COLUMNS)
                + f"  | {scan['per_miss'] / index['per_miss']:6.1f} ×  | {index['misses']:5d} {scan['misses']:5d}"
                + f"  | {'yes' if agree else 'NO'}  | {index['heap_ops']:.1f}"
            )
            if not agree:
                return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
