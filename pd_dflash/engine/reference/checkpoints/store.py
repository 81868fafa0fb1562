"""The host store of a checkpoint's experts, filled by streaming the safetensors files into it.

Each MoE layer is one ``[E, expert_nbytes]`` byte tensor: expert e's parts (``ExpertLayout.parts``: bf16
weights, or MXFP4 blocks + scales + biases) lie back to back in row e, exactly as many bytes as the checkpoint
stores, so one expert is ONE host→device copy. The layers are views of one ``HostArena`` (``offload/store.py``:
allocated once from the total, pinned in place once filled on CUDA — no per-tensor pinned allocations, which
torch rounds up to powers of two). The loader reads the files straight into the parts' views; nothing is
converted on the host. On the device a slot's bytes are viewed as the parts again: as is when they are the
compute dtype (``compute_views``: the slot pool views the bytes), else dequantised once when they land (MXFP4 →
the compute dtype, ``offload/cache.py``).
"""

from __future__ import annotations

import ctypes
import mmap

import torch

from pd_dflash.engine.reference.checkpoints import mxfp4
from pd_dflash.engine.reference.families.layouts import ExpertLayout
from pd_dflash.engine.reference.offload.store import PAGE, HostArena, HostExpertStore

TORCH_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "U8": torch.uint8}
_MADV_POPULATE_WRITE = 23  # Linux ≥ 5.14
try:
    _LIBC = ctypes.CDLL(None, use_errno=True)
except OSError:  # pragma: no cover - not a POSIX libc
    _LIBC = None


def host_empty(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised host tensor to read a checkpoint tensor into, its pages committed in one kernel call
    (``MAP_POPULATE``, Linux): faulting pages in one by one while ``read`` copies into them costs several times
    the read itself on virtual machines (benchmarks/load.py)."""
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if nbytes < (1 << 20) or not hasattr(mmap, "MAP_POPULATE"):
        return torch.empty(shape, dtype=dtype)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE
    return torch.frombuffer(mmap.mmap(-1, nbytes, flags=flags), dtype=dtype).view(shape)


def populate(view: torch.Tensor) -> torch.Tensor:
    """Commit a host view's pages now, before a read copies into them (``MADV_POPULATE_WRITE``; else by
    writing zeros). Returns the view."""
    nbytes = view.numel() * view.element_size()
    start = view.data_ptr() - view.data_ptr() % PAGE
    length = view.data_ptr() + nbytes - start
    if _LIBC is None or _LIBC.madvise(ctypes.c_void_p(start), ctypes.c_size_t(length), _MADV_POPULATE_WRITE):
        view.view(-1).view(torch.uint8).zero_()
    return view


class LayerArena(HostArena):
    """The checkpoint store's arena: each layer starts on a page, so each layer is page-locked on its own, as
    soon as it is filled (``cudaHostRegister`` of disjoint whole pages), instead of all at once after the load."""

    ALIGN = PAGE


def arena_layers(layout: ExpertLayout) -> tuple[LayerArena, dict[int, torch.Tensor]]:
    """One arena for every MoE layer's ``[E, expert_nbytes]`` bytes, and each layer's view (not yet touched)."""
    shape = (layout.num_experts, layout.expert_nbytes)
    arena = LayerArena(store_bytes(layout))
    return arena, {layer: arena.take(shape, torch.uint8) for layer in layout.moe_layers}


def store_bytes(layout: ExpertLayout) -> int:
    """Host bytes of the store's arena (the experts as stored, each layer page-aligned)."""
    return LayerArena.size_of(
        [((layout.num_experts, layout.expert_nbytes), torch.uint8)] * len(layout.moe_layers)
    )


def layer_range(arena: HostArena, view: torch.Tensor) -> tuple[int, int]:
    """(offset, bytes) of a layer's pages in ``arena``: its view rounded up to whole pages."""
    offset = view.data_ptr() - arena.buffer.data_ptr()
    return offset, min(LayerArena._aligned(view.numel()), arena.nbytes - offset)


def meta_layers(layout: ExpertLayout) -> dict[int, torch.Tensor]:
    """Every MoE layer's bytes on ``meta`` (byte accounting without memory)."""
    shape = (layout.num_experts, layout.expert_nbytes)
    return {layer: torch.empty(shape, dtype=torch.uint8, device="meta") for layer in layout.moe_layers}


def part_views(layout: ExpertLayout, row: torch.Tensor) -> list[torch.Tensor]:
    """One expert's bytes (``[expert_nbytes]`` uint8, host or device) as its parts, in their dtypes and shapes;
    a batch of experts (``[n, expert_nbytes]``) as ``[n, *shape]`` parts."""
    out, offset, lead = [], 0, tuple(row.shape[:-1])
    for p in layout.parts:
        chunk = row[..., offset : offset + p.nbytes]
        out.append(chunk.view(TORCH_DTYPES[p.dtype]).view(*lead, *p.shape))
        offset += p.nbytes
    return out


class CheckpointExpertStore(HostExpertStore):
    """A :class:`HostExpertStore` over experts stored exactly as in the checkpoint (``storage``: bf16, fp16,
    fp32 or mxfp4), one byte row per expert in ``arena``; expert bytes are the parts' bytes, nothing added."""

    def __init__(
        self, layout: ExpertLayout, layers: dict[int, torch.Tensor], arena: HostArena | None = None
    ) -> None:
        if not layers:
            raise ValueError("the model has no MoE layer to offload")
        offset = 0
        for p in layout.parts:  # every part must start aligned for its dtype (no padding is added)
            if offset % torch.empty((), dtype=TORCH_DTYPES[p.dtype]).element_size():
                raise ValueError(f"part {p.name} would start at byte {offset}, misaligned for {p.dtype}")
            offset += p.nbytes
        self.storage = layout.storage
        self.layout = layout
        self.arena = arena
        self.parts = {layer: [t] for layer, t in layers.items()}
        self.scales = {layer: [None] for layer in layers}
        self.layer_ids = tuple(sorted(layers))
        self.num_experts = layout.num_experts
        self.expert_nbytes = layout.expert_nbytes
        self.spec = [((self.expert_nbytes,), torch.uint8)]
        for layer, t in layers.items():
            if tuple(t.shape) != (self.num_experts, self.expert_nbytes) or t.dtype != torch.uint8:
                raise ValueError(f"MoE layer {layer}: {tuple(t.shape)} {t.dtype} is not the layout's bytes")

    def compute_views(self, buffers: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor] | None:
        """Each part as ``[slots, *shape]`` viewing the slots' bytes (``buffers == [[slots, expert_nbytes]]``)
        when every part is stored in the compute dtype (bf16 experts at bf16); None for MXFP4 or other dtypes."""
        if self.storage == "mxfp4" or any(TORCH_DTYPES[p.dtype] != dtype for p in self.layout.parts):
            return None
        (rows,) = buffers
        out, offset = [], 0
        for p in self.layout.parts:
            chunk = rows[:, offset : offset + p.nbytes].view(dtype)
            out.append(chunk.view(rows.shape[0], *p.shape))
            offset += p.nbytes
        return out

    #: ``dequantize`` takes a batch of slots (``[[n, expert_nbytes]]`` → ``[n, ...]`` tensors): ``SlotPool``
    #: lands a layer's prefetches in one call.
    batched_dequantize = True

    def dequantize(self, slot: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
        """The expert's compute tensors from its slot (on the device where it is computed; once per landing), or
        a batch of experts' from their slots' rows."""
        return self.dequantize_parts(part_views(self.layout, slot[0]), dtype)

    def stored_parts(self, buffers: list[torch.Tensor]) -> list[torch.Tensor]:
        """The slot buffers (``[[slots, expert_nbytes]]``) as ``[slots, *shape]`` part views, made once:
        ``SlotPool`` gathers a batch of landed slots part by part, with no per-landing view ops."""
        return part_views(self.layout, buffers[0])

    def passthrough(self, dtype: torch.dtype) -> dict[int, int]:
        """{compute tensor: stored part} for the compute tensors that ARE a stored part (MXFP4's biases, stored
        at the compute dtype): ``SlotPool`` views those slot bytes as the compute tensor, nothing to land."""
        if self.storage != "mxfp4":
            return {}
        parts = self.layout.parts
        return {c: p for c, p in ((1, 2), (3, 5)) if TORCH_DTYPES[parts[p].dtype] == dtype}

    def dequantize_parts(
        self, parts: list[torch.Tensor], dtype: torch.dtype, contiguous: bool = True
    ) -> list[torch.Tensor]:
        """``dequantize`` from the parts already in their dtypes and shapes (one expert, or a batch); with
        ``contiguous=False`` a weight may be a view (the caller copies it into its slot)."""
        if self.storage == "mxfp4":
            return mxfp4.expert_weights(parts, dtype, contiguous)
        return [p if p.dtype == dtype else p.to(dtype) for p in parts]
