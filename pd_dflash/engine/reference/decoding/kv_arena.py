"""The target's KV cache as one preallocated arena, and the layout that runs a round's attention as ONE call of
each decoder layer's attention module over every block of the round (gpt-fast's static KV cache, batched).

**Arena.** Per decoder layer one K and one V tensor ``[slots, kv_heads, max_len, head_dim]`` (transformers'
``[batch, heads, seq, dim]`` layout per slot); a request owns a slot (``KVRow``) while it is in flight. An entry
is stored at its token's **position**, so the valid entries of a request are exactly positions
``0 .. request.cached − 1``: rolling rejected speculative rows back is ``request.cached -= n`` (length
bookkeeping, no tensor touched). Entries past ``cached`` are dead: a query at position p attends keys ≤ p only,
and every key in ``[cached, p]`` is written by the same forward before its attention reads it (each layer writes
its block rows first). The arena is sized once per cell (``reserve``: slots = concurrency, ``max_len`` = longest
prompt + max_new_tokens + block) and grows (a copy, not per step) only if a caller goes beyond it.

**Layout** (``build_layout``, once per forward): ids, positions and every index are built on the host and
copied to the device in ONE transfer (pinned on CUDA); the masks are built on the device once per forward and
attention window (causal by position; sliding windows by their width, transformers' rule). Each layer then runs
transformers' own attention module ONCE over the round's concatenated rows ``[1, T, hidden]`` (projections,
q/k norms, RoPE — and gpt-oss's sinks — stay theirs), with ``ArenaCache`` as its ``cache`` (one ``index_put_``
per K and V writes every block's rows at their slots and positions) and ``arena_attention`` as its attention
function: the softmax kernel itself runs per block on the block's exact query rows and KV length (strided views
of the arena, no copy; blocks in lockstep — equal rows and KV lengths, consecutive slots — share one call as
batch elements). That is what keeps the engine bit-identical to transformers' per-sequence attention:
attention kernels tile by length (measured on CPU bf16: padding the keys of a query past the next multiple of 16
changes its output bits), so ONE padded kernel call would change a bf16 model's greedy tokens with the batch's
composition. There are no padding rows: the norms, the projections and the MoE block see the real rows only.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AttentionInterface


@dataclass(eq=False)
class KVRow:
    """A request's slot in the arena, held from admission until it retires."""

    slot: int


class KVArena:
    """Per-layer K/V tensors ``[slots, kv_heads, max_len, head_dim]``; slots handed out to requests in flight."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        attn = model.model.layers[0].self_attn
        self.num_layers = model.config.num_hidden_layers
        self.head_dim = int(attn.head_dim)
        self.kv_heads = attn.k_proj.out_features // self.head_dim
        self.dtype, self.device = attn.k_proj.weight.dtype, device
        self.slots, self.max_len = 0, 0
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self._free: list[int] = []

    @property
    def bytes_per_position(self) -> int:
        """K + V bytes of one token over every layer (layers × 2 × kv_heads × head_dim × element size)."""
        return self.num_layers * 2 * self.kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def allocated_bytes(self) -> int:
        """The arena's K/V tensors, whatever they hold."""
        return self.slots * self.max_len * self.bytes_per_position

    def reserve(self, slots: int, max_len: int) -> None:
        """Hold at least ``slots`` rows of ``max_len`` positions (one allocation per layer; kept entries are
        copied)."""
        slots, max_len = max(slots, self.slots), max(max_len, self.max_len)
        if (slots, max_len) == (self.slots, self.max_len):
            return
        shape = (slots, self.kv_heads, max_len, self.head_dim)
        for tensors in (self.keys, self.values):
            for i in range(self.num_layers):
                new = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if len(tensors) == self.num_layers:
                    new[: self.slots, :, : self.max_len] = tensors[i]
                    tensors[i] = new
                else:
                    tensors.append(new)
        self._free += range(self.slots, slots)
        self.slots, self.max_len = slots, max_len

    def acquire(self) -> KVRow:
        """A free slot (the lowest: deterministic, whatever order requests retired in)."""
        if not self._free:
            self.reserve(max(1, 2 * self.slots), max(self.max_len, 1))
        self._free.sort()
        return KVRow(self._free.pop(0))

    def release(self, row: KVRow) -> None:
        self._free.append(row.slot)

    def entries(self, row: KVRow, layer: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A row's K and V of ``layer`` at positions ``0 .. length − 1``: ``[kv_heads, length, head_dim]``."""
        return self.keys[layer][row.slot, :, :length], self.values[layer][row.slot, :, :length]


@dataclass
class Layout:
    """Where a round's rows sit (concatenated ``[1, T]``), on the device, built once per forward."""

    ids: torch.Tensor  # [1, T] token ids
    positions: torch.Tensor  # [1, T] positions in their requests
    #: Arena index of each row's K/V entry, broadcast to ``[1, kv_heads, T]``: (slot, head, position).
    write: tuple[torch.Tensor, torch.Tensor, torch.Tensor]
    slots: list[int]
    spans: list[tuple[int, int]]
    #: Per block, its KV length after this forward (its cached positions + its rows).
    kv_lens: list[int]
    #: Every block has as many rows and as long a KV as the others, in consecutive slots: ONE kernel call runs
    #: them all, each batch element exactly its block (no padding anywhere).
    lockstep: bool
    #: Attention window (None: full causal) → the blocks' masks, additive (what the model's attention
    #: implementation expects): ``[n, 1, rows, kv_len]`` for one block or blocks in lockstep, else one
    #: ``[1, 1, rows, kv_len]`` per block.
    masks: dict[int | None, torch.Tensor | list[torch.Tensor]]
    logit_rows: torch.Tensor | None  # [L] rows the LM head needs; None: all of them
    #: transformers' attention function of the model's implementation (sdpa or the family's eager one).
    inner: Callable
    rope: tuple[torch.Tensor, torch.Tensor] | None = None


def build_layout(
    arena: KVArena, blocks, windows: set[int | None], eager: bool, pinned: bool, inner
) -> Layout:
    """The round's layout from its blocks (``target.Block``): one host→device copy, then the masks on device."""
    lens = [len(b.tokens) for b in blocks]
    starts = [b.request.cached for b in blocks]
    n, rows = len(blocks), max(lens)
    kv_lens = [s + k for s, k in zip(starts, lens, strict=True)]
    if max(kv_lens) > arena.max_len:  # past the cell's reservation (a caller outside the step loop): grow
        arena.reserve(arena.slots, max(max(kv_lens), 2 * arena.max_len))
    missing = [b.request.rid for b in blocks if not isinstance(b.request.cache, KVRow)]
    if missing:
        raise ValueError(f"requests {missing} hold no KV arena row: give each one TargetModel.new_cache()")
    slots = [b.request.cache.slot for b in blocks]
    ids = [t for b in blocks for t in b.tokens]
    positions, padded, write_slots, spans, logit_rows, t = [], [], [], [], [], 0
    for b, s, k, slot in zip(blocks, starts, lens, slots, strict=True):
        positions += range(s, s + k)
        padded += [*range(s, s + k), *[0] * (rows - k)]
        write_slots += [slot] * k
        spans.append((t, t + k))
        logit_rows += range(t + b.logits_from, t + k)
        t += k
    host = torch.tensor(
        [*ids, *positions, *write_slots, *range(arena.kv_heads), *padded, *logit_rows],
        dtype=torch.long,
        pin_memory=pinned,
    )
    dev = host.to(arena.device, non_blocking=pinned)
    ids_t, pos_t, slots_t, heads_t, padded_t, logit_t = dev.split(
        [t, t, t, arena.kv_heads, n * rows, len(logit_rows)]
    )
    masks = _masks(padded_t.view(n, rows), max(kv_lens), windows, arena.dtype, eager)
    lockstep = len({*lens}) == len({*kv_lens}) == 1 and slots == list(range(slots[0], slots[0] + n))
    if not lockstep:
        per_block = list(enumerate(zip(lens, kv_lens, strict=True)))
        masks = {w: [m[j : j + 1, :, :k, :kv] for j, (k, kv) in per_block] for w, m in masks.items()}
    return Layout(
        ids=ids_t[None],
        positions=pos_t[None],
        write=(slots_t.view(1, 1, t), heads_t.view(1, -1, 1), pos_t.view(1, 1, t)),
        slots=slots,
        spans=spans,
        kv_lens=kv_lens,
        lockstep=lockstep,
        masks=masks,
        logit_rows=None if len(logit_rows) == t else logit_t,
        inner=inner,
    )


def _masks(
    positions: torch.Tensor, kv_len: int, windows, dtype, eager: bool
) -> dict[int | None, torch.Tensor]:
    """Per window, the additive mask ``[n, 1, R, kv_len]``: 0 where a query may attend a key — the key's
    position is ≤ the query's and, for a sliding window w, > the query's − w (transformers' rule) — else
    transformers' eager fill (the dtype's min) or −inf for SDPA (what SDPA makes of transformers' boolean mask)."""
    keys = torch.arange(kv_len, device=positions.device)
    q = positions[:, None, :, None]
    causal = keys <= q
    zero = torch.zeros((), dtype=dtype, device=q.device)
    fill = torch.finfo(dtype).min if eager else float("-inf")
    out = {}
    for w in windows:
        allowed = causal if w is None else causal & (keys > q - w)
        out[w] = torch.where(allowed, zero, fill)
    return out


class ArenaCache:
    """The ``cache`` transformers' attention modules call: writes a layer's new K/V rows into the arena at their
    slots and positions (one ``index_put_`` each), and returns the blocks' K/V windows as strided views of the
    arena: ``[n, kv_heads, kv_len, head_dim]`` for one block or blocks in lockstep, else a list of
    ``[1, kv_heads, kv_len_j, head_dim]`` (which ``arena_attention`` takes)."""

    def __init__(self, arena: KVArena, layout: Layout) -> None:
        self.arena, self.layout = arena, layout

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        lay = self.layout
        out = []
        for store, new in (
            (self.arena.keys[layer_idx], key_states),
            (self.arena.values[layer_idx], value_states),
        ):
            store.index_put_(lay.write, new)
            stride, heads, dim = store.stride(), store.shape[1], store.shape[3]
            if lay.lockstep:
                size = (len(lay.slots), heads, lay.kv_lens[0], dim)
                out.append(store.as_strided(size, stride, lay.slots[0] * stride[0]))
                continue
            out.append(
                [
                    store.as_strided((1, heads, kv, dim), stride, slot * stride[0])
                    for slot, kv in zip(lay.slots, lay.kv_lens, strict=True)
                ]
            )
        return out[0], out[1]


def arena_attention(module, query, key, value, attention_mask, *, arena_layout: Layout, **kwargs):
    """The attention function the target runs under (``ARENA_ATTENTION``): transformers' own function of the
    model's implementation, on each block's query rows (a strided view of the round's queries) and its exact KV
    window; the outputs concatenated back to the round's rows ``[1, T, heads, head_dim]``."""
    inner = arena_layout.inner
    _, heads, total, dim = query.shape
    stride, offset = query.stride(), query.storage_offset()
    if isinstance(key, torch.Tensor):
        n = key.shape[0]
        if n == 1:
            return inner(module, query, key, value, attention_mask, **kwargs)
        rows = total // n  # blocks in lockstep: the round's rows as n batch elements
        size, strides = (n, heads, rows, dim), (rows * stride[2], stride[1], stride[2], stride[3])
        out = inner(module, query.as_strided(size, strides, offset), key, value, attention_mask, **kwargs)[0]
        return out.reshape(1, total, heads, dim), None
    outs = [
        inner(
            module,
            query.as_strided((1, heads, e - s, dim), stride, offset + s * stride[2]),
            k,
            v,
            m,
            **kwargs,
        )[0]
        for (s, e), k, v, m in zip(arena_layout.spans, key, value, attention_mask, strict=True)
    ]
    return torch.cat(outs, dim=1), None


#: The name the target's attention modules look their attention function up by while the engine drives them.
ARENA_ATTENTION = "pd_dflash_arena"
AttentionInterface.register(ARENA_ATTENTION, arena_attention)
