"""The host store of a checkpoint's experts, filled by streaming the safetensors files into it.

Parts are allocated once per MoE layer as ``[E, ...]`` tensors in the dtype the checkpoint stores (pinned on
CUDA, on ``meta`` for byte accounting without memory) and filled in place by the loader; nothing is converted
on the host. MXFP4 parts stay MXFP4 in the store and on the link and are dequantised on the device at use.
"""

from __future__ import annotations

import mmap

import torch

from pd_dflash.engine.reference.checkpoints import mxfp4
from pd_dflash.engine.reference.checkpoints.layouts import ExpertLayout
from pd_dflash.engine.reference.expert_store import HostExpertStore

TORCH_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "U8": torch.uint8}


def host_empty(shape: tuple[int, ...], dtype: torch.dtype, *, pin: bool = False) -> torch.Tensor:
    """An uninitialised host tensor to read a checkpoint into: pinned (CUDA), or on Linux anonymous memory
    populated in one kernel call (``MAP_POPULATE``) — faulting pages in one by one while ``read`` copies into
    them costs several times the read itself on virtual machines (benchmarks/load.py)."""
    if pin or not hasattr(mmap, "MAP_POPULATE"):
        return torch.empty(shape, dtype=dtype, pin_memory=pin)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    if nbytes < (1 << 20):
        return torch.empty(shape, dtype=dtype)
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE
    return torch.frombuffer(mmap.mmap(-1, nbytes, flags=flags), dtype=dtype).view(shape)


def allocate_layer(
    layout: ExpertLayout, *, pin: bool = False, device: str | torch.device = "cpu"
) -> list[torch.Tensor]:
    """Empty ``[E, ...]`` parts of one MoE layer (``device='meta'`` allocates nothing)."""
    shapes = [((layout.num_experts, *p.shape), TORCH_DTYPES[p.dtype]) for p in layout.parts]
    if torch.device(device).type == "meta":
        return [torch.empty(s, dtype=dt, device="meta") for s, dt in shapes]
    return [host_empty(s, dt, pin=pin) for s, dt in shapes]


def allocate_parts(
    layout: ExpertLayout, *, pin: bool = False, device: str | torch.device = "cpu"
) -> dict[int, list[torch.Tensor]]:
    """Empty parts for every MoE layer."""
    return {layer: allocate_layer(layout, pin=pin, device=device) for layer in layout.moe_layers}


class CheckpointExpertStore(HostExpertStore):
    """A :class:`HostExpertStore` over parts stored exactly as in the checkpoint (``storage``: bf16, fp16, fp32
    or mxfp4); expert bytes are counted from those parts."""

    def __init__(self, layout: ExpertLayout, parts: dict[int, list[torch.Tensor]]) -> None:
        if not parts:
            raise ValueError("the model has no MoE layer to offload")
        self.storage = layout.storage
        self.layout = layout
        self.parts = parts
        self.scales = {layer: [None] * len(p) for layer, p in parts.items()}
        self.layer_ids = tuple(sorted(parts))
        self.num_experts = layout.num_experts
        self.spec = [(tuple(p.shape), TORCH_DTYPES[p.dtype]) for p in layout.parts]
        for layer in self.layer_ids:
            got = [(tuple(t.shape[1:]), t.dtype) for t in parts[layer]]
            if got != self.spec or any(t.shape[0] != self.num_experts for t in parts[layer]):
                raise ValueError(f"MoE layer {layer}: parts {got} do not match the layout {self.spec}")
        self.expert_nbytes = sum(
            _numel(shape) * torch.empty((), dtype=dt).element_size() for shape, dt in self.spec
        )

    def dequantize(self, slot: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
        if self.storage == "mxfp4":
            return mxfp4.expert_weights(slot, dtype)
        return [p if p.dtype == dtype else p.to(dtype) for p in slot]


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
