"""NVTX push/pop ranges with upstream's names (nsys 2025.1.3 drops start/end ranges; push/pop survive).

The ``nvtx`` package is a silent no-op without a GPU or a collector, unlike
``torch.cuda.nvtx`` which raises on the CPU wheel. Only the five upstream names are accepted.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from pd_dflash.upstream import NVTX_RANGES

try:
    import nvtx as _nvtx
except ImportError:  # the engine extra is not installed: ranges become no-ops
    _nvtx = None

_ALLOWED = frozenset(NVTX_RANGES)


@contextmanager
def nvtx_range(name: str) -> Iterator[None]:
    if name not in _ALLOWED:
        raise ValueError(f"unknown NVTX range {name!r}; upstream's parser keys on {NVTX_RANGES}")
    if _nvtx is None:
        yield
        return
    _nvtx.push_range(message=name)
    try:
        yield
    finally:
        _nvtx.pop_range()
