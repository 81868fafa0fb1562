"""Route-ahead's issue order: a drafted block's deeper layers go on the link before the router pass computes the
first MoE layer's exact gate input (their keys computed a second way, from the routers' weights by hand)."""

from __future__ import annotations

import torch

from pd_dflash.engine.reference.decoding.target import Block, Request, TargetModel
from pd_dflash.engine.reference.families import family_of
from pd_dflash.engine.reference.offload.cache import ExpertCache
from pd_dflash.engine.reference.offload.link import HostLink
from pd_dflash.engine.reference.offload.route_prefetch import RouteAheadPrefetcher
from pd_dflash.engine.reference.offload.runtime import OffloadRuntime, install_offload
from tests.engine.reference.helpers import tiny_model

CPU = torch.device("cpu")


def test_deeper_layers_are_issued_before_the_first_layers_exact_gate_input():
    torch.set_num_threads(1)
    model = tiny_model("qwen3_moe", seed=2, num_hidden_layers=3)
    family = family_of(model.config)
    target = TargetModel(model, family, CPU)
    store = install_offload(model, family, "fp32", pin=False)
    cache = ExpertCache(store, store.total_bytes - store.expert_nbytes, CPU, torch.float32, link=HostLink())
    layers = store.layer_ids
    prefetcher = RouteAheadPrefetcher(
        target, layers, top_k=2, history=False, expert_nbytes=store.expert_nbytes
    )
    runtime = OffloadRuntime(store, cache, prefetcher)
    runtime.attach(model)
    target.sync_hook = runtime.synchronize
    request = Request("r", list(range(3, 13)), 8, cache=target.new_cache())
    target.forward([Block(request, request.prompt, len(request.prompt) - 1)])  # the prefill
    torch.manual_seed(7)
    hidden = torch.randn(4, model.config.hidden_size)  # the drafter's hidden states of the block's 4 rows
    block = Block(request, [5, 6, 7, 8], 0, drafts=[6, 7, 8], route_hidden=hidden)

    resident = set(cache.entries)  # what the prefill left in the cache
    events: list = []
    prefetch, exact = cache.prefetch, target.first_gate_inputs
    cache.prefetch = lambda key, **kw: events.append(key) or prefetch(key, **kw)
    target.first_gate_inputs = lambda *a, **kw: events.append("exact") or exact(*a, **kw)
    runtime.plan([block])

    # By hand: each deeper layer's router logits are norm(h) · Wᵀ; the top-2 experts per row, union over rows.
    want = set()
    for layer in layers[1:]:
        dec = model.model.layers[layer]
        logits = dec.post_attention_layernorm(hidden) @ dec.mlp.gate.weight.T
        want |= {(layer, int(e)) for e in logits.topk(2, dim=-1).indices.flatten()}
    before = events[: events.index("exact")]
    assert before == sorted(want)  # every deeper key, in layer order, and no first-layer key
    assert prefetcher.counters["early_issued"] == len(want - resident)  # transfers started early
    # Then the exact first layer's keys (the deeper ones are only reserved again: already in the cache).
    new = {k for k in events[events.index("exact") + 1 :] if k not in want}
    assert new and {layer for layer, _ in new} == {layers[0]}
    runtime.close()
