"""Plan-time checks of a reference-engine spec, without torch: every real checkpoint a spec names that is
visible from here (``checkpoints.check``), its DFlash drafter against it (``dflash.config``), and its prompt
file. ``engine/registry.py`` runs :func:`check_spec` for every command that loads a spec; it sits above
``checkpoints/``, ``dflash/`` and ``presets/`` so that none of them imports another's checks.
"""

from __future__ import annotations

import os
from typing import Any

from pd_dflash.engine.reference.checkpoints.check import check_checkpoint
from pd_dflash.engine.reference.checkpoints.resolve import TINY_REAL, resolve
from pd_dflash.engine.reference.dflash.config import check_drafter
from pd_dflash.engine.reference.families import checkpoint_family
from pd_dflash.engine.reference.positions import (
    PromptTexts,
    check_positions,
    checkpoint_prompt_length,
    preset_prompt_length,
)
from pd_dflash.engine.reference.presets.catalog import PRESETS
from pd_dflash.engine.reference.prompts import load_prompt_texts, needs_chat_template, prompt_kind
from pd_dflash.errors import InputError
from pd_dflash.spec_inputs import prompt_file


def check_spec(spec: Any) -> list[str]:
    """Plan-time checks of a reference-engine spec (``registry.check`` runs this for every command that loads
    a spec): each real checkpoint visible from here — its files, its chat template when the prompts are text,
    and its DFlash drafter against it (``dflash.config.check_drafter``). Resolution uses the spec's ``env``
    (the runners' ``HF_HOME``) over this process's. Returns notes (checkpoints not on this machine); raises the
    first InputError, prefixed with the model's index."""
    env = {**os.environ, **spec.env}
    text_prompts = prompt_kind(spec.workload.prompts) != "synthetic"
    _check_prompt_content(spec.workload.prompts)
    notes = []
    texts = PromptTexts(spec.workload.prompts)
    for i, m in enumerate(spec.models):
        if m.preset is not None or _is_preset_name(m.id):
            preset = PRESETS.get(m.preset or m.id)  # an unknown one is registry.check's to name
            if preset is not None:
                bound = f"max_positions of preset {preset.name}"
                check_positions(
                    spec, i, m.id, preset.max_positions, bound, preset_prompt_length(spec, texts, preset)
                )
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
        chat = text_prompts and needs_chat_template(m.id, checkpoint_family(checked.config, "config.json"))
        check_positions(
            spec,
            i,
            m.id,
            checked.config.get("max_position_embeddings"),
            f"max_position_embeddings in {found.directory / 'config.json'}",
            checkpoint_prompt_length(spec, found.directory, texts, chat=chat),
        )
        if note:
            notes.append(f"{m.id}: {note}")
    return notes


def _check_prompt_content(source: str) -> None:
    """A prompt file that is here is read as the runners will read it (bad lines named at plan time); one that
    is not here is ``spec_inputs.check_here``'s to refuse (plan, run), not this check's (report --spec too)."""
    path = prompt_file(source)
    if path is not None and path.is_file():
        load_prompt_texts(source)


def _is_preset_name(name: str) -> bool:
    return name in PRESETS and name not in TINY_REAL
