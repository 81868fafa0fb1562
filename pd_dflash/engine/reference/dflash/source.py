"""A published DFlash drafter behind the decode loop's drafter seam (``SpeculativeDecoding`` in decoding/speculative.py).

- ``capture``: the verify forward keeps the target's hidden states after the drafter's ``target_layer_ids``
  (HF ``hidden_states[id + 1]``: the decoder layer's output; the last layer's is after the final norm, as HF
  returns it);
- ``observe``: after each commit, the kept rows' features (prompt rows after the prefill; anchor + accepted drafts
  after a verify — the bonus token is the next anchor) wait in ``request.features`` until the next draft;
- ``draft``: ONE drafter forward for every request of the step; each request's new context enters its own drafter
  KV there (block rows cropped), so rejected drafts never reach it. The KV is dropped when the request is done.

With ``route_ahead`` each block also carries the drafter's last hidden state of every block row (before its final
norm: a residual stream of the target's width) as the proxy of the target's deeper gate inputs (offload/route_prefetch.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from pd_dflash.engine.reference import host_sync
from pd_dflash.engine.reference.decoding.sampling import probabilities, sample
from pd_dflash.engine.reference.decoding.target import Block, Request
from pd_dflash.engine.reference.dflash.model import DFlashDrafter, DraftKV, DraftRows


class DFlashSource:
    kind = "dflash"

    def __init__(self, drafter: DFlashDrafter, facts: dict[str, Any], *, route_ahead: bool = False) -> None:
        self.drafter, self.route_ahead = drafter, route_ahead
        #: This source's facts (a copy per cell), kept current: the row reads them after the cell.
        self.facts = {**facts, "peak_draft_kv_bytes": 0}
        self.layer_ids = tuple(drafter.config.target_layer_ids)
        self.capture = tuple(i + 1 for i in self.layer_ids)
        self.kv: dict[Any, DraftKV] = {}

    def describe(self) -> dict[str, Any]:
        return self.facts

    def observe(self, request: Request, rows: dict[int, torch.Tensor]) -> None:
        feats = torch.cat([rows[i] for i in self.capture], dim=-1)
        request.features = feats if request.features is None else torch.cat([request.features, feats])
        if request.done:
            self.kv.pop(request.rid, None)
            request.features = None

    @torch.no_grad()
    def draft(self, requests: Sequence[Request], block_size: int, temperature: float) -> list[Block]:
        rows = []
        for r in requests:
            kv = self.kv.setdefault(r.rid, DraftKV())
            context = r.features if r.features is not None else self._no_context()
            if kv.length + context.shape[0] != r.cached:
                raise RuntimeError(
                    f"request {r.rid}: drafter KV ({kv.length}) + new context ({context.shape[0]}) != target "
                    f"position {r.cached}"
                )
            rows.append(DraftRows(kv, context, r.output[-1]))
            r.features = None  # now in the drafter KV
        hidden = self.drafter(rows, block_size)
        kv_bytes = sum(kv.nbytes for kv in self.kv.values())
        self.facts["peak_draft_kv_bytes"] = max(self.facts["peak_draft_kv_bytes"], kv_bytes)
        logits = self.drafter.logits(hidden[:, 1:])
        q = probabilities(logits, temperature) if temperature > 0 else None
        if q is not None:
            picked = torch.stack([sample(q[i], r.generator) for i, r in enumerate(requests)])
        else:
            picked = logits.argmax(-1)
        all_drafts = host_sync.tolist("draft", picked)  # one host read for the batch
        out = []
        for i, r in enumerate(requests):
            drafts = all_drafts[i]
            out.append(
                Block(
                    r,
                    [r.output[-1], *drafts],
                    0,
                    drafts=drafts,
                    draft_probs=None if q is None else q[i],
                    route_hidden=hidden[i] if self.route_ahead else None,
                )
            )
        return out

    def _no_context(self) -> torch.Tensor:
        w = self.drafter.fc.weight
        return w.new_zeros(0, w.shape[1])
