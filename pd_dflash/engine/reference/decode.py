"""What one round feeds the target and how AR decoding commits: requests, blocks and the target forward.

``TargetModel`` drives a transformers MoE causal LM layer by layer over the blocks of a round: embeddings, then
per decoder layer attention per request on its own KV cache and the MoE block ONCE over the concatenated tokens
of all requests (the experts fetched are the union over the verified requests), then norm + LM head on the rows
each block needs. ``AutoregressiveDecoding`` proposes width-1 blocks and commits one token per round
(``speculative.py`` holds the speculative counterpart); the step loop that drives both is ``serving.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from pd_dflash.engine.reference import host_sync
from pd_dflash.engine.reference.families import MoEFamily, attention_masks
from pd_dflash.engine.reference.sampling import probabilities, sample
from pd_dflash.engine.request_metrics import RequestTiming


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
    def timing(self) -> RequestTiming:
        """When it was admitted, got its first token and finished, and its tokens (``request_metrics``)."""
        return RequestTiming(self.admitted_at, self.first_token_at, self.finished_at, len(self.output))

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
    #: The router pass's work up to the first MoE layer's attention, kept for the verify (``TargetModel``).
    prefix: Prefix | None = None


@dataclass
class Prefix:
    """What route-ahead's router pass computed for a block and the verify resumes from: the residual stream
    after decoder layer ``layer``'s attention [rows, hidden], every layer's attention mask (built before the
    block touched the KV cache), and the block's KV entries, left in layers ``0..layer`` of the request's cache."""

    layer: int
    residual: torch.Tensor
    masks: list[Any]


@dataclass
class Commit:
    committed: int  # tokens appended to the output this round (bonus included)
    kept_rows: int  # block rows whose work survives (the rest is rolled back)


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
        #: How the host waits for compute (set per cell to the offload runtime's, which keeps the link's
        #: prefetch queue moving meanwhile); None: the compute stream alone.
        self.sync_hook = None

    def synchronize(self) -> None:
        """Block the host until the compute stream has finished: never the whole device, so prefetches on the
        link's copy streams keep running (e.g. route-ahead's history prefetches overlap the next draft)."""
        if self.sync_hook is not None:
            self.sync_hook()
        elif self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def new_cache(self):
        from transformers.cache_utils import DynamicCache

        return DynamicCache(config=self.model.config)

    def _spans_and_positions(self, blocks: Sequence[Block]) -> tuple[list[tuple[int, int]], torch.Tensor]:
        """Each block's (start, end) in the concatenated rows, and the rows' positions in their requests."""
        spans, start = [], 0
        for b in blocks:
            spans.append((start, start + len(b.tokens)))
            start += len(b.tokens)
        positions = torch.cat(
            [torch.arange(b.request.cached, b.request.cached + len(b.tokens)) for b in blocks]
        ).to(self.device)[None]
        return spans, positions

    def _embed(self, blocks: Sequence[Block], layers: int) -> tuple[torch.Tensor, _Rows]:
        """Embeddings of the concatenated block tokens, with each block's span, rotary terms and masks."""
        base = self.model.model
        ids = torch.tensor([t for b in blocks for t in b.tokens], device=self.device)[None]
        spans, positions = self._spans_and_positions(blocks)
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
        self, blocks: Sequence[Block], capture: Sequence[int] = (), *, layers: int | None = None
    ) -> tuple[list[torch.Tensor], dict[int, torch.Tensor]]:
        """Logits ``[rows, vocab]`` per block, and the captured hidden states ``{index: [1, T, hidden]}`` over the
        concatenated tokens (HF ``output_hidden_states`` indexing: 0 = embeddings, i = output of layer i,
        ``num_layers`` = after the final norm).

        ``layers`` runs only the first n decoder layers and applies the final norm + LM head to their output
        (the early-exit drafter).
        """
        logits, captured, _ = self._run(blocks, capture, layers, keep_gate_inputs=False)
        return logits, captured

    @torch.no_grad()
    def forward_with_gate_inputs(
        self, blocks: Sequence[Block], capture: Sequence[int] = (), *, layers: int | None = None
    ) -> tuple[list[torch.Tensor], dict[int, torch.Tensor], dict[int, torch.Tensor]]:
        """``forward``, plus each run layer's MoE input (post-norm) ``{layer: [1, T, hidden]}``: the exact gate
        inputs route-ahead predicts from when the early-exit drafter has run those layers."""
        return self._run(blocks, capture, layers, keep_gate_inputs=True)

    def _run(self, blocks, capture, layers, *, keep_gate_inputs: bool):
        base = self.model.model
        upto = self.num_layers if layers is None else layers
        start = self._resume_layer(blocks, capture, upto, keep_gate_inputs)
        if start is None:
            h, rows = self._embed(blocks, upto)
            start = -1
        else:
            h, rows = self._resume(blocks)
        captured = {0: h} if 0 in capture else {}
        gate_inputs = {}
        for i, layer in enumerate(base.layers[:upto]):
            if i < start:
                continue  # dense layers the router pass ran whole
            if i > start:  # layer ``start``'s attention: the router pass's
                h = self._attend(i, layer, h, blocks, rows)
            mlp_in = layer.post_attention_layernorm(h)
            if keep_gate_inputs:
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
        self.synchronize()
        return logits, captured, gate_inputs

    @torch.no_grad()
    def first_gate_inputs(
        self, blocks: Sequence[Block], layer: int, *, keep: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The EXACT MoE input of decoder layer ``layer`` for every row of the blocks, and the residual stream
        there, without touching a routed expert: layers before it run whole (they must be dense), layer
        ``layer`` runs its attention only. Without ``keep`` the KV entries this writes are rolled back; with it
        they stay and each block keeps a ``Prefix`` the verify resumes from (no work done twice). Returns
        ``([1, T, h] gate input, [1, T, h] residual)`` over the concatenated rows."""
        base = self.model.model
        h, rows = self._embed(blocks, self.num_layers if keep else layer + 1)
        for i, dec in enumerate(base.layers[: layer + 1]):
            h = self._attend(i, dec, h, blocks, rows)
            gate = dec.post_attention_layernorm(h)
            if i < layer:
                h = h + self.family.mlp(dec.mlp, gate)
        for j, b in enumerate(blocks):
            s, e = rows.spans[j]
            if keep:
                b.prefix = Prefix(layer, h[0, s:e], rows.masks[j])
            else:
                self._crop_prefix_layers(b, layer)
        return gate, h

    def release_prefix(self, block: Block) -> None:
        """Drop a block's kept router-pass work (its KV entries leave layers 0..prefix.layer): the block changed
        (cut to fewer rows) or is verified with blocks that have none."""
        if block.prefix is not None:
            self._crop_prefix_layers(block, block.prefix.layer)
            block.prefix = None

    def _crop_prefix_layers(self, block: Block, layer: int) -> None:
        for cached_layer in block.request.cache.layers[: layer + 1]:
            cached_layer.crop(-len(block.tokens))

    def _resume_layer(self, blocks, capture, upto: int, keep_gate_inputs: bool) -> int | None:
        """The layer a full forward can resume at (every block kept the same prefix and nothing before it is
        asked for); otherwise None, after dropping whatever prefixes there are."""
        layers = {b.prefix.layer if b.prefix is not None else None for b in blocks}
        if len(layers) == 1 and None not in layers:
            (start,) = layers
            if upto == self.num_layers and not keep_gate_inputs and not any(0 <= i <= start for i in capture):
                return start
        for b in blocks:
            self.release_prefix(b)
        return None

    def _resume(self, blocks: Sequence[Block]) -> tuple[torch.Tensor, _Rows]:
        """The kept residuals concatenated, with rotary terms for the block positions and the kept masks."""
        base = self.model.model
        h = torch.cat([b.prefix.residual for b in blocks])[None]
        spans, positions = self._spans_and_positions(blocks)
        rows = _Rows(spans, base.rotary_emb(h, positions), [b.prefix.masks for b in blocks])
        for b in blocks:
            b.prefix = None
        return h, rows


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
        return int(host_sync.item("token", sample(probabilities(logits, temperature), generator)))
    return int(host_sync.item("token", logits.float().argmax()))
