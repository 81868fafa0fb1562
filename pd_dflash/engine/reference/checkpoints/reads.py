"""The loader's reads: every tensor of a checkpoint, in file order, straight into its destination.

An expert tensor goes into its part's view in the expert's byte row of the host store (an ``[E, ...]`` tensor:
one read per expert, consecutive in the file); a non-expert tensor into a host buffer handed to the parameter
it fills (which moves it to the device in the compute dtype). Destinations are prepared ahead by a background
thread (``prealloc.py``); each shard is read in one sequential pass with the kernel told so.
"""

from __future__ import annotations

import collections
import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from pd_dflash.engine.reference.checkpoints.check import CheckedCheckpoint
from pd_dflash.engine.reference.checkpoints.files import TensorEntry
from pd_dflash.engine.reference.checkpoints.prealloc import Preallocator
from pd_dflash.engine.reference.checkpoints.progress import LoadProgress
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
