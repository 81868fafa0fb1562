"""Checking a checkpoint before anything loads it, without torch: the config's architecture, every shard the
index names, every expert tensor in its expected shape and dtype (MXFP4 blocks *and* scales), the non-expert
tensors, and a chat template where the target needs one. ``pd-dflash plan`` runs these on the driver
(``spec_check.check_spec``); the engine runs :func:`check_checkpoint` before it allocates anything. Every
problem is an :class:`~pd_dflash.errors.InputError` naming the file and the field or tensor. Which tensors a
checkpoint must hold is its family's to say (``families/``); this module reads any family's layout.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pd_dflash.engine.reference.checkpoints.fields import (
    generation_eos_ids,
    has_chat_template,
    read_target_config,
)
from pd_dflash.engine.reference.checkpoints.files import CheckpointFiles, open_checkpoint
from pd_dflash.engine.reference.checkpoints.resolve import resolve
from pd_dflash.engine.reference.families import checkpoint_family, expert_layout
from pd_dflash.engine.reference.families.layouts import ExpertLayout, config_dtype
from pd_dflash.engine.reference.prompts import needs_chat_template
from pd_dflash.errors import InputError

_FLOAT = ("BF16", "F16", "F32")


@dataclass(frozen=True)
class CheckedCheckpoint:
    directory: Path
    config: dict[str, Any]
    layout: ExpertLayout
    files: CheckpointFiles


def check_checkpoint(directory: Path, *, chat_template_for: str | None = None) -> CheckedCheckpoint:
    """Everything about the checkpoint in ``directory`` that can be checked without loading it
    (``chat_template_for``: the model id whose instruct-ness decides whether a chat template is required)."""
    config = read_target_config(directory)  # every key the engine reads, of its type
    where = str(directory / "config.json")
    family = checkpoint_family(config, where)
    generation_eos_ids(directory)  # its types, before transformers reads it at load
    files = open_checkpoint(directory)
    layout = expert_layout(config, where=where, dtype=_stored_float_dtype(files, config))
    for layer in layout.moe_layers:
        for src in layout.sources(layer):
            part = layout.parts[src.part]
            entry = files.tensors.get(src.tensor)
            if entry is None:
                raise InputError(
                    f"tensor {src.tensor!r} ({_what(layout, part.name, layer)}) is missing from the checkpoint",
                    where=str(directory),
                )
            if entry.shape != src.shape or entry.dtype != part.dtype:
                raise InputError(
                    f"tensor {src.tensor!r} is {entry.dtype}{list(entry.shape)}, expected "
                    f"{part.dtype}{list(src.shape)} from config.json",
                    where=str(entry.file),
                )
    for name in family.non_expert_tensors(config, layout):
        if name not in files.tensors:
            raise InputError(f"tensor {name!r} is missing from the checkpoint", where=str(directory))
    needs = chat_template_for is not None and needs_chat_template(chat_template_for, family)
    if needs and not has_chat_template(directory):
        raise InputError(
            f"tokenizer_config.json: no chat_template, but {chat_template_for} is an instruct target "
            "(prompted through its chat template); add the tokenizer's chat template",
            where=str(directory),
        )
    return CheckedCheckpoint(directory, config, layout, files)


def check_model(
    model_id: str,
    path: str | None = None,
    *,
    env: Mapping[str, str] | None = None,
    require_present: bool = False,
) -> str | None:
    """Check one ``models[]`` entry where this process runs. A checkpoint that is here must be complete
    (InputError otherwise); one that is not here is a note (``plan`` on a head box without the weights), or an
    InputError when ``require_present`` (on a box that will load it)."""
    found = resolve(model_id, path, env=env)
    if found.source == "tiny-real":
        return None
    if found.directory is None:
        message = f"checkpoint not found here (looked in {', '.join(found.tried)})"
        if require_present:
            raise InputError(message + "; download it into HF_HOME or set models[].path", where=found.field)
        return f"{model_id}: {message}; the runners resolve it on their boxes"
    check_checkpoint(found.directory, chat_template_for=model_id)
    return None


def _stored_float_dtype(files: CheckpointFiles, config: dict[str, Any]) -> str:
    """The checkpoint's float dtype as stored (the embedding's), else the config's."""
    embed = files.tensors.get("model.embed_tokens.weight")
    return embed.dtype if embed is not None and embed.dtype in _FLOAT else config_dtype(config)


def _what(layout: ExpertLayout, part: str, layer: int) -> str:
    if part.endswith("_scales"):
        return f"MXFP4 scales of layer {layer}'s experts"
    if part.endswith("_blocks"):
        return f"MXFP4 blocks of layer {layer}'s experts"
    return f"{part} of a layer-{layer} expert"
