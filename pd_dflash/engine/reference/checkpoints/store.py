"""The host store of a checkpoint's experts, filled by streaming the safetensors files into it.

Each MoE layer is one ``[E, expert_nbytes]`` byte tensor (pinned on CUDA; on ``meta`` for byte accounting
without memory): expert e's parts (``ExpertLayout.parts``: bf16 weights, or MXFP4 blocks + scales + biases) lie
back to back in row e, exactly as many bytes as the checkpoint stores, so one expert is ONE host→device copy.
The loader reads the files straight into the parts' views; nothing is converted on the host. On the device a
slot's bytes are viewed as the parts again and dequantised there (MXFP4 → the compute dtype; bf16 → as is).
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
) -> torch.Tensor:
    """One MoE layer's empty ``[E, expert_nbytes]`` bytes (``device='meta'`` allocates nothing)."""
    shape = (layout.num_experts, layout.expert_nbytes)
    if torch.device(device).type == "meta":
        return torch.empty(shape, dtype=torch.uint8, device="meta")
    return host_empty(shape, torch.uint8, pin=pin)


def allocate_parts(
    layout: ExpertLayout, *, pin: bool = False, device: str | torch.device = "cpu"
) -> dict[int, torch.Tensor]:
    """Every MoE layer's empty bytes."""
    return {layer: allocate_layer(layout, pin=pin, device=device) for layer in layout.moe_layers}


def part_views(layout: ExpertLayout, row: torch.Tensor) -> list[torch.Tensor]:
    """One expert's bytes (``[expert_nbytes]`` uint8, host or device) as its parts, in their dtypes and shapes."""
    out, offset = [], 0
    for p in layout.parts:
        chunk = row[offset : offset + p.nbytes]
        out.append(chunk.view(TORCH_DTYPES[p.dtype]).view(p.shape))
        offset += p.nbytes
    return out


class CheckpointExpertStore(HostExpertStore):
    """A :class:`HostExpertStore` over experts stored exactly as in the checkpoint (``storage``: bf16, fp16,
    fp32 or mxfp4), one byte row per expert; expert bytes are the parts' bytes, nothing added."""

    def __init__(self, layout: ExpertLayout, layers: dict[int, torch.Tensor]) -> None:
        if not layers:
            raise ValueError("the model has no MoE layer to offload")
        offset = 0
        for p in layout.parts:  # every part must start aligned for its dtype (no padding is added)
            if offset % torch.empty((), dtype=TORCH_DTYPES[p.dtype]).element_size():
                raise ValueError(f"part {p.name} would start at byte {offset}, misaligned for {p.dtype}")
            offset += p.nbytes
        self.storage = layout.storage
        self.layout = layout
        self.parts = {layer: [t] for layer, t in layers.items()}
        self.scales = {layer: [None] for layer in layers}
        self.layer_ids = tuple(sorted(layers))
        self.num_experts = layout.num_experts
        self.expert_nbytes = layout.expert_nbytes
        self.spec = [((self.expert_nbytes,), torch.uint8)]
        for layer, t in layers.items():
            if tuple(t.shape) != (self.num_experts, self.expert_nbytes) or t.dtype != torch.uint8:
                raise ValueError(f"MoE layer {layer}: {tuple(t.shape)} {t.dtype} is not the layout's bytes")

    def dequantize(self, slot: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
        """The expert's compute tensors from its slot (on the device where it is computed)."""
        parts = part_views(self.layout, slot[0])
        if self.storage == "mxfp4":
            return mxfp4.expert_weights(parts, dtype)
        return [p if p.dtype == dtype else p.to(dtype) for p in parts]
