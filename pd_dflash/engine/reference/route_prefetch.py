"""Route-ahead prefetch (OURS): run the target's routers on the drafted block BEFORE the verify, and fetch the
predicted experts of every MoE layer while the verify's earlier layers compute.

**Router pass** (``plan``, NVTX ``route_ahead_router``). The verify's MoE layer l routes the rows
``[anchor, d1 .. d_{B−1}]`` from its gate input ``post_attention_layernorm_l(h_l)``, which is only known once
the verify runs. The pass computes, per block:

- the first MoE layer's gate input EXACTLY: the target's layers up to it run on the block with the request's
  KV cache, the MoE layer itself its attention only (no routed expert is touched), and the KV entries are
  rolled back. Its prediction is the verify's routing (recall 1.0);
- deeper layers from a proxy of ``h_l``: the DFlash drafter's hidden state at the same block position (the
  drafter shares the target's hidden size; its state carries the context and the predicted continuation);
  for a prefill (no draft yet), the residual stream after the first MoE layer's attention;
- the early-exit drafter instead provides the exact gate inputs of its d layers (it ran them on the same rows
  and cache) and its layer-d output as the proxy of the deeper layers.

The target's own ``post_attention_layernorm_l`` and router then give each row's top-k; the layer's predicted set
is the union over the block's rows. Measured recall of the candidate proxies (docs/reference-engine.md
"Route-ahead proxy"): the drafter's hidden state beats the token embeddings and the first layer's residual on
every deeper layer of both mini presets. The row reports the recall reached (coverage, per layer in
``engine.prediction.per_layer``).

**Issue** (``begin_round``, NVTX ``route_ahead_issue``). The predicted (layer, expert) keys of the verified
blocks are issued in layer order, each pinned in the device cache until its layer has run, at most ``window``
pinned at once (half the cache's slots by default, so the layer being computed always has room to stream).
After each verify layer the pins of that layer are released and the next keys are issued: layer-pipelined
issue, so the link works on layer l+1.. while layer l computes. A key already resident is pinned, not fetched.
Anything not resident when its layer runs is fetched on demand (correct-on-miss): a misprediction costs link
time and a slot, never correctness.

**Cross-round prefetch** (``cross_round=True``, a design ablation): at the end of a verify, each continuing
request's next-round likely experts — those its kept rows routed, per layer (topics persist) — are issued as
ordinary prefetches, so they overlap the next draft; they join the next round's predicted set and mark its
verify as in flight for the 2-D scheduler (its prefetch is already moving).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch

from pd_dflash.engine.nvtx_ranges import nvtx_range
from pd_dflash.engine.reference.decode import Block, TargetModel

Key = tuple[int, int]


class RouteAheadPrefetcher:
    name = "route_ahead"
    routes_blocks = True

    def __init__(
        self,
        target: TargetModel,
        layer_ids: Sequence[int],
        top_k: int,
        *,
        issue: bool = True,
        window: int = 1,
        cross_round: bool = False,
    ) -> None:
        layers = target.model.model.layers
        self.target, self.top_k, self.issue, self.window = target, top_k, issue, max(1, window)
        self.layer_ids = list(layer_ids)
        self.routers = {i: getattr(layers[i].mlp, target.family.router_attr) for i in self.layer_ids}
        self.norms = {i: layers[i].post_attention_layernorm for i in self.layer_ids}
        self.cross_round = cross_round
        #: Per request: the predicted experts of its pending block, per layer.
        self.routes: dict[object, dict[int, frozenset[int]]] = {}
        #: Per request: cross-round experts already issued for its next round.
        self.cross: dict[object, dict[int, frozenset[int]]] = {}
        self.predicted: dict[int, frozenset[int]] = {}
        self._queue: deque[Key] = deque()
        self._pins: dict[int, list[Key]] = {}
        self._pinned = 0
        self._owners: list[tuple[object, int]] = []
        self._routed: dict[int, torch.Tensor] = {}
        self.counters = {"issued": 0, "already_cached": 0, "dropped": 0, "late": 0, "cross_round_issued": 0}

    def describe(self) -> dict:
        return {
            "prefetcher": self.name,
            "issues_fetches": self.issue,
            "issue": "layer-pipelined, pinned until the layer runs",
            "window_slots": self.window,
            "cross_round_prefetch": self.cross_round,
        }

    # -- router pass -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def plan(self, blocks: list[Block]) -> None:
        """Predict each block's experts per layer (one router call per layer over all blocks' rows)."""
        if not blocks:
            return
        with nvtx_range("route_ahead_router"):
            first = self.layer_ids[0]
            need = [b for b in blocks if first not in b.gate_inputs]
            if need:  # the exact gate input of the first MoE layer (its attention on the request's cache)
                gate, residual = self.target.first_gate_inputs(need, first)
                row = 0
                for b in need:
                    n = len(b.tokens)
                    b.gate_inputs = {**b.gate_inputs, first: gate[0, row : row + n]}
                    if b.route_hidden is None:  # prefill: no draft, the residual stream there is the proxy
                        b.route_hidden = residual[0, row : row + n]
                    row += n
            spans, start = [], 0
            for b in blocks:
                spans.append((start, start + len(b.tokens)))
                start += len(b.tokens)
            stacked = torch.cat([b.route_hidden for b in blocks])
            routes: list[dict[int, frozenset[int]]] = [{} for _ in blocks]
            for layer in self.layer_ids:
                exact = [b.gate_inputs.get(layer) for b in blocks]
                if all(x is not None for x in exact):
                    x = torch.cat(exact)
                else:
                    x = self.norms[layer](stacked)
                    for j, (s, e) in enumerate(spans):
                        if exact[j] is not None:
                            x[s:e] = exact[j]
                ids = self.routers[layer](x)[2]  # [rows, k] router indices (Qwen3-MoE, Mixtral, gpt-oss)
                for j, (s, e) in enumerate(spans):
                    routes[j][layer] = frozenset(torch.unique(ids[s:e]).tolist())
            for b, r in zip(blocks, routes, strict=True):
                self.routes[b.request.rid] = r

    def keys(self, rid: object) -> set[Key]:
        """(layer, expert) keys the request's pending block is predicted to need (cross-round ones included)."""
        out = {(layer, e) for layer, es in self.routes.get(rid, {}).items() for e in es}
        out |= {(layer, e) for layer, es in self.cross.get(rid, {}).items() for e in es}
        return out

    def in_flight(self, rid: object) -> bool:
        """A cross-round prefetch for this request's round is already on the link."""
        return rid in self.cross

    # -- the verify --------------------------------------------------------------------------------------------
    def begin_round(self, cache, owners: list[tuple[object, int]]) -> None:
        """Before the verify forward: the predicted sets of the verified blocks, issued in layer order."""
        self._owners, self._routed = owners, {}
        predicted: dict[int, set[int]] = {layer: set() for layer in self.layer_ids}
        for rid, _ in owners:
            for source in (self.routes.pop(rid, {}), self.cross.pop(rid, {})):
                for layer, es in source.items():
                    predicted[layer] |= es
        self.predicted = {layer: frozenset(es) for layer, es in predicted.items()}
        self._queue = deque((layer, e) for layer in self.layer_ids for e in sorted(predicted[layer]))
        if self.issue and not cache.resident:
            with nvtx_range("route_ahead_issue"):
                self._pump(cache)

    def after_layer(self, cache, layer: int, routed: torch.Tensor) -> None:
        """Layer ``layer`` has acquired its experts and computes now: its unissued keys are moot (fetched on
        demand); keep the link busy with the next layers' keys."""
        if self.cross_round:
            self._routed[layer] = routed.detach()
        while self._queue and self._queue[0][0] <= layer:
            self._queue.popleft()
            self.counters["late"] += 1
        if self.issue and not cache.resident:
            self._pump(cache)

    def layer_done(self, cache, layer: int) -> None:
        for key in self._pins.pop(layer, []):
            cache.unpin(key)
            self._pinned -= 1
        if self.issue and not cache.resident:
            self._pump(cache)

    def end_round(self, cache, kept_spans: list[tuple[int, int]], finished: set) -> None:
        for layer in list(self._pins):  # a layer that did not run (cannot happen in a full forward)
            self.layer_done(cache, layer)
        self._queue.clear()
        if not self.cross_round or not self._routed:
            return
        for (rid, _), (start, stop) in zip(self._owners, kept_spans, strict=True):
            if rid in finished:
                continue
            nxt = {
                layer: frozenset(torch.unique(r[start:stop]).tolist()) for layer, r in self._routed.items()
            }
            self.cross[rid] = nxt
            if self.issue and not cache.resident:
                with nvtx_range("route_ahead_issue"):
                    for layer in self.layer_ids:
                        for e in sorted(nxt.get(layer, ())):
                            if not cache.contains((layer, e)):
                                self.counters["cross_round_issued"] += 1
                            cache.prefetch((layer, e))

    def forget(self, rid: object) -> None:
        self.routes.pop(rid, None)
        self.cross.pop(rid, None)

    def _pump(self, cache) -> None:
        while self._queue and self._pinned < self.window:
            key = self._queue[0]
            cached = cache.contains(key)
            if not cache.prefetch(key):
                self.counters["dropped"] += 1
                return  # every slot pinned or in flight: retry after the next layer
            self._queue.popleft()
            self.counters["already_cached" if cached else "issued"] += 1
            if cache.pin(key):
                self._pins.setdefault(key[0], []).append(key)
                self._pinned += 1
