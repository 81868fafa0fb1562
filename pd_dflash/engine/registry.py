"""Static facts about each engine, readable without importing the engine (no torch, no Ray).

The driver groups cells by what an engine can serve from one model load; ``plan`` reports what an engine
cannot run before anything starts. :func:`check` is the step that validates a spec for its engine when a
command loads it (the core ``spec`` module knows no engine): the engine name, each model's ``engine_options``
and the fields an engine requires. Nothing is imported from outside the package at that point: a custom
``module:Class`` engine is checked for its form only, and imported by the sweep's preflight on each box
(:func:`traits` / :func:`engine_class`, runner side).
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ValidationError

from pd_dflash.baselines import GATED, ORDER
from pd_dflash.errors import InputError, excerpt, format_validation_error
from pd_dflash.spec import ModelSpec, SweepSpec, load_spec
from pd_dflash.spec_inputs import check_concurrency, check_here, check_locale, check_token_counts

if TYPE_CHECKING:
    from pd_dflash.engine.interface import Engine
    from pd_dflash.spec import Cell

#: A custom engine is named ``package.module:ClassName``.
CUSTOM_ENGINE = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")


#: Spec fields only some engines read: each built-in engine declares which of them it reads
#: (``EngineTraits.reads``), and a spec that sets one its engine does not read is refused (:func:`check_reads`).
ENGINE_FIELDS = {
    "memory.expert_cache_fraction": "the reference engine's device expert cache",
    "memory.device_memory_ratio": "MoE-Infinity's device memory ratio of the offloaded load",
    "memory.resident_memory_ratio": "MoE-Infinity's device memory ratio of B3's load",
    "workload.chat_date": "the date a chat template renders (the reference engine's text prompts)",
}
#: ``workload.prompts`` kinds (``prompts.prompt_kind``): synthetic, humaneval, jsonl (``file:PATH``), lines.
PROMPT_KINDS = frozenset({"synthetic", "humaneval", "jsonl", "lines"})


@dataclass(frozen=True)
class EngineTraits:
    #: ``module:Class`` of the engine implementation (imported only on runners).
    entry_point: str
    #: ``module:Class`` of the pydantic model validating ``engine_options`` (a pure module), or None.
    options_model: str | None = None
    supported_baselines: frozenset[str] = frozenset(ORDER)
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
    #: A torch-free check of one model entry (fields the engine requires), ``check_model(model, where)``;
    #: raises InputError. Runs at plan time, so it may import only torch-free modules.
    check_model: Callable[[ModelSpec, str], None] | None = None
    #: A torch-free check of the whole spec (files the engine will read: checkpoints, drafters, prompts),
    #: ``check_spec(spec) -> notes``; raises InputError. Runs after ``check_model``, at plan time too.
    check_spec: Callable[[SweepSpec], list[str]] | None = None
    #: The ``ENGINE_FIELDS`` this engine reads (None: not declared, nothing checked); one it does not read is
    #: refused: at plan for a built-in engine, at the sweep's preflight for a custom one (its traits come from a box).
    reads: frozenset[str] | None = None
    #: The ``workload.prompts`` kinds it reads (``PROMPT_KINDS``).
    prompt_kinds: frozenset[str] = PROMPT_KINDS


def _reference_model(model: ModelSpec, where: str) -> None:
    """A named preset must exist (a model id that is no preset is a checkpoint, found when it loads)."""
    if model.preset is None:
        return
    # The catalogue is pydantic + numpy only (transformers is imported inside its functions).
    from pd_dflash.engine.reference.presets.catalog import PRESETS

    if model.preset not in PRESETS:
        raise InputError(
            f"unknown reference preset {excerpt(model.preset)}; known presets: {', '.join(PRESETS)}",
            where=f"{where}.preset",
        )


def _reference_spec(spec: SweepSpec) -> list[str]:
    """Every baseline's parts have a factory (``cell.py``); real checkpoints (and their drafters) visible from
    here; a checkpoint that is not: a note."""
    from pd_dflash.engine.reference.cell import check_configurations
    from pd_dflash.engine.reference.spec_check import check_spec

    check_configurations(spec.baselines)
    return check_spec(spec)


def _moe_infinity_spec(spec: SweepSpec) -> list[str]:
    """Visible checkpoints' positions against the spec's longest cell (torch-free, library-free)."""
    from pd_dflash.engine.moe_infinity.spec_check import check_spec

    return check_spec(spec)


def _moe_infinity_model(model: ModelSpec, where: str) -> None:
    if not model.offload_dir:
        raise InputError(
            "MoE-Infinity needs an offload_dir (where it stores offloaded experts)",
            where=f"{where}.offload_dir",
        )


BUILTIN: dict[str, EngineTraits] = {
    "reference": EngineTraits(
        entry_point="pd_dflash.engine.reference.engine:ReferenceEngine",
        options_model="pd_dflash.engine.reference.options:ReferenceOptions",
        requires=("torch", "transformers"),
        check_model=_reference_model,
        check_spec=_reference_spec,
        host_memory="pd_dflash.engine.reference.checkpoints.host_memory:runner_host_memory_bytes",
        reads=frozenset({"memory.expert_cache_fraction", "workload.chat_date"}),
    ),
    "moe_infinity": EngineTraits(
        entry_point="pd_dflash.engine.moe_infinity.engine:MoEInfinityEngine",
        options_model="pd_dflash.engine.moe_infinity.options:MoEInfinityOptions",
        separate_resident_load=True,
        # The adapter switches MoE-Infinity's own prefetcher and verify budgets for Phase A's configurations; the
        # ablations (RA, AR2D) recombine the reference engine's parts, which MoE-Infinity does not expose apart.
        supported_baselines=frozenset(GATED),
        unsupported_reason={
            name: f"{name} is an ablation of the reference engine (baselines.py); MoE-Infinity's adapter runs "
            "Phase A's configurations only"
            for name in ORDER
            if name not in GATED
        },
        requires=("torch", "moe_infinity"),
        install_hints={
            "moe_infinity": "engine 'moe_infinity' runs on GPU boxes with MoE-Infinity installed in the runners' "
            "Python (EfficientMoE/MoE-Infinity, built for sm_120 with MOE_ENABLE_SM120=1); see docs/operators.md. "
            "Without it use engine 'reference'",
        },
        check_model=_moe_infinity_model,
        check_spec=_moe_infinity_spec,
        # Its prompts (moe_infinity/prompts.py): synthetic paragraphs or a plain text file, no chat template.
        reads=frozenset({"memory.device_memory_ratio", "memory.resident_memory_ratio"}),
        prompt_kinds=frozenset({"synthetic", "lines"}),
    ),
}


def _import(path: str) -> Any:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def static_traits(engine: str) -> EngineTraits | None:
    """A built-in engine's traits, known without importing anything; None for a custom engine."""
    return BUILTIN.get(engine)


def traits(engine: str) -> EngineTraits:
    """Traits of a built-in engine, or of a custom ``module:Class`` engine (its ``traits`` attribute).

    A custom engine is imported here: call this on runners and in preflight, never at plan time.
    """
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


def validate_engine_options(
    engine: str, model: ModelSpec, *, where: str, engine_traits: EngineTraits | None = None
) -> BaseModel | None:
    """``model.engine_options`` through the engine's options model (imports a custom engine's: runner side)."""
    path = (engine_traits or traits(engine)).options_model
    if path is None:
        if model.engine_options:
            raise InputError("this engine takes no engine_options", where=f"{where}.engine_options")
        return None
    options_cls = _import(path)
    try:
        return options_cls.model_validate(model.engine_options)
    except ValidationError as exc:
        raise InputError(format_validation_error(exc, prefix=f"{where}.engine_options")) from None


def check(spec: SweepSpec, *, where: str | None = None) -> SweepSpec:
    """The engine step of loading a spec for a command; returns the spec, raises InputError (exit 2).

    A built-in engine: each model's ``engine_options`` and required fields. A custom ``module:Class`` engine:
    the form of its name only (nothing is imported; preflight imports it on the boxes).
    """
    if spec.engine not in BUILTIN and not CUSTOM_ENGINE.match(spec.engine):
        raise InputError(
            f"engine: unknown engine {excerpt(spec.engine)}: use one of {', '.join(BUILTIN)} or 'module:Class' "
            f"(got {excerpt(spec.engine)})",
            where=where or "<spec>",
        )
    check_concurrency(spec)  # whatever the engine: no more requests are in flight than there are
    check_token_counts(spec)
    known = static_traits(spec.engine)
    if known is None:
        return spec
    check_reads(spec, known)
    for i, model in enumerate(spec.models):
        link = model.engine_options.get("emulated_h2d_gbps")
        if isinstance(link, list) and (not link or len(set(link)) != len(link)):
            raise InputError(
                f"an ablation list must be non-empty and without duplicates, got {link}",
                where=f"models.{i}.engine_options.emulated_h2d_gbps",
            )
        # A link-rate list is an ablation axis (ablation.ABLATION_AXES): every rate must be a valid option.
        for variant in model.variants():
            validate_engine_options(spec.engine, variant, where=f"models.{i}", engine_traits=known)
            if known.check_model is not None:
                known.check_model(variant, f"models.{i}")
    if known.check_spec is not None:
        known.check_spec(spec)
    return spec


def check_reads(spec: SweepSpec, known: EngineTraits) -> None:
    """Refuse a spec field (``ENGINE_FIELDS``) or prompt kind the engine does not read: its cells would carry a
    value no measurement used, and a list-valued one would measure the same thing under several labels."""
    from pd_dflash.engine.reference.prompts import prompt_kind  # torch-free

    if known.reads is not None:
        for name, what in ENGINE_FIELDS.items():
            section, _, key = name.partition(".")
            part = getattr(spec, section)
            if name in known.reads or key not in part.model_fields_set or getattr(part, key) is None:
                continue
            value = getattr(part, key)
            axis = (
                " (a list: one measurement under each label, the plan multiplied)"
                if isinstance(value, list)
                else ""
            )
            reads = ", ".join(sorted(known.reads)) or "none of them"
            raise InputError(
                f"engine {spec.engine} does not read {name} ({what}), so the cells would be labelled with a "
                f"value no measurement uses{axis}. Of the engine-specific fields it reads {reads}; remove {name}",
                where=name,
            )
    kind = prompt_kind(spec.workload.prompts)
    if kind not in known.prompt_kinds:
        raise InputError(
            f"engine {spec.engine} does not read {kind} prompts ({excerpt(spec.workload.prompts)}); it reads "
            f"{', '.join(sorted(known.prompt_kinds))} (a plain text file is 'lines')",
            where="workload.prompts",
        )


def load_checked_spec(path: str | Path) -> SweepSpec:
    """``spec.load_spec`` followed by :func:`check`: how a command (plan, report --spec, run) loads a spec. The
    locale check comes first: ``check`` may look for files the spec names."""
    spec = load_spec(path)
    check_locale(spec, str(path))
    return check(spec, where=str(path))


def load_spec_here(path: str | Path) -> SweepSpec:
    """:func:`load_checked_spec` plus what this machine can check (``spec_inputs.check_here``: the prompt
    file, local mode's memory): how ``plan`` and ``run`` load a spec (``report --spec`` may run elsewhere)."""
    spec = load_checked_spec(path)
    check_here(spec)
    return spec


def plan_notes(spec: SweepSpec) -> list[str]:
    """What ``plan`` cannot know before preflight: a custom engine (not imported at plan time), files of a
    built-in engine that are not on this machine (its ``check_spec`` notes)."""
    if spec.engine in BUILTIN:
        known = BUILTIN[spec.engine]
        return known.check_spec(spec) if known.check_spec is not None else []
    return [
        f"engine {spec.engine} is unverified until preflight: plan does not import it, so its import, traits "
        "(supported baselines) and engine_options are checked by the sweep's preflight on each box"
    ]


def plan_blocked_reason(engine: str) -> Callable[[Cell], str | None] | None:
    """``blocked_reason`` for ``plan``: a built-in engine's; None (nothing known blocked) for a custom one."""
    if engine not in BUILTIN:
        return None
    return lambda cell: blocked_reason(engine, cell)


def host_memory_bytes(engine: str, model: ModelSpec) -> int | None:
    """Host bytes one runner of a built-in ``engine`` needs for ``model`` (None: unknown, or a custom engine,
    which is never imported here)."""
    known = static_traits(engine)
    path = known.host_memory if known is not None else None
    return None if path is None else _import(path)(model)


def blocked_reason(engine: str, cell: Cell) -> str | None:
    """Why this engine will not run the cell at all (known before any runner starts), or None."""
    return blocked_reason_for(traits(engine), engine, cell)


def blocked_reason_for(t: EngineTraits, engine: str, cell: Cell) -> str | None:
    """``blocked_reason`` from traits already at hand (the sweep's driver gets a custom engine's from preflight)."""
    if cell.baseline not in t.supported_baselines:
        return t.unsupported_reason.get(cell.baseline, f"engine {engine} does not implement {cell.baseline}")
    return None


def load_group(engine: str, cell: Cell) -> str:
    """Cells of one model with the same load group are served by one model load (model affinity)."""
    return load_group_for(traits(engine), cell)


def load_group_for(t: EngineTraits, cell: Cell) -> str:
    """``load_group`` from traits already at hand."""
    if t.separate_resident_load and not cell.offloaded:
        return "resident"
    return "shared"
