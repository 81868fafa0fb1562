"""Speculative decoding on the decode loop's seams: a drafter proposes ``[anchor, d1 .. d_{B−1}]`` per request,
one batched width-B target forward verifies every block, the accept rule commits a prefix plus the bonus token,
and the rejected rows are rolled back: the request's KV length drops (``request.cached -= n``; the KV arena
stores entries at their positions, so entries past the length are dead, ``decoding/kv_arena.py``).

Two drafters:

- ``dflash.source.DFlashSource``: a DFlash drafter in z-lab's published layout (``dflash/model.py``), a published
  one (``models[].draft``) or a preset's trained one (``presets/drafters.py``). ONE drafter forward proposes the
  whole block for every request of the step, conditioned on the target's features at every committed position
  (each request's drafter KV). It runs resident: it is small and dense and owns no routed expert.
- ``EarlyExitDrafter``: the first d target layers + the target's final norm and LM head, drafting
  autoregressively for B−1 steps on the request's own KV cache (those d layers' entries are rolled back
  before the verify: the length drops back). Its MoE layers fetch experts through the device cache like any access (they count as
  accesses, but feed neither the prediction statistics nor the AR prefetcher).

Both also leave the route-ahead proxy on the block (``Block.route_hidden`` / ``Block.gate_inputs``; the choice of
proxy is documented in offload/route_prefetch.py). Lossless at T = 0: the committed tokens are the target's argmax
(``greedy_accept``), so the output is greedy AR decoding's, token for token (tested for every configuration).
At T > 0, ``speculative_sample`` with each request's own generator.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from pd_dflash.engine.reference import host_sync
from pd_dflash.engine.reference.decoding.sampling import (
    greedy_accept,
    probabilities,
    sample,
    speculative_sample,
)
from pd_dflash.engine.reference.decoding.target import Block, Commit, Request, TargetModel, next_token


class SpeculativeDecoding:
    """Proposer (via a drafter) and commit rule (accept + KV rollback) of speculative decoding."""

    speculative = True

    def __init__(self, drafter, block_size: int, temperature: float = 0.0) -> None:
        if block_size < 2:
            raise ValueError(f"speculative decoding needs a block of at least 2 tokens, got {block_size}")
        self.drafter, self.block_size, self.temperature = drafter, block_size, temperature
        self.capture = tuple(drafter.capture)

    def propose(self, requests: Sequence[Request]) -> list[Block]:
        """The prompt for a new request (prefill: not a verify round), else a drafted block."""
        blocks = {
            r.rid: Block(r, list(r.prompt), len(r.prompt) - 1, prefill=True) for r in requests if not r.cached
        }
        todo = [r for r in requests if r.cached]
        if todo:
            for b in self.drafter.draft(todo, self.block_size, self.temperature):
                blocks[b.request.rid] = b
        return [blocks[r.rid] for r in requests]

    def commit(self, block: Block, logits: torch.Tensor, captured: dict[int, torch.Tensor]) -> Commit:
        r = block.request
        if block.prefill:
            committed, kept = [next_token(logits[-1], self.temperature, r.generator)], len(block.tokens)
        else:
            drafts = torch.tensor(block.drafts, device=logits.device)[None]
            if self.temperature > 0:
                if block.draft_probs is None:
                    raise RuntimeError(
                        f"request {r.rid}: a sampled draft without its drafter's probabilities"
                    )
                result = speculative_sample(
                    logits[None], drafts, block.draft_probs[None], self.temperature, r.generator
                )
            else:
                result = greedy_accept(logits[None], drafts)
            committed = result.committed()[0]
            kept = len(committed)  # accepted drafts + the bonus: the rows whose work survives
        committed = committed[: r.remaining]
        stop = next((i for i, t in enumerate(committed) if t in r.eos_token_ids), None)
        if stop is not None:  # the first token that is any of the eos ids ends the request
            committed = committed[: stop + 1]
        r.output.extend(committed)
        r.cached -= len(block.tokens) - kept  # the rejected rows' KV entries are dead past the length
        self.drafter.observe(r, {i: h[:kept] for i, h in captured.items()})
        return Commit(committed=len(committed), kept_rows=kept)


class EarlyExitDrafter:
    """Self-drafting with the first ``layers`` target layers + the target head, on the request's KV cache.

    Drafts B−1 tokens autoregressively (one batched d-layer forward per step), then rolls those layers' KV
    entries back (the request's length drops back), so the verify sees the cache as before. With ``route_ahead`` it feeds one more step (the last
    draft), which gives the EXACT gate inputs of the first d layers for every verify row (the verify recomputes
    the same values) and the layer-d output as the proxy of the deeper layers.
    """

    kind = "early_exit"
    capture: tuple[int, ...] = ()

    def __init__(self, target: TargetModel, layers: int, *, route_ahead: bool = False) -> None:
        if not 1 <= layers < target.num_layers:
            raise ValueError(
                f"early_exit_layers must be in [1, {target.num_layers - 1}] for a {target.num_layers}-layer "
                f"target, got {layers}"
            )
        self.target, self.layers, self.route_ahead = target, layers, route_ahead

    def describe(self) -> dict:
        return {
            "kind": self.kind,
            "layers": self.layers,
            "of_target_layers": self.target.num_layers,
            "runs": "target layers through the offloaded expert cache (accesses counted, no statistics)",
        }

    def observe(self, request: Request, rows: dict[int, torch.Tensor]) -> None:
        pass

    @torch.no_grad()
    def draft(self, requests: Sequence[Request], block_size: int, temperature: float) -> list[Block]:
        tokens = {r.rid: [r.output[-1]] for r in requests}
        probs: dict = {r.rid: [] for r in requests}
        gates: dict = {r.rid: defaultdict(list) for r in requests}
        hidden: dict = {r.rid: [] for r in requests}
        steps = block_size if self.route_ahead else block_size - 1
        for step in range(steps):
            blocks = [Block(r, [tokens[r.rid][-1]], 0) for r in requests]
            if self.route_ahead:
                logits, captured, gate_inputs = self.target.forward_with_gate_inputs(
                    blocks, capture=(self.layers,), layers=self.layers
                )
            else:
                logits, captured = self.target.forward(blocks, layers=self.layers)
            for j, r in enumerate(requests):
                if self.route_ahead:
                    for layer, x in gate_inputs.items():
                        gates[r.rid][layer].append(x[0, j : j + 1])
                    hidden[r.rid].append(captured[self.layers][0, j : j + 1])
                if step < block_size - 1:
                    row = logits[j][-1]
                    if temperature > 0:
                        q = probabilities(row, temperature)
                        probs[r.rid].append(q)
                        tokens[r.rid].append(int(host_sync.item("draft", sample(q, r.generator))))
                    else:
                        tokens[r.rid].append(int(host_sync.item("draft", row.float().argmax())))
        for (
            r
        ) in requests:  # roll the drafted entries back out of the first d layers (the verify rewrites them)
            r.cached -= steps
        out = []
        for r in requests:
            out.append(
                Block(
                    r,
                    tokens[r.rid],
                    0,
                    drafts=tokens[r.rid][1:],
                    draft_probs=torch.stack(probs[r.rid]) if temperature > 0 else None,
                    route_hidden=torch.cat(hidden[r.rid]) if self.route_ahead else None,
                    gate_inputs={k: torch.cat(v) for k, v in gates[r.rid].items()},
                )
            )
        return out
