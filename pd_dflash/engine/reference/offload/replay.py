"""Offline replay of a verify access trace under an eviction policy: misses of LRU, LFU, the round plan and
Belady's optimum on the same accesses (``benchmarks/cache_policy.py`` records the trace from a real engine run).

A trace is a list of rounds; a round is a list of MoE layers in verify order, each ``(layer, experts needed in
acquisition order, experts predicted)``. The replay is demand-only (no prefetch, no link timing): it counts the
accesses that find their expert absent, with a cache of ``slots`` experts, where the experts a layer has already
acquired stay pinned until the layer ends (as in the engine). ``plan`` is the engine's own ``RoundPlan``; with
``use_prediction`` the round's predicted keys are reserved at round start (what route-ahead gives the cache),
without it the plan knows only the last round's set (B0/B1/B2's history-only plan).

``clairvoyant_in_time`` replays the same trace on its recorded compute timeline with a link: the
prefetched-in-time coverage a policy that knows the future reaches with the cell's slots and link rate.

Pure Python (no torch).
"""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Sequence

from pd_dflash.engine.reference.offload.eviction import Evictor, RoundPlan

Key = tuple[int, int]
Layer = tuple[int, Sequence[int], Sequence[int]]
Trace = Sequence[Sequence[Layer]]
POLICIES = ("lru", "lfu", "plan", "plan+prediction", "belady")


def accesses(trace: Trace) -> list[tuple[int, int, Key]]:
    """The flat access sequence: (round, layer index in the round, key)."""
    return [
        (r, i, (layer, e))
        for r, rnd in enumerate(trace)
        for i, (layer, needed, _) in enumerate(rnd)
        for e in needed
    ]


def replay(trace: Trace, slots: int, policy: str) -> int:
    """Misses of ``policy`` on ``trace`` with a cache of ``slots`` experts (starting empty). LRU, LFU and the plan
    evict through the engine's own ``Evictor`` (a key's stamp: its use count and its last access, which is also
    its LRU position); Belady scans for the key needed latest."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if slots < 1:
        raise ValueError(f"a cache needs at least one slot, got {slots}")
    flat = accesses(trace)
    layer_ids = sorted({layer for rnd in trace for layer, _, _ in rnd})
    plan = RoundPlan(layer_ids)
    evictor = None if policy == "belady" else Evictor("plan" if policy.startswith("plan") else policy, plan)
    next_use = _next_uses(flat) if policy == "belady" else None
    resident: dict[Key, list[int]] = {}  # key -> [last use, use count]
    misses, pinned, where = 0, set(), None
    for t, (r, i, key) in enumerate(flat):
        if where != (r, i):
            if evictor is not None:  # the last layer's keys are candidates again
                for k in pinned & resident.keys():
                    evictor.add(k, _stamp(resident[k]))
            if policy.startswith("plan"):
                _advance_plan(plan, trace, r, i, where, use_prediction=policy == "plan+prediction")
            where, pinned = (r, i), set()
            if policy.startswith("plan"):
                plan.layer_started(key[0], [(key[0], e) for e in trace[r][i][1]])
        if key not in resident:
            misses += 1
            if len(resident) >= slots:
                victim = _victim(evictor, resident, pinned, next_use)
                del resident[victim]
                if evictor is not None:
                    evictor.discard(victim)
            resident[key] = [t, 0]
        elif evictor is not None:
            evictor.hold(key)
        resident[key][0] = t
        resident[key][1] += 1
        pinned.add(key)
        if policy.startswith("plan"):
            plan.record_use(key)
    return misses


def _stamp(state: list[int]) -> tuple[int, int, int]:
    last, uses = state
    return (uses, last, last)


def _advance_plan(plan: RoundPlan, trace: Trace, r: int, i: int, where, *, use_prediction: bool) -> None:
    """Round boundaries: the previous round's keys become history; the new round's prediction is reserved."""
    if where is not None and where[0] == r:
        return
    if where is not None:
        plan.end_round()
    if use_prediction:
        plan.predict((layer, e) for layer, _, predicted in trace[r] for e in predicted)


def _victim(evictor: Evictor | None, resident: dict[Key, list[int]], pinned: set[Key], next_use) -> Key:
    """The unpinned key the policy evicts; when every resident key is pinned (a layer needing more than the
    cache holds), the one it evicts among them."""
    if evictor is None:
        candidates = [k for k in resident if k not in pinned] or list(resident)
        return max(candidates, key=lambda k: next_use[resident[k][0]])  # next use after its last access
    victim = evictor.victim()
    if victim is None:
        victim = min(resident, key=lambda k: evictor.rank(k, _stamp(resident[k])))
    return victim


def _next_uses(flat: list[tuple[int, int, Key]]) -> list[float]:
    """For every access t, when the same key is accessed next (inf: never)."""
    following: dict[Key, int] = {}
    out = [float("inf")] * len(flat)
    for t in range(len(flat) - 1, -1, -1):
        key = flat[t][2]
        out[t] = following.get(key, float("inf"))
        following[key] = t
    return out


def clairvoyant_in_time(
    trace: Trace,
    timeline: Sequence[Sequence[tuple[float, float, float]]],
    slots: int,
    transfer_seconds: float,
) -> dict:
    """Prefetched-in-time coverage of a clairvoyant policy on a recorded trace and its compute timeline.

    It knows every future access. One link moves one expert per ``transfer_seconds`` and never idles while a
    load would help: it loads the absent key needed soonest, into a free slot or over the resident key needed
    latest (Belady), as long as that key is needed later than the loaded one. Compute runs as recorded (the
    time between MoE layers, and each layer's time minus what it waited for a transfer): a layer starts when
    every expert it needs has landed (it waits for the late ones); its experts stay pinned while it computes.
    An access is in time when its expert has landed when its layer starts, and it counts (as in the engine's
    metric) only if the engine's predictor named it. Returns ``in_time`` (predicted and in time), ``landed``
    (in time, predicted or not), ``actual`` accesses, ``loads`` and ``stall_seconds``."""
    instants = _instants(trace, timeline)
    uses: dict[Key, list[int]] = {}
    for p, (_, _, keys, _) in enumerate(instants):
        for k in keys:
            uses.setdefault(k, []).append(p)
    sim = _Clairvoyant(instants, uses, slots, transfer_seconds)
    return sim.run()


def _instants(trace: Trace, timeline) -> list[tuple[float, float, list[Key], set[Key]]]:
    """Per MoE layer of every round, in order: (compute before it, its own compute, keys, predicted keys)."""
    if len(trace) != len(timeline) or any(len(a) != len(b) for a, b in zip(trace, timeline, strict=True)):
        raise ValueError(
            "the timeline must have one (start, end, waited) per layer of every round of the trace"
        )
    out, prev_end = [], None
    for rnd, times in zip(trace, timeline, strict=True):
        for (layer, needed, predicted), (start, end, waited) in zip(rnd, times, strict=True):
            gap = 0.0 if prev_end is None else max(0.0, start - prev_end)
            keys = [(layer, e) for e in needed]
            out.append((gap, max(0.0, end - start - waited), keys, {(layer, e) for e in predicted}))
            prev_end = end
    return out


class _Clairvoyant:
    def __init__(self, instants, uses, slots: int, transfer_seconds: float) -> None:
        if slots < 1 or not transfer_seconds > 0:
            raise ValueError("slots must be >= 1 and transfer_seconds > 0")
        self.instants, self.uses, self.slots, self.tau = instants, uses, slots, transfer_seconds
        self.ready: dict[Key, float] = {}  # resident key -> when its transfer lands
        self.link_free = 0.0
        self.loads = 0

    def next_use(self, key: Key, p: int) -> float:
        """The first instant ≥ p that needs ``key`` (inf: never)."""
        times = self.uses.get(key, ())
        i = bisect_left(times, p)
        return times[i] if i < len(times) else float("inf")

    def load(self, key: Key, at: float, pinned: set[Key], p: int) -> float:
        """Start loading ``key`` once the link is free (evicting the resident key needed latest); its landing."""
        if len(self.ready) >= self.slots:
            victim = max((k for k in self.ready if k not in pinned), key=lambda k: self.next_use(k, p))
            del self.ready[victim]
        self.link_free = max(self.link_free, at) + self.tau
        self.ready[key] = self.link_free
        self.loads += 1
        return self.link_free

    def prefetch(self, start: float, until: float, p: int, pinned: set[Key]) -> None:
        """Keep the link busy in [start, until) with loads that beat their victim (Belady)."""
        while max(self.link_free, start) < until:
            want = next(
                (k for q in range(p, len(self.instants)) for k in self.instants[q][2] if k not in self.ready),
                None,
            )
            if want is None:
                return
            if len(self.ready) >= self.slots:
                free = [k for k in self.ready if k not in pinned]
                if not free or max(self.next_use(k, p) for k in free) <= self.next_use(want, p):
                    return
            self.load(want, start, pinned, p)

    def run(self) -> dict:
        t, in_time, landed, actual, stall = 0.0, 0, 0, 0, 0.0
        for p, (gap, compute, keys, predicted) in enumerate(self.instants):
            self.prefetch(t, t + gap, p, set())
            t += gap
            pinned, start = set(keys), t
            for k in keys:
                if k in self.ready and self.ready[k] <= t:
                    landed += 1
                    in_time += k in predicted
                else:
                    start = max(start, self.ready[k] if k in self.ready else self.load(k, t, pinned, p))
            actual += len(keys)
            self.prefetch(t, start + compute, p + 1, pinned)
            stall += start - t
            t = start + compute
        return {
            "in_time": in_time,
            "landed": landed,
            "actual": actual,
            "loads": self.loads,
            "stall_seconds": stall,
        }
