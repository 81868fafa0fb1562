"""Speculative decoding on the decode loop's seams: a drafter proposes ``[anchor, d1 .. d_{B−1}]`` per request,
one batched width-B target forward verifies every block, the accept rule commits a prefix plus the bonus token,
and the rejected rows are rolled back: the request's KV length drops (``request.cached -= n``; the KV arena
stores entries at their positions, so entries past the length are dead, ``kv_arena.py``).

Two drafters:

- ``BlockDrafterSource``: the DFlash-style block drafter (``block_drafter.py``). ONE drafter forward proposes the
  whole block for every request of the step, conditioned on the target's features at the request's last
  committed positions (a rolling buffer filled from the verify forward's captured hidden states). It runs
  resident: it is small and dense and owns no routed expert.
- ``EarlyExitDrafter``: the first d target layers + the target's final norm and LM head, drafting
  autoregressively for B−1 steps on the request's own KV cache (those d layers' entries are rolled back
  before the verify: the length drops back). Its MoE layers fetch experts through the device cache like any access (they count as
  accesses, but feed neither the prediction statistics nor the AR prefetcher).

Both also leave the route-ahead proxy on the block (``Block.route_hidden`` / ``Block.gate_inputs``; the choice of
proxy is documented in route_prefetch.py). Lossless at T = 0: the committed tokens are the target's argmax
(``greedy_accept``), so the output is greedy AR decoding's, token for token (tested for every configuration).
At T > 0, ``speculative_sample`` with each request's own generator.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

import torch

from pd_dflash.engine.reference import host_sync
from pd_dflash.engine.reference.block_drafter import BlockDrafter
from pd_dflash.engine.reference.decode import Block, Commit, Request, TargetModel, next_token
from pd_dflash.engine.reference.sampling import greedy_accept, probabilities, sample, speculative_sample


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


class BlockDrafterSource:
    """The DFlash block drafter behind the decode loop: one parallel forward per step for all requests."""

    kind = "dflash"

    def __init__(self, drafter: BlockDrafter, target: TargetModel, *, route_ahead: bool = False) -> None:
        self.drafter, self.target, self.route_ahead = drafter, target, route_ahead
        self.capture = tuple(drafter.config.target_layer_ids)
        self.context_len = drafter.config.context_len

    def describe(self) -> dict:
        cfg = self.drafter.config
        return {
            "kind": self.kind,
            "layers": cfg.num_layers,
            "heads": cfg.num_heads,
            "target_layer_ids": list(cfg.target_layer_ids),
            "context_len": cfg.context_len,
            "max_block_size": cfg.block_size,
            "params": sum(p.numel() for p in self.drafter.parameters()),
            "runs": "resident (dense, no routed experts)",
        }

    def observe(self, request: Request, rows: dict[int, torch.Tensor]) -> None:
        """Append the target's features of the committed (kept) rows to the request's context buffer."""
        feats = torch.cat([rows[i] for i in self.capture], dim=-1)
        if request.features is not None:
            feats = torch.cat([request.features, feats], dim=0)
        request.features = feats[-self.context_len :]

    @torch.no_grad()
    def draft(self, requests: Sequence[Request], block_size: int, temperature: float) -> list[Block]:
        by_ctx: dict[int, list[Request]] = defaultdict(list)
        for r in requests:  # one drafter call needs one context length (only short prompts differ)
            by_ctx[r.features.shape[0]].append(r)
        out = []
        for group in by_ctx.values():
            device = group[0].features.device
            anchors = torch.tensor([r.output[-1] for r in group], device=device)
            hidden = self.drafter.hidden_states(anchors, torch.stack([r.features for r in group]), block_size)
            logits = self.drafter.logits(hidden[:, 1:])
            q = probabilities(logits, temperature) if temperature > 0 else None
            self.target.synchronize()  # the draft's end (on CUDA the link keeps prefetching meanwhile)
            if q is not None:
                picked = torch.stack([sample(q[i], r.generator) for i, r in enumerate(group)])
            else:
                picked = logits.argmax(-1)
            all_drafts = host_sync.tolist("draft", picked)  # one host read for the group
            for i, r in enumerate(group):
                drafts = all_drafts[i]
                tokens = [r.output[-1], *drafts]
                out.append(
                    Block(
                        r,
                        tokens,
                        0,
                        drafts=drafts,
                        draft_probs=None if q is None else q[i],
                        route_hidden=hidden[i] if self.route_ahead else None,  # route_prefetch.py
                    )
                )
        return out


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
