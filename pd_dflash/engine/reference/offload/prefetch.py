"""The AR prefetcher of B0/B1: predicts the next layers' experts from recent routing history.

In the spirit of MoE-Infinity's activation-aware prefetching (arXiv 2401.14361), which matches a request's
expert-activation history against past activation matrices to predict the layers ahead. Ours keeps two
pieces of history, both learned online from what the target really routed during the cell:

- a co-activation matrix per pair of consecutive MoE layers, ``C_l[i, j]`` = how often a token routed to
  expert i at layer l was routed to expert j at the next layer. At layer l, each token's next-layer top-k is
  predicted from its own layer-l experts (Σ_i C_l[i, :] / Σ_j C_l[i, j]), and the union is prefetched while
  layer l computes;
- per request, decayed activation counts at the first MoE layer: before a round, each request's top-k of
  those counts is prefetched for the first layer (a topic reuses its experts).

With no history yet it predicts nothing (an empty prediction, never a guess). Its guesses are the link's
background band (``offload/link.py``: served after on-demand and route-ahead transfers), each layer's in one
batch. ``issue=False`` makes it
observe-only (B3: experts are resident, but the prediction quality is still measured on the same scale).

Before a verify it knows no layer but the first, so what it expects a request's next verify to fetch (``keys``,
what the 2-D deficit scheduler prices a configuration like AR2D with) is what that request's rows routed in its
last verify: the same history route-ahead's predictor adds to its router pass.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from pd_dflash.engine.reference.offload.link import BACKGROUND


class ActivationAwarePrefetcher:
    name = "activation_aware"

    def __init__(
        self,
        layer_ids: Sequence[int],
        num_experts: int,
        top_k: int,
        *,
        issue: bool = True,
        decay: float = 0.9,
    ) -> None:
        self.layer_ids = list(layer_ids)
        self.num_experts, self.top_k, self.issue, self.decay = num_experts, top_k, issue, decay
        self.next_layer = dict(zip(self.layer_ids[:-1], self.layer_ids[1:], strict=True))
        self.coactivation = {layer: np.zeros((num_experts, num_experts)) for layer in self.next_layer}
        self.first_layer_counts: dict[object, np.ndarray] = {}
        self.predicted: dict[int, frozenset[int]] = {}
        self.counters: dict[str, int] = {}  # it counts no issue outcomes (the Prefetcher seam's field)
        self._owners: list[tuple[object, int]] = []
        self._previous: np.ndarray | None = None
        #: Per request: the (layer, expert) keys its rows routed in its last verify, and in the current one.
        self.last_routed: dict[object, set[tuple[int, int]]] = {}
        self._routing: dict[object, set[tuple[int, int]]] = {}

    def describe(self) -> dict:
        return {"prefetcher": self.name, "issues_fetches": self.issue, "lookahead_layers": 1}

    def route(self, blocks, cache) -> bool:
        """No router pass: an AR prefetcher learns from the verify's own routing."""
        return False

    def begin_round(self, cache, owners: list[tuple[object, int]]) -> None:
        """``owners``: (request id, rows) per request of the round, in row order. Prefetches the first layer."""
        self.predicted, self._owners, self._previous = {}, owners, None
        self._routing = {rid: set() for rid, _ in owners}
        predicted: set[int] = set()
        for rid, _ in owners:
            counts = self.first_layer_counts.get(rid)
            if counts is not None:
                predicted.update(_top(counts, self.top_k))
        self._issue(cache, self.layer_ids[0], predicted)

    def after_layer(self, cache, layer: int, routed: torch.Tensor) -> None:
        """Learn from layer ``layer``'s routing (``[tokens, k]`` ids on the host: a CPU tensor or an array) and
        prefetch the next layer."""
        ids = np.asarray(routed)  # the routing on the host (OffloadRuntime)
        onehot = np.zeros((ids.shape[0], self.num_experts))
        np.put_along_axis(onehot, ids, 1.0, axis=1)
        row = 0
        for rid, n in self._owners:
            self._routing[rid].update((layer, int(e)) for e in np.unique(ids[row : row + n]))
            row += n
        if layer == self.layer_ids[0]:
            row = 0
            for rid, n in self._owners:
                counts = self.first_layer_counts.get(rid, np.zeros(self.num_experts))
                self.first_layer_counts[rid] = self.decay * counts + onehot[row : row + n].sum(axis=0)
                row += n
        nxt = self.next_layer.get(layer)
        if nxt is not None:
            c = self.coactivation[layer]
            conditional = c / np.maximum(c.sum(axis=1, keepdims=True), 1.0)
            scores = onehot @ conditional  # [tokens, experts]
            top = np.argsort(-scores, axis=1, kind="stable")[:, : self.top_k]  # ties: lower expert id
            chosen = top[np.take_along_axis(scores, top, axis=1) > 0]
            self._issue(cache, nxt, {int(e) for e in chosen})
        prev_layer = self.layer_ids[self.layer_ids.index(layer) - 1] if layer != self.layer_ids[0] else None
        if prev_layer is not None and self._previous is not None:
            self.coactivation[prev_layer] += self._previous.T @ onehot
        self._previous = onehot

    def layer_done(self, cache, layer: int) -> None:
        pass  # nothing pinned across a layer

    def end_round(self, cache, kept_spans, finished) -> None:
        """The verify is over: what each request's rows routed is its history for the next one."""
        self.last_routed.update(self._routing)
        self._routing = {}

    def keys(self, rid: object) -> set[tuple[int, int]]:
        """(layer, expert) keys the request's next verify is expected to need: its last verify's routing."""
        return self.last_routed.get(rid, set())

    def in_flight(self, rid: object) -> bool:
        """The verify completes within its scheduling step: no round is ever in flight."""
        return False

    def forget(self, rid: object) -> None:
        self.first_layer_counts.pop(rid, None)
        self.last_routed.pop(rid, None)

    def _issue(self, cache, layer: int, predicted: set[int]) -> None:
        self.predicted[layer] = frozenset(predicted)
        rest = [(layer, e) for e in sorted(predicted)] if self.issue else []
        while rest:  # one batched issue; a key that finds no slot is dropped and the next one tried
            done, _ = cache.prefetch_many(rest, speculative=True, band=BACKGROUND)
            rest = rest[done + 1 :]


def _top(scores: np.ndarray, k: int) -> list[int]:
    """Indices of the k largest positive scores (ties by lower expert id)."""
    order = np.argsort(-scores, kind="stable")[:k]
    return [int(i) for i in order if scores[i] > 0]
