"""Loading a real checkpoint into the reference engine without ever materialising it in host memory.

The model is built on the ``meta`` device; every routed-experts module is replaced by ``OffloadedExperts``
before any weight is read; then the safetensors files are read once, in file order, each tensor straight into
its destination: an expert's bytes into its slice of the host store (pinned on CUDA, stored as in the file:
bf16, or MXFP4 blocks + scales + biases), a non-expert tensor into a temporary CPU tensor that goes to the
device in the compute dtype. Peak host memory is the store plus one non-expert tensor (on CUDA).
"""

from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pd_dflash.engine.reference.checkpoints.check import CheckedCheckpoint, check_checkpoint
from pd_dflash.engine.reference.checkpoints.files import TensorEntry
from pd_dflash.engine.reference.checkpoints.prealloc import Preallocator
from pd_dflash.engine.reference.checkpoints.progress import LoadProgress
from pd_dflash.engine.reference.checkpoints.resolve import resolve
from pd_dflash.engine.reference.checkpoints.store import (
    TORCH_DTYPES,
    CheckpointExpertStore,
    allocate_layer,
    host_empty,
    part_views,
)
from pd_dflash.engine.reference.families import MoEFamily, family_of
from pd_dflash.engine.reference.offload import OffloadedExperts
from pd_dflash.errors import InputError

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_STORED = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@dataclass
class LoadedCheckpoint:
    model: nn.Module
    family: MoEFamily
    store: CheckpointExpertStore
    tokenizer: Any
    card: dict[str, Any] = field(default_factory=dict)


@dataclass
class _Read:
    """One tensor read: ``entry``'s bytes into ``place(buffer)``, where ``buffer`` is the preallocated buffer
    ``key`` (a layer's store parts, or a non-expert tensor's host copy handed to ``assign``)."""

    entry: TensorEntry
    key: tuple
    place: Any
    assign: Any = None


def locate(model_id: str, path: str | None, cache_dir: str | None) -> tuple[Path, str]:
    """(checkpoint directory, how it was found); tiny real-layout names are generated into the cache."""
    found = resolve(model_id, path)
    if found.source == "tiny-real":
        from pd_dflash.engine.reference.checkpoints.tiny import materialise

        return materialise(model_id, cache_dir), found.source
    if found.directory is None:
        raise InputError(
            f"checkpoint {path or model_id!r} not found offline (looked in {', '.join(found.tried)}). Use a local "
            "directory (models[].path) or a model already in the Hugging Face cache under HF_HOME",
            where=found.field,
        )
    return found.directory, found.source


def load_checkpoint(
    model_id: str,
    path: str | None = None,
    *,
    device: torch.device,
    dtype: str = "auto",
    storage: str = "auto",
    pin: bool = False,
    cache_dir: str | None = None,
) -> LoadedCheckpoint:
    """The checkpoint of ``models[].id`` / ``models[].path``. (A missing chat template is found when prompts
    are made: a REFUSED row; ``pd-dflash plan`` already checks it where the checkpoint is visible.)"""
    directory, source = locate(model_id, path, cache_dir)
    checked = check_checkpoint(directory)
    layout = checked.layout
    if storage not in ("auto", layout.storage):
        raise InputError(
            f"{storage!r}: a checkpoint's experts are stored as the checkpoint stores them ({layout.storage}); "
            "use auto",
            where="models[].engine_options.storage_dtype",
        )
    compute = COMPUTE_DTYPES[dtype] if dtype != "auto" else _STORED.get(layout.storage, torch.bfloat16)
    if layout.storage == "mxfp4" and dtype == "auto":
        compute = TORCH_DTYPES[layout.parts[2].dtype]  # the biases' dtype: the checkpoint's float dtype
    model, family = build_skeleton(checked, compute)
    reads = _expert_reads(checked) + _parameter_reads(checked, model, device, compute)
    progress = LoadProgress(model_id, sum(r.entry.nbytes for r in reads))
    buffers = _read_all(reads, lambda key: _allocate(key, checked, pin), progress)
    seconds = progress.finish()
    _finish_model(model, device)
    store = CheckpointExpertStore(layout, {layer: buffers[("layer", layer)] for layer in layout.moe_layers})
    read = {r.entry.name for r in reads}
    unused = sorted(set(checked.files.tensors) - read)
    card = {
        "checkpoint": str(directory),
        "resolved_from": source,
        "architecture": layout.architecture,
        "model_type": checked.config.get("model_type"),
        "storage": layout.storage,
        "checkpoint_bytes": checked.files.total_bytes,
        "load_bytes": progress.done,
        "load_seconds": seconds,
        "unused_tensors": unused[:8] + ([f"... {len(unused) - 8} more"] if len(unused) > 8 else []),
    }
    return LoadedCheckpoint(model.eval(), family, store, _tokenizer(directory), card)


def build_skeleton(checked: CheckedCheckpoint, compute: torch.dtype) -> tuple[nn.Module, MoEFamily]:
    """The model on ``meta`` with every routed-experts module already replaced by ``OffloadedExperts``."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(checked.directory, local_files_only=True)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the engine computes MXFP4 experts itself: no transformers quantizer
    family = family_of(config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=compute)
    if (checked.directory / "generation_config.json").is_file():
        model.generation_config = GenerationConfig.from_pretrained(checked.directory, local_files_only=True)
    for i, layer in enumerate(model.model.layers):
        experts = family.experts_module(layer)
        if (experts is not None) != (i in checked.layout.moe_layers):
            raise InputError(
                f"layer {i}: the model class and config.json disagree on whether it is an MoE layer",
                where=str(checked.directory / "config.json"),
            )
        if experts is not None:
            layer.mlp.experts = OffloadedExperts(i, family.expert_fn(experts))
    return model, family


def _expert_reads(checked: CheckedCheckpoint) -> list[_Read]:
    """Each expert tensor of the checkpoint into its part's view in the expert's byte row (an ``[E, ...]``
    tensor: one read per expert, consecutive in the file)."""
    layout, reads = checked.layout, []
    for layer in layout.moe_layers:
        for src in layout.sources(layer):
            entry = checked.files.tensors[src.tensor]
            nbytes = layout.parts[src.part].nbytes
            experts = [src.expert] if src.expert is not None else range(layout.num_experts)
            for e in experts:
                if src.expert is None:
                    start = entry.start + e * nbytes
                    sub = replace(entry, shape=layout.parts[src.part].shape, start=start, end=start + nbytes)
                else:
                    sub = entry

                def place(layer_bytes, e=e, src=src):
                    part = part_views(layout, layer_bytes[e])[src.part]
                    return part if src.expert is None else part[src.row0 : src.row0 + src.shape[0]]

                reads.append(_Read(sub, ("layer", layer), place))
    return reads


def _parameter_reads(
    checked: CheckedCheckpoint, model: nn.Module, device: torch.device, compute
) -> list[_Read]:
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

        reads.append(_Read(entry, ("param", name), lambda t: t, assign))
    return reads


def _allocate(key: tuple, checked: CheckedCheckpoint, pin: bool):
    """(bytes, allocate) of the buffer ``key``: a layer's store bytes (pinned on CUDA) or a tensor's host copy."""
    kind, what = key
    if kind == "layer":
        nbytes = checked.layout.expert_nbytes * checked.layout.num_experts

        def layer() -> torch.Tensor:
            try:
                return allocate_layer(checked.layout, pin=pin)
            except RuntimeError as exc:
                raise RuntimeError(
                    f"cannot allocate {'pinned ' if pin else ''}host memory for MoE layer {what}'s experts "
                    f"({nbytes} B): {exc}. The host store needs {checked.layout.total_bytes} B"
                    f"{' of pinnable memory (ulimit -l)' if pin else ''}; see docs/operators.md"
                ) from None

        return nbytes, layer
    entry = checked.files.tensors[what]
    return entry.nbytes, lambda: host_empty(entry.shape, TORCH_DTYPES[entry.dtype])


def _read_all(reads: list[_Read], allocate, progress: LoadProgress) -> dict[tuple, Any]:
    """Every read in file order (one sequential pass per shard), bytes straight into their destination, the
    destinations allocated ahead by a background thread. Returns the store parts by layer key."""
    reads = sorted(reads, key=lambda r: (str(r.entry.file), r.entry.start))
    order = list(dict.fromkeys(r.key for r in reads))
    pre = Preallocator([(key, *allocate(key)) for key in order])
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
                    progress.advance(r.entry.nbytes)
    finally:
        pre.close()
    return buffers


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


def _finish_model(model: nn.Module, device: torch.device) -> None:
    """Non-persistent buffers (rotary frequencies) are computed, not loaded: rebuild their modules on the
    device; tie weights; nothing may be left on ``meta``."""
    for name, module in list(model.named_modules()):
        if any(b.is_meta for b in module.buffers(recurse=False)):
            parent_name, _, leaf = name.rpartition(".")
            rebuilt = type(module)(model.config).to(device)
            setattr(model.get_submodule(parent_name) if parent_name else model, leaf, rebuilt)
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"not loaded from the checkpoint: {', '.join(left[:5])}")


def _tokenizer(directory: Path):
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(directory, local_files_only=True)
    except (OSError, ValueError, TypeError):
        return None  # prompts must then be token ids
