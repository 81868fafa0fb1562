"""Generation in rounds: continuous batching of c requests, ONE batched target forward per round.

A round (``run_requests``):

1. admission — waiting requests enter until ``concurrency`` are in flight (a new request's first block is its
   prompt, so its prefill counts toward its TTFT);
2. scheduling — ``scheduler(active)`` picks whose blocks enter the round (AR: everyone; the B2/OURS deficit
   schedulers plug in here);
3. proposal — ``decoding.propose(request)`` gives each a block of tokens (AR: its last token; DFlash:
   ``[anchor, d1 .. d_{B−1}]``);
4. ``hooks.begin_round`` — the prefetch hook (the AR prefetcher predicts the first layer; route-ahead will
   issue every layer's predicted experts here, before verify);
5. the target forward (``TargetModel.forward``): embeddings, then per decoder layer attention per request on
   its own KV cache and the MoE block ONCE over the concatenated tokens of all requests (so the experts fetched
   are the union over the c in-flight requests), then norm + LM head on the rows each block needs;
6. ``decoding.commit`` — the accept rule: committed tokens (AR: one) and kept rows (KV rollback of rejected
   positions goes here for speculative decoding);
7. ``hooks.end_round(kept_spans)``; finished requests leave and free their KV cache.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pd_dflash.engine.nvtx_ranges import nvtx_range
from pd_dflash.engine.reference.families import MoEFamily, attention_masks
from pd_dflash.engine.reference.sampling import probabilities, sample


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
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None

    @property
    def done(self) -> bool:
        if len(self.output) >= self.max_new_tokens:
            return True
        return self.eos_token_id is not None and bool(self.output) and self.output[-1] == self.eos_token_id


@dataclass
class Block:
    """The tokens one request feeds the target this round; logits are computed from ``logits_from`` on."""

    request: Request
    tokens: list[int]
    logits_from: int


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
    committed: list[int]
    kv_bytes: int


class TargetModel:
    """Drives a transformers MoE causal LM layer by layer over the blocks of a round (gpt-fast spirit)."""

    def __init__(self, model: nn.Module, family: MoEFamily, device: torch.device) -> None:
        self.model, self.family, self.device = model, family, device
        self.num_layers = model.config.num_hidden_layers

    def new_cache(self):
        from transformers.cache_utils import DynamicCache

        return DynamicCache(config=self.model.config)

    @torch.no_grad()
    def forward(
        self, blocks: Sequence[Block], capture: Sequence[int] = ()
    ) -> tuple[list[torch.Tensor], dict]:
        """Logits ``[rows, vocab]`` per block, and the captured hidden states ``{index: [1, T, hidden]}`` over the
        concatenated tokens (HF ``output_hidden_states`` indexing: 0 = embeddings, i = output of layer i,
        ``num_layers`` = after the final norm)."""
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
        cos, sin = base.rotary_emb(h, positions)
        masks = [
            attention_masks(self.model, h[:, s:e], b.request.cache, positions[:, s:e])
            for b, (s, e) in zip(blocks, spans, strict=True)
        ]
        captured = {0: h} if 0 in capture else {}
        for i, layer in enumerate(base.layers):
            x = layer.input_layernorm(h)
            attn = [
                layer.self_attn(
                    hidden_states=x[:, s:e],
                    position_embeddings=(cos[:, s:e], sin[:, s:e]),
                    attention_mask=masks[j][i],
                    cache=b.request.cache,
                )[0]
                for j, (b, (s, e)) in enumerate(zip(blocks, spans, strict=True))
            ]
            h = h + (attn[0] if len(attn) == 1 else torch.cat(attn, dim=1))
            h = h + self.family.mlp(layer.mlp, layer.post_attention_layernorm(h))
            if i + 1 in capture and i + 1 < self.num_layers:
                captured[i + 1] = h
        h = base.norm(h)
        if self.num_layers in capture:
            captured[self.num_layers] = h
        logits = []
        for b, (s, e) in zip(blocks, spans, strict=True):
            b.request.cached += len(b.tokens)
            logits.append(self.model.lm_head(h[0, s + b.logits_from : e]))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return logits, captured


class AutoregressiveDecoding:
    """Proposer and commit rule of AR decoding: width-1 blocks (the whole prompt on the first round)."""

    def __init__(self, temperature: float = 0.0) -> None:
        self.temperature = temperature

    def propose(self, request: Request) -> Block:
        tokens = list(request.prompt) if request.cached == 0 else [request.output[-1]]
        return Block(request, tokens, logits_from=len(tokens) - 1)

    def commit(self, block: Block, logits: torch.Tensor) -> Commit:
        last = logits[-1]
        if self.temperature > 0:
            token = int(sample(probabilities(last, self.temperature), block.request.generator))
        else:
            token = int(last.float().argmax())
        block.request.output.append(token)
        return Commit(committed=1, kept_rows=len(block.tokens))


class RoundHooks:
    """What the loop calls around each target forward (``OffloadRuntime`` implements it)."""

    def begin_round(self, owners: list[tuple[Any, int]]) -> None: ...
    def end_round(self, *, kept_spans: list[tuple[int, int]]) -> None: ...
    def forget(self, rid: Any) -> None: ...


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
    scheduler: Callable[[list[Request]], list[Request]] | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> list[RoundRecord]:
    """Serve ``requests`` with ``concurrency`` in flight until all are done; returns one record per round."""
    waiting, active, rounds = deque(requests), [], []
    while waiting or active:
        round_start = clock()
        while waiting and len(active) < concurrency:
            request = waiting.popleft()
            request.cache, request.admitted_at = target.new_cache(), round_start
            active.append(request)
        batch = scheduler(list(active)) if scheduler is not None else list(active)
        blocks = [decoding.propose(r) for r in batch]
        hooks.begin_round([(b.request.rid, len(b.tokens)) for b in blocks])
        forward_start = clock()
        with nvtx_range("target_verify"):
            logits, _ = target.forward(blocks)
        forward_seconds = clock() - forward_start
        commits = [decoding.commit(b, lg) for b, lg in zip(blocks, logits, strict=True)]
        spans, row = [], 0
        for b, c in zip(blocks, commits, strict=True):
            spans.append((row, row + c.kept_rows))
            row += len(b.tokens)
        hooks.end_round(kept_spans=spans)
        end = clock()
        kv = sum(kv_bytes(r.cache) for r in active)
        for r in batch:
            if r.first_token_at is None and r.output:
                r.first_token_at = end
        for r in [r for r in active if r.done]:
            r.finished_at, r.cache = end, None
            active.remove(r)
            hooks.forget(r.rid)
        rounds.append(
            RoundRecord(
                start=round_start,
                seconds=end - round_start,
                forward_seconds=forward_seconds,
                requests=len(blocks),
                tokens=row,
                committed=[c.committed for c in commits],
                kv_bytes=kv,
            )
        )
    return rounds
