"""The loader's reads: every tensor of a checkpoint, in file order, straight into its destination.

An expert tensor goes into its part's view in the expert's byte row of the host store (an ``[E, ...]`` tensor:
one read per expert, consecutive in the file); a non-expert tensor into a host buffer handed to the parameter
it fills (which moves it to the device in the compute dtype). Destinations are prepared ahead by a background
thread (``Preallocator``); each shard is read in one sequential pass with the kernel told so, and the bytes that
land are logged (``LoadProgress``).

Preparing ahead: fresh host memory is zeroed by the kernel when first used; done inline, while a read copies into
it, that costs several times the read (benchmarks/load.py). One thread allocates or populates the buffers in the
order the reads will need them, at most ``LOOKAHEAD_BYTES`` ahead of the reader, so that overlaps I/O (both
release the GIL). Progress is log lines (bytes, rate, ETA), not a progress bar: a runner's output is a log file.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import sys
import threading
import time
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from pd_dflash.engine.reference.checkpoints.check import CheckedCheckpoint
from pd_dflash.engine.reference.checkpoints.files import TensorEntry
from pd_dflash.engine.reference.checkpoints.store import TORCH_DTYPES, host_empty, part_views, populate
from pd_dflash.errors import InputError


@dataclass
class Read:
    """``entry``'s bytes into ``place(buffer)``, ``buffer`` being the prepared buffer ``key`` (a layer's store
    bytes, or a non-expert tensor's host copy, then handed to ``assign``)."""

    entry: TensorEntry
    key: tuple
    place: Any
    assign: Any = None


def expert_reads(checked: CheckedCheckpoint) -> list[Read]:
    layout, reads = checked.layout, []
    for layer in layout.moe_layers:
        for src in layout.sources(layer):
            entry = checked.files.tensors[src.tensor]
            nbytes = layout.parts[src.part].nbytes
            experts = [src.expert] if src.expert is not None else range(layout.num_experts)
            for e in experts:
                sub = entry
                if src.expert is None:  # expert e's slice of an [E, ...] tensor
                    start = entry.start + e * nbytes
                    sub = replace(entry, shape=layout.parts[src.part].shape, start=start, end=start + nbytes)

                def place(layer_bytes, e=e, src=src):
                    part = part_views(layout, layer_bytes[e])[src.part]
                    return part if src.expert is None else part[src.row0 : src.row0 + src.shape[0]]

                reads.append(Read(sub, ("layer", layer), place))
    return reads


def parameter_reads(
    checked: CheckedCheckpoint, model: nn.Module, device: torch.device, compute
) -> list[Read]:
    reads = []
    for name, param in model.named_parameters():
        entry = checked.files.get(name, "a non-expert weight of the model")
        if entry.shape != tuple(param.shape):
            raise InputError(
                f"tensor {name!r} is {list(entry.shape)}, the model built from config.json expects "
                f"{list(param.shape)}",
                where=str(entry.file),
            )
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name)
        # Floating weights take the compute dtype; anything else keeps its stored dtype.
        dtype = compute if param.dtype.is_floating_point else param.dtype

        def assign(t: torch.Tensor, module=module, leaf=leaf, dtype=dtype) -> None:
            module._parameters[leaf] = nn.Parameter(t.to(device=device, dtype=dtype), requires_grad=False)

        reads.append(Read(entry, ("param", name), lambda t: t, assign))
    return reads


def read_all(
    reads: list[Read],
    checked: CheckedCheckpoint,
    layers: dict[int, torch.Tensor],
    progress: LoadProgress,
    filled: Callable[[int], None] | None = None,
):
    """Every read in file order (one sequential pass per shard), each destination prepared ahead: a layer's
    store view populated, a non-expert tensor's host copy allocated. ``filled(layer)`` is called once a MoE
    layer's last read has landed (the loader pins it then)."""
    reads = sorted(reads, key=lambda r: (str(r.entry.file), r.entry.start))
    left = collections.Counter(r.key for r in reads if r.key[0] == "layer")
    jobs = []
    for key in dict.fromkeys(r.key for r in reads):
        kind, what = key
        if kind == "layer":
            view = layers[what]
            jobs.append((key, view.numel(), lambda view=view: populate(view)))
        else:
            entry = checked.files.tensors[what]
            jobs.append((key, entry.nbytes, lambda e=entry: host_empty(e.shape, TORCH_DTYPES[e.dtype])))
    pre = Preallocator(jobs)
    buffers: dict[tuple, Any] = {}
    try:
        for file, group in itertools.groupby(reads, key=lambda r: r.entry.file):
            with open(file, "rb", buffering=0) as handle:
                _read_ahead(handle)
                for r in group:
                    if r.key not in buffers:
                        buffers[r.key] = pre.take(r.key)
                    dest = r.place(buffers[r.key])
                    _read_into(handle, r.entry, dest)
                    if r.assign is not None:
                        r.assign(dest)
                        del buffers[r.key]  # a non-expert tensor's host copy is not kept
                    elif filled is not None:
                        left[r.key] -= 1
                        if not left[r.key]:
                            filled(r.key[1])
                    progress.advance(r.entry.nbytes)
    finally:
        pre.close()


def _read_ahead(handle) -> None:
    """Tell the kernel the whole shard will be read in order, so its readahead keeps the disk busy while the
    reader copies one tensor at a time (Linux; a no-op elsewhere)."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
        os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_WILLNEED)


def _read_into(handle, entry: TensorEntry, dest: torch.Tensor) -> None:
    if not dest.is_contiguous() or dest.numel() * dest.element_size() != entry.nbytes:
        raise RuntimeError(
            f"{entry.name}: destination {tuple(dest.shape)} {dest.dtype} does not fit {entry.nbytes} B"
        )
    view = memoryview(dest.view(-1).view(torch.uint8).numpy())
    handle.seek(entry.start)
    got = 0
    while got < entry.nbytes:
        n = handle.readinto(view[got:])
        if not n:
            raise InputError(
                f"tensor {entry.name!r}: file ends after {got} of {entry.nbytes} B", where=str(entry.file)
            )
        got += n


# -- buffers prepared ahead of the reads -------------------------------------------------------------------
#: How far (bytes) buffers are prepared ahead of the reader: also the most non-expert weights in host memory at
#: once while they travel to the device.
LOOKAHEAD_BYTES = 2 << 30


class Preallocator:
    def __init__(
        self, jobs: list[tuple[Hashable, int, Callable[[], Any]]], lookahead_bytes: int = LOOKAHEAD_BYTES
    ) -> None:
        """``jobs``: (key, bytes, allocate) in the order the reader will ``take`` them."""
        self._futures: dict[Hashable, Future] = {key: Future() for key, _, _ in jobs}
        self._sizes = {key: nbytes for key, nbytes, _ in jobs}
        self._ahead = 0  # allocated bytes not yet taken
        self._limit = lookahead_bytes
        self._cond = threading.Condition()
        self._stop = False
        self._thread = threading.Thread(
            target=self._run, args=(jobs,), name="pd-dflash-prealloc", daemon=True
        )
        self._thread.start()

    def _run(self, jobs) -> None:
        for key, nbytes, allocate in jobs:
            with self._cond:
                self._cond.wait_for(
                    lambda n=nbytes: self._stop or self._ahead == 0 or self._ahead + n <= self._limit
                )
                if self._stop:
                    return
                self._ahead += nbytes
            try:
                self._futures[key].set_result(allocate())
            except BaseException as exc:  # surfaced to the reader by take()
                self._futures[key].set_exception(exc)

    def take(self, key: Hashable) -> Any:
        """The buffer for ``key`` (waits for its allocation); frees its share of the lookahead."""
        value = self._futures[key].result()
        with self._cond:
            self._ahead -= self._sizes.pop(key, 0)
            self._cond.notify_all()
        return value

    def close(self) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join()


# -- progress ------------------------------------------------------------------------------------------------
logger = logging.getLogger("pd_dflash.load")
if not logger.handlers:  # a runner process configures no logging: print INFO lines to stderr
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(logging.Formatter("%(asctime)s %(name)s: %(message)s"))
    logger.addHandler(_handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


class LoadProgress:
    """Counts bytes as they land and logs at most every ``every_s`` seconds, and once at the end."""

    def __init__(self, name: str, total_bytes: int, every_s: float = 5.0) -> None:
        self.name, self.total, self.every_s = name, max(1, total_bytes), every_s
        self.done = 0
        self.start = self._last = time.perf_counter()
        logger.info("loading %s: %s to read", name, _gb(total_bytes))

    def advance(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.perf_counter()
        if now - self._last >= self.every_s:
            self._last = now
            rate = self.done / max(now - self.start, 1e-9)
            eta = (self.total - self.done) / rate if rate > 0 else float("inf")
            logger.info(
                "loading %s: %s / %s (%.0f%%), %.2f GB/s, ETA %.0f s",
                self.name,
                _gb(self.done),
                _gb(self.total),
                100 * self.done / self.total,
                rate / 1e9,
                eta,
            )

    def finish(self) -> float:
        seconds = time.perf_counter() - self.start
        logger.info(
            "loaded %s: %s in %.1f s (%.2f GB/s)",
            self.name,
            _gb(self.done),
            seconds,
            self.done / max(seconds, 1e-9) / 1e9,
        )
        return seconds


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB"
