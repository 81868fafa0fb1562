"""Ablation axes of a sweep spec: settings that may be lists, one cell per value (``memory.expert_cache_fraction``
and a model's ``engine_options.emulated_h2d_gbps``). A cell carries its values in ``Cell.ablation``: they join its
identity and the model part of its report group key, so ``model|B{b}|c{c}`` stays upstream's key for a
single-valued spec. Pure (no Ray, no torch).
"""

from __future__ import annotations

from typing import Any

#: Spec settings that may be lists (ablation axes): name → where it is written. Each cell of an ablation takes one
#: value of each list-valued axis and carries it in ``Cell.ablation`` (its identity and its report group).
ABLATION_AXES: dict[str, str] = {
    "expert_cache_fraction": "memory.expert_cache_fraction",
    "emulated_h2d_gbps": "models[].engine_options.emulated_h2d_gbps",
}


def value_label(value: float) -> str:
    """An ablation value as the report's group key writes it (``%g``: six significant digits)."""
    return f"{float(value):g}"


def group_model(model: str, ablation: dict[str, float] | None) -> str:
    """The model part of a report group key: the model, and its ablation values when it has any (e.g.
    ``mini-gpt-oss[expert_cache_fraction=0.25,emulated_h2d_gbps=0.05]``), so ``model|B{b}|c{c}`` stays upstream's
    key for a single-valued spec."""
    if not ablation:
        return model
    return (
        f"{model}["
        + ",".join(f"{k}={value_label(ablation[k])}" for k in ABLATION_AXES if k in ablation)
        + "]"
    )


def check_distinct(values: list, field: str) -> list:
    """Refuse two values of one ablation axis that are equal at the group key's precision (:func:`value_label`):
    ``[0.25, 0.2500001]`` would plan two cells whose rows share one report group and identity slot, which the
    report then refuses as duplicates. Exact duplicates are the same case."""
    seen: dict[str, object] = {}
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            continue  # not a number: the field's own check names it
        label = value_label(v)
        if label in seen:
            if seen[label] == v:
                raise ValueError(f"duplicate value {v!r} in {field}")
            raise ValueError(
                f"values {seen[label]!r} and {v!r} in {field} are equal at the report's precision (both {label}): "
                "their cells would share one identity; use values that differ in 6 significant digits"
            )
        seen[label] = v
    return values


def ablation_settings(spec: Any, model: Any) -> list[dict[str, float]]:
    """Every combination of the list-valued ablation axes for ``model`` ([{}] for a single-valued spec)."""
    axes: dict[str, list[float]] = {}
    if isinstance(spec.memory.expert_cache_fraction, list):
        axes["expert_cache_fraction"] = spec.memory.expert_cache_fraction
    if model.link_axis():
        axes["emulated_h2d_gbps"] = model.link_axis()
    settings: list[dict[str, float]] = [{}]
    for name, values in axes.items():
        settings = [{**s, name: float(v)} for s in settings for v in values]
    return settings


def identity_of(
    model: str,
    baseline: str,
    block_size: int,
    concurrency: int,
    repeat: int,
    ablation: dict[str, float] | None,
) -> tuple:
    """A row's identity: upstream's ``(model, baseline, block_size, concurrency, repeat)``, plus the sorted
    ablation values when the spec has list-valued axes (one rule for cells, rows and the report)."""
    base = (model, baseline, block_size, concurrency, repeat)
    return base + tuple(sorted(ablation.items())) if ablation else base
