"""``pd-dflash report``: rows → result matrices, gates and the go/no-go verdict.

Compatible with the files of upstream's ``benchmarks/dflash/report.py`` (docs/metrics.md): the same
group key ``model|B{b}|c{c}``, ``result_matrix.json`` as ``{group: {baseline: row}}``, the CSV's upstream
columns first, the per-group JSON on stdout, exit 0 iff every group is complete. What it adds: repeats
aggregated with confidence intervals, B0 rows shared across block sizes, and the gates of docs/metrics.md.
The sweep's collector calls :func:`write_outputs` every N rows.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from pd_dflash.baselines import ORDER
from pd_dflash.errors import InputError, format_validation_error
from pd_dflash.report.adaptive import adaptive_markdown, adaptive_verdict
from pd_dflash.report.aggregate import Matrix, build_matrix
from pd_dflash.report.basis import verdict_basis, verdict_line
from pd_dflash.report.brief import RowBrief, brief_of
from pd_dflash.report.confidence import confidence_verdict
from pd_dflash.report.design import Found, unknown_design_warning
from pd_dflash.report.gates import Expectations, evaluate, overall
from pd_dflash.report.matrix_json import matrix_json, write_matrix_json
from pd_dflash.report.render import dumps, matrix_csv, matrix_markdown
from pd_dflash.rows import ROWS_FILE, RowSource, iter_rows, read_line_at, write_atomic
from pd_dflash.schema import Row
from pd_dflash.spec import Gates, SweepSpec


def _evaluate(
    rows: Sequence[Row | RowBrief],
    gates: Gates,
    spec: SweepSpec | None,
    sources: Sequence[str] | None,
    plots: bool,
    design: Found | None = None,
) -> tuple[Matrix, dict[str, Any], dict[str, str | bytes]]:
    """The matrix, the verdict, and every output but result_matrix.json (whose size grows with the rows).

    The verdict holds upstream's mean-based evaluation (``overall``, unchanged in meaning), the confidence-aware
    one beside it (``confidence``, per group under ``groups[key]["confidence"]``) and what both rest on
    (``basis``); ``overall["line"]`` states all three, ``overall["line_on_means"]`` the mean-based part alone.
    ``design`` is what the inputs' sweep records said of their repeats (report/design.py): when it is not known,
    rows that look adaptive get a warning in the verdict instead of silently fixed-n intervals.
    """
    matrix = build_matrix(rows, sources)
    details = evaluate(matrix, gates, Expectations.infer(matrix, spec))
    summary = overall(details)
    confidence = confidence_verdict(matrix, details, gates)
    adaptive = None
    if spec is not None and spec.adaptive:  # each group judged at its last look (report/adaptive.py)
        confidence, adaptive = adaptive_verdict(rows, spec, gates, details)
    warning = None
    if spec is None and design is not None and not design.known:
        warning = unknown_design_warning(matrix, design.why)
    if warning is not None:
        confidence["design_warning"] = warning
        confidence["line"] += f" [{warning}]"
    basis = verdict_basis(matrix)
    summary["line_on_means"] = summary["line"]
    summary["line"] = verdict_line(summary, confidence, basis)
    ok = bool(details) and all(d["complete"] and d["valid"] for d in details.values())
    verdict = {
        "groups": details,
        "overall": summary,
        "confidence": confidence,
        "basis": basis,
        "complete": ok,
        "exit_code": 0 if ok else 1,
    }
    if adaptive is not None:
        verdict["adaptive"] = adaptive
    files: dict[str, str | bytes] = {
        "result_matrix.csv": matrix_csv(matrix),
        "result_matrix.md": matrix_markdown(
            matrix, details, summary, gates, confidence=confidence, basis=basis
        ),
        "verdict.json": dumps(verdict),
    }
    if adaptive is not None:
        files["result_matrix.md"] = adaptive_markdown(str(files["result_matrix.md"]), adaptive, details)
    if plots:
        from pd_dflash.report.plots import render_plots

        files.update(render_plots(matrix))
    return matrix, verdict, files


def build_report(
    rows: Sequence[Row | RowBrief],
    gates: Gates,
    *,
    spec: SweepSpec | None = None,
    sources: Sequence[str] | None = None,
    plots: bool = False,
    design: Found | None = None,
) -> tuple[dict[str, Any], dict[str, str | bytes]]:
    """The verdict and every output file's content (relative name → text or PNG bytes); writes nothing."""
    matrix, verdict, files = _evaluate(rows, gates, spec, sources, plots, design)
    return verdict, {"result_matrix.json": matrix_json(matrix), **files}


def write_outputs(
    rows: Sequence[Row | RowBrief],
    out_dir: Path | str,
    gates: Gates,
    *,
    plots: bool = False,
    spec: SweepSpec | None = None,
    sources: Sequence[str] | None = None,
    design: Found | None = None,
) -> dict[str, Any]:
    """Aggregate, evaluate the gates and write every output atomically; return the verdict.

    Tolerates an incomplete matrix (its groups are simply incomplete). Pass ``spec`` to expect its full grid
    (absent groups are then listed as missing). A duplicate identity raises InputError before anything is
    written. result_matrix.json is streamed to its file (rows are fetched group by group).
    """
    matrix, verdict, files = _evaluate(rows, gates, spec, sources, plots, design)
    out = Path(out_dir)
    for name in ("result_matrix.json", *files):
        (out / name).parent.mkdir(parents=True, exist_ok=True)
    _write_named(out / "result_matrix.json", lambda fh: write_matrix_json(matrix, fh))
    for name, content in files.items():
        _write_named(out / name, content)
    return verdict


def _write_named(path: Path, content: Any) -> None:
    """``write_atomic``, with an OSError naming the file it was writing (a full disk's error names none)."""
    try:
        write_atomic(path, content)
    except OSError as exc:
        if exc.filename is None:
            exc.filename = str(path)
        raise


# -- inputs ---------------------------------------------------------------------------------------------------


def effective_gates(
    spec: SweepSpec | None,
    allow_blocked: Sequence[str] = (),
    allow_unmeasured: Sequence[str] = (),
) -> Gates:
    """The gates of ``spec`` (built-in thresholds without one), widened by the command line's allowances."""
    gates = spec.gates if spec is not None else Gates()
    extra = list(allow_blocked)
    unknown = [b for b in extra if b not in ORDER]
    if unknown:
        raise InputError(
            f"unknown baseline {unknown[0]!r}; use one of {', '.join(ORDER)}",
            where="--allow-blocked",
        )
    merged = [b for b in ORDER if b in set(gates.allow_blocked) | set(extra)]
    unmeasured = list(gates.allow_unmeasured)
    unmeasured += [m for m in allow_unmeasured if m not in unmeasured]
    try:
        return Gates.model_validate(
            {**gates.model_dump(), "allow_blocked": merged, "allow_unmeasured": unmeasured}
        )
    except ValidationError as exc:
        raise InputError(format_validation_error(exc), where="--allow-unmeasured") from None


def _fetcher(source: RowSource, row: Row):
    """How to get a row's stored form back later: a JSON-lines row's text is re-read from its offset through
    the held file (so it need not stay in memory; a changed line is refused); a row of a whole-JSON file (read
    whole anyway) is kept."""
    if source.offset is None:
        return row.to_json_dict
    return lambda: read_line_at(source)


@contextmanager
def open_inputs(paths: Sequence[str | Path]) -> Iterator[tuple[list[RowBrief], list[str]]]:
    """Summaries of every row of every input (a directory means its ``rows.jsonl``), and where each came from,
    with every input held open until the block ends.

    Each file is opened once and read once; writing result_matrix.json reads each JSON-lines row again through
    that same handle, so a file replaced meanwhile (a copy or an rsync renaming over it) is still read as it
    was, and one rewritten in place is refused (``rows.read_line_at``): a matrix always agrees with itself. An
    input without a single row is an InputError (there is nothing to report).
    """
    briefs: list[RowBrief] = []
    sources: list[str] = []
    with ExitStack() as held:
        for raw in paths:
            path = Path(raw)
            if path.is_dir():
                path = path / ROWS_FILE
            before = len(briefs)
            for row, source in iter_rows(path, hold=held):
                briefs.append(brief_of(row, _fetcher(source, row)))
                sources.append(source.label)
            if len(briefs) == before:
                raise InputError("holds no rows: nothing to report", where=str(path))
        yield briefs, sources
