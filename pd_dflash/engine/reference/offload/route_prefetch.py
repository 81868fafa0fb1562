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

**Predictor**: route-ahead ∪ history. A request's history is what its rows routed in its last verify, per layer
(topics persist: 0.8 of a round's experts per layer come back in the next). ``history=False`` (an ablation)
predicts from the router pass alone.

**Issue as soon as the information exists**, in layer order, each key reserved in the cache's round plan
(``offload/eviction.py``: a reserved key of a layer still to run is never evicted by a prefetch):

1. at the end of a verify (``end_round``), each continuing request's history — its non-resident keys go on the
   link while the next block is drafted;
2. as soon as a block is drafted (``plan``, before the first MoE layer's exact gate input is computed), its
   deeper layers' keys from the drafter's hidden states (only rows the cost-aware width may keep);
3. right after the router pass (``after_plan``), the exact first layer's keys and the rest of the new blocks'
   prediction, before scheduling and admission;
4. at the verify (``begin_round``), whatever of the verified blocks' prediction could not be issued yet, and
   after every verify layer again (``after_layer``, ``layer_done``): a prefetch that finds no victim it may take
   (every other slot reserved for a layer still to run) waits until a layer has run and frees its keys.

Each pump goes on the link as one batch per layer (``ExpertCache.batched``: one copy dispatch, one landing call,
one event pair). The router pass's predictions are the link's route-ahead band (``band``, default 1); the
history issued at the end of a verify, a guess made before any router pass, is background (band 2), so a
router-pass key overtakes a queued history key (BM3 sets ``band`` to 0, 1 or 2 and compares).

A resident key is only reserved: it costs no issue capacity. A key whose layer starts before it was issued is
dropped (``late``) and, if routed, fetched on demand (correct-on-miss): a misprediction costs link time and a
slot, never correctness.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import numpy as np
import torch

from pd_dflash.engine.nvtx_ranges import nvtx_range
from pd_dflash.engine.reference import host_sync
from pd_dflash.engine.reference.offload.issue_queue import IssueQueue
from pd_dflash.engine.reference.offload.link import BACKGROUND, ROUTE_AHEAD, check_band
from pd_dflash.engine.reference.offload.verify_width import CostAwareWidth, new_bytes_per_row

if TYPE_CHECKING:
    from pd_dflash.engine.reference.decoding.target import Block, TargetModel

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
        history: bool = True,
        width: CostAwareWidth | None = None,
        expert_nbytes: int = 0,
        reuse_prefix: bool = True,
        band: int = ROUTE_AHEAD,
    ) -> None:
        layers = target.model.model.layers
        #: The link band of the router pass's predictions (``offload/link.py``); history goes as background.
        self.band = check_band(band)
        self.target, self.top_k, self.issue, self.use_history = target, top_k, issue, history
        #: The verify resumes from the router pass's first-layer work (``decoding/target.Prefix``) instead of redoing it.
        self.reuse_prefix = reuse_prefix
        #: Cost-aware verify width (``offload/verify_width.py``), or None: every block is verified whole.
        self.width, self.expert_nbytes = width, expert_nbytes
        self.layer_ids = list(layer_ids)
        self.position = {layer: i for i, layer in enumerate(self.layer_ids)}
        self.routers = {i: getattr(layers[i].mlp, target.family.router_attr) for i in self.layer_ids}
        self.norms = {i: layers[i].post_attention_layernorm for i in self.layer_ids}
        #: Per request: the router pass's predicted experts of its pending block, per layer.
        self.routes: dict[object, dict[int, frozenset[int]]] = {}
        #: Per request: each row's predicted (layer, expert) keys, and whether its pending block is a prefill.
        self.row_keys: dict[object, list[set[Key]]] = {}
        self._prefill: set[object] = set()
        self._last_end: float | None = None
        #: Per request: the layers whose prediction came from the exact gate input (not a proxy).
        self.exact: dict[object, frozenset[int]] = {}
        #: Per request: the experts its rows routed in its last verify, per layer.
        self.history: dict[object, dict[int, frozenset[int]]] = {}
        #: The verified round's prediction per layer (what the statistics compare with the routing).
        self.predicted: dict[int, frozenset[int]] = {}
        self._queue = IssueQueue(self.position)
        #: The confident keys of the round being verified, and of the pending blocks (None: to recompute after a
        #: router pass or a verify changed them; see ``_confident``).
        self._sure: set[Key] = set()
        self._pending_sure: set[Key] | None = None
        self._owners: list[tuple[object, int]] = []
        self._routed: dict[int, torch.Tensor] = {}
        self.counters = {
            "issued": 0,
            "already_cached": 0,
            "waited_for_a_slot": 0,
            "late": 0,
            "history_issued": 0,
            "early_issued": 0,
        }

    def describe(self) -> dict:
        return {
            "prefetcher": self.name,
            "issues_fetches": self.issue,
            "predictor": "route-ahead ∪ history" if self.use_history else "route-ahead",
            "issue": "layer order, reserved in the cache's round plan: history at the end of a verify, the "
            "router pass's prediction right after it, the rest after each verify layer",
            "verify_width": self.width.describe() if self.width is not None else "full",
        }

    # -- router pass -------------------------------------------------------------------------------------------
    @torch.no_grad()
    def plan(self, blocks: list[Block], cache=None) -> None:
        """Predict each block's experts per layer (one router call per layer over all blocks' rows). With the
        ``cache``, a drafted block's deeper layers (predicted from the drafter's hidden states, which exist as
        soon as the block is drafted) are issued BEFORE the first MoE layer's exact gate input is computed."""
        if not blocks:
            return
        with nvtx_range("route_ahead_router"):
            drafted = [b for b in blocks if b.route_hidden is not None]
            deeper = self.layer_ids[1:]
            early = self._route(drafted, deeper) if drafted and deeper else []
            if cache is not None and early:
                self._issue_early(drafted, early, cache)
            self._exact_first_layer(blocks)
            late = dict(zip(map(id, drafted), self._route(drafted, self.layer_ids[:1]), strict=True))
            rest = [b for b in blocks if id(b) not in late]
            late.update(zip(map(id, rest), self._route(rest, self.layer_ids), strict=True))
            early_of = dict(zip(map(id, drafted), early, strict=True))
            for b in blocks:
                rid, rows = b.request.rid, late[id(b)]
                for i, keys in enumerate(early_of.get(id(b), ())):
                    rows[i] |= keys
                self.row_keys[rid], self.exact[rid] = rows, frozenset(b.gate_inputs)
                self.routes[rid] = _union_per_layer(rows, self.layer_ids)
                if b.prefill:
                    self._prefill.add(rid)
                else:
                    self._prefill.discard(rid)
            self._pending_sure = None

    def _issue_early(self, blocks: list[Block], rows: list[list[set[Key]]], cache) -> None:
        """The deeper layers' predicted keys of freshly drafted blocks, issued in layer order while the exact
        first layer is still to compute. With the cost-aware width, only rows the cut may keep: the rows before
        the cut the deeper layers alone already call for (the exact layer only adds bytes, so the final cut is
        never later)."""
        keys: set[Key] = set()
        for block_rows in rows:
            keep = len(block_rows)
            if self.width is not None:
                new = new_bytes_per_row(block_rows, cache.contains, self.expert_nbytes, cache.num_slots)
                keep = self.width.width(new, count=False)
            keys.update(k for row in block_rows[:keep] for k in row)
        self.counters["early_issued"] += sum(1 for k in keys if not cache.contains(k))
        self._enqueue(keys)
        self._pump(cache)

    def _exact_first_layer(self, blocks: list[Block]) -> None:
        """The first MoE layer's exact gate input (its attention on the request's cache) for blocks without one;
        a prefill (no draft) takes the residual stream there as the proxy of the deeper layers."""
        first = self.layer_ids[0]
        need = [b for b in blocks if first not in b.gate_inputs]
        if not need:
            return
        gate, residual = self.target.first_gate_inputs(need, first, keep=self.reuse_prefix)
        row = 0
        for b in need:
            n = len(b.tokens)
            b.gate_inputs = {**b.gate_inputs, first: gate[0, row : row + n]}
            if b.route_hidden is None:
                b.route_hidden = residual[0, row : row + n]
            row += n

    def _route(self, blocks: list[Block], layers: Sequence[int]) -> list[list[set[Key]]]:
        """Per block, per row, its predicted (layer, expert) keys of ``layers``: from the exact gate input where
        the block has one, else from the proxy hidden state ``Block.route_hidden`` through the layer's own norm
        and router. (A source of better proxies — e.g. a drafter's own hidden states per layer — plugs in by
        filling ``Block.route_hidden`` or ``Block.gate_inputs``.)"""
        spans, start = [], 0
        for b in blocks:
            spans.append((start, start + len(b.tokens)))
            start += len(b.tokens)
        rows: list[list[set[Key]]] = [[set() for _ in range(e - s)] for s, e in spans]
        if not blocks:
            return rows
        stacked, routed = None, []
        for layer in layers:
            exact = [b.gate_inputs.get(layer) for b in blocks]
            if all(x is not None for x in exact):
                x = torch.cat(exact)
            else:
                stacked = torch.cat([b.route_hidden for b in blocks]) if stacked is None else stacked
                x = self.norms[layer](stacked)
                for j, (s, e) in enumerate(spans):
                    if exact[j] is not None:
                        x[s:e] = exact[j]
            routed.append(self.routers[layer](x)[2])  # [rows, k] router indices (Qwen3-MoE, Mixtral, gpt-oss)
        if not routed:
            return rows
        every = host_sync.tolist("router_pass", torch.stack(routed))  # one host read for every layer
        for layer, ids in zip(layers, every, strict=True):
            for j, (s, e) in enumerate(spans):
                for i in range(e - s):
                    rows[j][i].update((layer, int(x)) for x in ids[s + i])
        return rows

    def route(self, blocks: list[Block], cache) -> bool:
        """The router pass over the new blocks, then their cut and issue (``plan`` + ``after_plan``)."""
        self.plan(blocks, cache)
        self.after_plan(cache, blocks)
        return True

    def keys(self, rid: object) -> set[Key]:
        """(layer, expert) keys the request's pending block is predicted to need (route-ahead ∪ history)."""
        return {(layer, e) for layer, es in self._prediction(rid).items() for e in es}

    def in_flight(self, rid: object) -> bool:
        """The verify completes within its scheduling step: no round is ever in flight."""
        return False

    def after_plan(self, cache, blocks: list[Block]) -> None:
        """Cut the new blocks to their cost-aware width, then issue their predicted keys right after the router
        pass (before scheduling)."""
        if self.width is not None:
            for b in blocks:
                if not b.prefill:
                    self._cut(b, cache)
            wanted = {k for rid in {*self.routes, *self.history} for k in self.keys(rid)}
            self._queue.retain(wanted)  # early keys of rows the cut dropped, not issued yet
        for b in blocks:
            self._enqueue(self.keys(b.request.rid))
        self._pump(cache)

    # -- the verify --------------------------------------------------------------------------------------------
    def begin_round(self, cache, owners: list[tuple[object, int]]) -> None:
        """Before the verify forward: the verified blocks' prediction, reserved and issued in layer order."""
        self._owners, self._routed = owners, {}
        predicted: dict[int, set[int]] = {layer: set() for layer in self.layer_ids}
        self._sure, self._pending_sure = self._confident_of([rid for rid, _ in owners]), None
        for rid, _ in owners:
            for layer, es in self._prediction(rid).items():
                predicted[layer] |= es
            self.routes.pop(rid, None)
        self.predicted = {layer: frozenset(es) for layer, es in predicted.items()}
        keys = {(layer, e) for layer, es in predicted.items() for e in es}
        cache.plan.predict(keys & self._sure)  # the others are reserved once prefetched (``_pump``)
        self._enqueue(keys)
        self._pump(cache)

    def after_layer(self, cache, layer: int, routed: torch.Tensor) -> None:
        """Layer ``layer`` has acquired its experts and computes now: its unissued keys are moot (fetched on
        demand); keep the link busy with the next layers' keys."""
        self._routed[layer] = routed  # the layer's routing on the host (``OffloadRuntime.routing_to_host``)
        self.counters["late"] += self._queue.drop_through(self.position[layer])
        self._pump(cache)

    def layer_done(self, cache, layer: int) -> None:
        self._pump(cache)

    def end_round(self, cache, kept_spans: list[tuple[int, int]], finished: set) -> None:
        """Each continuing request's history becomes what its rows routed; issue it for its next round."""
        self._queue.clear()
        self._sure, self._pending_sure = set(), None
        self._measure_round(kept_spans)
        row = 0
        for rid, rows in self._owners:
            if rid not in finished and self._routed:
                self.history[rid] = {
                    layer: frozenset(np.unique(np.asarray(r[row : row + rows])).tolist())
                    for layer, r in self._routed.items()
                }
            row += rows
        if not self.use_history:
            return
        keys = {k for rid, _ in self._owners if rid not in finished for k in self.keys(rid)}
        self.counters["history_issued"] += sum(1 for k in keys if not cache.contains(k))
        self._enqueue(keys)
        self._pump(cache, BACKGROUND)

    def forget(self, rid: object) -> None:
        for table in (self.routes, self.history, self.exact, self.row_keys):
            table.pop(rid, None)
        self._pending_sure = None
        self._prefill.discard(rid)

    # -- internals ---------------------------------------------------------------------------------------------
    def _cut(self, block: Block, cache) -> None:
        """Verify only the rows worth their new experts (``offload/verify_width.py``); lossless."""
        rid = block.request.rid
        rows = self.row_keys[rid]
        keep = self.width.width(new_bytes_per_row(rows, cache.contains, self.expert_nbytes, cache.num_slots))
        if keep == len(block.tokens):
            return
        self.target.release_prefix(block)
        block.tokens, block.drafts = block.tokens[:keep], block.drafts[: keep - 1]
        if block.draft_probs is not None:
            block.draft_probs = block.draft_probs[: keep - 1]
        if block.route_hidden is not None:
            block.route_hidden = block.route_hidden[:keep]
        block.gate_inputs = {layer: x[:keep] for layer, x in block.gate_inputs.items()}
        self.row_keys[rid] = rows[:keep]
        self.routes[rid] = _union_per_layer(rows[:keep], self.layer_ids)
        self._pending_sure = None

    def _measure_round(self, kept_spans: list[tuple[int, int]]) -> None:
        """Acceptance per verified block and seconds per committed token, for the cost-aware width."""
        now = time.perf_counter()
        if self.width is not None and self._last_end is not None:
            outcomes = [
                ((stop - start) - 1, rows)
                for (rid, rows), (start, stop) in zip(self._owners, kept_spans, strict=True)
                if rid not in self._prefill
            ]
            committed = sum(stop - start for start, stop in kept_spans)
            if outcomes:
                self.width.observe(outcomes, now - self._last_end, committed)
        self._last_end = now

    def _prediction(self, rid: object) -> dict[int, frozenset[int]]:
        """route-ahead ∪ history of the request, per layer; a layer predicted from its exact gate input takes
        the router pass alone (it is the verify's routing: history would add only misses). Before the router
        pass (between a verify and the next draft) it is the history."""
        route = self.routes.get(rid, {})
        hist = self.history.get(rid, {}) if self.use_history else {}
        exact = self.exact.get(rid, frozenset()) if rid in self.routes else frozenset()
        return {
            layer: route.get(layer, frozenset())
            if layer in exact
            else route.get(layer, frozenset()) | hist.get(layer, frozenset())
            for layer in self.layer_ids
        }

    def _enqueue(self, keys) -> None:
        if self.issue:
            self._queue.add(keys)

    def _confident(self) -> set[Key]:
        """Keys worth displacing a computed key for: an exact layer's, or predicted by both route-ahead and
        history (of the pending blocks and of the round being verified). The others (one source, a proxy layer)
        are prefetched only into slots the plan does not want."""
        if self._pending_sure is None:
            self._pending_sure = self._confident_of(self.routes)
        return self._pending_sure | self._sure

    def _confident_of(self, rids) -> set[Key]:
        out: set[Key] = set()
        for rid in rids:
            hist, exact = self.history.get(rid, {}), self.exact.get(rid, frozenset())
            for layer, es in self.routes.get(rid, {}).items():
                sure = es if layer in exact else es & hist.get(layer, frozenset())
                out |= {(layer, e) for e in sure}
        return out

    def _pump(self, cache, band: int | None = None) -> None:
        """Issue queued keys in layer order until one finds no slot it may take (retried after the next layer):
        each run of keys of one confidence as ONE batched issue (``ExpertCache.prefetch_many``: a link batch per
        layer), in ``band`` (default: the router pass's, ``self.band``)."""
        if not self.issue or cache.resident or not self._queue:
            return
        confident, band = self._confident(), self.band if band is None else band
        speculative_blocked = False  # a speculative prefetch found no unwanted slot: no later one will either
        queue, kept, order, i = self._queue, [], self._queue.order, 0
        with nvtx_range("route_ahead_issue"), cache.batched(band):
            while i < len(order):
                sure = order[i][2] in confident
                if not sure and speculative_blocked:  # only a cached key still goes (a touch)
                    if cache.contains(order[i][2]):
                        cache.prefetch(order[i][2], speculative=True)
                        queue.keys.discard(order[i][2])
                        self.counters["already_cached"] += 1
                    else:
                        kept.append(order[i])
                    i += 1
                    continue
                j = i + 1
                while j < len(order) and (order[j][2] in confident) == sure:
                    j += 1
                run = [item[2] for item in order[i:j]]
                done, issued = cache.prefetch_many(run, speculative=not sure, band=band)
                queue.keys.difference_update(run[:done])
                self.counters["issued"] += issued
                self.counters["already_cached"] += done - issued
                if done == len(run):
                    i = j
                    continue
                self.counters["waited_for_a_slot"] += 1
                if sure:
                    kept += order[i + done :]
                    break
                speculative_blocked = True
                kept.append(order[i + done])
                i += done + 1
        queue.order = kept


def _union_per_layer(rows: list[set[Key]], layer_ids: Sequence[int]) -> dict[int, frozenset[int]]:
    out: dict[int, set[int]] = {layer: set() for layer in layer_ids}
    for keys in rows:
        for layer, e in keys:
            out[layer].add(e)
    return {layer: frozenset(es) for layer, es in out.items()}
