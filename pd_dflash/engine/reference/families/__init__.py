"""The model families the reference engine serves, one module each (``qwen3_moe``, ``gpt_oss``, ``mixtral``),
behind one interface (``base.MoEFamily``), and the registry that finds a family by name, by a transformers
config, or by a checkpoint's ``config.json``. Adding a family is one module and one entry in ``FAMILIES``.

Torch-free at import (``pd-dflash plan`` checks checkpoints through it); a family's compute imports torch
when it is called.
"""

from __future__ import annotations

from typing import Any

from pd_dflash.engine.reference.families import gpt_oss, mixtral, qwen3_moe
from pd_dflash.engine.reference.families.base import MoEFamily
from pd_dflash.engine.reference.families.layouts import ExpertLayout, config_dtype, quant_method
from pd_dflash.errors import InputError

__all__ = [
    "ARCHITECTURES",
    "FAMILIES",
    "FAMILY_FILES",
    "MoEFamily",
    "checkpoint_family",
    "expert_layout",
    "family_named",
    "family_of",
    "num_experts",
]

#: Every family, by transformers' ``model_type`` (in the order the errors list them).
FAMILIES: dict[str, MoEFamily] = {f.name: f for f in (qwen3_moe.FAMILY, mixtral.FAMILY, gpt_oss.FAMILY)}
#: Architectures of the published checkpoints the engine reads (``config.json: architectures[0]``) → family.
ARCHITECTURES: dict[str, MoEFamily] = {f.architecture: f for f in FAMILIES.values() if f.architecture}
#: The family source files (relative to ``engine/reference/``) that decide what a preset or a tiny checkpoint
#: holds: part of their cache keys (``presets/training.code_version``).
FAMILY_FILES: tuple[str, ...] = (
    "families/base.py",
    *(f"families/{type(f).__module__.rsplit('.', 1)[1]}.py" for f in FAMILIES.values()),
)


def family_named(name: str) -> MoEFamily:
    if name not in FAMILIES:
        raise ValueError(f"unknown model family {name!r} (known: {', '.join(FAMILIES)})")
    return FAMILIES[name]


def family_of(config: Any) -> MoEFamily:
    """The family of a transformers config (its ``model_type``)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(
            f"model_type {model_type!r} is not supported by the reference engine "
            f"(supported: {', '.join(FAMILIES)})"
        )
    return FAMILIES[model_type]


def checkpoint_family(config: dict[str, Any], where: str) -> MoEFamily:
    """The family of a checkpoint's ``config.json`` (its ``architectures[0]``, which ``model_type`` must match)."""
    archs = config.get("architectures") or []
    arch = archs[0] if archs else None
    if arch not in ARCHITECTURES:
        raise InputError(
            f"architectures: {arch!r} is not supported by the reference engine "
            f"(supported: {', '.join(ARCHITECTURES)})",
            where=where,
        )
    family = ARCHITECTURES[arch]
    if config.get("model_type") not in (None, family.name):
        raise InputError(
            f"model_type: {config.get('model_type')!r} does not match architecture {arch}", where=where
        )
    return family


def expert_layout(
    config: dict[str, Any], *, where: str = "config.json", dtype: str | None = None
) -> ExpertLayout:
    """The expert layout a checkpoint with this config.json has (``dtype``: the stored float dtype, e.g. read
    from the checkpoint; default the config's)."""
    family = checkpoint_family(config, where)
    dims = family.layout_dims(config, where)
    method = quant_method(config)
    if method is not None and method not in family.quant_methods:
        quantized = [f"{m} for {f.architecture}" for f in ARCHITECTURES.values() for m in f.quant_methods]
        raise InputError(
            f"quantization_config.quant_method: {method!r} is not supported for {family.architecture} "
            f"(supported: unquantized, or {', '.join(quantized)})",
            where=where,
        )
    return family.expert_layout(config, dims, dtype or config_dtype(config), method, where)


def num_experts(config: Any) -> int:
    return int(getattr(config, "num_experts", None) or config.num_local_experts)
