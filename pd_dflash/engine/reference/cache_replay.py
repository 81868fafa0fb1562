"""Offline replay of a verify access trace under an eviction policy: misses of LRU, LFU, the round plan and
Belady's optimum on the same accesses (``benchmarks/cache_policy.py`` records the trace from a real engine run).

A trace is a list of rounds; a round is a list of MoE layers in verify order, each ``(layer, experts needed in
acquisition order, experts predicted)``. The replay is demand-only (no prefetch, no link timing): it counts the
accesses that find their expert absent, with a cache of ``slots`` experts, where the experts a layer has already
acquired stay pinned until the layer ends (as in the engine). ``plan`` is the engine's own ``RoundPlan``; with
``use_prediction`` the round's predicted keys are reserved at round start (what route-ahead gives the cache),
without it the plan knows only the last round's set (B0/B1/B2's history-only plan).

Pure Python (no torch).
"""

from __future__ import annotations

from collections.abc import Sequence

from pd_dflash.engine.reference.cache_plan import RoundPlan

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
    """Misses of ``policy`` on ``trace`` with a cache of ``slots`` experts (starting empty)."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if slots < 1:
        raise ValueError(f"a cache needs at least one slot, got {slots}")
    flat = accesses(trace)
    layer_ids = sorted({layer for rnd in trace for layer, _, _ in rnd})
    plan = RoundPlan(layer_ids) if policy.startswith("plan") else None
    next_use = _next_uses(flat) if policy == "belady" else None
    resident: dict[Key, list[int]] = {}  # key -> [last use, use count]
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
                candidates = [k for k in resident if k not in pinned] or [k for k in resident]
                victim = _victim(policy, candidates, resident, plan, next_use)
                del resident[victim]
            resident[key] = [t, 0]
        resident[key][0] = t
        resident[key][1] += 1
        pinned.add(key)
        if plan is not None:
            plan.record_use(key)
    return misses


def _advance_plan(plan: RoundPlan, trace: Trace, r: int, i: int, where, *, use_prediction: bool) -> None:
    """Round boundaries: the previous round's keys become history; the new round's prediction is reserved."""
    if where is not None and where[0] == r:
        return
    if where is not None:
        plan.end_round()
    if use_prediction:
        plan.predict((layer, e) for layer, _, predicted in trace[r] for e in predicted)


def _victim(policy, candidates, resident, plan, next_use) -> Key:
    if policy == "lru":
        return min(candidates, key=lambda k: resident[k][0])
    if policy == "lfu":
        return min(candidates, key=lambda k: (resident[k][1], resident[k][0]))
    if policy == "belady":
        return max(candidates, key=lambda k: next_use[resident[k][0]])  # next use after its last access
    return plan.choose([(k, resident[k][0]) for k in candidates], None)


def _next_uses(flat: list[tuple[int, int, Key]]) -> list[float]:
    """For every access t, when the same key is accessed next (inf: never)."""
    following: dict[Key, int] = {}
    out = [float("inf")] * len(flat)
    for t in range(len(flat) - 1, -1, -1):
        key = flat[t][2]
        out[t] = following.get(key, float("inf"))
        following[key] = t
    return out
