"""Offloaded MoE layers: each model's experts module is replaced by ``OffloadedExperts``, which computes a layer's
routed experts over the device cache's slot pool (``offload/grouped.py``: one grouped GEMM per projection, a constant
number of ops however many experts the layer routes to), and an ``OffloadRuntime`` (one per cell) that owns the
cache, the prefetcher and the prediction statistics and is driven by the decode loop's round hooks.

Per MoE layer:

- **resident** (B3, every expert in the cache): no host sync at all. The layer computes from the device slot table
  and records its routing on the device; after the forward, ALL layers' routing comes to the host in ONE transfer,
  inside the wait that ends the forward (``synchronize``), and the cache accounting, the statistics, the trace and
  the observe-only prefetcher are fed layer by layer exactly as if it had come per layer (values unchanged).
- **offloaded**: the routing comes to the host in ONE transfer (pinned memory, waited by event through the link:
  ``host_sync`` site ``routing``), the layer's routed experts are acquired (pinned, fetched on demand) in ascending
  id order, the prefetcher learns from the routing and issues fetches for the next layer, then ONE grouped compute
  runs over all of them. A cache smaller than the layer's union computes it in as few chunks as its slots allow
  (acquire what fits, compute, release, repeat).

Outputs are bit-identical to the eager experts module (``offload/grouped.py``), resident or offloaded, whatever slots the
experts occupy.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from pd_dflash.engine.reference import host_sync
from pd_dflash.engine.reference.families import MoEFamily, num_experts
from pd_dflash.engine.reference.offload.cache import ExpertCache
from pd_dflash.engine.reference.offload.grouped import GroupedFn, LayerCompute
from pd_dflash.engine.reference.offload.store import HostExpertStore
from pd_dflash.engine.reference.seams import Prefetcher
from pd_dflash.engine.route_ahead import RouteAheadStats


class OffloadedExperts(nn.Module):
    """Drop-in replacement of a transformers experts module (same ``forward(hidden, top_k_index,
    top_k_weights)`` signature), computing the routed experts like the family's eager forward."""

    def __init__(self, layer_id: int, grouped_fn: GroupedFn) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.grouped_fn = grouped_fn
        self.runtime: OffloadRuntime | None = None

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        if self.runtime is None:
            raise RuntimeError("OffloadedExperts used without an OffloadRuntime (call runtime.attach(model))")
        return self.runtime.experts(self.layer_id, hidden_states, top_k_index, top_k_weights, self.grouped_fn)


def install_offload(
    model: nn.Module, family: MoEFamily, storage: str, pin: bool, host_available_bytes: int | None = None
) -> HostExpertStore:
    """Move every MoE layer's experts into a host store and replace the modules (frees the fused params as the
    store fills). ``Refused``, before the store allocates anything, when it would not fit in
    ``host_available_bytes`` (the model is then left without its experts: the engine refuses every cell)."""
    tensors: dict[int, list[torch.Tensor]] = {}
    for i, layer in enumerate(model.model.layers):
        experts = family.experts_module(layer)
        if experts is None:
            continue
        tensors[i] = [getattr(experts, name).data for name in family.tensor_names]
        layer.mlp.experts = OffloadedExperts(i, family.grouped_fn(experts))
    store = HostExpertStore(tensors, storage=storage, pin=pin, host_available_bytes=host_available_bytes)
    if store.num_experts != num_experts(model.config):
        raise ValueError(
            f"store has {store.num_experts} experts per layer, config says {num_experts(model.config)}"
        )
    return store


class OffloadRuntime:
    """One cell's offload state: cache + prefetcher + prediction statistics, behind the decode-loop hooks."""

    def __init__(
        self, store: HostExpertStore, cache: ExpertCache, prefetcher: Prefetcher | None = None
    ) -> None:
        self.store, self.cache, self.prefetcher = store, cache, prefetcher
        self.stats = RouteAheadStats()
        #: Σ over layers of |routed union| in the current round (the round's needed expert count), and per
        #: committed round since the last reset.
        self.round_needed = 0
        self.needed_per_round: list[int] = []
        #: Device expert-cache occupancy (bytes) at the end of each round since the last reset.
        self.occupancy_per_round: list[int] = []
        #: Between begin_round and end_round: MoE layers then feed the statistics and the prefetcher. Outside a
        #: round (e.g. a drafter running target layers) experts are still fetched and counted, nothing else.
        self.in_round = False
        self._observed: set[int] = set()
        #: Per MoE layer, over the verify forwards since the last reset: [Σ|P|, Σ|A|, Σ|P∩A|] (recall per layer).
        self.per_layer: dict[int, list[int]] = {}
        #: Prefetched-in-time coverage over committed rounds: [Σ|{k ∈ P∩A: resident and ready when the verify
        #: acquired it}|, Σ|A|], and the current round's share until it commits.
        self.in_time = [0, 0]
        self._round_in_time = [0, 0]
        #: The verify access trace since the last reset: per round, per MoE layer (layer, experts needed in
        #: acquisition order, experts predicted). ``benchmarks/cache_policy.py`` replays it offline.
        self.trace: list[list[tuple[int, tuple[int, ...], tuple[int, ...]]]] = []
        #: The trace's timeline: per round, per MoE layer (start, end, seconds compute waited for a transfer) on
        #: the host clock (``cache_replay.clairvoyant_in_time`` replays the trace on it).
        self.timeline: list[list[tuple[float, float, float]]] = []
        #: Resident layers of forwards not yet waited for: (layer, routing on the device, observed, start, end).
        self._deferred: list[tuple[int, torch.Tensor, bool, float, float]] = []

    def attach(self, model: nn.Module) -> None:
        for layer in model.model.layers:
            experts = getattr(getattr(layer, "mlp", None), "experts", None)
            if isinstance(experts, OffloadedExperts):
                experts.runtime = self

    def reset_measurement(self) -> None:
        """After warm-up: counters and statistics restart; cache contents and prefetch history stay warm."""
        self._flush_deferred()
        self.cache.reset_counters()
        host_sync.COUNTER.reset()
        self.stats = RouteAheadStats()
        self.needed_per_round, self.occupancy_per_round = [], []
        self.per_layer = {}
        self.in_time, self.trace, self.timeline = [0, 0], [], []

    # -- decode-loop hooks -------------------------------------------------------------------------------------
    def plan(self, blocks) -> bool:
        """New blocks before scheduling: a route-ahead prefetcher runs its router pass (True when it did)."""
        return self.prefetcher is not None and self.prefetcher.route(blocks, self.cache)

    def begin_round(self, owners: list[tuple[object, int]]) -> None:
        """Before the target forward: ``owners`` = (request id, rows) in row order."""
        self._flush_deferred()
        self.cache.begin_round()
        self.stats.begin_step()
        self.round_needed, self.in_round, self._observed = 0, True, set()
        self._round_in_time = [0, 0]
        self.trace.append([])
        self.timeline.append([])
        if self.prefetcher is not None:
            self.prefetcher.begin_round(self.cache, owners)

    def end_round(
        self,
        *,
        kept_rows: int | None = None,
        kept_spans: list[tuple[int, int]] | None = None,
        finished: set | None = None,
    ) -> None:
        """After the accept rule: the kept rows of each request (AR keeps every row)."""
        self._flush_deferred()
        self.in_round = False
        self.stats.commit_step(kept_rows, kept_spans=kept_spans)
        self.in_time = [a + b for a, b in zip(self.in_time, self._round_in_time, strict=True)]
        self.cache.end_round()
        if self.prefetcher is not None:
            spans = kept_spans if kept_spans is not None else [(0, kept_rows or 0)]
            self.prefetcher.end_round(self.cache, spans, finished or set())
        self.cache.collect()
        self.needed_per_round.append(self.round_needed)
        self.occupancy_per_round.append(self.cache.occupancy_bytes)

    def forget(self, rid: object) -> None:
        if self.prefetcher is not None:
            self.prefetcher.forget(rid)

    def close(self) -> None:
        self.cache.close()

    # -- the experts seam ------------------------------------------------------------------------------------
    def synchronize(self, event=None) -> None:
        """The target's wait at the end of a forward or a draft (``TargetModel.sync_hook``; counted, site
        ``forward_end``): block the host until the compute stream (or ``event``) has finished, never the whole
        device (the link keeps its prefetch queue moving meanwhile, ``offload/link.py``). The resident layers' routing of
        the forward comes to the host inside this wait (one transfer) and is accounted for right after."""
        copy = self._copy_deferred()
        host_sync.wait("forward_end", lambda: self._block(event))
        self._account_deferred(copy)

    def _block(self, event=None) -> None:
        if self.cache.link is not None:
            self.cache.link.synchronize(event)
        elif event is not None:
            event.synchronize()
        elif self.cache.device.type == "cuda":
            torch.cuda.current_stream(self.cache.device).synchronize()

    def routing_to_host(self, top_k_index: torch.Tensor) -> torch.Tensor:
        """The layer's ``[tokens, k]`` routing on the host: one device→host copy into pinned memory, waited for by
        event through the link (counted, site ``routing``)."""
        host, landed = host_sync.to_host_async(top_k_index)

        def wait() -> None:
            if landed is not None:
                self._block(landed)

        host_sync.wait("routing", wait)
        return host

    def experts(
        self, layer: int, hidden: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor, fn
    ) -> torch.Tensor:
        """Layer ``layer``'s routed experts over the slot pool (``OffloadedExperts.forward``)."""
        moe = LayerCompute(hidden, top_k_index, top_k_weights, self.cache.slots, layer, fn)
        if self.cache.resident:
            start = time.perf_counter()
            moe.compute()
            observe = self.in_round and layer not in self._observed
            if observe:
                self._observed.add(layer)
            self._deferred.append((layer, top_k_index, observe, start, time.perf_counter()))
        else:
            self.run_layer(layer, top_k_index, lambda experts, whole: moe.compute(None if whole else experts))
        return moe.finish()

    def run_layer(
        self, layer: int, top_k_index: torch.Tensor, compute: Callable[[list[int], bool], None]
    ) -> None:
        """Fetch layer ``layer``'s routed experts and compute them: ``compute(experts, whole)`` once every expert
        of a chunk is acquired and ready (``whole``: the chunk is the layer's whole union, the usual case)."""
        start, waited = time.perf_counter(), self.cache.counters.exposed_seconds
        top_k_index = self.routing_to_host(top_k_index)
        needed = np.unique(top_k_index.numpy()).tolist()  # ascending, like the eager path
        observe = self.in_round and layer not in self._observed
        prefetcher = self.prefetcher if observe else None
        predicted = self._observe(layer, needed, top_k_index) if observe else frozenset()
        todo, chunk = deque(needed), []

        def fill() -> None:
            with self.cache.batching.demand_batched():  # the misses: one link batch, one landing call
                while todo:
                    entry = self.cache.acquire((layer, todo[0]))
                    if entry is None:
                        return
                    if observe and todo[0] in predicted and entry.ready_at_access:
                        self._round_in_time[0] += 1
                    chunk.append((todo.popleft(), entry))

        fill()
        if not chunk:
            raise RuntimeError(f"layer {layer}: no cache slot available (every slot is pinned)")
        if prefetcher is not None:
            prefetcher.after_layer(self.cache, layer, top_k_index)
        whole = not todo
        while chunk:
            for _, entry in chunk:
                self.cache.ready(entry)
            compute([e for e, _ in chunk], whole)
            self.cache.release_all([entry for _, entry in chunk])
            chunk.clear()
            fill()
            if todo and not chunk:
                raise RuntimeError(
                    f"layer {layer}: no cache slot can be freed for expert {todo[0]} "
                    "(every slot is pinned); raise the expert cache capacity"
                )
        self._layer_done(prefetcher, layer)
        if observe:
            self.timeline[-1].append(
                (start, time.perf_counter(), self.cache.counters.exposed_seconds - waited)
            )

    def _layer_done(self, prefetcher: Prefetcher | None, layer: int) -> None:
        if prefetcher is not None:
            prefetcher.layer_done(self.cache, layer)

    # -- resident layers: routing after the forward ------------------------------------------------------------
    def _copy_deferred(self):
        """Start the ONE device→host copy of the deferred layers' routing (waited by the caller's wait)."""
        if not self._deferred:
            return None
        deferred, self._deferred = self._deferred, []
        host, _ = host_sync.to_host_async(torch.cat([d[1].reshape(-1) for d in deferred]))
        return deferred, host

    def _flush_deferred(self) -> None:
        """Account for deferred layers no forward-end wait covered (e.g. HF's own forward through the module)."""
        copy = self._copy_deferred()
        if copy is not None:
            host_sync.wait("deferred_routing", self._block)
            self._account_deferred(copy)

    def _account_deferred(self, copy) -> None:
        """Feed the deferred layers, in order, to the cache accounting, the statistics and the prefetcher."""
        if copy is None:
            return
        deferred, host = copy
        flat, offset = host.numpy(), 0  # numpy from here on: host bookkeeping dispatches no torch op
        for layer, routing, observe, start, end in deferred:
            n = routing.numel()
            rows = flat[offset : offset + n].reshape(tuple(routing.shape))
            offset += n
            self._account_resident(layer, rows, observe, start, end)

    def _account_resident(self, layer: int, routing: np.ndarray, observe: bool, start: float, end: float):
        """What ``run_layer`` does on the host for a layer whose experts were all resident (``routing``: the
        layer's ``[tokens, k]`` ids as a host array; the statistics and the AR prefetcher read it as they read
        the offloaded layers' host tensor)."""
        needed = np.unique(routing).tolist()
        predicted = self._observe(layer, needed, routing) if observe else frozenset()
        entries = []
        for e in needed:
            entry = self.cache.acquire((layer, e))
            if entry is None:  # a resident cache holds every expert: never short of a slot
                raise RuntimeError(f"layer {layer}: resident expert {e} has no slot")
            if observe and e in predicted and entry.ready_at_access:
                self._round_in_time[0] += 1
            entries.append(entry)
        prefetcher = self.prefetcher if observe else None
        if prefetcher is not None:
            prefetcher.after_layer(self.cache, layer, routing)
        self.cache.release_all(entries)
        self._layer_done(prefetcher, layer)
        if observe:
            self.timeline[-1].append((start, end, 0.0))

    def _observe(self, layer: int, needed: list[int], top_k_index: torch.Tensor) -> frozenset[int]:
        """A verify layer starts: statistics, the plan, the trace; returns the layer's predicted experts."""
        prefetcher = self.prefetcher
        self._observed.add(layer)
        self.round_needed += len(needed)
        self.cache.begin_layer(layer, [(layer, e) for e in needed])
        issued = prefetcher is not None and prefetcher.issue and not self.cache.resident
        predicted = prefetcher.predicted.get(layer, frozenset()) if prefetcher is not None else frozenset()
        self.stats.observe_layer(
            layer, predicted, top_k_index, expert_nbytes=self.store.nbytes_map(layer) if issued else None
        )
        counts = self.per_layer.setdefault(layer, [0, 0, 0])
        counts[0] += len(predicted)
        counts[1] += len(needed)
        counts[2] += len(predicted & set(needed))
        self._round_in_time[1] += len(needed)
        self.trace[-1].append((layer, tuple(needed), tuple(sorted(predicted))))
        return frozenset(predicted)
