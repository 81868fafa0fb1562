"""What one round feeds the target and how AR decoding commits: requests, blocks and the target forward.

``TargetModel`` drives a transformers MoE causal LM layer by layer over the blocks of a round: embeddings, then
per decoder layer ONE attention-module call over the concatenated rows of every block (each request's KV lives
in a row of the preallocated KV arena, ``decoding/kv_arena.py``) and the MoE block ONCE over the same rows (the experts
fetched are the union over the verified requests), then norm + LM head once over the rows the blocks need. ``AutoregressiveDecoding`` proposes width-1 blocks and commits one token per round
(``decoding/speculative.py`` holds the speculative counterpart); the step loop that drives both is ``decoding/loop.py``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from pd_dflash.engine.reference import host_sync
from pd_dflash.engine.reference.decoding.kv_arena import (
    ARENA_ATTENTION,
    ArenaCache,
    KVArena,
    KVRow,
    Layout,
    build_layout,
)
from pd_dflash.engine.reference.decoding.sampling import probabilities, sample
from pd_dflash.engine.reference.families import MoEFamily
from pd_dflash.engine.request_metrics import RequestTiming


@dataclass(eq=False)
class Request:
    rid: Any
    prompt: list[int]
    max_new_tokens: int
    #: Every end-of-sequence id of the target (``generation_config.eos_token_id`` may list several): any stops it.
    eos_token_ids: frozenset[int] = frozenset()
    generator: torch.Generator | None = None
    cache: Any = None  # its KV arena row (``kv_arena.KVRow``) while in flight
    cached: int = 0  # positions of the KV cache in use (the next position): rollback lowers it
    output: list[int] = field(default_factory=list)
    #: DFlash drafter context: the target's features at the last committed positions [ctx, F].
    features: torch.Tensor | None = None
    admitted_at: float | None = None
    first_token_at: float | None = None
    finished_at: float | None = None

    @property
    def timing(self) -> RequestTiming:
        """When it was admitted, got its first token and finished, and its tokens (``request_metrics``)."""
        if self.admitted_at is None:
            raise RuntimeError(f"request {self.rid}: timed before it entered the loop")
        return RequestTiming(self.admitted_at, self.first_token_at, self.finished_at, len(self.output))

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - len(self.output)

    @property
    def done(self) -> bool:
        if len(self.output) >= self.max_new_tokens:
            return True
        return bool(self.output) and self.output[-1] in self.eos_token_ids


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
    after decoder layer ``layer``'s attention [rows, hidden]; the block's KV entries stay in layers ``0..layer``
    of the request's arena row, at the block's positions (past ``request.cached``: dropping them is free)."""

    layer: int
    residual: torch.Tensor


@dataclass
class Commit:
    committed: int  # tokens appended to the output this round (bonus included)
    kept_rows: int  # block rows whose work survives (the rest is rolled back)


class TargetModel:
    """Drives a transformers MoE causal LM layer by layer over the blocks of a round (gpt-fast spirit)."""

    def __init__(self, model: nn.Module, family: MoEFamily, device: torch.device) -> None:
        self.model, self.family, self.device = model, family, device
        config = model.config
        self.num_layers = config.num_hidden_layers
        if config._attn_implementation not in ("eager", "sdpa"):
            raise ValueError(
                f"the reference engine runs attention as 'eager' or 'sdpa', not the model's "
                f"attn_implementation {config._attn_implementation!r}"
            )
        self._eager = config._attn_implementation == "eager"
        #: transformers' attention function of the model's implementation, which ``arena_attention`` calls per
        #: block (eager: the family's own, gpt-oss's with its sinks).
        attn = model.model.layers[0].self_attn
        self._inner = (
            vars(sys.modules[type(attn).__module__])["eager_attention_forward"]
            if self._eager
            else ALL_ATTENTION_FUNCTIONS["sdpa"]
        )
        #: Each layer's attention window (None: full causal), as transformers' mask builders read the config.
        self.windows = family.attention_windows(config)
        #: Every request's KV cache: one preallocated arena (``decoding/kv_arena.py``), a row per request in flight.
        self.arena = KVArena(model, device)
        #: How the host waits for compute (set per cell to the offload runtime's, which keeps the link's
        #: prefetch queue moving meanwhile); None: the compute stream alone.
        self.sync_hook: Callable[[], None] | None = None

    def synchronize(self) -> None:
        """Block the host until the compute stream has finished: never the whole device, so prefetches on the
        link's copy streams keep running (e.g. route-ahead's history prefetches overlap the next draft)."""
        if self.sync_hook is not None:
            self.sync_hook()
        elif self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()

    def reserve(self, requests: Sequence[Request], concurrency: int, block: int) -> None:
        """Size the KV arena for a cell once: ``concurrency`` rows of the longest prompt + max_new_tokens +
        ``block`` positions (the most a round can write past the committed tokens)."""
        if requests:
            longest = max(len(r.prompt) + r.max_new_tokens for r in requests)
            self.arena.reserve(min(concurrency, len(requests)), longest + block)

    def new_cache(self) -> KVRow:
        """A request's KV cache: a free arena row (``release_cache`` when the request leaves)."""
        return self.arena.acquire()

    def release_cache(self, row: KVRow) -> None:
        self.arena.release(row)

    def kv_entries(self, request: Request, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The request's K and V entries of ``layer`` in use: ``[kv_heads, cached, head_dim]``."""
        return self.arena.entries(request.cache, layer, request.cached)

    def kv_bytes(self, requests: Sequence[Request]) -> int:
        """Bytes of the KV entries the requests hold (positions in use × K + V bytes per position, every layer);
        the arena's allocation is ``arena.allocated_bytes``."""
        return sum(r.cached for r in requests) * self.arena.bytes_per_position

    def _layout(self, blocks: Sequence[Block], layers: int) -> Layout:
        windows = set(self.windows[:layers])
        pinned = self.device.type == "cuda"
        return build_layout(self.arena, blocks, windows, self._eager, pinned, self._inner)

    @contextmanager
    def _arena_attention(self):
        """The model's attention modules look their attention function up in the config at every call: while the
        engine drives them it is ``arena_attention`` (restored after, so the model's own ``generate`` is
        untouched)."""
        config = self.model.config
        saved = config._attn_implementation_internal
        config._attn_implementation_internal = ARENA_ATTENTION
        try:
            yield
        finally:
            config._attn_implementation_internal = saved

    def _attend(self, i: int, layer: nn.Module, h: torch.Tensor, rows: Layout) -> torch.Tensor:
        """Layer ``i``'s attention in ONE call of its attention module over every block of the round (the arena
        as its KV cache); returns the residual stream after it, over the concatenated rows."""
        attn = layer.self_attn(
            hidden_states=layer.input_layernorm(h),
            position_embeddings=rows.rope,
            attention_mask=rows.masks[self.windows[i]],
            cache=ArenaCache(self.arena, rows),
            arena_layout=rows,
        )[0]
        return h + attn

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
        with self._arena_attention():
            return self._run_layers(blocks, capture, layers, keep_gate_inputs=keep_gate_inputs)

    def _run_layers(self, blocks, capture, layers, *, keep_gate_inputs: bool):
        base = self.model.model
        upto = self.num_layers if layers is None else layers
        start = self._resume_layer(blocks, capture, upto, keep_gate_inputs)
        rows = self._layout(blocks, upto)
        if start is None:
            h, start = base.embed_tokens(rows.ids), -1
        else:  # the kept residuals of the router pass
            h = torch.cat([b.prefix.residual for b in blocks])[None]
            for b in blocks:
                b.prefix = None
        rows.rope = base.rotary_emb(h, rows.positions)
        captured = {0: h} if 0 in capture else {}
        gate_inputs = {}
        for i, layer in enumerate(base.layers[:upto]):
            if i < start:
                continue  # dense layers the router pass ran whole
            if i > start:  # layer ``start``'s attention: the router pass's
                h = self._attend(i, layer, h, rows)
            mlp_in = layer.post_attention_layernorm(h)
            if keep_gate_inputs:
                gate_inputs[i] = mlp_in
            h = h + self.family.mlp(layer.mlp, mlp_in)
            if i + 1 in capture and i + 1 < self.num_layers:
                captured[i + 1] = h
        h = base.norm(h)
        if self.num_layers in capture and upto == self.num_layers:
            captured[self.num_layers] = h
        logits = self._logits(h[0], blocks, rows)
        for b in blocks:
            b.request.cached += len(b.tokens)
        self.synchronize()
        return logits, captured, gate_inputs

    def _logits(self, h: torch.Tensor, blocks: Sequence[Block], rows: Layout) -> list[torch.Tensor]:
        """The LM head once over the rows every block needs (``logits_from`` on), split per block."""
        needed = h if rows.logit_rows is None else h.index_select(0, rows.logit_rows)
        logits = self.model.lm_head(needed)
        return (
            [logits]
            if len(blocks) == 1
            else list(logits.split([len(b.tokens) - b.logits_from for b in blocks]))
        )

    @torch.no_grad()
    def first_gate_inputs(
        self, blocks: Sequence[Block], layer: int, *, keep: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The EXACT MoE input of decoder layer ``layer`` for every row of the blocks, and the residual stream
        there, without touching a routed expert: layers before it run whole (they must be dense), layer
        ``layer`` runs its attention only. The KV entries this writes sit past ``request.cached`` (so they are
        dead unless kept); with ``keep`` each block keeps a ``Prefix`` the verify resumes from (no work done
        twice). Returns ``([1, T, h] gate input, [1, T, h] residual)`` over the concatenated rows."""
        base = self.model.model
        rows = self._layout(blocks, layer + 1)
        h = base.embed_tokens(rows.ids)
        rows.rope = base.rotary_emb(h, rows.positions)
        with self._arena_attention():
            for i, dec in enumerate(base.layers[: layer + 1]):
                h = self._attend(i, dec, h, rows)
                gate = dec.post_attention_layernorm(h)
                if i < layer:
                    h = h + self.family.mlp(dec.mlp, gate)
        for b, (s, e) in zip(blocks, rows.spans, strict=True):
            b.prefix = Prefix(layer, h[0, s:e]) if keep else None
        return gate, h

    def release_prefix(self, block: Block) -> None:
        """Drop a block's kept router-pass work (the block changed — cut to fewer rows — or is verified with
        blocks that have none): its KV entries past ``request.cached`` are dead already, the verify rewrites them."""
        block.prefix = None

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


class AutoregressiveDecoding:
    """Proposer and commit rule of AR decoding: width-1 blocks (the whole prompt on the first round)."""

    speculative = False
    block_size = 1
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
