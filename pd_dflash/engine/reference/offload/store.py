"""The host store: every routed expert's tensors in host memory (pinned on CUDA), in the storage dtype.

Bytes are counted from what is stored — Σ numel × element_size of an expert's payload, scales included —
never from a nominal figure. fp8 storage is e4m3 with one fp32 scale per expert and weight matrix
(amax / 448), dequantized once, when it lands in a device cache slot (``offload/cache.py``); 1-D tensors (gpt-oss
biases) stay in bf16 under fp8.

**The arena** (``HostArena``) is the one place the host store gets its memory, pinned or not. Its API, for any
loader (``HostExpertStore`` below; a streaming checkpoint loader the same way):

1. ``HostArena.size_of([(shape, dtype), ...])``: the exact bytes of the tensors to place (each aligned to
   ``ALIGN``), so the arena is allocated ONCE from the total, before anything is loaded;
2. ``check_host_memory(...)`` (``memory.require``) against what is available: ``Refused`` with the figures;
3. ``arena = HostArena(total)``, then ``arena.take(shape, dtype)`` per tensor, in order: a view to fill
   (``view.copy_(tensor)``, or read into it), so the source can be dropped tensor by tensor;
4. ``arena.pin()`` once filled (CUDA): the pages already written are page-locked in place
   (``cudaHostRegister``): no second copy and no rounding. The arena is an anonymous ``mmap`` (page-aligned)
   wrapped as ONE tensor, so every view's *storage* starts at the arena's first byte, inside the registered
   range: ``Tensor.is_pinned()`` asks the driver about the storage's start, not the view's (a ``torch.empty``
   registered from its next page boundary would leave every view reporting unpinned). torch's pinned allocator rounds every allocation up
   to a power of two (54 GiB of bf16 experts pinned tensor by tensor take 72 GiB, as one block 64 GiB);
   unpinned again when the arena is freed.
"""

from __future__ import annotations

import mmap
import time
import weakref
from collections.abc import Sequence

import torch

from pd_dflash.engine.reference.offload.memory import require

STORAGE_DTYPES: dict[str, torch.dtype] = {
    "fp32": torch.float32,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
    "fp8": torch.float8_e4m3fn,
}
FP8_E4M3_MAX = 448.0


#: Page size the arena starts on (``cudaHostRegister`` works on whole pages).
PAGE = 4096


class HostArena:
    """One host allocation handed out as views, in order; pinned in place once filled (see the module doc)."""

    ALIGN = 256

    def __init__(self, nbytes: int) -> None:
        self.nbytes, self.used, self.pinned = int(nbytes), 0, False
        self.ranges: list[tuple[int, int]] = []  # (pointer, bytes) registered with cudaHostRegister
        self.buffer = page_aligned(self.nbytes)

    @classmethod
    def size_of(cls, specs: Sequence[tuple[Sequence[int], torch.dtype]]) -> int:
        return sum(cls._aligned(_numel(shape) * _element_size(dt)) for shape, dt in specs)

    def take(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        """The next ``shape``/``dtype`` view of the arena (uninitialised: the caller fills it)."""
        n = _numel(shape) * _element_size(dtype)
        start, self.used = self.used, self.used + self._aligned(n)
        if self.used > self.nbytes:
            raise ValueError(f"the arena of {self.nbytes} B is full ({start} B used, {n} B more asked)")
        return self.buffer[start : start + n].view(dtype).view(tuple(shape))

    def pin(self) -> None:
        """Page-lock the arena in place for non-blocking host→device copies (CUDA only)."""
        if self.pinned or self.nbytes == 0:
            return
        self.pin_range(0, self.nbytes, "the expert arena")
        self.pinned = True

    def pin_range(self, offset: int, nbytes: int, what: str) -> float:
        """Page-lock ``nbytes`` from ``offset`` (page-aligned, disjoint from earlier ranges) in place, e.g. one
        layer as soon as the loader has filled it; returns the seconds ``cudaHostRegister`` took."""
        if offset % PAGE or offset < 0 or offset + nbytes > self.nbytes:
            raise ValueError(
                f"pinning {what}: [{offset}, +{nbytes}) is not a page-aligned range of the arena"
            )
        ptr = self.buffer.data_ptr() + offset
        start = time.perf_counter()
        err = int(torch.cuda.cudart().cudaHostRegister(ptr, nbytes, 0))
        if err != 0:
            raise RuntimeError(f"pinning {what} ({nbytes:,} B) failed (cudaHostRegister error {err})")
        self.ranges.append((ptr, nbytes))
        weakref.finalize(self, _unpin, ptr, self.buffer)  # before the memory is freed
        return time.perf_counter() - start

    @classmethod
    def _aligned(cls, n: int) -> int:
        return -(-n // cls.ALIGN) * cls.ALIGN


def page_aligned(nbytes: int) -> torch.Tensor:
    """``nbytes`` of uncommitted host memory as one uint8 tensor whose storage starts on a page (an anonymous
    ``mmap``; the tensor keeps the mapping alive)."""
    if nbytes == 0:
        return torch.empty(0, dtype=torch.uint8)
    memory = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    return torch.frombuffer(memory, dtype=torch.uint8)


def _unpin(ptr: int, base: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(ptr)
    del base


class HostExpertStore:
    """Per MoE layer and tensor, one ``[E, ...]`` host tensor; expert ``e``'s payload is the contiguous slice
    ``[e]`` of each (plus its fp8 scales), all in one ``HostArena``. ``layers`` ({layer: tensors}) is consumed,
    layer by layer. ``host_available_bytes``: the host memory available now (None: unknown, not checked)."""

    def __init__(
        self,
        layers: dict[int, list[torch.Tensor]],
        storage: str = "fp32",
        pin: bool = False,
        *,
        host_available_bytes: int | None = None,
    ) -> None:
        if storage not in STORAGE_DTYPES:
            raise ValueError(f"storage dtype must be one of {', '.join(STORAGE_DTYPES)}, got {storage!r}")
        if not layers:
            raise ValueError("the model has no MoE layer to offload")
        self.storage = storage
        plan = {layer: [_stored_specs(t, storage) for t in layers[layer]] for layer in sorted(layers)}
        check_host_memory(layers, plan, host_available_bytes, pinned=pin)
        self.arena = HostArena(
            HostArena.size_of([spec for specs in plan.values() for pair in specs for spec in pair if spec])
        )
        self.parts: dict[int, list[torch.Tensor]] = {}
        self.scales: dict[int, list[torch.Tensor | None]] = {}
        for layer in sorted(layers):
            tensors = layers.pop(layer)  # drop the source as we go: peak host memory ≈ one layer extra
            parts, scales = [], []
            for t in tensors:
                q, s = _quantize(t.detach(), storage)
                parts.append(self._place(q))
                scales.append(None if s is None else self._place(s))
            self.parts[layer], self.scales[layer] = parts, scales
            del tensors
        if pin:
            self.arena.pin()
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
        self.expert_nbytes: int = sum(_numel(shape) * _element_size(dt) for shape, dt in self.spec)

    def _place(self, t: torch.Tensor) -> torch.Tensor:
        view = self.arena.take(t.shape, t.dtype)
        view.copy_(t)
        return view

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

    def compute_spec(self, dtype: torch.dtype) -> list[tuple[tuple[int, ...], torch.dtype]]:
        """Shape and dtype of each of one expert's compute tensors (``dequantize``'s outputs)."""
        return [(tuple(w.shape), w.dtype) for w in self.dequantize(self.payload(self.layer_ids[0], 0), dtype)]

    def compute_nbytes(self, dtype: torch.dtype) -> int:
        """Bytes of one expert's compute tensors (what a dequantised slot holds on the device)."""
        return sum(_numel(shape) * _element_size(dt) for shape, dt in self.compute_spec(dtype))

    def device_slot_nbytes(self, dtype: torch.dtype, *, linked: bool) -> int:
        """Device bytes one cache slot takes: the stored bytes (when the pool views them, or as the landing
        buffer of an offloaded cache), plus the dequantised weights when the storage is not the compute format."""
        meta = [torch.empty((1, *shape), dtype=dt, device="meta") for shape, dt in self.spec]
        if self.compute_views(meta, dtype) is not None:
            return self.expert_nbytes
        return (self.expert_nbytes if linked else 0) + self.compute_nbytes(dtype)

    def compute_views(self, buffers: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor] | None:
        """The slot pool as compute tensors ``[slots, ...]`` viewing the stored-format ``buffers`` (one per
        ``spec`` entry) when the storage IS the compute format (nothing to dequantise); else None."""
        if any(s is not None for s in self.scales[self.layer_ids[0]]) or any(
            b.dtype != dtype for b in buffers
        ):
            return None
        return list(buffers)

    def dequantize(self, slot: list[torch.Tensor], dtype: torch.dtype) -> list[torch.Tensor]:
        """Compute-dtype weights from a slot's tensors (a no-op view when the storage is the compute dtype); the
        cache calls it once per expert landing in a slot, never per access."""
        n = len(self.parts[self.layer_ids[0]])
        parts, scales = slot[:n], iter(slot[n:])
        out = []
        for p, s in zip(parts, self.scales[self.layer_ids[0]], strict=True):
            if s is not None:
                out.append(p.to(dtype) * next(scales).to(dtype))
            else:
                out.append(p if p.dtype == dtype else p.to(dtype))
        return out


def check_host_memory(
    layers: dict[int, list[torch.Tensor]],
    plan: dict[int, list[tuple]],
    available: int | None,
    *,
    pinned: bool,
) -> None:
    """Refuse a store that does not fit: the arena fills layer by layer while each layer's source tensors are
    released, so the host needs, at the peak, the largest running excess of arena bytes over released source
    bytes (one layer when storage and source dtypes match) plus the largest quantization temporary."""
    arena = released = peak = temporary = 0
    for layer in sorted(plan):
        layer_bytes = HostArena.size_of([spec for pair in plan[layer] for spec in pair if spec])
        arena += layer_bytes
        peak = max(peak, arena - released)
        released += sum(t.numel() * t.element_size() for t in layers[layer])
        temporary = max(temporary, max(_numel(p[0]) * _element_size(p[1]) for p, _ in plan[layer]))
    what = f"the host expert store ({arena:,} B of experts in one arena{', pinned' if pinned else ''})"
    fix = (
        "a box with more free host memory, fewer runners per box, or a smaller storage_dtype "
        "(models[].engine_options.storage_dtype: bf16 or fp8)"
    )
    require(what, peak + temporary, available, fix, "host")


def _numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def _stored_specs(t: torch.Tensor, storage: str) -> tuple[tuple, tuple | None]:
    """``((shape, dtype) stored, (shape, dtype) of its scale or None)``, as ``_quantize`` will store ``t``."""
    if storage != "fp8":
        return (tuple(t.shape), STORAGE_DTYPES[storage]), None
    if t.dim() < 3:
        return (tuple(t.shape), torch.bfloat16), None
    return (tuple(t.shape), torch.float8_e4m3fn), ((t.shape[0],), torch.float32)


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
