"""The batched issue (``offload/batching.py``): a layer's prefetches as one link batch change nothing the cache
decides, only how many calls reach the link; MXFP4 landings of a batch dequantise in one grouped call."""

from __future__ import annotations

import pytest
import torch

from pd_dflash.engine.reference.checkpoints.loader import load_checkpoint
from pd_dflash.engine.reference.checkpoints.tiny import materialise
from pd_dflash.engine.reference.offload.cache import ExpertCache
from pd_dflash.engine.reference.offload.link import BACKGROUND, HostLink
from tests.engine.reference.helpers import SimClock, store

CPU = torch.device("cpu")


def cache_of(s, slots, gbps=None):
    clock = SimClock()
    link = HostLink(gbps, window=2, clock=clock, sleep=clock.sleep)
    return ExpertCache(s, slots * s.expert_nbytes, CPU, torch.float32, policy="plan", link=link), link


def state(cache):
    entries = {k: (e.slot, e.seq, e.prefetched) for k, e in cache.entries.items()}
    counters = {k: v for k, v in vars(cache.counters).items() if "seconds" not in k}
    return entries, counters, sorted(cache.plan.predicted), sorted(cache.evictor._live)


@pytest.mark.parametrize("storage", ["fp32", "fp8"])
def test_prefetch_many_decides_what_prefetch_decides_key_by_key(storage):
    s = store(storage, layers=3, experts=6)
    keys = [(layer, e) for layer in range(3) for e in (5, 2, 1, 3, 0)]  # (0, 2) is cached: a touch
    one, _ = cache_of(s, slots=7)
    many, link = cache_of(s, slots=7)
    for c in (one, many):
        c.prefetch((0, 2))
        c.begin_round()
        c.begin_layer(0, [(0, 2)])
    handled = 0
    while handled < len(keys) and one.prefetch(keys[handled]):  # key by key, up to the first without a slot
        handled += 1
    assert 1 < handled < len(keys)  # the cache fills up on the way: victims are chosen too
    assert many.prefetch_many(keys) == (handled, handled - 1)
    assert state(many) == state(one)
    for key in many.entries:  # the weights landed as they would one by one
        assert all(
            torch.equal(a, b)
            for a, b in zip(many.weights(many.entries[key]), one.weights(one.entries[key]), strict=True)
        )
    assert link.pending() == {"queued": 0, "prefetch_stream": 0, "demand": 0}


def test_one_link_item_per_layer_in_the_band_asked_for():
    s = store("fp32", layers=2, experts=4)
    cache, link = cache_of(s, slots=8, gbps=1000 / 1e9)
    keys = [(0, 0), (0, 1), (1, 2), (1, 3)]
    assert cache.prefetch_many(keys, band=BACKGROUND) == (4, 4)
    transfers = [cache.entries[k].transfer for k in keys]
    assert transfers[0].batch is transfers[1].batch is not transfers[2].batch is transfers[3].batch
    assert {t.band for t in transfers} == {BACKGROUND}
    assert link.pending()["prefetch_stream"] + link.pending()["queued"] == 2


def test_a_demand_fetch_inside_a_batched_issue_first_sends_what_is_collected():
    s = store("fp32", layers=2, experts=4)
    cache, _ = cache_of(s, slots=8, gbps=1000 / 1e9)
    with cache.batched():
        cache.prefetch((0, 0))
        assert cache.entries[(0, 0)].transfer.batch is None  # collected, not on the link yet
        entry = cache.acquire((1, 1))
    assert cache.entries[(0, 0)].transfer.batch is not None
    cache.ready(entry)
    cache.release(entry)


def test_a_batch_of_mxfp4_landings_dequantises_once_into_the_slots_one_by_one_would_fill():
    loaded = load_checkpoint("tiny-real-gpt-oss", str(materialise("tiny-real-gpt-oss")), device=CPU)
    st = loaded.store
    layer, n = st.layer_ids[0], st.num_experts
    one = ExpertCache(st, n * st.expert_nbytes, CPU, torch.bfloat16, link=HostLink(None))
    many = ExpertCache(st, n * st.expert_nbytes, CPU, torch.bfloat16, link=HostLink(None))
    calls = []
    real = st.dequantize_parts
    st.dequantize_parts = lambda parts, dtype, **kw: calls.append(len(parts[0])) or real(parts, dtype, **kw)
    try:
        keys = [(layer, e) for e in range(n)]
        for k in keys:
            one.prefetch(k)
        calls.clear()
        many.prefetch_many(keys)
    finally:
        del st.dequantize_parts
    assert calls == [n]  # one grouped call for the layer's landings
    assert many.counters.dequantized_landings == n
    for k in keys:
        got, want = many.weights(many.entries[k]), one.weights(one.entries[k])
        assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
