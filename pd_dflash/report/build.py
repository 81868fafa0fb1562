"""``pd-dflash report``: rows → result matrices, gates and the go/no-go verdict.

Compatible with the files of upstream's ``benchmarks/dflash/report.py`` (docs/metrics.md): the same
group key ``model|B{b}|c{c}``, ``result_matrix.json`` as ``{group: {baseline: row}}``, the CSV's upstream
columns first, the per-group JSON on stdout, exit 0 iff every group is complete. What it adds: repeats
aggregated with confidence intervals, B0/B3 rows shared across block sizes, and the gates of docs/metrics.md.
The sweep's collector calls :func:`write_outputs` every N rows.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from pd_dflash.errors import InputError, format_validation_error
from pd_dflash.report.aggregate import build_matrix
from pd_dflash.report.gates import Expectations, evaluate, overall
from pd_dflash.report.render import dumps, matrix_csv, matrix_json, matrix_markdown
from pd_dflash.rows import ROWS_FILE, read_rows, write_atomic
from pd_dflash.schema import Row
from pd_dflash.spec import Gates, SweepSpec
from pd_dflash.upstream import BASELINE_ORDER


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
        from pd_dflash.report.plots import render_plots

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


# -- inputs ---------------------------------------------------------------------------------------------------


def effective_gates(
    spec: SweepSpec | None,
    allow_blocked: Sequence[str] = (),
    allow_unmeasured: Sequence[str] = (),
) -> Gates:
    """The gates of ``spec`` (built-in thresholds without one), widened by the command line's allowances."""
    gates = spec.gates if spec is not None else Gates()
    extra = list(allow_blocked)
    unknown = [b for b in extra if b not in BASELINE_ORDER]
    if unknown:
        raise InputError(
            f"unknown baseline {unknown[0]!r}; use one of {', '.join(BASELINE_ORDER)}",
            where="--allow-blocked",
        )
    merged = [b for b in BASELINE_ORDER if b in set(gates.allow_blocked) | set(extra)]
    unmeasured = list(gates.allow_unmeasured)
    unmeasured += [m for m in allow_unmeasured if m not in unmeasured]
    try:
        return Gates.model_validate(
            {**gates.model_dump(), "allow_blocked": merged, "allow_unmeasured": unmeasured}
        )
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
            path = path / ROWS_FILE
        got, _ = read_rows(path)
        rows.extend(got)
        sources.extend(_sources(path, len(got)))
    return rows, sources
