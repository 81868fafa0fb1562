"""The CUDA link on large experts (64 MiB), where ordering and timing mistakes show. Skipped without CUDA.

- slot hazard: a copy into a reused slot must wait for the compute still reading it (compute delayed on the GPU
  with ``torch.cuda._sleep``); a control with those waits patched out must see the slot overwritten, so the
  hazard test can fail;
- demand copies reach ≥ 0.7 × the probe's bandwidth; a prefetch backlog slows a demand copy by a bounded
  factor (it shares the link with the ≤ window prefetches on the stream, never the backlog);
- the host time of one 256 MiB submit is < 10 % of its transfer (non-blocking from pinned memory);
- exposed fetch ≈ the transfer's time without prefetch, ≈ 0 with a prefetch behind long compute.
"""

from __future__ import annotations

import time

import pytest
import torch

from pd_dflash.engine.probe import measure_h2d_bytes_per_second
from pd_dflash.engine.reference.offload.cache import ExpertCache
from pd_dflash.engine.reference.offload.cuda_link import CudaLink
from pd_dflash.engine.reference.offload.store import HostArena, HostExpertStore
from pd_dflash.intervals import union_seconds
from tests.engine.reference.helpers import record_figure

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

DEVICE = torch.device("cuda:0")
MIB = 2**20
EXPERT_MIB = 64
#: GPU clock cycles of "compute" that reads a slot late: ≈ 0.1 s at 2 GHz, ≫ a 64 MiB copy (≈ 1-5 ms).
SLEEP_CYCLES = 200_000_000
READ = 4096  # elements of a slot the late compute reads


def big_store(experts: int = 4, mib: int = EXPERT_MIB) -> HostExpertStore:
    """One MoE layer of ``experts`` experts of ``mib`` MiB each, expert e filled with e + 1, pinned (the arena)."""
    weights = torch.empty(experts, mib * MIB // 4)
    for e in range(experts):
        weights[e].fill_(e + 1)
    return HostExpertStore({0: [weights]}, storage="fp32", pin=True)


def cache_of(store: HostExpertStore, slots: int) -> ExpertCache:
    return ExpertCache(store, slots * store.expert_nbytes, DEVICE, torch.float32, link=CudaLink(DEVICE))


def read_late(cache: ExpertCache, key) -> tuple[torch.Tensor, object]:
    """Compute reads ``key``'s slot only after a long GPU sleep; returns what it read and the entry."""
    entry = cache.acquire(key)
    weights = cache.weights(entry)
    torch.cuda._sleep(SLEEP_CYCLES)
    seen = weights[0][:READ].clone()
    cache.release(entry)
    return seen, entry


def demand_hazard() -> tuple[torch.Tensor, torch.Tensor]:
    """One slot: the demand copy of expert 1 evicts expert 0 while compute still has to read it."""
    cache = cache_of(big_store(), slots=1)
    seen_0, _ = read_late(cache, (0, 0))
    entry = cache.acquire((0, 1))
    seen_1 = cache.weights(entry)[0][:READ].clone()
    cache.release(entry)
    torch.cuda.synchronize()
    cache.close()
    return seen_0, seen_1


def prefetch_hazard() -> tuple[torch.Tensor, torch.Tensor]:
    """Two slots: a prefetch into the slot of expert 0 (evicted) while compute still has to read it."""
    cache = cache_of(big_store(), slots=2)
    seen_0, entry = read_late(cache, (0, 0))
    cache.link.host_wait(entry.transfer)  # landed: expert 0 is evictable (compute has not read it yet)
    assert cache.prefetch((0, 1)) and cache.prefetch((0, 2))  # the free slot, then expert 0's
    assert not cache.contains((0, 0))
    entry = cache.acquire((0, 2))
    seen_2 = cache.weights(entry)[0][:READ].clone()
    cache.release(entry)
    torch.cuda.synchronize()
    cache.close()
    return seen_0, seen_2


@pytest.mark.parametrize(("hazard", "later"), [(demand_hazard, 2.0), (prefetch_hazard, 3.0)])
def test_a_reused_slot_is_written_only_after_compute_has_read_it(hazard, later):
    seen, seen_later = hazard()
    assert torch.all(seen == 1.0), f"the late read saw {seen.unique().tolist()}: the slot was overwritten"
    assert torch.all(seen_later == later)


@pytest.mark.parametrize("hazard", [demand_hazard, prefetch_hazard])
def test_control_without_the_slot_waits_the_hazard_test_fails(monkeypatch, hazard):
    """The slot hazard is real: with the copy's wait for the slot's last compute patched out, the late read
    sees the next expert's bytes. If this control passes without corruption, the hazard test has no teeth."""
    monkeypatch.setattr(CudaLink, "_wait_slot_free", lambda self, stream, slot: None)
    seen, _ = hazard()
    assert not torch.all(seen == 1.0), "no corruption without the slot waits: the hazard test cannot fail"


def payloads(store: HostExpertStore) -> tuple[list, list]:
    src = [store.payload(0, e) for e in range(store.num_experts)]
    dst = [[torch.empty_like(t, device=DEVICE) for t in p] for p in src]
    return src, dst


def timed_demand(link: CudaLink, dst, src, nbytes: int) -> float:
    start = time.perf_counter()
    link.host_wait(link.submit(dst, src, nbytes, demand=True))
    return time.perf_counter() - start


def test_demand_copies_reach_the_probe_and_a_backlog_slows_them_boundedly():
    probe = measure_h2d_bytes_per_second(DEVICE)
    store = big_store(experts=8)
    src, dst = payloads(store)
    n = store.expert_nbytes
    link = CudaLink(DEVICE)
    link.host_wait(link.submit(dst[0], src[0], n, demand=True))  # warm-up
    demands = [link.submit(dst[e], src[e], n, demand=True) for e in range(8)]
    for t in demands:
        link.host_wait(t)
    rate = 8 * n / union_seconds(link.span(t) for t in demands)
    alone = min(timed_demand(link, dst[0], src[0], n) for _ in range(3))
    backlog = [link.submit(dst[1 + i % 7], src[1 + i % 7], n, demand=False) for i in range(16)]
    loaded = timed_demand(link, dst[0], src[0], n)
    for t in backlog:
        link.host_wait(t)
    backlog_seconds = union_seconds(link.span(t) for t in backlog)
    record_figure(
        "demand_throughput_and_backlog",
        probe_gbps=probe / 1e9,
        demand_gbps=rate / 1e9,
        demand_over_probe=rate / probe,
        demand_alone_ms=alone * 1e3,
        demand_under_backlog_ms=loaded * 1e3,
        slowdown=loaded / alone,
        backlog_ms=backlog_seconds * 1e3,
    )
    assert rate >= 0.7 * probe, f"demand copies at {rate / 1e9:.1f} GB/s, probe {probe / 1e9:.1f} GB/s"
    assert loaded <= (link.window + 1.5) * alone, (
        f"{loaded * 1e3:.2f} ms under a backlog vs {alone * 1e3:.2f}"
    )
    assert loaded < 0.5 * backlog_seconds
    link.close()


def test_one_256_mib_submit_takes_under_a_tenth_of_its_transfer_on_the_host():
    nbytes = 256 * MIB
    arena = HostArena(nbytes)
    src = arena.take((nbytes // 4,), torch.float32)
    src.fill_(1.0)
    arena.pin()
    dst = torch.empty_like(src, device=DEVICE)
    link = CudaLink(DEVICE)
    link.host_wait(link.submit([dst], [src], nbytes, demand=True))  # warm-up
    start = time.perf_counter()
    t = link.submit([dst], [src], nbytes, demand=True)
    host = time.perf_counter() - start
    link.host_wait(t)
    record_figure("submit_host_time", host_ms=host * 1e3, transfer_ms=link.seconds(t) * 1e3)
    assert host < 0.1 * link.seconds(t), (
        f"submit took {host * 1e3:.3f} ms of a {link.seconds(t) * 1e3:.3f} ms copy"
    )
    link.close()


def test_exposed_fetch_is_the_transfer_without_prefetch_and_zero_behind_long_compute():
    cache = cache_of(big_store(experts=2), slots=1)
    entry = cache.acquire((0, 0))  # on demand: compute waits for the whole copy
    cache.weights(entry)[0].sum()
    cache.release(entry)
    cache.link.synchronize()
    cache.collect()
    start, end, _, demand = cache.transfer_log[-1]
    transfer, exposed = end - start, cache.counters.exposed_seconds
    assert demand
    assert cache.prefetch((0, 1))  # evicts expert 0 once its compute is done
    torch.cuda._sleep(SLEEP_CYCLES)  # compute long enough to hide the prefetch
    entry = cache.acquire((0, 1))
    cache.weights(entry)[0].sum()
    cache.release(entry)
    cache.link.synchronize()
    cache.collect()
    hidden = cache.counters.exposed_seconds - exposed
    record_figure(
        "exposed", transfer_ms=transfer * 1e3, exposed_ms=exposed * 1e3, behind_compute_ms=hidden * 1e3
    )
    assert 0.8 * transfer <= exposed <= 1.05 * transfer + 1e-4
    assert hidden < 0.05 * transfer
    cache.close()
