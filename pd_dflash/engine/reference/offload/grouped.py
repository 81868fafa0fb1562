"""A MoE layer's routed experts in a constant number of ops, however many experts it routes to.

The device expert cache is a slot pool (``ExpertCache.pool``: one ``[slots, ...]`` tensor per compute tensor) with
a device-side ``(layer, expert) → slot`` table (``ExpertCache.slot_table``, −1 = absent). Per MoE layer
(``LayerCompute``, the idea of transformers' ``grouped_mm_experts_forward`` over slots instead of experts):

1. each token's experts in ascending id order (one sort of ``[tokens, k]``), the pairs flattened token-major,
   get their slot by ONE gather from the table row of the layer;
2. ONE stable sort by slot; group offsets by ``histc`` + ``cumsum`` over ALL slots (empty groups cost nothing;
   no ``torch.unique``, so no host sync and nothing data-dependent on the host);
3. the family's expert function (``families/``: ``MoEFamily.grouped_fn``) with one grouped GEMM per projection (``torch._grouped_mm``)
   — or, where the device/dtype/strides lack it or (CPU) the pool has too many slots for torch's CPU loop over
   groups, the named fallback ``gathered_bmm``: each pair's weights gathered by slot and one ``bmm`` (gpt-fast's
   ``w1[expert_indices]``), recorded in the row's ``engine.expert_compute``;
4. routing weights multiplied; the pair outputs go back to their token's row (one ``index_copy_``) and are summed
   per token in ascending expert order, the eager experts module's ``index_add_`` order. The GEMMs and that sum
   are the eager ones bit for bit; CPU elementwise kernels (SiLU, sigmoid) may round an element differently
   depending on where it falls in a vector, so outputs agree with the eager module to fp32 rounding (tested,
   with equal greedy tokens against transformers' ``generate``), whatever slot each expert occupies.

A cache smaller than a layer's union computes it in chunks (``compute(experts)``: pairs of other experts go to a
sentinel group past the last slot, which the GEMMs skip, and are written to a dump row); the per-token sum runs
once, at ``finish``, over every chunk's outputs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from pd_dflash.engine.reference.host_sync import to_device

GROUPED_MM = "grouped_mm"
GATHERED_BMM = "gathered_bmm"
#: Dtypes ``torch._grouped_mm`` computes: all three on the CPU (torch ≥ 2.9); bf16 only on CUDA (SM80+), where
#: others would take ATen's fallback, which reads the offsets on the host.
_CPU_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: torch's CPU ``_grouped_mm`` loops over every group, empty ones included (≈ 5 µs each, measured on this VM:
#: 6,144 groups took 31 ms per call against 46 µs for the gathered bmm of 8 pairs); beyond this many slots the
#: CPU takes the gathered bmm. CUDA's grouped kernel schedules the groups on the device.
CPU_GROUPED_MM_MAX_SLOTS = 64

#: ``mm(x, w)``: x [S, in] (sorted by slot) times the slot's ``w [slots, in, out]`` for each row.
Matmul = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
#: A family's experts over sorted rows: ``fn(x, pool, mm, slots) -> [S, hidden]`` (``slots``: each row's slot).
GroupedFn = Callable[[torch.Tensor, list[torch.Tensor], Matmul, torch.Tensor], torch.Tensor]


def expert_compute_kind(pool: list[torch.Tensor]) -> str:
    """``grouped_mm`` where torch computes this pool's dtype on this device, its strides are 16-byte multiples
    (the kernel's requirement) and, on the CPU, the pool has at most ``CPU_GROUPED_MM_MAX_SLOTS`` slots; else
    ``gathered_bmm``."""
    if not hasattr(torch, "_grouped_mm"):
        return GATHERED_BMM
    matrices = [p for p in pool if p.dim() == 3]
    device, dtype = matrices[0].device, matrices[0].dtype
    if device.type == "cuda":
        if dtype != torch.bfloat16 or torch.cuda.get_device_capability(device) < (8, 0):
            return GATHERED_BMM
    elif device.type != "cpu" or dtype not in _CPU_DTYPES or matrices[0].shape[0] > CPU_GROUPED_MM_MAX_SLOTS:
        return GATHERED_BMM
    size = dtype.itemsize
    for p in matrices:
        if any(s * size % 16 for s in p.stride()[:-1]) or p.stride()[-1] != 1 or p.data_ptr() % 16:
            return GATHERED_BMM
    return GROUPED_MM


class LayerCompute:
    """One MoE layer's experts over the slot pool (the module doc): ``compute`` once (or per chunk), ``finish``."""

    def __init__(
        self,
        hidden: torch.Tensor,
        top_k_index: torch.Tensor,
        top_k_weights: torch.Tensor,
        slots,
        layer: int,
        fn: GroupedFn,
        kind: str | None = None,
    ) -> None:
        """``slots``: the cache's ``SlotPool`` (its table is read at each ``compute``, after the layer's fetches);
        ``kind``: ``grouped_mm`` / ``gathered_bmm`` (default: the pool's)."""
        self.hidden, self.weights, self.slots, self.layer, self.fn = hidden, top_k_weights, slots, layer, fn
        self.pool = slots.pool
        self.kind = kind or slots.expert_compute
        self.tokens, self.top_k = top_k_index.shape
        self.num_slots = self.pool[0].shape[0]
        # Each token's experts in ascending id order (the eager accumulation order), flattened token-major:
        # pair i is (token i // k, i-th smallest expert of it) and its output goes to row i.
        experts, order = top_k_index.sort(dim=1)
        self.pair_expert = experts.reshape(-1)
        self.pair_weight = top_k_weights.gather(1, order).reshape(-1)
        rows = self.tokens * self.top_k
        self.out = torch.empty(rows + 1, hidden.shape[-1], dtype=hidden.dtype, device=hidden.device)

    def compute(self, experts: list[int] | None = None) -> None:
        """The pairs of ``experts`` (None: every pair; their slots must all be in the table)."""
        table_row = self.slots.table[self.layer]
        slot = table_row[self.pair_expert]
        n = self.num_slots
        if experts is not None:
            member = torch.zeros(table_row.shape[0], dtype=torch.bool)
            member[experts] = True
            member = to_device(member, slot.device)[self.pair_expert]
            slot = torch.where(member, slot, n)  # the sentinel group, past the last slot
        slot, perm = torch.sort(slot, stable=True)
        bins = n + (experts is not None)
        counts = torch.histc(
            slot.float() if slot.device.type == "cpu" else slot.int(), bins=bins, min=0, max=bins
        )
        offsets = counts[:n].cumsum(0, dtype=torch.int32)
        x = self.hidden[perm // self.top_k]
        safe = slot if experts is None else slot.clamp(max=n - 1)
        y = self.fn(x, self.pool, self._matmul(offsets, safe), safe)
        y = y * self.pair_weight[perm, None]
        dest = perm if experts is None else torch.where(slot < n, perm, self.tokens * self.top_k)  # dump row
        self.out.index_copy_(0, dest, y.to(self.out.dtype))

    def finish(self) -> torch.Tensor:
        """Each token's expert outputs summed in ascending expert order (the eager accumulation order)."""
        parts = self.out[:-1].view(self.tokens, self.top_k, -1).unbind(1)
        total = parts[0]
        for p in parts[1:]:
            total = total + p
        return total

    def _matmul(self, offsets: torch.Tensor, slots: torch.Tensor) -> Matmul:
        if self.kind == GROUPED_MM:
            return lambda x, w: torch._grouped_mm(x, w, offs=offsets)
        return lambda x, w: torch.bmm(x[:, None], w[slots])[:, 0]
