"""Which repeats design the rows were measured under, when ``report`` is given no ``--spec`` (docs/metrics.md §7f).

An adaptive sweep stops each group once its gates are decided; read as fixed-n 95 % intervals its rows overstate
their confidence (optional stopping). A sweep directory's ``sweep.json`` holds the spec it ran, so there the design
is knowable and the report judges each group by its looks. Where rows look adaptive (repeat counts that differ
between groups) and no design is known, the verdict says so instead of deciding silently on fixed-n intervals.
Pure: reads JSON, imports neither Ray nor torch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from pd_dflash.report.aggregate import Matrix
from pd_dflash.spec import SweepSpec

#: The record a sweep directory keeps beside its rows (sweep/resume.py's ``SWEEP_FILE``).
SWEEP_RECORD = "sweep.json"


@dataclass(frozen=True)
class Found:
    """What the inputs' sweep records say: ``spec`` is the adaptive spec to judge by (None when the design is
    fixed or unknown); ``known`` is whether every input's design is known; ``why`` says where, or why not."""

    spec: SweepSpec | None
    known: bool
    why: str


def stored_spec(record_path: Path) -> tuple[SweepSpec | None, str]:
    """The spec a sweep record holds (its env values are not stored: only their names and hash), or None and
    why it cannot be read."""
    try:
        record = json.loads(record_path.read_text(encoding="utf-8"))
        data = dict(record["spec"])
    except FileNotFoundError:
        return None, f"no {SWEEP_RECORD} beside the rows"
    except (OSError, UnicodeError, ValueError, KeyError, TypeError) as exc:
        return None, f"{record_path} is unreadable ({type(exc).__name__})"
    data["env"] = {}
    try:
        return SweepSpec.model_validate(data), str(record_path)
    except (ValidationError, ValueError) as exc:
        return None, f"{record_path} holds no valid spec ({type(exc).__name__})"


def design_beside(inputs: Sequence[str | Path]) -> Found:
    """The design of the rows of ``inputs`` (a sweep directory or its rows.jsonl) from the sweep records beside
    them: known only when every input has one and they all hold the same spec."""
    specs: list[SweepSpec] = []
    where: list[str] = []
    for raw in inputs:
        path = Path(raw)
        folder = path if path.is_dir() else path.parent
        spec, why = stored_spec(folder / SWEEP_RECORD)
        if spec is None:
            return Found(None, False, f"{raw}: {why}")
        specs.append(spec)
        where.append(why)
    if len({s.model_dump_json() for s in specs}) > 1:
        return Found(None, False, f"the inputs' sweep records hold different specs ({', '.join(where)})")
    spec = specs[0] if specs else None
    if spec is None:
        return Found(None, False, "no inputs")
    return Found(spec if spec.adaptive else None, True, where[0])


def repeat_counts(matrix: Matrix) -> dict[str, int]:
    """Group → the most repeats one of its configurations has (B0's shared cell aside: another group may have
    asked for its repeats)."""
    counts = {}
    for key, group in matrix.groups.items():
        own = {b: ps for b, ps in group.by_baseline.items() if b != "B0"} or group.by_baseline
        counts[key] = max((len({p.row.repeat for p in ps}) for ps in own.values()), default=0)
    return counts


def unknown_design_warning(matrix: Matrix, why: str = "") -> str | None:
    """The warning for rows whose repeat counts differ between groups with no design known, else None."""
    counts = repeat_counts(matrix)
    if len(set(counts.values())) < 2:
        return None
    low = min(counts, key=lambda k: counts[k])
    high = max(counts, key=lambda k: counts[k])
    because = f" ({why})" if why else ""
    return (
        f"WARNING: repeat counts differ between groups ({counts[low]} in {low}, {counts[high]} in {high}) and no "
        f"repeats design is known{because}: if these rows come from an adaptive sweep, the 95% intervals are not "
        "valid under its optional stopping (docs/metrics.md §7f); pass --spec SPEC, or report the sweep's "
        "directory with its sweep.json"
    )
