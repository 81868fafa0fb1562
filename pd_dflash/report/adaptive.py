"""Adaptive repeats: a group's looks, judged from its rows by the stopping rule (docs/metrics.md §7f).

A group (model | B | c, every configuration in it, B0's cell shared across block sizes) is looked at after
``min`` repeats, then after each further one: a look at k repeats asks the verdict gates of intervals over
repeats 0..k−1 only, at the rule's coverage (``stopping.look_coverage``). Only those rows count, so a look's
answer does not depend on when rows arrived (a shared B0 repeat measured for another group is not read early):
the driver (``sweep/waves.py``), a resumed driver and ``pd-dflash report`` replay the same looks from the same
rows and reach the same decisions.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pd_dflash.baselines import ORDER
from pd_dflash.report.aggregate import Group, build_matrix, group_key, t_quantile
from pd_dflash.report.brief import RowBrief
from pd_dflash.report.confidence import INCONCLUSIVE, group_confidence, tally
from pd_dflash.report.gates import VERDICT_GATES, Expectations, evaluate_group
from pd_dflash.schema import FINAL_STATUSES, Row
from pd_dflash.spec import Cell, Gates, SweepSpec, cell_count, expand
from pd_dflash.stopping import (
    ALPHA,
    RULE,
    STOP_REASONS,
    AdaptiveRepeats,
    look_coverage,
    planned_looks,
    stop_reason,
)

GroupId = tuple[str, int, int]
AnyRow = Row | RowBrief


@dataclass(frozen=True)
class Look:
    """One look at a group: its verdict gates on the intervals over its first ``repeats`` repeats."""

    repeats: int
    gates: dict[str, dict[str, str]]
    #: Every cell it needs has a measured row (else more repeats cannot decide it: "cell failures").
    complete: bool
    why_incomplete: str = ""

    def as_json(self) -> dict[str, Any]:
        statuses = {name: g["status"] for name, g in self.gates.items()}
        out: dict[str, Any] = {"repeats": self.repeats, "gates": statuses}
        if not self.complete:
            out["incomplete"] = self.why_incomplete
        return out


@dataclass
class GroupRun:
    """Where a group stands: the repeats it asks for, its looks so far, and why it stopped (None: not yet)."""

    repeats: int
    looks: list[Look] = field(default_factory=list)
    stop: str | None = None


def current(rows: Iterable[AnyRow]) -> dict[tuple, AnyRow]:
    """identity → its row: a final row is never replaced, a failed one by the next row of its identity."""
    out: dict[tuple, AnyRow] = {}
    for row in rows:
        held = out.get(row.identity)
        if held is None or held.status not in FINAL_STATUSES:
            out[row.identity] = row
    return out


class Design:
    """The groups of an adaptive spec and the cells each needs per repeat, and how one look is judged."""

    def __init__(self, spec: SweepSpec, cells: Sequence[Cell] | None = None) -> None:
        if spec.adaptive is None:
            raise ValueError(f"spec {spec.name} has fixed repeats: nothing to adapt")
        self.spec, self.bounds = spec, spec.adaptive
        self.coverage = look_coverage(self.bounds)
        self.baselines = tuple(b for b in ORDER if b in spec.baselines)
        #: group → repeat → the cells of that repeat the group needs (a shared B0 cell is in several groups).
        self.members: dict[GroupId, list[list[Cell]]] = {}
        #: identity → the groups its row fills
        self.groups_of: dict[tuple, list[GroupId]] = {}
        for cell in cells if cells is not None else expand(spec):
            for b in cell.block_sizes_covered:
                gid = (cell.group_model, b, cell.concurrency)
                per = self.members.setdefault(gid, [[] for _ in range(self.bounds.max)])
                per[cell.repeat].append(cell)
                self.groups_of.setdefault(cell.identity, []).append(gid)
        self.members = dict(sorted(self.members.items()))

    def cells_of(self, gid: GroupId, repeats: int) -> list[Cell]:
        """The cells of the group's first ``repeats`` repeats."""
        return [c for per in self.members[gid][:repeats] for c in per]

    def landed(self, gid: GroupId, repeats: int, rows: Mapping[tuple, AnyRow]) -> bool:
        """Whether every cell of the group's first ``repeats`` repeats has a row (a look can be taken)."""
        return all(c.identity in rows for c in self.cells_of(gid, repeats))

    def judge(
        self, gids: Sequence[GroupId], repeats: int, rows: Mapping[tuple, AnyRow], gates: Gates
    ) -> dict[GroupId, Look]:
        """The looks at ``repeats`` repeats of groups whose cells all have rows, from one matrix of their rows
        (a group's intervals are those of its own rows: the matrix keeps groups apart)."""
        picked = {c.identity: rows[c.identity] for gid in gids for c in self.cells_of(gid, repeats)}
        matrix = build_matrix(list(picked.values()), coverage=self.coverage)
        looks = {}
        for gid in gids:
            group = matrix.groups.get(group_key(*gid)) or Group(*gid)
            expect = Expectations((gid,), self.baselines, tuple(range(repeats)))
            detail = evaluate_group(matrix, group, gates, expect)
            judged = group_confidence(matrix, group, gates, detail)
            complete = detail["complete"] and detail["valid"]
            why = "" if complete else detail["gates"]["completeness"]["summary"]
            looks[gid] = Look(repeats, judged, complete, why)
        return looks

    def take(self, run: GroupRun, look: Look) -> None:
        """Record a look; the group stops, or asks for one more repeat."""
        run.looks.append(look)
        statuses = [g["status"] for g in look.gates.values()]
        run.stop = stop_reason(statuses, run.repeats, self.bounds, failed=not look.complete)
        if run.stop is None:
            run.repeats += 1

    def advance(self, gid: GroupId, run: GroupRun, rows: Mapping[tuple, AnyRow], gates: Gates) -> bool:
        """Take every look the rows allow; True when the group then asks for more repeats than before."""
        asked = run.repeats
        while run.stop is None and self.landed(gid, run.repeats, rows):
            self.take(run, self.judge([gid], run.repeats, rows, gates)[gid])
        return run.repeats > asked


def replay(design: Design, rows: Iterable[AnyRow], gates: Gates) -> dict[GroupId, GroupRun]:
    """Every group's looks from the rows, as the driver took them: one matrix per look count, not per look."""
    held = current(rows)
    runs = {gid: GroupRun(design.bounds.min) for gid in design.members}
    for k in range(design.bounds.min, design.bounds.max + 1):
        ready = [
            g for g, r in runs.items() if r.stop is None and r.repeats == k and design.landed(g, k, held)
        ]
        if ready:
            for gid, look in design.judge(ready, k, held, gates).items():
                design.take(runs[gid], look)
    return runs


def decidable_effects(bounds: AdaptiveRepeats) -> dict[int, float]:
    """Repeats → how far (in one repeat's standard deviations) a mean must sit from a gate's threshold for that
    look's interval to clear it: t(k − 1, coverage)/√k. What one more repeat buys, for choosing the bounds."""
    coverage = look_coverage(bounds)
    return {k: t_quantile(k - 1, coverage) / math.sqrt(k) for k in range(bounds.min, bounds.max + 1)}


def _pending(look: Look | None, repeats: int) -> dict[str, dict[str, str]]:
    if look is not None:
        return look.gates
    why = f"no look yet: the group's first {repeats} repeats have not all landed"
    return {name: {"status": INCONCLUSIVE, "summary": why} for name in VERDICT_GATES}


def adaptive_verdict(
    rows: Sequence[AnyRow], spec: SweepSpec, gates: Gates, details: dict[str, dict[str, Any]]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the confidence-aware verdict, the ``adaptive`` section) of an adaptive spec's rows.

    Each group's ``confidence`` becomes its last look's gates (the rule's intervals, which hold the stated level
    whatever look it stopped at); ``details[key]["adaptive"]`` says its repeats, looks and why it stopped.
    """
    design = Design(spec)
    runs = replay(design, rows, gates)
    stopped = dict.fromkeys(STOP_REASONS, 0)
    for gid, run in runs.items():
        key = group_key(*gid)
        last = run.looks[-1] if run.looks else None
        detail = details.get(key)
        if detail is None:
            continue
        detail["confidence"] = _pending(last, run.repeats)
        detail["adaptive"] = {
            "repeats": run.looks[-1].repeats if run.looks else 0,
            "stop": run.stop,
            "looks": [look.as_json() for look in run.looks],
        }
        if run.stop:
            stopped[run.stop] += 1
    used = [d["adaptive"]["repeats"] for d in details.values() if "adaptive" in d]
    lo, hi = min(used, default=0), max(used, default=0)
    used_text = f"{lo}–{hi}" if lo != hi else f"{lo}"
    on = (
        f"{design.coverage:.2%} intervals, adaptive, {used_text} repeats, "
        f"Bonferroni over {planned_looks(design.bounds)} looks"
    )
    confidence = tally(details, on=on)
    wanted = {c.identity for gid, run in runs.items() for c in design.cells_of(gid, run.repeats)}
    ran = sum(1 for identity in current(rows) if identity in design.groups_of)
    section = {
        "rule": RULE,
        "alpha": ALPHA,
        "min": design.bounds.min,
        "max": design.bounds.max,
        "looks_planned": planned_looks(design.bounds),
        "look_coverage": design.coverage,
        "groups_stopped": stopped,
        "groups_open": sum(1 for run in runs.values() if run.stop is None),
        "cells_run": ran,
        "cells_wanted": len(wanted),
        "cells_at_fixed_max": cell_count(spec, design.bounds.max),
        "cells_at_min": cell_count(spec, design.bounds.min),
    }
    return confidence, section


def adaptive_markdown(markdown: str, section: dict[str, Any], details: dict[str, dict[str, Any]]) -> str:
    """result_matrix.md with its interval gates named for what they are (each group's last look) and the section
    that gives the rule, the saving, and per group its repeats, looks and stop reason."""
    looks = f"{section['look_coverage']:.2%} intervals (each group's last look, see Adaptive repeats)"
    return markdown.replace("95% intervals", looks) + _section(section, details)


def _section(section: dict[str, Any], details: dict[str, dict[str, Any]]) -> str:
    s = section
    open_ = f", {s['groups_open']} still running" if s["groups_open"] else ""
    lines = [
        "",
        "## Adaptive repeats",
        "",
        f"- rule: {s['rule']}: {s['looks_planned']} planned looks (after {s['min']}..{s['max']} repeats), "
        f"each on intervals of coverage {s['look_coverage']:.4g} (α = {s['alpha']:g} over all looks)",
        "- groups stopped: " + ", ".join(f"{n} {why}" for why, n in s["groups_stopped"].items()) + open_,
        f"- cells run: {s['cells_run']} of {s['cells_at_fixed_max']} at fixed max ({s['max']} repeats); "
        f"{s['cells_at_min']} at min",
        "",
        "| group | repeats | stopped | looks (repeats: inconclusive gates) |",
        "|---|---|---|---|",
    ]
    for key, d in details.items():
        a = d.get("adaptive")
        if a is None:
            continue
        looks = "; ".join(
            f"{look['repeats']}: "
            + (", ".join(n for n, st in look["gates"].items() if st == INCONCLUSIVE) or "-")
            + (" (incomplete)" if "incomplete" in look else "")
            for look in a["looks"]
        )
        cell = key.replace("|", "\\|")
        lines.append(f"| {cell} | {a['repeats']} | {a['stop'] or 'not yet'} | {looks or 'none yet'} |")
    return "\n".join(lines) + "\n"
