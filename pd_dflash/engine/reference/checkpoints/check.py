"""Checking a checkpoint before anything loads it, without torch: the config's architecture, every shard the
index names, every expert tensor in its expected shape and dtype (MXFP4 blocks *and* scales), the non-expert
tensors, and a chat template where the target needs one. ``pd-dflash plan`` runs :func:`check_spec` on the
driver; the engine runs :func:`check_checkpoint` before it allocates anything. Every problem is an
:class:`~pd_dflash.errors.InputError` naming the file and the field or tensor.
"""

from __future__ import annotations

import os
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
from pd_dflash.engine.reference.checkpoints.layouts import (
    ExpertLayout,
    architecture_of,
    config_dtype,
    expert_layout,
    non_expert_tensors,
)
from pd_dflash.engine.reference.checkpoints.resolve import TINY_REAL, resolve
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
    architecture_of(config, where)
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
    for name in non_expert_tensors(config, layout):
        if name not in files.tensors:
            raise InputError(f"tensor {name!r} is missing from the checkpoint", where=str(directory))
    needs = chat_template_for is not None and needs_chat_template(chat_template_for, config.get("model_type"))
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


def check_spec(spec: Any) -> list[str]:
    """Plan-time checks of a reference-engine spec (``registry.check`` runs this for every command that loads
    a spec): each real checkpoint visible from here — its files, its chat template when the prompts are text,
    and its DFlash drafter against it (``dflash.config.check_drafter``). Resolution uses the spec's ``env``
    (the runners' ``HF_HOME``) over this process's. Returns notes (checkpoints not on this machine); raises the
    first InputError, prefixed with the model's index."""
    from pd_dflash.engine.reference.dflash.config import check_drafter
    from pd_dflash.engine.reference.prompts import prompt_kind

    env = {**os.environ, **spec.env}
    text_prompts = prompt_kind(spec.workload.prompts) != "synthetic"
    _check_prompt_content(spec.workload.prompts)
    notes = []
    for i, m in enumerate(spec.models):
        if m.preset is not None or _is_preset_name(m.id):
            continue
        found = resolve(m.id, m.path, env=env)
        if found.source == "tiny-real":
            continue
        if found.problem == "is not a directory":
            raise InputError(
                f"{m.path} is not a directory: a checkpoint is a directory with config.json and safetensors",
                where=f"models.{i}.path",
            )
        if found.problem is not None:
            notes.append(
                f"{m.id}: models.{i}.path {m.path} {found.problem} here; the runners look for it on their boxes "
                "(a box without it refuses the model's cells)"
            )
            continue
        if found.directory is None:
            notes.append(
                f"{m.id}: checkpoint not found here (looked in {', '.join(found.tried)}); "
                "the runners resolve it on their boxes"
            )
            continue
        try:
            checked = check_checkpoint(found.directory, chat_template_for=m.id if text_prompts else None)
            note = (
                check_drafter(
                    m.draft,
                    checked.config,
                    target_where=str(found.directory / "config.json"),
                    env=env,
                    block_sizes=spec.block_sizes,
                )
                if m.draft
                else None
            )
        except InputError as exc:
            raise InputError(str(exc), where=f"models.{i}") from None
        if note:
            notes.append(f"{m.id}: {note}")
    return notes


def _check_prompt_content(source: str) -> None:
    """A prompt file that is here is read as the runners will read it (bad lines named at plan time); one that
    is not here is ``spec_inputs.check_here``'s to refuse (plan, run), not this check's (report --spec too)."""
    from pd_dflash.engine.reference.prompts import load_prompt_texts
    from pd_dflash.spec_inputs import prompt_file

    path = prompt_file(source)
    if path is not None and path.is_file():
        load_prompt_texts(source)


def _is_preset_name(name: str) -> bool:
    from pd_dflash.engine.reference.presets.catalog import PRESETS

    return name in PRESETS and name not in TINY_REAL


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
