"""Static facts about each engine, readable without importing the engine (no torch, no Ray).

The driver groups cells by what an engine can serve from one model load; ``plan`` reports what an engine
cannot run before anything starts; the spec validates ``engine_options`` against the engine's options model.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from pd_dflash.errors import InputError, format_validation_error

if TYPE_CHECKING:
    from pd_dflash.engine.interface import Engine
    from pd_dflash.spec import Cell, ModelSpec

ALL_BASELINES = frozenset({"B0", "B1", "B2", "B3", "OURS"})


@dataclass(frozen=True)
class EngineTraits:
    #: ``module:Class`` of the engine implementation (imported only on runners).
    entry_point: str
    #: ``module:Class`` of the pydantic model validating ``engine_options`` (a pure module), or None.
    options_model: str | None = None
    supported_baselines: frozenset[str] = ALL_BASELINES
    #: True when B3 (resident) needs its own model load, e.g. a device-memory ratio fixed at load time.
    separate_resident_load: bool = False
    #: Modules that must be importable where the engine runs (checked by the sweep's preflight).
    requires: tuple[str, ...] = ()
    #: Why an unsupported baseline is not run (shown by `plan`, stored as the row's reason).
    unsupported_reason: dict[str, str] = field(default_factory=dict)
    #: How to get a missing ``requires`` module onto a box (for preflight's message), keyed by module.
    install_hints: dict[str, str] = field(default_factory=dict)
    #: ``module:function`` (torch-free) giving the host bytes one runner needs for a model (``ModelSpec`` →
    #: int or None when unknown); the sweep reserves them with Ray's ``memory`` resource.
    host_memory: str | None = None


BUILTIN: dict[str, EngineTraits] = {
    "reference": EngineTraits(
        entry_point="pd_dflash.engine.reference.engine:ReferenceEngine",
        options_model="pd_dflash.engine.reference.options:ReferenceOptions",
        requires=("torch", "transformers"),
        supported_baselines=ALL_BASELINES,
        host_memory="pd_dflash.engine.reference.host_memory:runner_host_memory_bytes",
    ),
    "moe_infinity": EngineTraits(
        entry_point="pd_dflash.engine.moe_infinity.engine:MoEInfinityEngine",
        options_model="pd_dflash.engine.moe_infinity.options:MoEInfinityOptions",
        separate_resident_load=True,
        requires=("torch", "moe_infinity"),
        install_hints={
            "moe_infinity": "engine 'moe_infinity' runs on GPU boxes with MoE-Infinity installed in the runners' "
            "Python (EfficientMoE/MoE-Infinity, built for sm_120 with MOE_ENABLE_SM120=1); see docs/operators.md. "
            "Without it use engine 'reference'",
        },
    ),
}


def _import(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def traits(engine: str) -> EngineTraits:
    """Traits of a built-in engine, or of a custom ``module:Class`` engine (its ``traits`` attribute)."""
    if engine in BUILTIN:
        return BUILTIN[engine]
    try:
        cls = _import(engine)
    except (ImportError, AttributeError) as exc:
        raise InputError(f"cannot import custom engine {engine!r}: {exc}", where="engine") from None
    found = getattr(cls, "traits", None)
    return found if isinstance(found, EngineTraits) else EngineTraits(entry_point=engine)


def engine_class(engine: str) -> type[Engine]:
    """Import the engine implementation (this may import torch: call it on runners only)."""
    return _import(traits(engine).entry_point)


def validate_engine_options(engine: str, model: ModelSpec, *, where: str) -> BaseModel | None:
    path = traits(engine).options_model
    if path is None:
        if model.engine_options:
            raise InputError("this engine takes no engine_options", where=f"{where}.engine_options")
        return None
    options_cls = _import(path)
    try:
        return options_cls.model_validate(model.engine_options)
    except ValidationError as exc:
        raise InputError(format_validation_error(exc, prefix=f"{where}.engine_options")) from None


def host_memory_bytes(engine: str, model: ModelSpec) -> int | None:
    """Host bytes one runner of ``engine`` needs for ``model`` (None: the engine does not say)."""
    path = traits(engine).host_memory
    return None if path is None else _import(path)(model)


def blocked_reason(engine: str, cell: Cell) -> str | None:
    """Why this engine will not run the cell at all (known before any runner starts), or None."""
    t = traits(engine)
    if cell.baseline not in t.supported_baselines:
        return t.unsupported_reason.get(cell.baseline, f"engine {engine} does not implement {cell.baseline}")
    return None


def load_group(engine: str, cell: Cell) -> str:
    """Cells of one model with the same load group are served by one model load (model affinity)."""
    if traits(engine).separate_resident_load and not cell.offloaded:
        return "resident"
    return "shared"
