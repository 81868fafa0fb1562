"""Offloaded MoE layers: each model's experts module is replaced by ``OffloadedExperts``, which computes
every routed expert from a device-cache slot, and an ``OffloadRuntime`` (one per cell) that owns the cache,
the prefetcher and the prediction statistics and is driven by the decode loop's round hooks.

Per MoE layer (``OffloadRuntime.run_layer``): the routing comes to the host in ONE transfer, the layer's routed
experts are pinned/fetched in ascending id order (the eager order, so offloaded and resident outputs are
bit-identical), the prefetcher then learns from the routing and issues fetches for the next layer, and each
expert is computed as soon as its slot is ready and released right after, so a cache smaller than the layer's
union still works (it streams). Each expert's rows come from ONE stable sort of the layer's routing on the
device and the host's per-expert counts: no host↔device synchronization per expert, so on CUDA the host
enqueues a whole layer ahead of the GPU.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import torch
from torch import nn

from pd_dflash.engine.reference.expert_cache import ExpertCache
from pd_dflash.engine.reference.expert_store import HostExpertStore
from pd_dflash.engine.reference.families import ExpertFn, MoEFamily, num_experts
from pd_dflash.engine.route_ahead import RouteAheadStats


class OffloadedExperts(nn.Module):
    """Drop-in replacement of a transformers experts module (same ``forward(hidden, top_k_index,
    top_k_weights)`` signature), computing each expert like the family's eager forward."""

    def __init__(self, layer_id: int, expert_fn: ExpertFn) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.expert_fn = expert_fn
        self.runtime: OffloadRuntime | None = None

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        if self.runtime is None:
            raise RuntimeError("OffloadedExperts used without an OffloadRuntime (call runtime.attach(model))")
        final = torch.zeros_like(hidden_states)
        tokens = top_k_index.shape[0]
        # Entry i of the position-major flattening is (top-k position i // tokens, token i % tokens); a stable
        # sort by expert keeps, within each expert, the eager path's torch.where(expert_mask[e]) order.
        order = torch.sort(top_k_index.T.reshape(-1), stable=True).indices

        def compute(expert: int, weights: list[torch.Tensor], rows: slice) -> None:
            picked = order[rows]
            top_k_pos, token_idx = picked // tokens, picked % tokens
            out = self.expert_fn(hidden_states[token_idx], weights)
            out = out * top_k_weights[token_idx, top_k_pos, None]
            final.index_add_(0, token_idx, out.to(final.dtype))

        self.runtime.run_layer(self.layer_id, top_k_index, compute)
        return final


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
        layer.mlp.experts = OffloadedExperts(i, family.expert_fn(experts))
    store = HostExpertStore(tensors, storage=storage, pin=pin, host_available_bytes=host_available_bytes)
    if store.num_experts != num_experts(model.config):
        raise ValueError(
            f"store has {store.num_experts} experts per layer, config says {num_experts(model.config)}"
        )
    return store


class OffloadRuntime:
    """One cell's offload state: cache + prefetcher + prediction statistics, behind the decode-loop hooks."""

    def __init__(self, store: HostExpertStore, cache: ExpertCache, prefetcher=None) -> None:
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

    def attach(self, model: nn.Module) -> None:
        for layer in model.model.layers:
            experts = getattr(getattr(layer, "mlp", None), "experts", None)
            if isinstance(experts, OffloadedExperts):
                experts.runtime = self

    def reset_measurement(self) -> None:
        """After warm-up: counters and statistics restart; cache contents and prefetch history stay warm."""
        self.cache.reset_counters()
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
        self.in_round = False
        self.stats.commit_step(kept_rows, kept_spans=kept_spans)
        self.in_time = [a + b for a, b in zip(self.in_time, self._round_in_time, strict=True)]
        self.cache.end_round()
        end = getattr(self.prefetcher, "end_round", None)
        if end is not None:
            end(self.cache, kept_spans if kept_spans is not None else [(0, kept_rows)], finished or set())
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
        """Block the host until the compute stream (or ``event``) has finished, never the whole device; the
        link keeps its prefetch queue moving meanwhile (``link.py``)."""
        if self.cache.link is not None:
            self.cache.link.synchronize(event)
        elif event is not None:
            event.synchronize()
        elif self.cache.device.type == "cuda":
            torch.cuda.current_stream(self.cache.device).synchronize()

    def routing_to_host(self, top_k_index: torch.Tensor) -> torch.Tensor:
        """The layer's ``[tokens, k]`` routing on the host: one device→host copy, waited for through the link."""
        if top_k_index.device.type != "cuda":
            return top_k_index
        host = torch.empty(top_k_index.shape, dtype=top_k_index.dtype, pin_memory=True)
        host.copy_(top_k_index, non_blocking=True)
        landed = torch.cuda.Event()
        landed.record(torch.cuda.current_stream(top_k_index.device))
        self.synchronize(landed)
        return host

    def run_layer(
        self, layer: int, top_k_index: torch.Tensor, compute: Callable[[int, list, slice], None]
    ) -> None:
        """Fetch and compute layer ``layer``'s routed experts; ``compute(expert, weights, rows)`` gets the
        expert's entries in the stable sort of the routing by expert id."""
        start, waited = time.perf_counter(), self.cache.counters.exposed_seconds
        top_k_index = self.routing_to_host(top_k_index)
        experts, counts = torch.unique(top_k_index, return_counts=True)  # ascending, like the eager path
        needed = experts.tolist()
        ends = counts.cumsum(0).tolist()
        rows = {e: slice(end - n, end) for e, end, n in zip(needed, ends, counts.tolist(), strict=True)}
        observe = self.in_round and layer not in self._observed
        prefetcher = self.prefetcher if observe else None
        predicted: frozenset[int] = frozenset()
        if observe:
            predicted = self._observe(layer, needed, top_k_index)
        todo, window = deque(needed), deque()

        def fill() -> None:
            while todo:
                entry = self.cache.acquire((layer, todo[0]))
                if entry is None:
                    return
                if observe and todo[0] in predicted and entry.ready_at_access:
                    self._round_in_time[0] += 1
                window.append((todo.popleft(), entry))

        fill()
        if prefetcher is not None:
            prefetcher.after_layer(self.cache, layer, top_k_index)
        while window:
            expert, entry = window.popleft()
            compute(expert, self.cache.weights(entry), rows[expert])
            self.cache.release(entry)
            if todo:
                fill()
                if not window and todo:
                    raise RuntimeError(
                        f"layer {layer}: no cache slot can be freed for expert {todo[0]} "
                        "(every slot is pinned); raise the expert cache capacity"
                    )
        if todo:
            raise RuntimeError(f"layer {layer}: no cache slot available (every slot is pinned)")
        done = getattr(prefetcher, "layer_done", None)
        if done is not None:
            done(self.cache, layer)
        if observe:
            self.timeline[-1].append(
                (start, time.perf_counter(), self.cache.counters.exposed_seconds - waited)
            )

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
