"""The target's KV cache as one preallocated arena, and the padded layout that runs a round's attention in ONE
call per decoder layer over every block of the round (gpt-fast's static KV cache, batched across requests).

**Arena.** Per decoder layer one K and one V tensor ``[slots, kv_heads, max_len, head_dim]`` (transformers'
``[batch, heads, seq, dim]`` layout per slot); a request owns a slot (``KVRow``) while it is in flight. An entry
is stored at its token's **position**, so the valid entries of a request are exactly positions
``0 .. request.cached − 1``: rolling rejected speculative rows back is ``request.cached -= n`` (length
bookkeeping, no tensor touched). Entries past ``cached`` are dead: a query at position p attends keys ≤ p only,
and every key in ``[cached, p]`` is written by the same forward before its attention reads it (each layer writes
its block rows first). The arena is sized once per cell (``reserve``: slots = concurrency, ``max_len`` = longest
prompt + max_new_tokens + block) and grows (a copy, not per step) only if a caller goes beyond it.

**Layout** (``Layout.build``, once per forward): the round's rows are concatenated ``[1, T, hidden]`` for the
norms and the MoE block (padding never reaches the MoE: its routing and statistics see the real rows only) and
padded ``[n, R, hidden]`` (n blocks, R = the longest) for attention. Ids, positions and every index are built on
the host and copied to the device in ONE transfer (pinned on CUDA); the masks are built on the device once per
forward and attention-window size (causal by position, sliding windows by their width, padding rows attend key
0 only, so no row is fully masked). Transformers' own attention modules run on the padded rows with
``ArenaCache`` as their ``cache``: q/k norms, RoPE, GQA and gpt-oss's sinks stay theirs.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn


def attention_windows(config) -> list[int | None]:
    """Each decoder layer's attention window (None: full causal), by transformers' rule: gpt-oss alternates
    ``layer_types`` (sliding layers use ``sliding_window``); the other families slide every layer when
    ``sliding_window`` is set."""
    layers = config.num_hidden_layers
    if config.model_type == "gpt_oss":
        return [
            config.sliding_window if t == "sliding_attention" else None for t in config.layer_types[:layers]
        ]
    return [getattr(config, "sliding_window", None)] * layers


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
        self.peak_allocated_bytes = 0

    @property
    def bytes_per_position(self) -> int:
        """K + V bytes of one token over every layer (layers × 2 × kv_heads × head_dim × element size)."""
        return self.num_layers * 2 * self.kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def allocated_bytes(self) -> int:
        """The arena's K/V tensors (the spare row included), whatever they hold."""
        return (self.slots + 1) * self.max_len * self.bytes_per_position if self.keys else 0

    def reserve(self, slots: int, max_len: int) -> None:
        """Hold at least ``slots`` rows of ``max_len`` positions (one allocation; kept entries are copied). One
        more physical row, the spare (index ``slots``), takes the padding rows' writes and is never handed out."""
        slots, max_len = max(slots, self.slots), max(max_len, self.max_len)
        if (slots, max_len) == (self.slots, self.max_len):
            return
        shape = (slots + 1, self.kv_heads, max_len, self.head_dim)
        for tensors in (self.keys, self.values):
            for i in range(self.num_layers):
                new = torch.zeros(shape, dtype=self.dtype, device=self.device)
                if len(tensors) == self.num_layers:
                    new[: self.slots + 1, :, : self.max_len] = tensors[i]
                    tensors[i] = new
                else:
                    tensors.append(new)
        self._free += range(self.slots, slots)
        self.slots, self.max_len = slots, max_len
        self.peak_allocated_bytes = max(self.peak_allocated_bytes, self.allocated_bytes)

    def acquire(self) -> KVRow:
        """A free slot (the lowest, so a full round's slots are usually one contiguous range)."""
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
    """Where a round's rows sit: concatenated ``[1, T]`` and padded ``[n, R]``, on the device (built once)."""

    ids: torch.Tensor  # [1, T] token ids, concatenated
    positions: torch.Tensor  # [n, R] positions (padding: 0)
    write_slots: torch.Tensor  # [n, R] arena slot each padded row is written to (padding: the spare slot)
    write_positions: (
        torch.Tensor
    )  # [n, R] position it is written at (padding: its row index in the spare slot)
    flat: torch.Tensor | None  # [T] padded index (j·R + r) of each concatenated row; None when no padding
    read: slice | torch.Tensor  # the round's slots in block order (a slice when contiguous)
    logit_rows: torch.Tensor | None  # [L] concatenated rows the LM head needs; None: all of them
    spans: list[tuple[int, int]]
    kv_len: int
    masks: dict[int | None, torch.Tensor]  # attention-window size (None: full causal) → [n, 1, R, kv_len]
    rope: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.positions.shape)

    def pad(self, x: torch.Tensor) -> torch.Tensor:
        """``[1, T, h]`` → ``[n, R, h]`` (padding rows are zeros)."""
        n, r = self.shape
        if self.flat is None:
            return x.view(n, r, x.shape[-1])
        return x.new_zeros(n * r, x.shape[-1]).index_copy_(0, self.flat, x[0]).view(n, r, x.shape[-1])

    def unpad(self, y: torch.Tensor) -> torch.Tensor:
        """``[n, R, h]`` → ``[1, T, h]``: the real rows only."""
        if self.flat is None:
            return y.reshape(1, -1, y.shape[-1])
        return y.reshape(-1, y.shape[-1]).index_select(0, self.flat)[None]


def build_layout(arena: KVArena, blocks, windows: set[int | None], eager: bool, pinned: bool) -> Layout:
    """The round's layout from its blocks (``decode.Block``): one host→device copy, then the masks on device."""
    lens = [len(b.tokens) for b in blocks]
    starts = [b.request.cached for b in blocks]
    n, rows = len(blocks), max(lens)
    kv_len = max(s + k for s, k in zip(starts, lens, strict=True))
    arena.reserve(arena.slots, kv_len)  # beyond the cell's reservation only when a caller goes past it
    spare = arena.slots  # the padding rows' writes land there
    slots = [b.request.cache.slot for b in blocks]
    ids = [t for b in blocks for t in b.tokens]
    positions, write_slots, write_positions, flat, spans, logit_rows, t = [], [], [], [], [], [], 0
    for j, (b, s, k) in enumerate(zip(blocks, starts, lens, strict=True)):
        positions += [*range(s, s + k), *[0] * (rows - k)]
        write_slots += [slots[j]] * k + [spare] * (rows - k)
        write_positions += [*range(s, s + k), *range(k, rows)]
        flat += range(j * rows, j * rows + k)
        spans.append((t, t + k))
        logit_rows += range(t + b.logits_from, t + k)
        t += k
    contiguous = slots == list(range(slots[0], slots[0] + n))
    uniform, all_logits = n * rows == t, len(logit_rows) == t
    host = torch.tensor(
        [*ids, *positions, *write_slots, *write_positions, *flat, *slots, *logit_rows],
        dtype=torch.long,
        pin_memory=pinned,
    )
    dev = host.to(arena.device, non_blocking=pinned)
    parts = dev.split([t, n * rows, n * rows, n * rows, t, n, len(logit_rows)])
    positions_t = parts[1].view(n, rows)
    return Layout(
        ids=parts[0][None],
        positions=positions_t,
        write_slots=parts[2].view(n, rows),
        write_positions=parts[3].view(n, rows),
        flat=None if uniform else parts[4],
        read=slice(slots[0], slots[0] + n) if contiguous else parts[5],
        logit_rows=None if all_logits else parts[6],
        spans=spans,
        kv_len=kv_len,
        masks=_masks(positions_t, kv_len, windows, arena.dtype if eager else None),
    )


def _masks(positions: torch.Tensor, kv_len: int, windows, dtype) -> dict[int | None, torch.Tensor]:
    """Per window: True (or 0.0 for eager attention, which adds it) where a query may attend a key: the key's
    position is ≤ the query's and, for a sliding window w, > the query's − w (transformers' rule)."""
    keys = torch.arange(kv_len, device=positions.device)
    q = positions[:, None, :, None]
    causal = keys <= q
    out = {}
    for w in windows:
        allowed = causal if w is None else causal & (keys > q - w)
        if dtype is not None:
            allowed = torch.where(
                allowed, torch.zeros((), dtype=dtype, device=q.device), torch.finfo(dtype).min
            )
        out[w] = allowed
    return out


class ArenaCache:
    """The ``cache`` transformers' attention modules call: writes a layer's new K/V rows into the arena at their
    slots and positions, and returns the round's padded K/V ``[n, kv_heads, kv_len, head_dim]``."""

    def __init__(self, arena: KVArena, layout: Layout) -> None:
        self.arena, self.layout = arena, layout

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        lay = self.layout
        out = []
        for store, new in (
            (self.arena.keys[layer_idx], key_states),
            (self.arena.values[layer_idx], value_states),
        ):
            store[lay.write_slots, :, lay.write_positions] = new.transpose(1, 2)
            window = store[:, :, : lay.kv_len]
            out.append(window[lay.read] if isinstance(lay.read, slice) else window.index_select(0, lay.read))
        return out[0], out[1]
