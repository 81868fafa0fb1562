"""``pd-dflash plan``: what a spec will run, counted while its cells stream past (never all held at once).

The engine's knowledge comes in as arguments (``blocked_reason``, ``notes``): the core knows no engine.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from typing import Any, TextIO

from pd_dflash.ablation import ABLATION_AXES, ablation_settings
from pd_dflash.baselines import BLOCK_INDEPENDENT
from pd_dflash.spec import Cell, SweepSpec, cell_count, iter_cells

BlockedReason = Callable[[Cell], "str | None"]


def plan_summary(
    spec: SweepSpec,
    blocked_reason: BlockedReason | None = None,
    on_cell: Callable[[Cell], None] | None = None,
) -> dict[str, Any]:
    """``{"counts": ..., "blocked": [...]}``, calling ``on_cell`` with each cell as it is expanded.

    ``blocked_reason(cell)`` says why the engine will not run a cell (the CLI passes the registry's); without
    it no cell is blocked.
    """
    per_model: dict[str, dict[str, int]] = {}
    blocked = []
    total = 0
    for c in iter_cells(spec):
        total += 1
        per_model.setdefault(c.model, {}).setdefault(c.baseline, 0)
        per_model[c.model][c.baseline] += 1
        reason = blocked_reason(c) if blocked_reason is not None else None
        if reason:
            blocked.append({"cell_id": c.cell_id, "model": c.model, "baseline": c.baseline, "reason": reason})
        if on_cell is not None:
            on_cell(c)
    saved = {
        f"{m.id}|{b}": (len(spec.block_sizes) - 1) * len(spec.concurrency) * spec.max_repeats
        for m in spec.models
        for b in spec.baselines
        if b in BLOCK_INDEPENDENT and len(spec.block_sizes) > 1
    }
    settings = sum(len(ablation_settings(spec, m)) for m in spec.models)  # ablation settings per model
    upstream_rows = settings * len(spec.baselines) * len(spec.block_sizes) * len(spec.concurrency)
    counts = {
        "total": total,
        "to_run": total - len(blocked),
        "blocked": len(blocked),
        "per_model_baseline": per_model,
        "saved_by_block_dedup": sum(saved.values()),
        "saved_by_block_dedup_detail": saved,
        "report_rows_per_repeat": upstream_rows,
        "fingerprint": spec.fingerprint(),
    }
    if spec.adaptive:  # every repeat a group may run is expanded; the waves run between the two counts
        from pd_dflash.report.adaptive import decidable_effects  # pandas only for an adaptive spec

        counts["adaptive_repeats"] = {
            "min": spec.min_repeats,
            "max": spec.max_repeats,
            "until": spec.adaptive.until,
            "cells_at_min": cell_count(spec, spec.min_repeats),
            "cells_at_max": cell_count(spec, spec.max_repeats),
            "decidable_effect_sd": decidable_effects(spec.adaptive),
        }
    return {"counts": counts, "blocked": blocked}


def plan(spec: SweepSpec, blocked_reason: BlockedReason | None = None) -> dict[str, Any]:
    """The whole plan as one dict: ``cells`` (JSON form), ``counts`` per model × baseline, ``blocked``."""
    cells: list[dict[str, Any]] = []
    summary = plan_summary(spec, blocked_reason, lambda c: cells.append(c.model_dump(mode="json")))
    return {"cells": cells, **summary}


def write_plan_json(
    spec: SweepSpec, out: TextIO, blocked_reason: BlockedReason | None = None, notes: Iterable[str] = ()
) -> None:
    """``plan --json``: the same bytes as ``json.dumps(plan(...))``, written one cell at a time."""
    out.write('{"cells": [')
    first = [True]

    def emit(cell: Cell) -> None:
        out.write(("" if first[0] else ", ") + json.dumps(cell.model_dump(mode="json")))
        first[0] = False

    summary = plan_summary(spec, blocked_reason, emit)
    out.write(f'], "counts": {json.dumps(summary["counts"])}, "blocked": {json.dumps(summary["blocked"])}')
    notes = list(notes)
    if notes:
        out.write(f', "notes": {json.dumps(notes)}')
    out.write("}\n")


def _list_axes(spec: SweepSpec) -> list[tuple[str, list]]:
    """The list-valued ablation axes, as the plan names them."""
    axes = []
    if isinstance(spec.memory.expert_cache_fraction, list):
        axes.append((ABLATION_AXES["expert_cache_fraction"], spec.memory.expert_cache_fraction))
    axes += [(f"{m.id} emulated_h2d_gbps", m.link_axis()) for m in spec.models if m.link_axis()]
    return axes


def _repeats_text(spec: SweepSpec) -> str:
    if spec.adaptive:
        return f"{spec.min_repeats}-{spec.max_repeats} repeats (adaptive)"
    return f"{spec.max_repeats} repeats"


def render_plan(spec: SweepSpec, planned: dict[str, Any], notes: Iterable[str] = ()) -> str:
    """The text plan: axes, cells per model × baseline, savings, blocked cells, notes, totals."""
    counts = planned["counts"]
    lines = [
        f"sweep {spec.name}: engine {spec.engine}, fingerprint {counts['fingerprint']}",
        f"axes: {len(spec.models)} models x {len(spec.baselines)} baselines x block sizes {spec.block_sizes} "
        f"x concurrency {spec.concurrency} x {_repeats_text(spec)}"
        + "".join(f" x {where} {values}" for where, values in _list_axes(spec)),
        "",
        "cells per model x baseline:",
    ]
    width = max(len(m) for m in counts["per_model_baseline"])
    for model, by_b in counts["per_model_baseline"].items():
        parts = "  ".join(f"{b}={n}" for b, n in by_b.items())
        lines.append(f"  {model:<{width}}  {parts}  (total {sum(by_b.values())})")
    if counts["saved_by_block_dedup"]:
        lines.append(
            f"B0 measured once per (model, c, repeat) and shown in every block-size group: "
            f"{counts['saved_by_block_dedup']} cells saved"
        )
    if planned["blocked"]:
        lines.append(f"blocked cells: {len(planned['blocked'])}")
        reasons: dict[str, int] = {}
        for b in planned["blocked"]:
            key = f"{b['baseline']}: {b['reason']}"
            reasons[key] = reasons.get(key, 0) + 1
        lines.extend(f"  {n} x {r}" for r, n in sorted(reasons.items()))
    adaptive = counts.get("adaptive_repeats")
    if adaptive:
        lines.append(
            f"adaptive repeats: min {adaptive['min']}, max {adaptive['max']}, until {adaptive['until']}: "
            f"{adaptive['cells_at_min']} cells at min, {adaptive['cells_at_max']} at max (the counts here are at "
            "max; a group stops adding repeats once its verdict gates are decided)"
        )
        effects = ", ".join(f"{k}: {h:.3g}" for k, h in adaptive["decidable_effect_sd"].items())
        lines.append(
            f"  a look after k repeats decides a gate whose mean sits at least this many repeat standard "
            f"deviations from its threshold (Bonferroni over the looks): {effects}"
        )
    lines.extend(f"note: {n}" for n in notes)
    lines.append(
        f"total: {counts['total']} cells ({counts['to_run']} to run, {counts['blocked']} blocked); "
        f"{counts['report_rows_per_repeat']} report rows per repeat"
    )
    return "\n".join(lines)
