"""``pd-dflash report`` and ``pd-dflash validate``: rows → result matrices, gates and the go/no-go verdict.

Compatible with upstream's ``benchmarks/dflash/report.py`` files (research/upstream-phase-a.md §5): the same
group key ``model|B{b}|c{c}``, ``result_matrix.json`` as ``{group: {baseline: row}}``, the CSV's upstream
columns first, the per-group JSON on stdout, exit 0 iff every group is complete. What it adds: repeats
aggregated with confidence intervals, B0/B3 rows shared across block sizes, and the gates of docs/metrics.md.
The sweep's collector calls :func:`write_outputs` every N rows.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from pd_dflash.errors import InputError, format_validation_error
from pd_dflash.report_aggregate import UPSTREAM_BASELINES, build_matrix
from pd_dflash.report_gates import Expectations, evaluate, overall
from pd_dflash.report_render import dumps, matrix_csv, matrix_json, matrix_markdown
from pd_dflash.rows import read_rows, write_atomic
from pd_dflash.schema import REQUIRED_METRICS, Row, Status
from pd_dflash.spec import BASELINE_ORDER, Gates, SweepSpec, load_spec

MATRIX_FILES = ("result_matrix.json", "result_matrix.csv", "result_matrix.md", "verdict.json")


def build_report(
    rows: Sequence[Row],
    gates: Gates,
    *,
    spec: SweepSpec | None = None,
    sources: Sequence[str] | None = None,
    plots: bool = False,
) -> tuple[dict[str, Any], dict[str, str | bytes]]:
    """The verdict and every output file's content (relative name → text or PNG bytes); writes nothing."""
    matrix = build_matrix(rows, sources)
    details = evaluate(matrix, gates, Expectations.infer(matrix, spec))
    summary = overall(details)
    ok = bool(details) and all(d["complete"] and d["valid"] for d in details.values())
    verdict = {"groups": details, "overall": summary, "complete": ok, "exit_code": 0 if ok else 1}
    files: dict[str, str | bytes] = {
        "result_matrix.json": matrix_json(matrix),
        "result_matrix.csv": matrix_csv(matrix),
        "result_matrix.md": matrix_markdown(matrix, details, summary, gates),
        "verdict.json": dumps(verdict),
    }
    if plots:
        from pd_dflash.report_plots import render_plots

        files.update(render_plots(matrix))
    return verdict, files


def write_outputs(
    rows: list[Row],
    out_dir: Path | str,
    gates: Gates,
    *,
    plots: bool = False,
    spec: SweepSpec | None = None,
    sources: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Aggregate, evaluate the gates and write every output atomically; return the verdict.

    Tolerates an incomplete matrix (its groups are simply incomplete). Pass ``spec`` to expect its full grid
    (absent groups are then listed as missing). A duplicate identity raises InputError before anything is
    written.
    """
    verdict, files = build_report(rows, gates, spec=spec, sources=sources, plots=plots)
    out = Path(out_dir)
    for name in files:
        (out / name).parent.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        write_atomic(out / name, content)
    return verdict


# -- pd-dflash report -----------------------------------------------------------------------------------


def _gates(args: argparse.Namespace) -> tuple[Gates, SweepSpec | None]:
    spec = load_spec(args.spec) if getattr(args, "spec", None) else None
    gates = spec.gates if spec is not None else Gates()
    extra = list(getattr(args, "allow_blocked", None) or [])
    unknown = [b for b in extra if b not in BASELINE_ORDER]
    if unknown:
        raise InputError(
            f"unknown baseline {unknown[0]!r}; use one of {', '.join(BASELINE_ORDER)}",
            where="--allow-blocked",
        )
    merged = [b for b in BASELINE_ORDER if b in set(gates.allow_blocked) | set(extra)]
    unmeasured = list(gates.allow_unmeasured)
    unmeasured += [m for m in getattr(args, "allow_unmeasured", None) or [] if m not in unmeasured]
    try:
        return Gates.model_validate(
            {**gates.model_dump(), "allow_blocked": merged, "allow_unmeasured": unmeasured}
        ), spec
    except ValidationError as exc:
        raise InputError(format_validation_error(exc), where="--allow-unmeasured") from None


def _sources(path: Path, count: int) -> list[str]:
    """``file:line`` for JSON lines, ``file[i]`` for a JSON list, ``file`` for one object (as read_rows names them)."""
    text = path.read_text(encoding="utf-8")
    if path.suffix != ".jsonl" and text.lstrip()[:1] == "[":
        return [f"{path}[{i}]" for i in range(count)]
    lines = [n for n, line in enumerate(text.split("\n"), start=1) if line.strip()]
    if len(lines) != count:
        return [str(path)] * count
    return [f"{path}:{n}" for n in lines]


def read_inputs(paths: Sequence[str | Path]) -> tuple[list[Row], list[str]]:
    """Rows of every input (a directory means its ``rows.jsonl``), and where each came from."""
    rows: list[Row] = []
    sources: list[str] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            path = path / "rows.jsonl"
        got, _ = read_rows(path)
        rows.extend(got)
        sources.extend(_sources(path, len(got)))
    return rows, sources


def report_main(args: argparse.Namespace) -> int:
    gates, spec = _gates(args)
    rows, sources = read_inputs(args.inputs)
    try:
        verdict = write_outputs(rows, args.out, gates, plots=bool(args.plots), spec=spec, sources=sources)
    except OSError as exc:
        raise InputError(
            f"cannot write outputs: {exc.strerror or exc}", where=exc.filename or args.out
        ) from None
    print(json.dumps(verdict["groups"], indent=2, sort_keys=True))
    print(verdict["overall"]["line"])
    print(f"wrote {Path(args.out) / 'result_matrix.{json,csv,md}'} ({len(rows)} rows)", file=sys.stderr)
    return verdict["exit_code"]


# -- pd-dflash validate ---------------------------------------------------------------------------------


def _bad_number(value: Any) -> bool:
    return (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not math.isfinite(value)
        or value < 0
    )


def validate_group(rows_by_baseline: dict[str, Any]) -> list[str]:
    """Upstream's ``validate_result_matrix`` for one group, collecting every error instead of the first.

    All of B0..B3 must be present; every row needs the ten metrics as finite, non-negative, non-bool numbers.
    The only exemption is B3 with status UNAVAILABLE_CAPACITY.
    """
    errors = []
    missing = [b for b in UPSTREAM_BASELINES if b not in rows_by_baseline]
    if missing:
        errors.append(f"missing baselines: {', '.join(missing)}")
    for b, row in rows_by_baseline.items():
        if not isinstance(row, dict):
            errors.append(f"{b} must be a row object; got {type(row).__name__}")
            continue
        if b == "B3" and row.get("status") == Status.UNAVAILABLE_CAPACITY.value:
            continue
        for m in REQUIRED_METRICS:
            if m not in row:
                errors.append(f"{b} missing metric: {m}")
            elif _bad_number(row[m]):
                errors.append(f"{b}.{m} must be a finite, non-negative number; got {row[m]!r}")
    return errors


def validate_main(args: argparse.Namespace) -> int:
    path = Path(args.matrix)
    try:
        matrix = json.loads(path.read_text(encoding="utf-8"))  # NaN/Infinity read, then named
    except OSError as exc:
        raise InputError(f"cannot read matrix: {exc.strerror or exc}", where=str(path)) from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        where = f"{path}:{exc.lineno}" if isinstance(exc, json.JSONDecodeError) else str(path)
        raise InputError(f"invalid JSON: {getattr(exc, 'msg', exc)}", where=where) from None
    if not isinstance(matrix, dict) or not all(isinstance(v, dict) for v in matrix.values()):
        raise InputError("a result matrix is a JSON object {group_key: {baseline: row}}", where=str(path))
    results = {}
    for key, group in sorted(matrix.items()):
        errors = validate_group(group)
        results[key] = {"valid": not errors, "errors": errors}
    print(json.dumps(results, indent=2, sort_keys=True))
    good = sum(r["valid"] for r in results.values())
    print(f"validate: {good}/{len(results)} groups valid")
    return 0 if results and good == len(results) else 1
