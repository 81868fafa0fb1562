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
   ``w1[expert_indices]``), recorded in the row's ``engine.expert_compute``. On CUDA, ``grouped_mm`` only where
   torch runs its device kernel: compute capability major 9 or 10 (torch's host-side gate; an RTX PRO 6000,
   12.0, takes ATen's mm loop, which reads ``offs`` on the host: one sync and one mm per group) AND a probe at
   the first pool of the device — one tiny ``_grouped_mm`` under ``torch.cuda.set_sync_debug_mode("error")`` —
   that ran clean;
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
from typing import Any

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


#: Compute-capability majors whose CUDA ``_grouped_mm`` is torch's device kernel (sm_90, sm_100); every other
#: major takes the mm loop over groups, which reads ``offs`` on the host (../shared/research/gpu-targets.md).
FAST_KERNEL_MAJORS = (9, 10)
#: The probe's outcome per CUDA device (``str(device)``): run once per process, at the device's first pool.
_PROBES: dict[str, dict[str, Any]] = {}


def expert_compute_kind(pool: list[torch.Tensor]) -> str:
    """The path ``expert_compute_choice`` picks for this pool."""
    return expert_compute_choice(pool)["path"]


def expert_compute_choice(pool: list[torch.Tensor]) -> dict[str, Any]:
    """``{"path": grouped_mm | gathered_bmm, "why": ..., "capability", "probe"}`` (the row's
    ``engine.expert_compute``). ``grouped_mm`` where torch computes this pool's dtype on this device without a
    host sync (CUDA: ``cuda_choice``), its strides are 16-byte multiples (the kernel's requirement) and, on the
    CPU, the pool has at most ``CPU_GROUPED_MM_MAX_SLOTS`` slots; else ``gathered_bmm``."""
    matrices = [p for p in pool if p.dim() == 3]
    device, dtype = matrices[0].device, matrices[0].dtype
    if not hasattr(torch, "_grouped_mm"):
        return _choice(GATHERED_BMM, f"torch {torch.__version__} has no _grouped_mm")
    if device.type == "cuda":
        choice = cuda_choice(device, dtype)
        if choice["path"] != GROUPED_MM:
            return choice
    elif device.type != "cpu" or dtype not in _CPU_DTYPES:
        return _choice(GATHERED_BMM, f"no grouped GEMM for {dtype} on {device.type}")
    elif matrices[0].shape[0] > CPU_GROUPED_MM_MAX_SLOTS:
        return _choice(GATHERED_BMM, f"a CPU pool of more than {CPU_GROUPED_MM_MAX_SLOTS} slots")
    else:
        choice = _choice(GROUPED_MM, f"torch's CPU grouped GEMM for {dtype}")
    size = dtype.itemsize
    for p in matrices:
        if any(s * size % 16 for s in p.stride()[:-1]) or p.stride()[-1] != 1 or p.data_ptr() % 16:
            return {**choice, "path": GATHERED_BMM, "why": "the pool's strides are not 16-byte multiples"}
    return choice


def cuda_choice(device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    """The CUDA decision: bf16, a capability whose major torch admits to its fast kernel, and a clean probe (run
    on every CUDA device, once, and recorded either way: on a major torch does not admit it shows the sync)."""
    capability = tuple(torch.cuda.get_device_capability(device))
    key = str(device if device.index is not None else torch.device("cuda", torch.cuda.current_device()))
    if key not in _PROBES:
        _PROBES[key] = probe_grouped_mm(device)
    probe = _PROBES[key]
    facts = {"capability": list(capability), "probe": probe}
    if dtype != torch.bfloat16:
        return _choice(GATHERED_BMM, f"torch's CUDA grouped GEMM computes bf16, not {dtype}", **facts)
    if capability[0] not in FAST_KERNEL_MAJORS:
        why = (
            f"compute capability {capability[0]}.{capability[1]}: torch's fast kernel admits majors 9 and 10"
        )
        return _choice(GATHERED_BMM, why + " only (the mm loop would read offs on the host)", **facts)
    if not (probe.get("sync_free") and probe.get("matches_mm")):
        why = probe.get("error") or "its result differs from two mms"
        return _choice(GATHERED_BMM, f"the grouped_mm probe was not clean: {why}", **facts)
    return _choice(GROUPED_MM, "torch's fast kernel; the probe ran without a host sync", **facts)


def probe_grouped_mm(device: torch.device) -> dict[str, Any]:
    """One tiny bf16 ``_grouped_mm`` (2 groups of 4 rows, 16 × 16) under ``set_sync_debug_mode("error")``: the
    mm-loop fallback's host read of ``offs`` raises there, the device kernel does not. Inputs are made on the
    device before the mode is set (nothing else in the probe syncs); the result is checked against two mms."""
    x = torch.randn(8, 16, dtype=torch.bfloat16, device=device)
    w = torch.randn(2, 16, 16, dtype=torch.bfloat16, device=device)
    offs = torch.arange(4, 9, 4, dtype=torch.int32, device=device)
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        y = torch._grouped_mm(x, w, offs=offs)
    except RuntimeError as exc:
        return {"sync_free": False, "error": str(exc).splitlines()[0][:300]}
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    want = torch.cat([x[:4] @ w[0], x[4:] @ w[1]]).float()
    return {"sync_free": True, "matches_mm": bool(torch.allclose(y.float(), want, rtol=2e-2, atol=2e-2))}


def _choice(path: str, why: str, **facts: Any) -> dict[str, Any]:
    return {"path": path, "why": why, "capability": None, "probe": None, **facts}


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
