"""The host store, the device cache and the link, on hand-built experts (no model needed)."""

from __future__ import annotations

import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from pd_dflash.engine.reference.offload.cache import ExpertCache
from pd_dflash.engine.reference.offload.link import HostLink
from tests.engine.reference.helpers import store

CPU = torch.device("cpu")


@pytest.mark.parametrize(
    ("storage", "bias", "nbytes"),
    [
        ("fp32", False, (18 + 15) * 4),
        ("bf16", False, (18 + 15) * 2),
        ("fp16", False, (18 + 15) * 2),
        ("fp8", False, 18 + 15 + 2 * 4),  # one byte per weight + one fp32 scale per matrix
        ("fp32", True, (18 + 15 + 6) * 4),
        ("fp8", True, 18 + 15 + 2 * 4 + 6 * 2),  # biases stay bf16 under fp8
    ],
)
def test_stored_bytes_are_exact(storage, bias, nbytes):
    s = store(storage, bias=bias)
    assert s.expert_nbytes == nbytes
    assert sum(t.numel() * t.element_size() for t in s.payload(1, 3)) == nbytes
    assert s.total_bytes == nbytes * 2 * 4
    assert s.nbytes_map(0) == dict.fromkeys(range(4), nbytes)


@pytest.mark.parametrize(("storage", "tol"), [("bf16", 1e-2), ("fp16", 1e-3), ("fp8", 7e-2)])
def test_dequantized_weights_are_close(storage, tol):
    ref, s = store("fp32"), store(storage)
    cache = ExpertCache(s, s.total_bytes, CPU, torch.float32)
    entry = cache.acquire((1, 2))
    got = cache.weights(entry)
    want = ref.payload(1, 2)
    for g, w in zip(got, want, strict=False):
        assert g.dtype == torch.float32
        assert (g - w).abs().max() <= tol * w.abs().max()


def run_sequence(cache, keys):
    for k in keys:
        entry = cache.acquire(k)
        cache.weights(entry)
        cache.release(entry)
    cache.drain()


def test_demand_accounting_on_a_hand_computed_sequence():
    s = store()
    cache = ExpertCache(s, 2 * s.expert_nbytes, CPU, torch.float32, link=HostLink())
    run_sequence(cache, [(0, 0), (0, 1), (0, 0), (0, 2), (0, 1)])  # LRU: miss miss hit miss(evicts 1) miss
    c = cache.counters
    assert (c.accesses, c.hits, c.misses, c.evictions) == (5, 1, 4, 2)
    assert c.demand_bytes == c.h2d_bytes == 4 * s.expert_nbytes
    assert c.h2d_transfers == 4 and c.prefetch_bytes == 0
    assert c.peak_occupancy_bytes == 2 * s.expert_nbytes
    cache.close()


@pytest.mark.parametrize(("policy", "evicted"), [("lru", (0, 0)), ("lfu", (0, 1))])
def test_eviction_policy(policy, evicted):
    s = store()
    cache = ExpertCache(s, 2 * s.expert_nbytes, CPU, torch.float32, policy=policy, link=HostLink())
    run_sequence(cache, [(0, 0), (0, 0), (0, 1), (0, 2)])  # expert 0: older but used twice
    assert not cache.contains(evicted)
    assert len(cache.entries) == 2
    cache.close()


def test_pinned_experts_are_never_evicted():
    s = store()
    cache = ExpertCache(s, 2 * s.expert_nbytes, CPU, torch.float32, link=HostLink())
    a, b = cache.acquire((0, 0)), cache.acquire((0, 1))
    assert cache.acquire((0, 2)) is None  # every slot is pinned by this step
    assert cache.prefetch((0, 3)) is False and cache.counters.prefetch_dropped == 1
    cache.release(b)
    cache.weights(a)
    assert cache.acquire((0, 2)) is not None
    assert cache.contains((0, 0)) and not cache.contains((0, 1))
    cache.close()


def test_resident_cache_moves_nothing():
    s = store()
    cache = ExpertCache(s, s.total_bytes, CPU, torch.float32)
    run_sequence(cache, [(layer, e) for layer in range(2) for e in range(4)])
    c = cache.counters
    assert c.hits == c.accesses == 8 and c.h2d_bytes == 0 and c.h2d_transfers == 0
    assert c.peak_occupancy_bytes == s.total_bytes


@settings(max_examples=40, deadline=None)
@given(
    slots=st.integers(1, 5),
    policy=st.sampled_from(["lru", "lfu"]),
    ops=st.lists(
        st.tuples(st.sampled_from(["use", "prefetch"]), st.integers(0, 1), st.integers(0, 3)), max_size=40
    ),
)
def test_capacity_is_never_exceeded_and_slots_hold_the_right_expert(slots, policy, ops):
    s = store()
    capacity = (
        slots * s.expert_nbytes + s.expert_nbytes // 2
    )  # a capacity that is not a whole number of slots
    cache = ExpertCache(s, capacity, CPU, torch.float32, policy=policy, link=HostLink())
    try:
        for op, layer, e in ops:
            if op == "prefetch":
                cache.prefetch((layer, e))
            else:
                entry = cache.acquire((layer, e))
                got = cache.weights(entry)
                for g, w in zip(got, s.payload(layer, e), strict=True):
                    assert torch.equal(g, w)
                cache.release(entry)
            assert cache.occupancy_bytes <= capacity
            assert len({entry.slot for entry in cache.entries.values()}) == len(cache.entries) <= slots
        cache.drain()
        c = cache.counters
        assert c.h2d_bytes == (c.demand_transfers + c.prefetch_transfers) * s.expert_nbytes
        assert c.peak_occupancy_bytes <= capacity
    finally:
        cache.close()


def test_emulated_link_paces_transfers_and_prefetch_hides_them():
    s = store()
    nbytes = s.expert_nbytes
    gbps = nbytes / 0.02 / 1e9  # 20 ms per expert
    cache = ExpertCache(s, s.total_bytes // 2, CPU, torch.float32, link=HostLink(gbps))
    on_demand = cache.acquire((0, 0))
    cache.weights(on_demand)
    exposed_demand = cache.counters.exposed_seconds
    assert exposed_demand >= 0.018  # the wait is really exposed (sleep never returns early)
    cache.prefetch((0, 1))
    time.sleep(0.1)  # "compute" while the prefetch is on the link
    before = cache.counters.exposed_seconds
    cache.weights(cache.acquire((0, 1)))
    assert cache.counters.exposed_seconds - before < exposed_demand
    cache.drain()
    assert cache.counters.h2d_seconds == pytest.approx(2 * 0.02)  # the link time is the emulated time
    assert cache.counters.hits == 1 and cache.counters.misses == 1
    cache.close()


def test_link_serves_on_demand_before_queued_prefetches():
    link = HostLink(gbps=1000 / 0.02 / 1e9)  # 1000 B take 20 ms
    src, dst = [torch.zeros(250)], [torch.empty(250)]
    prefetches = [link.submit(dst, src, 1000, demand=False) for _ in range(4)]
    demand = link.submit(dst, src, 1000, demand=True)
    link.wait(demand)
    for t in prefetches:
        link.wait(t)
    assert demand.start < prefetches[-1].start
    link.close()
