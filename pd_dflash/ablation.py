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


def group_model(model: str, ablation: dict[str, float] | None) -> str:
    """The model part of a report group key: the model, and its ablation values when it has any (e.g.
    ``mini-gpt-oss[expert_cache_fraction=0.25,emulated_h2d_gbps=0.05]``), so ``model|B{b}|c{c}`` stays upstream's
    key for a single-valued spec."""
    if not ablation:
        return model
    return f"{model}[" + ",".join(f"{k}={ablation[k]:g}" for k in ABLATION_AXES if k in ablation) + "]"


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
