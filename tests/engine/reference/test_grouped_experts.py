"""The experts hot path: the device slot table, grouped compute over the slot pool against the per-expert path,
counted host syncs (a resident forward has none per layer; a read that bypasses ``host_sync`` is caught), and
quantised experts dequantised once, when they land."""

from __future__ import annotations

import random

import pytest
import torch

from pd_dflash.engine.reference import host_sync
from pd_dflash.engine.reference.decoding.target import Block, Request
from pd_dflash.engine.reference.families import family_of
from pd_dflash.engine.reference.offload import grouped
from pd_dflash.engine.reference.offload.cache import ExpertCache
from pd_dflash.engine.reference.offload.grouped import GATHERED_BMM, GROUPED_MM, LayerCompute
from pd_dflash.engine.reference.offload.link import HostLink
from pd_dflash.engine.reference.offload.prefetch import ActivationAwarePrefetcher
from pd_dflash.engine.reference.offload.runtime import OffloadRuntime
from tests.engine.reference.helpers import eager_copy, generate, offloaded, prompts_for, runtime, tiny_model

CPU = torch.device("cpu")


def check_table(cache: ExpertCache) -> None:
    """Every (layer, expert): the table names its slot iff it is cached, and the slot holds its weights."""
    table = cache.slots.table
    for layer in cache.store.layer_ids:
        for e in range(cache.store.num_experts):
            entry = cache.entries.get((layer, e))
            assert int(table[layer, e]) == (-1 if entry is None else entry.slot), (layer, e)
            if entry is not None:
                want = cache.store.dequantize(cache.store.payload(layer, e), cache.compute_dtype)
                for got, w in zip(cache.weights(entry), want, strict=True):
                    assert torch.equal(got, w)


@pytest.mark.parametrize("storage", ["fp32", "fp8"])
def test_the_slot_table_follows_inserts_and_evictions(storage):
    model = tiny_model("gpt_oss")
    _, store = offloaded(model, storage)
    resident = ExpertCache(store, store.total_bytes, CPU, torch.float32)
    check_table(resident)
    cache = ExpertCache(store, 5 * store.expert_nbytes, CPU, torch.float32, policy="lru", link=HostLink())
    rng = random.Random(0)
    keys = [(layer, e) for layer in store.layer_ids for e in range(store.num_experts)]
    for _ in range(60):
        key = rng.choice(keys)
        if rng.random() < 0.3:
            cache.prefetch(key)
        else:
            entry = cache.acquire(key)
            cache.weights(entry)
            cache.release(entry)
        check_table(cache)
    assert cache.counters.evictions > 0
    cache.close()


def per_expert(family, experts, cache, layer, hidden, top_k_index, top_k_weights):
    """The per-expert path (the engine's before the slot pool): each routed expert from its slot, in ascending
    id order, accumulated like the eager module."""
    fn = family.expert_fn(experts)
    out = torch.zeros_like(hidden)
    mask = torch.nn.functional.one_hot(top_k_index, cache.store.num_experts).permute(2, 1, 0)
    for e in sorted(set(top_k_index.flatten().tolist())):
        top_k_pos, token = torch.where(mask[e])
        y = fn(hidden[token], cache.weights(cache.entries[(layer, e)]))
        out.index_add_(0, token, y * top_k_weights[token, top_k_pos, None])
    return out


@pytest.mark.parametrize("family_name", ["qwen3_moe", "gpt_oss", "mixtral"])
@pytest.mark.parametrize("kind", [GROUPED_MM, GATHERED_BMM])
def test_grouped_compute_equals_the_per_expert_path(family_name, kind):
    model = tiny_model(family_name)
    family = family_of(model.config)
    experts = family.experts_module(eager_copy(model).model.layers[1])
    _, store = offloaded(model)
    cache = ExpertCache(store, store.total_bytes, CPU, torch.float32)
    assert cache.slots.expert_compute == GROUPED_MM  # torch._grouped_mm computes fp32 on the CPU
    g = torch.Generator().manual_seed(5)
    tokens, k, n = 41, model.config.num_experts_per_tok, store.num_experts
    hidden = torch.randn(tokens, model.config.hidden_size, generator=g)
    top_k_index = torch.rand(tokens, n, generator=g).argsort(dim=-1)[:, :k]
    top_k_weights = torch.rand(tokens, k, generator=g)
    want = per_expert(family, experts, cache, 1, hidden, top_k_index, top_k_weights)
    args = (hidden, top_k_index, top_k_weights, cache.slots, 1, family.grouped_fn(experts))
    whole = LayerCompute(*args, kind)
    whole.compute()
    assert torch.allclose(whole.finish(), want, rtol=1e-5, atol=1e-7)
    chunked = LayerCompute(*args, kind)  # a cache smaller than the union: two chunks
    chunked.compute([0, 1, 2])
    chunked.compute(list(range(3, n)))
    assert torch.allclose(chunked.finish(), want, rtol=1e-5, atol=1e-7)


def test_the_fallback_gives_the_same_greedy_tokens(micro, monkeypatch):
    model, _ = micro
    prompts = prompts_for(model.config.vocab_size, n=3, length=10, seed=4)
    target, store = offloaded(model)
    want, _ = generate(target, runtime(target, store, fraction=0.3, gbps=None), prompts, 12, 2)
    monkeypatch.setattr(
        "pd_dflash.engine.reference.offload.slot_pool.expert_compute_choice",
        lambda pool: {"path": GATHERED_BMM, "why": "forced by the test"},
    )
    rt = runtime(target, store)
    assert rt.cache.slots.expert_compute == GATHERED_BMM
    got, _ = generate(target, rt, prompts, 12, 2)
    assert got == want


def one_forward(target, rt, prompt):
    request = Request("r", prompt, 4, cache=target.new_cache())
    rt.begin_round([("r", len(prompt))])
    host_sync.COUNTER.reset()
    with host_sync.SyncGuard() as guard:
        target.forward([Block(request, prompt, len(prompt) - 1)])
    counts = dict(host_sync.COUNTER.by_site)
    rt.end_round(kept_rows=len(prompt))
    return counts, guard.unaccounted


@pytest.mark.parametrize("family_name", ["qwen3_moe", "gpt_oss"])
def test_a_resident_forward_syncs_once_and_an_offloaded_one_once_per_moe_layer(family_name):
    model = tiny_model(family_name)
    target, store = offloaded(model)
    prompt = prompts_for(64, n=1, length=10)[0]
    for fraction, routing in ((None, 0), (0.5, len(store.layer_ids))):
        rt = runtime(target, store, fraction=fraction)
        target.sync_hook = rt.synchronize  # as the engine wires it
        counts, unaccounted = one_forward(target, rt, prompt)
        # The forward's end, once; a resident forward's routing comes back inside that wait.
        assert counts == ({"forward_end": 1} | ({"routing": routing} if routing else {}))
        assert unaccounted == []  # nothing read the device behind host_sync's back
        rt.close()


def test_a_read_that_bypasses_host_sync_is_caught(monkeypatch):
    """Adding an ``.item()`` to the hot path (here in the grouped experts) is flagged by the guard."""
    model = tiny_model("qwen3_moe")
    target, store = offloaded(model)
    rt = runtime(target, store)
    target.sync_hook = rt.synchronize
    real = grouped.LayerCompute.finish

    def finish_with_a_read(self):
        out = real(self)
        out.sum().item()
        return out

    monkeypatch.setattr(grouped.LayerCompute, "finish", finish_with_a_read)
    _, unaccounted = one_forward(target, rt, prompts_for(64, n=1, length=6)[0])
    assert unaccounted.count("aten._local_scalar_dense.default") == len(store.layer_ids)


def test_resident_accounting_after_the_forward_equals_per_layer_accounting(micro):
    """A resident forward brings its routing to the host once, after the forward; the cache counters, the
    statistics, the trace and the observe-only prefetcher see exactly what per-layer routing gives (here: an
    offloaded cache that holds every expert, which reads the routing per layer)."""
    model, _ = micro
    prompts = prompts_for(model.config.vocab_size, n=3, length=10, seed=6)
    target, store = offloaded(model)
    results = []
    for link in (None, HostLink()):
        cache = ExpertCache(store, store.total_bytes, CPU, torch.float32, link=link)
        k = model.config.num_experts_per_tok
        rt = OffloadRuntime(
            store, cache, ActivationAwarePrefetcher(store.layer_ids, store.num_experts, k, issue=False)
        )
        rt.attach(target.model)
        target.sync_hook = rt.synchronize
        out, _ = generate(target, rt, prompts, 8, 2)
        c = cache.counters
        results.append(
            (out, rt.stats.as_dict(), rt.per_layer, rt.trace, rt.in_time, rt.needed_per_round, c.accesses)
        )
        assert len(rt.timeline) == len(rt.trace) and all(
            len(t) == len(s) for t, s in zip(rt.timeline, rt.trace, strict=True)
        )
        rt.close()
    assert results[0] == results[1]


def test_quantised_experts_are_dequantised_once_when_they_land(micro, monkeypatch):
    model, _ = micro
    prompts = prompts_for(model.config.vocab_size, n=2, length=8, seed=7)
    target, store = offloaded(model, "fp8")
    calls = []
    real = store.dequantize
    monkeypatch.setattr(store, "dequantize", lambda slot, dtype: calls.append(1) or real(slot, dtype))
    rt = runtime(target, store)  # resident (B3): every expert dequantised at load, none afterwards
    assert rt.cache.counters.dequantized_landings == store.num_entries and not rt.cache.slots.direct
    rt.reset_measurement()
    calls.clear()
    generate(target, rt, prompts, 6)
    assert calls == [] and rt.cache.counters.dequantized_landings == 0
    rt = runtime(target, store, fraction=0.3, gbps=None)  # offloaded: once per transfer, never per access
    calls.clear()
    generate(target, rt, prompts, 6)
    c = rt.cache.counters
    assert len(calls) == c.dequantized_landings == c.h2d_transfers > 0
    assert c.hits > 0  # hits read the slot as it is: no dequantisation per access
    assert rt.cache.slots.device_slot_nbytes == store.expert_nbytes + store.compute_nbytes(torch.float32)
    rt.close()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("storage", ["bf16", "fp8"])
def test_cuda_grouped_experts_and_landing_dequant_match_the_cpu_without_host_syncs(storage):
    """On CUDA (bf16): the grouped path over the slot pool equals the per-expert path, transfers dequantise on
    the copy stream, and a resident MoE layer never synchronises (``set_sync_debug_mode('error')``)."""
    model = tiny_model("qwen3_moe", hidden_size=64).to(torch.bfloat16)
    family = family_of(model.config)
    experts = family.experts_module(eager_copy(model).model.layers[1])
    _, store = offloaded(model, storage)
    device = torch.device("cuda:0")
    from pd_dflash.engine.reference.offload.cuda_link import CudaLink

    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(33, 64, generator=g).to(device, torch.bfloat16)
    top_k_index = torch.rand(33, store.num_experts, generator=g).argsort(dim=-1)[:, :2].to(device)
    top_k_weights = torch.rand(33, 2, generator=g).to(device, torch.bfloat16)
    for link in (None, CudaLink(device)):
        capacity = store.total_bytes if link is None else store.total_bytes // 2
        cache = ExpertCache(store, capacity, device, torch.bfloat16, link=link)
        layer = store.layer_ids[1]
        entries = [cache.acquire((layer, e)) for e in range(store.num_experts)] if link is not None else []
        entries = [e for e in entries if e is not None]
        needed = top_k_index.unique().tolist()
        if link is not None:  # route to what is cached only
            cached = sorted(e.key[1] for e in entries)
            top_k_index = torch.tensor(cached, device=device)[torch.arange(33, device=device) % len(cached)][
                :, None
            ]
            top_k_index = torch.cat([top_k_index, top_k_index.roll(1, 0)], dim=1)
            needed = cached
            for entry in entries:
                cache.ready(entry)
        moe = LayerCompute(hidden, top_k_index, top_k_weights, cache.slots, layer, family.grouped_fn(experts))
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            moe.compute()
            got = moe.finish()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert cache.slots.expert_compute == GROUPED_MM
        for e in needed:  # each slot holds its expert as the CPU dequantises it (the landing step was right)
            stored = store.dequantize(store.payload(layer, e), torch.bfloat16)
            for on_device, on_cpu in zip(cache.weights(cache.entries[(layer, e)]), stored, strict=True):
                assert torch.allclose(on_device.cpu().float(), on_cpu.float(), rtol=1e-2, atol=1e-3)
        want = per_expert(family, experts.to(device), cache, layer, hidden, top_k_index, top_k_weights)
        assert needed and torch.allclose(got.float(), want.float(), rtol=2e-2, atol=2e-2)
        cache.close()


def test_the_counter_reports_syncs_per_round_and_per_token():
    counter = host_sync.HostSyncCounter()
    counter.by_site.update({"routing": 6, "forward_end": 3, "token": 3})
    assert counter.facts(rounds=3, generated_tokens=4) == {
        "total": 12,
        "per_round": 4.0,
        "per_generated_token": 3.0,
        "by_site": {"forward_end": 3, "routing": 6, "token": 3},
    }
    assert counter.facts(0, 0)["per_round"] is None and counter.facts(0, 0)["per_generated_token"] is None
    before = host_sync.COUNTER.total
    assert host_sync.wait("forward_end", lambda: 3) == 3 and host_sync.COUNTER.total == before + 1
    before += 1
    assert host_sync.item("token", torch.tensor(7)) == 7 and host_sync.COUNTER.total == before + 1


def test_a_layer_whose_slots_are_all_pinned_says_so():
    model = tiny_model("qwen3_moe")
    _, store = offloaded(model)
    cache = ExpertCache(store, 2 * store.expert_nbytes, CPU, torch.float32, policy="lru", link=HostLink())
    rt = OffloadRuntime(store, cache)
    layer = store.layer_ids[0]
    for e in (0, 1):  # another layer's experts hold both slots (e.g. route-ahead's pins)
        cache.prefetch((store.layer_ids[1], e))
        assert cache.pin((store.layer_ids[1], e))
    with pytest.raises(RuntimeError, match="every slot is pinned"):
        rt.run_layer(layer, torch.tensor([[2, 3]]), lambda experts, whole: None)
    cache.unpin((store.layer_ids[1], 0))  # one slot: the layer's two experts go in two chunks
    chunks = []
    rt.run_layer(layer, torch.tensor([[2, 3]]), lambda experts, whole: chunks.append((experts, whole)))
    assert chunks == [([2], False), ([3], False)]
    cache.close()


def test_a_large_cpu_pool_takes_the_gathered_bmm():
    """torch's CPU grouped GEMM loops over every slot's group, empty ones included: beyond
    ``CPU_GROUPED_MM_MAX_SLOTS`` slots the CPU computes the pairs with the named fallback."""
    small = [torch.empty(grouped.CPU_GROUPED_MM_MAX_SLOTS, 32, 16)]
    large = [torch.empty(grouped.CPU_GROUPED_MM_MAX_SLOTS + 1, 32, 16)]
    misaligned = [torch.empty(4, 32, 3)]  # a 12-byte row stride: not a 16-byte multiple
    assert grouped.expert_compute_kind(small) == GROUPED_MM
    assert grouped.expert_compute_kind(large) == GATHERED_BMM
    assert grouped.expert_compute_kind(misaligned) == GATHERED_BMM


def _syncing_grouped_mm(x, w, offs):
    """What ATen's mm-loop fallback does under ``set_sync_debug_mode("error")``: its host read of ``offs``."""
    raise RuntimeError("called a synchronizing CUDA operation")


@pytest.fixture
def fake_cuda(monkeypatch):
    """A CUDA device of a chosen capability whose ``_grouped_mm`` behaves as torch's does there: the device
    kernel on majors 9 and 10, the syncing mm loop elsewhere (the probe's real code runs on CPU tensors)."""
    state = {"mode": 0, "calls": 0}

    def use(capability):
        def grouped_mm(x, w, offs):
            state["calls"] += 1
            assert state["mode"] == 2, "the probe must run under set_sync_debug_mode('error')"
            if capability[0] not in (9, 10):
                _syncing_grouped_mm(x, w, offs)
            return real(x, w, offs=offs)

        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
        monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: state["mode"])
        modes = {"default": 0, "warn": 1, "error": 2}
        monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", lambda m: state.update(mode=modes.get(m, m)))
        monkeypatch.setattr(torch, "_grouped_mm", grouped_mm)
        monkeypatch.setattr(grouped, "_PROBES", {})
        return state

    real, probe = torch._grouped_mm, grouped.probe_grouped_mm
    monkeypatch.setattr(grouped, "probe_grouped_mm", lambda device: probe(torch.device("cpu")))
    return use


@pytest.mark.parametrize(
    ("capability", "path"),
    [((12, 0), GATHERED_BMM), ((9, 0), GROUPED_MM), ((10, 0), GROUPED_MM), ((8, 0), GATHERED_BMM)],
)
def test_the_cuda_path_is_grouped_mm_only_where_torch_runs_its_fast_kernel(fake_cuda, capability, path):
    state = fake_cuda(capability)
    choice = grouped.cuda_choice(torch.device("cuda", 0), torch.bfloat16)
    assert choice["path"] == path and choice["capability"] == list(capability)
    assert state["calls"] == 1 and state["mode"] == 0  # probed once, the debug mode restored
    assert choice["probe"]["sync_free"] == (capability[0] in (9, 10))
    if path == GATHERED_BMM:
        assert f"{capability[0]}.{capability[1]}" in choice["why"]
    else:
        assert choice["probe"]["matches_mm"] is True
    again = grouped.cuda_choice(torch.device("cuda", 0), torch.bfloat16)
    assert again == choice and state["calls"] == 1  # once per device and process


def test_a_syncing_probe_on_an_admitted_major_takes_the_gathered_bmm(fake_cuda, monkeypatch):
    fake_cuda((9, 0))
    monkeypatch.setattr(torch, "_grouped_mm", _syncing_grouped_mm)
    choice = grouped.cuda_choice(torch.device("cuda", 0), torch.bfloat16)
    assert choice["path"] == GATHERED_BMM and choice["probe"]["sync_free"] is False
    assert "synchronizing" in choice["why"] and "synchronizing" in choice["probe"]["error"]


def test_cuda_grouped_mm_is_bf16_only(fake_cuda):
    fake_cuda((9, 0))
    choice = grouped.cuda_choice(torch.device("cuda", 0), torch.float32)
    assert choice["path"] == GATHERED_BMM and "bf16" in choice["why"]
