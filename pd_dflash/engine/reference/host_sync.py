"""Every device→host read of the engine's decode path goes through here, and is counted.

On a GPU a host sync (``.item()``, ``.tolist()``, ``.cpu()``, a wait on an event) drains the compute queue: host
and GPU time then add instead of overlapping, so the engine keeps them few and counts them. The functions below
(``item``, ``tolist``, ``wait``) are the one way the decode path reads the device; each call adds one to its
site's count in ``COUNTER`` — on the CPU too (nothing really waits there), so a CPU row predicts the syncs of the
same configuration on CUDA. Sites: ``forward_end`` (the host waits for a target forward or a draft; a resident
forward's routing comes back inside this wait, one transfer for all its layers), ``routing`` (an offloaded MoE
layer's routing, one transfer per layer), ``token`` / ``draft`` / ``accept`` / ``router_pass`` (token ids and
router indices read by the decoding), ``deferred_routing`` (a resident forward that no target-forward wait ended,
e.g. HF's own forward). A fetch that waits for a slot still being written by a prefetch is the cache's own
counter (``expert_cache.slot_waits``), not a read of the device.

``SyncGuard`` is the check that nothing bypasses this module: a ``TorchDispatchMode`` that records every op that
reads the device on the host (``aten._local_scalar_dense`` = ``.item()``, ``nonzero``, ``unique``, a bool-mask
index, a copy to the CPU from another device) issued OUTSIDE these functions. On the CPU, ``.tolist()`` does not
pass through the dispatcher, so the guard sees ``.item()``-style reads only; the counter sees every read made
through this module.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import torch
from torch.utils._python_dispatch import TorchDispatchMode

T = TypeVar("T")


class HostSyncCounter:
    """Host syncs per site since the last ``reset`` (the engine resets it with the cell's counters)."""

    def __init__(self) -> None:
        self.by_site: Counter[str] = Counter()

    def reset(self) -> None:
        self.by_site = Counter()

    @property
    def total(self) -> int:
        return sum(self.by_site.values())

    def facts(self, rounds: int, generated_tokens: int) -> dict[str, Any]:
        """The row's ``engine.host_syncs``: total, per round, per generated token and per site."""
        total = self.total
        return {
            "total": total,
            "per_round": total / rounds if rounds else None,
            "per_generated_token": total / generated_tokens if generated_tokens else None,
            "by_site": dict(sorted(self.by_site.items())),
        }


COUNTER = HostSyncCounter()
_state = threading.local()


@contextmanager
def _counted(site: str) -> Iterator[None]:
    COUNTER.by_site[site] += 1
    depth = getattr(_state, "depth", 0)
    _state.depth = depth + 1
    try:
        yield
    finally:
        _state.depth = depth


def inside() -> bool:
    """A read through this module is in progress (the guard does not flag it)."""
    return getattr(_state, "depth", 0) > 0


def item(site: str, t: torch.Tensor) -> Any:
    """``t.item()``, counted."""
    with _counted(site):
        return t.item()


def tolist(site: str, t: torch.Tensor) -> list:
    """``t.tolist()``, counted."""
    with _counted(site):
        return t.tolist()


def wait(site: str, fn: Callable[[], T]) -> T:
    """Run ``fn``, a host wait on the device (an event, a stream), counted; returns what ``fn`` returns."""
    with _counted(site):
        return fn()


def to_host_async(t: torch.Tensor) -> tuple[torch.Tensor, Any]:
    """Start copying ``t`` to pinned host memory on the current stream: ``(host tensor, event)`` — read the host
    tensor only after ``wait(site, event.synchronize)`` (or a wait that covers the stream). On the CPU: ``(t,
    None)``."""
    if t.device.type != "cuda":
        return t, None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(t.device))
    return host, event


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A small host tensor on ``device`` without a host wait (pinned, non-blocking on CUDA)."""
    if device.type != "cuda":
        return host
    return host.pin_memory().to(device, non_blocking=True)


_aten = torch.ops.aten
#: Ops that read device memory on the host (a sync on CUDA) whatever their arguments.
SYNCING_OPS = frozenset(
    {
        _aten._local_scalar_dense.default,
        _aten.is_nonzero.default,
        _aten.equal.default,
        _aten.nonzero.default,
        _aten.masked_select.default,
        _aten._unique.default,
        _aten._unique2.default,
        _aten.unique_dim.default,
        _aten.unique_consecutive.default,
    }
)


class SyncGuard(TorchDispatchMode):
    """Records every op that would make the host wait for the device, issued outside this module's functions
    (``unaccounted``: op names in order). Use around a forward: ``with SyncGuard() as guard: ...``."""

    def __init__(self) -> None:
        super().__init__()
        self.unaccounted: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not inside() and _syncs(func, args, kwargs):
            self.unaccounted.append(str(func))
        return func(*args, **kwargs)


def _syncs(func, args, kwargs) -> bool:
    if func in SYNCING_OPS:
        return True
    if func is _aten.index.Tensor:  # a bool mask index is a nonzero
        return any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ()) if i is not None
        )
    if func is _aten.repeat_interleave.Tensor:
        return kwargs.get("output_size") is None
    if func in (_aten._to_copy.default, _aten.copy_.default):
        src = args[1] if func is _aten.copy_.default else args[0]
        dst = args[0].device if func is _aten.copy_.default else kwargs.get("device")
        return (
            isinstance(src, torch.Tensor) and src.device.type != "cpu" and getattr(dst, "type", None) == "cpu"
        )
    return False
