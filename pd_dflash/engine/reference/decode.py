"""Generation in steps: continuous batching of c requests, at most ONE batched target forward per step.

A step (``run_requests``):

1. admission — waiting requests enter until ``concurrency`` are in flight (a new request's first block is its
   prompt, so its prefill counts toward its TTFT);
2. proposal — every in-flight request without a pending block gets one from ``decoding.propose`` (AR: its last
   token; speculative: ``[anchor, d1 .. d_{B−1}]`` from ONE batched drafter forward — the ``dflash_draft``
   window);
3. ``hooks.plan(blocks)`` — route-ahead runs the target's routers on the new blocks (``route_ahead_router``);
4. scheduling — ``scheduler.select(pending)`` picks whose blocks are verified now (B1/AR: everyone; B2/OURS:
   the deficit schedulers). A step that admits nothing runs no forward (an idle step, no time passes);
5. ``hooks.begin_round`` — the prefetch hook (the AR prefetcher issues the first layer; route-ahead issues the
   predicted experts of every layer, layer-pipelined);
6. the target forward (``TargetModel.forward``, ``target_verify``): embeddings, then per decoder layer attention
   per request on its own KV cache and the MoE block ONCE over the concatenated tokens of all requests (the
   experts fetched are the union over the verified requests), then norm + LM head on the rows each block needs;
7. ``decoding.commit`` — the accept rule: committed tokens and kept rows (rejected rows are rolled back out of
   the request's KV cache);
8. ``hooks.end_round(kept_spans)``; finished requests leave and free their KV cache.

A round is a step that ran a forward; its record carries the draft, router, issue and verify times and their
wall-clock windows (the link's transfers are compared against them: the BM4 overlap).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pd_dflash.engine.nvtx_ranges import nvtx_range
from pd_dflash.engine.reference.families import MoEFamily, attention_masks
from pd_dflash.engine.reference.sampling import probabilities, sample

#: A scheduler that admits nothing this many steps in a row is broken (liveness is proven for the deficit
#: schedulers; this only turns a bug into an error instead of a hang).
MAX_IDLE_STEPS = 100_000


@dataclass(eq=False)
class Request:
    rid: Any
    prompt: list[int]
    max_new_tokens: int
    eos_token_id: int | None = None
    generator: torch.Generator | None = None
    cache: Any = None  # a transformers DynamicCache while in flight
    cached: int = 0  # tokens in the KV cache (the next position)
    output: list[int] = field(default_factory=list)
    #: DFlash drafter context: the target's features at the last committed positions [ctx, F].
    features: torch.Tensor | None = None
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.output)

    @property
    def done(self) -> bool:
        if len(self.output) >= self.max_new_tokens:
            return True
        return self.eos_token_id is not None and bool(self.output) and self.output[-1] == self.eos_token_id


@dataclass(eq=False)
class Block:
    """The tokens one request feeds the target in a round; logits are computed from ``logits_from`` on."""

    request: Request
    tokens: list[int]
    logits_from: int
    #: The prompt (first round of a request): not a verify round.
    prefill: bool = False
    #: Speculative blocks: ``tokens = [anchor, *drafts]`` and, at T > 0, the drafter's q [B−1, vocab].
    drafts: list[int] = field(default_factory=list)
    draft_probs: torch.Tensor | None = None
    #: Route-ahead proxy: a pre-norm hidden state per block row [rows, hidden] used for every MoE layer, and
    #: exact gate inputs (post-norm, [rows, hidden]) for the layers where they are known (early exit).
    route_hidden: torch.Tensor | None = None
    gate_inputs: dict[int, torch.Tensor] = field(default_factory=dict)
    #: Scheduling step at which the block became pending (the deficit schedulers' arrival order).
    ready_step: int = 0


@dataclass
class Commit:
    committed: int  # tokens appended to the output this round (bonus included)
    kept_rows: int  # block rows whose work survives (the rest is rolled back)


@dataclass
class RoundRecord:
    start: float
    seconds: float
    forward_seconds: float
    requests: int
    tokens: int
    #: Committed tokens per verified block, and which blocks were prefills (not verify rounds).
    committed: list[int]
    kv_bytes: int
    prefill: list[bool] = field(default_factory=list)
    draft_seconds: float = 0.0
    router_seconds: float = 0.0
    issue_seconds: float = 0.0
    #: Scheduling steps this round waited through with nothing admitted (idle steps before its forward).
    idle_steps: int = 0
    #: (kind, start, end) wall-clock windows of the round's phases: draft, router, issue, verify.
    windows: list[tuple[str, float, float]] = field(default_factory=list)


@dataclass
class _Rows:
    """Where each block's rows sit in a round's concatenated tokens, with their rotary terms and masks."""

    spans: list[tuple[int, int]]
    rope: tuple[torch.Tensor, torch.Tensor]
    masks: list[Any]


class TargetModel:
    """Drives a transformers MoE causal LM layer by layer over the blocks of a round (gpt-fast spirit)."""

    def __init__(self, model: nn.Module, family: MoEFamily, device: torch.device) -> None:
        self.model, self.family, self.device = model, family, device
        self.num_layers = model.config.num_hidden_layers

    def new_cache(self):
        from transformers.cache_utils import DynamicCache

        return DynamicCache(config=self.model.config)

    def _embed(self, blocks: Sequence[Block], layers: int) -> tuple[torch.Tensor, _Rows]:
        """Embeddings of the concatenated block tokens, with each block's span, rotary terms and masks."""
        base = self.model.model
        ids = torch.tensor([t for b in blocks for t in b.tokens], device=self.device)[None]
        spans, start = [], 0
        for b in blocks:
            spans.append((start, start + len(b.tokens)))
            start += len(b.tokens)
        positions = torch.cat(
            [torch.arange(b.request.cached, b.request.cached + len(b.tokens)) for b in blocks]
        ).to(self.device)[None]
        h = base.embed_tokens(ids)
        rope = base.rotary_emb(h, positions)
        masks = [
            attention_masks(self.model, h[:, s:e], b.request.cache, positions[:, s:e], layers=layers)
            for b, (s, e) in zip(blocks, spans, strict=True)
        ]
        return h, _Rows(spans, rope, masks)

    def _attend(self, i: int, layer: nn.Module, h: torch.Tensor, blocks: Sequence[Block], rows: _Rows):
        """Layer ``i``'s attention, per request on its own KV cache; returns the residual stream after it."""
        x = layer.input_layernorm(h)
        cos, sin = rows.rope
        attn = [
            layer.self_attn(
                hidden_states=x[:, s:e],
                position_embeddings=(cos[:, s:e], sin[:, s:e]),
                attention_mask=rows.masks[j][i],
                cache=b.request.cache,
            )[0]
            for j, (b, (s, e)) in enumerate(zip(blocks, rows.spans, strict=True))
        ]
        return h + (attn[0] if len(attn) == 1 else torch.cat(attn, dim=1))

    @torch.no_grad()
    def forward(
        self,
        blocks: Sequence[Block],
        capture: Sequence[int] = (),
        *,
        layers: int | None = None,
        gate_inputs: dict[int, torch.Tensor] | None = None,
    ) -> tuple[list[torch.Tensor], dict]:
        """Logits ``[rows, vocab]`` per block, and the captured hidden states ``{index: [1, T, hidden]}`` over the
        concatenated tokens (HF ``output_hidden_states`` indexing: 0 = embeddings, i = output of layer i,
        ``num_layers`` = after the final norm).

        ``layers`` runs only the first n decoder layers and applies the final norm + LM head to their output
        (the early-exit drafter); ``gate_inputs`` receives each run layer's MoE input (post-norm) ``[1, T, h]``.
        """
        base = self.model.model
        upto = self.num_layers if layers is None else layers
        h, rows = self._embed(blocks, upto)
        captured = {0: h} if 0 in capture else {}
        for i, layer in enumerate(base.layers[:upto]):
            h = self._attend(i, layer, h, blocks, rows)
            mlp_in = layer.post_attention_layernorm(h)
            if gate_inputs is not None:
                gate_inputs[i] = mlp_in
            h = h + self.family.mlp(layer.mlp, mlp_in)
            if i + 1 in capture and i + 1 < self.num_layers:
                captured[i + 1] = h
        h = base.norm(h)
        if self.num_layers in capture and upto == self.num_layers:
            captured[self.num_layers] = h
        logits = []
        for b, (s, e) in zip(blocks, rows.spans, strict=True):
            b.request.cached += len(b.tokens)
            logits.append(self.model.lm_head(h[0, s + b.logits_from : e]))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return logits, captured

    @torch.no_grad()
    def first_gate_inputs(self, blocks: Sequence[Block], layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The EXACT MoE input of decoder layer ``layer`` for every row of the blocks, and the residual stream
        there, without touching a routed expert: layers before it run whole (they must be dense), layer
        ``layer`` runs its attention only. The KV entries this writes are rolled back (the verify recomputes
        them). Returns ``([1, T, h] gate input, [1, T, h] residual)`` over the concatenated rows."""
        base = self.model.model
        h, rows = self._embed(blocks, layer + 1)
        for i, dec in enumerate(base.layers[: layer + 1]):
            h = self._attend(i, dec, h, blocks, rows)
            gate = dec.post_attention_layernorm(h)
            if i < layer:
                h = h + self.family.mlp(dec.mlp, gate)
        for b in blocks:
            for cached_layer in b.request.cache.layers[: layer + 1]:
                cached_layer.crop(-len(b.tokens))
        return gate, h


class AutoregressiveDecoding:
    """Proposer and commit rule of AR decoding: width-1 blocks (the whole prompt on the first round)."""

    speculative = False
    capture: tuple[int, ...] = ()

    def __init__(self, temperature: float = 0.0) -> None:
        self.temperature = temperature

    def propose(self, requests: Sequence[Request]) -> list[Block]:
        blocks = []
        for r in requests:
            tokens = list(r.prompt) if r.cached == 0 else [r.output[-1]]
            blocks.append(Block(r, tokens, logits_from=len(tokens) - 1, prefill=r.cached == 0))
        return blocks

    def commit(self, block: Block, logits: torch.Tensor, captured: dict[int, torch.Tensor]) -> Commit:
        block.request.output.append(next_token(logits[-1], self.temperature, block.request.generator))
        return Commit(committed=1, kept_rows=len(block.tokens))


def next_token(logits: torch.Tensor, temperature: float, generator: torch.Generator | None) -> int:
    """Greedy (T = 0) or sampled next token from one row of logits."""
    if temperature > 0:
        return int(sample(probabilities(logits, temperature), generator))
    return int(logits.float().argmax())


class RoundHooks:
    """What the loop calls around each target forward (``OffloadRuntime`` implements it)."""

    def plan(self, blocks: list[Block]) -> bool:
        """Predict the new blocks' experts before scheduling; True when a router pass ran."""
        return False

    def begin_round(self, owners: list[tuple[Any, int]]) -> None: ...
    def end_round(self, *, kept_spans: list[tuple[int, int]], finished: set | None = None) -> None: ...
    def forget(self, rid: Any) -> None: ...


class AdmitAll:
    """No scheduler (AR, B1): every pending block is verified every step."""

    name = "none"

    def select(self, blocks: list[Block]) -> list[Block]:
        return list(blocks)

    def describe(self) -> dict:
        return {"kind": self.name}


def kv_bytes(cache) -> int:
    total = 0
    for layer in getattr(cache, "layers", ()):
        for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
            if t is not None:
                total += t.numel() * t.element_size()
    return total


def run_requests(
    target: TargetModel,
    requests: Sequence[Request],
    *,
    concurrency: int,
    decoding,
    hooks: RoundHooks,
    scheduler=None,
    clock: Callable[[], float] = time.perf_counter,
) -> list[RoundRecord]:
    """Serve ``requests`` with ``concurrency`` in flight until all are done; returns one record per round."""
    scheduler = scheduler or AdmitAll()
    waiting, active, rounds = deque(requests), [], []
    pending: dict[Any, Block] = {}
    step, idle = 0, 0
    round_start = None
    carried = {"draft": 0.0, "router": 0.0}
    windows: list[tuple[str, float, float]] = []
    while waiting or active:
        now = clock()
        round_start = now if round_start is None else round_start
        while waiting and len(active) < concurrency:
            request = waiting.popleft()
            request.cache, request.admitted_at = target.new_cache(), now
            if decoding.speculative:
                request.cache.activate_past_recording()  # sliding-window layers must be able to roll back
            active.append(request)
        fresh = [r for r in active if r.rid not in pending]
        if fresh:
            t0 = clock()
            with nvtx_range("dflash_draft") if decoding.speculative else nullcontext():
                new_blocks = decoding.propose(fresh)
            t1 = clock()
            routed = hooks.plan(new_blocks)  # route-ahead: the router pass (its own NVTX range)
            t2 = clock()
            for b in new_blocks:
                b.ready_step = step
                pending[b.request.rid] = b
            if decoding.speculative and any(not b.prefill for b in new_blocks):
                carried["draft"] += t1 - t0
                windows.append(("draft", t0, t1))
            if routed:
                carried["router"] += t2 - t1
                windows.append(("router", t1, t2))
        batch = scheduler.select([pending[r.rid] for r in active])
        step += 1
        if not batch:
            idle += 1
            if idle > MAX_IDLE_STEPS:
                raise RuntimeError(f"the scheduler admitted nothing for {idle} steps in a row")
            continue
        for b in batch:
            del pending[b.request.rid]
        t0 = clock()
        hooks.begin_round([(b.request.rid, len(b.tokens)) for b in batch])
        forward_start = clock()
        with nvtx_range("target_verify"):
            logits, captured = target.forward(batch, capture=decoding.capture)
        forward_end = clock()
        spans, row, commits = [], 0, []
        for b, lg in zip(batch, logits, strict=True):
            rows = {i: h[0, row : row + len(b.tokens)] for i, h in captured.items()}
            c = decoding.commit(b, lg, rows)
            commits.append(c)
            spans.append((row, row + c.kept_rows))
            row += len(b.tokens)
        end_active = [r for r in active if r.done]
        hooks.end_round(kept_spans=spans, finished={r.rid for r in end_active})
        end = clock()
        kv = sum(kv_bytes(r.cache) for r in active)
        for b in batch:
            if b.request.first_token_at is None and b.request.output:
                b.request.first_token_at = end
        for r in end_active:
            r.finished_at, r.cache, r.features = end, None, None
            active.remove(r)
            pending.pop(r.rid, None)
            hooks.forget(r.rid)
        windows += [("issue", t0, forward_start), ("verify", forward_start, forward_end)]
        rounds.append(
            RoundRecord(
                start=round_start,
                seconds=end - round_start,
                forward_seconds=forward_end - forward_start,
                requests=len(batch),
                tokens=row,
                committed=[c.committed for c in commits],
                kv_bytes=kv,
                prefill=[b.prefill for b in batch],
                draft_seconds=carried["draft"],
                router_seconds=carried["router"],
                issue_seconds=forward_start - t0,
                idle_steps=idle,
                windows=windows,
            )
        )
        round_start, idle, windows = None, 0, []
        carried = {"draft": 0.0, "router": 0.0}
    return rounds
