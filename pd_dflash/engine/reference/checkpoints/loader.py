"""Loading a real checkpoint into the reference engine without ever materialising it in host memory.

The model is built on the ``meta`` device from ``config.json``; every routed-experts module is replaced by
``OffloadedExperts`` before any weight is read. Then the memory is checked (host: the store's arena plus the
non-expert weights in flight; device: the non-expert weights) — a load that would not fit is refused with the
figures before anything is allocated (the engine refuses every cell; the model stays the ``meta`` skeleton).
Then the safetensors files are read once, in file order, each tensor straight into its destination
(``reads.py``): the experts into the host store's one arena (stored as in the file: bf16, or MXFP4 blocks +
scales + biases; on CUDA each layer's pages are pinned in place as soon as that layer is filled:
``LayerPinner``), the rest to the device in the compute dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from pd_dflash.engine.interface import Refused
from pd_dflash.engine.reference.checkpoints.check import CheckedCheckpoint, check_checkpoint
from pd_dflash.engine.reference.checkpoints.reads import (
    LOOKAHEAD_BYTES,
    LoadProgress,
    expert_reads,
    parameter_reads,
    read_all,
)
from pd_dflash.engine.reference.checkpoints.resolve import resolve
from pd_dflash.engine.reference.checkpoints.store import (
    TORCH_DTYPES,
    CheckpointExpertStore,
    LayerArena,
    arena_layers,
    layer_range,
    store_bytes,
)
from pd_dflash.engine.reference.families import MoEFamily, family_of
from pd_dflash.engine.reference.offload.memory import module_bytes, require
from pd_dflash.engine.reference.offload.runtime import OffloadedExperts
from pd_dflash.errors import InputError
from pd_dflash.schema import Status

COMPUTE_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class LoadedCheckpoint:
    model: nn.Module
    family: MoEFamily
    #: None when the load was refused (``refusal``): the model is then the ``meta`` skeleton.
    store: CheckpointExpertStore | None
    tokenizer: Any
    card: dict[str, Any] = field(default_factory=dict)
    refusal: Refused | None = None


def locate(model_id: str, path: str | None, cache_dir: str | None) -> tuple[Path, str]:
    """(checkpoint directory, how it was found); tiny real-layout names are generated into the cache."""
    found = resolve(model_id, path)
    if found.source == "tiny-real":
        from pd_dflash.engine.reference.checkpoints.tiny import materialise

        return materialise(model_id, cache_dir), found.source
    if found.problem is not None:
        raise InputError(
            f"{path} {found.problem} on this box: a checkpoint is a directory with config.json and safetensors",
            where=found.field,
        )
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
    host_available_bytes: int | None = None,
    device_available_bytes: int | None = None,
) -> LoadedCheckpoint:
    """The checkpoint of ``models[].id`` / ``models[].path`` (``*_available_bytes``: memory available now;
    None: not checked). A missing chat template is found when prompts are made (a REFUSED row); ``pd-dflash
    plan`` has already checked it where the checkpoint was visible."""
    directory, source = locate(model_id, path, cache_dir)
    checked = check_checkpoint(directory)
    layout = checked.layout
    if storage not in ("auto", layout.storage):
        raise InputError(
            f"{storage!r}: a checkpoint's experts are stored as the checkpoint stores them ({layout.storage}); "
            "use auto",
            where="models[].engine_options.storage_dtype",
        )
    model, family = build_skeleton(checked, _compute_dtype(checked, dtype))
    compute = next(model.parameters()).dtype
    card = {
        "checkpoint": str(directory),
        "resolved_from": source,
        "architecture": layout.architecture,
        "model_type": checked.config.get("model_type"),
        "storage": layout.storage,
        "checkpoint_bytes": checked.files.total_bytes,
    }
    try:
        _check_memory(checked, model, device, pin, host_available_bytes, device_available_bytes)
    except Refused as refusal:
        return LoadedCheckpoint(model, family, None, None, card, refusal=refusal)
    reads = expert_reads(checked) + parameter_reads(checked, model, device, compute)
    progress = LoadProgress(model_id, sum(r.entry.nbytes for r in reads))
    arena, layers = arena_layers(layout)
    pinner = LayerPinner(arena, layers) if pin else None
    try:
        read_all(reads, checked, layers, progress, filled=pinner.pin if pinner else None)
        for layer in set(layers) - set(pinner.done if pinner else layers):  # a layer no read reached
            pinner.pin(layer)
    except Refused as refusal:  # a layer could not be page-locked: the arena is freed with the store
        return LoadedCheckpoint(model, family, None, None, card, refusal=refusal)
    card.update(load_bytes=progress.done, load_seconds=progress.finish())
    if pinner is not None:
        card.update(pin_seconds=pinner.seconds, pinned_layers=len(pinner.done))
        arena.pinned = True
    _finish_model(model, device)
    unused = sorted(set(checked.files.tensors) - {r.entry.name for r in reads})
    card["unused_tensors"] = unused[:8] + ([f"... {len(unused) - 8} more"] if len(unused) > 8 else [])
    store = CheckpointExpertStore(layout, layers, arena)
    return LoadedCheckpoint(model.eval(), family, store, _tokenizer(directory), card)


class LayerPinner:
    """Page-locks each MoE layer's arena pages as soon as the loader has filled them (``read_all``'s ``filled``),
    so registration overlaps the reads and a failure names the layer and the figures at once, not after the
    whole load; ``seconds`` is the total ``cudaHostRegister`` time (the row's ``pin_seconds`` load fact)."""

    def __init__(self, arena: LayerArena, layers: dict[int, torch.Tensor]) -> None:
        self.arena, self.layers = arena, layers
        self.seconds, self.done, self.pinned_bytes = 0.0, [], 0

    def pin(self, layer: int) -> None:
        offset, nbytes = layer_range(self.arena, self.layers[layer])
        try:
            self.seconds += self.arena.pin_range(offset, nbytes, f"MoE layer {layer}'s experts")
        except RuntimeError as exc:
            raise Refused(
                Status.REFUSED,
                f"{exc}, after {len(self.done)} of {len(self.layers)} layers ({self.pinned_bytes:,} B) were "
                f"pinned: the box cannot page-lock {self.arena.nbytes:,} B of experts. Fix: a box with more "
                "lockable host memory (ulimit -l, the cgroup's limit), or fewer runners per box",
            ) from None
        self.done.append(layer)
        self.pinned_bytes += nbytes


def _compute_dtype(checked: CheckedCheckpoint, dtype: str) -> torch.dtype:
    """``engine_options.dtype``, else the checkpoint's float dtype (an MXFP4 checkpoint's: its biases')."""
    if dtype != "auto":
        return COMPUTE_DTYPES[dtype]
    floats = [p.dtype for p in checked.layout.parts if p.dtype != "U8"]
    return TORCH_DTYPES[floats[0]]


def _check_memory(
    checked: CheckedCheckpoint,
    model: nn.Module,
    device: torch.device,
    pin: bool,
    host_available: int | None,
    device_available: int | None,
) -> None:
    """Refuse, before anything is allocated, a load that would not fit: the host holds the store's arena and
    the non-expert weights in flight (all of them on a CPU device, at most the read-ahead on CUDA); the device
    holds the non-expert weights."""
    arena = store_bytes(checked.layout)
    non_expert = module_bytes(model)  # the skeleton's parameters, in the compute dtype
    in_flight = non_expert if device.type == "cpu" else min(non_expert, LOOKAHEAD_BYTES)
    require(
        f"the host expert store ({arena:,} B of experts as stored{', pinned' if pin else ''}) + the non-expert "
        f"weights in host memory during the load ({in_flight:,} B)",
        arena + in_flight,
        host_available,
        "a box with more free host memory, or fewer runners per box (docs/operators.md)",
        "host",
    )
    if device.type == "cuda":
        fix = "a GPU with more free memory (another process may hold some)"
        require("the non-expert weights", non_expert, device_available, fix, "device")


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
            layer.mlp.experts = OffloadedExperts(i, family.grouped_fn(experts))
    return model, family


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
