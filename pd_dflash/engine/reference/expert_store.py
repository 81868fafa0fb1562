"""The host store: every routed expert's tensors in host memory (pinned on CUDA), in the storage dtype.

Bytes are counted from what is stored — Σ numel × element_size of an expert's payload, scales included —
never from a nominal figure. fp8 storage is e4m3 with one fp32 scale per expert and weight matrix
(amax / 448), dequantized on use; 1-D tensors (gpt-oss biases) stay in bf16 under fp8.
"""

from __future__ import annotations

import torch

STORAGE_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.float8_e4m3fn,
}
FP8_E4M3_MAX = 448.0


class HostExpertStore:
    """Per MoE layer and tensor, one ``[E, ...]`` host tensor; expert ``e``'s payload is the contiguous slice
    ``[e]`` of each (plus its fp8 scales). ``layers`` ({layer: tensors}) is consumed."""

    def __init__(
        self, layers: dict[int, list[torch.Tensor]], storage: str = "fp32", pin: bool = False
    ) -> None:
        if storage not in STORAGE_DTYPES:
            raise ValueError(f"storage dtype must be one of {', '.join(STORAGE_DTYPES)}, got {storage!r}")
        if not layers:
            raise ValueError("the model has no MoE layer to offload")
        self.storage = storage
        self.parts: dict[int, list[torch.Tensor]] = {}
        self.scales: dict[int, list[torch.Tensor | None]] = {}
        for layer in sorted(layers):
            tensors = layers.pop(layer)  # drop the source as we go: peak host memory ≈ one layer extra
            parts, scales = [], []
            for t in tensors:
                q, s = _quantize(t.detach(), storage)
                parts.append(q.pin_memory() if pin else q)
                scales.append(None if s is None else (s.pin_memory() if pin else s))
            self.parts[layer], self.scales[layer] = parts, scales
        self.layer_ids: tuple[int, ...] = tuple(sorted(self.parts))
        first = self.parts[self.layer_ids[0]]
        self.num_experts = int(first[0].shape[0])
        self.spec = [(tuple(p.shape[1:]), p.dtype) for p in first] + [
            ((1,), s.dtype) for s in self.scales[self.layer_ids[0]] if s is not None
        ]
        for layer in self.layer_ids:
            spec = [(tuple(p.shape[1:]), p.dtype) for p in self.parts[layer]]
            spec += [((1,), s.dtype) for s in self.scales[layer] if s is not None]
            if spec != self.spec or self.parts[layer][0].shape[0] != self.num_experts:
                raise ValueError(
                    f"MoE layer {layer} has differently shaped experts; one slot size is required"
                )
        self.expert_nbytes: int = sum(
            _numel(shape) * torch.empty((), dtype=dt).element_size() for shape, dt in self.spec
        )

    @property
    def total_bytes(self) -> int:
        """M: all routed-expert bytes as stored."""
        return self.expert_nbytes * self.num_experts * len(self.layer_ids)

    @property
    def num_entries(self) -> int:
        return self.num_experts * len(self.layer_ids)

    def nbytes_map(self, layer: int) -> dict[int, int]:
        """{expert id: stored bytes} of one layer (RouteAheadStats' ``expert_nbytes``)."""
        return dict.fromkeys(range(self.num_experts), self.expert_nbytes)

    def payload(self, layer: int, expert: int) -> list[torch.Tensor]:
        """The tensors a transfer copies, in slot order (parts, then scales)."""
        out = [p[expert] for p in self.parts[layer]]
        out += [s[expert : expert + 1] for s in self.scales[layer] if s is not None]
        return out

    def dequantize(self, slot: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
        """Compute-dtype weights from a slot's tensors (a no-op view when the storage is the compute dtype)."""
        n = len(self.parts[self.layer_ids[0]])
        parts, scales = slot[:n], iter(slot[n:])
        out = []
        for p, s in zip(parts, self.scales[self.layer_ids[0]], strict=True):
            if s is not None:
                out.append(p.to(dtype) * next(scales).to(dtype))
            else:
                out.append(p if p.dtype == dtype else p.to(dtype))
        return out


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _quantize(t: torch.Tensor, storage: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    t = t.to("cpu")
    if storage != "fp8":
        return t.to(STORAGE_DTYPES[storage]).contiguous(), None
    if t.dim() < 3:  # per-expert vectors (biases): bf16, no scale
        return t.to(torch.bfloat16).contiguous(), None
    amax = t.float().abs().amax(dim=tuple(range(1, t.dim())))
    scale = torch.where(amax > 0, amax / FP8_E4M3_MAX, torch.ones_like(amax))
    q = (t.float() / scale.view(-1, *([1] * (t.dim() - 1)))).to(torch.float8_e4m3fn)
    return q.contiguous(), scale.contiguous()
