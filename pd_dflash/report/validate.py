"""``pd-dflash validate``: upstream's ``validate_result_matrix`` checks on a result_matrix.json."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pd_dflash.errors import InputError
from pd_dflash.schema import Status, check_number
from pd_dflash.upstream import REQUIRED_METRICS, UPSTREAM_BASELINES


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
            else:
                try:
                    check_number(m, row[m])
                except ValueError:
                    errors.append(f"{b}.{m} must be a finite, non-negative number; got {row[m]!r}")
    return errors


def validate_matrix_file(path: Path) -> dict[str, dict[str, Any]]:
    """Every group of a result_matrix.json with its errors: ``{key: {"valid": bool, "errors": [...]}}``."""
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
    return results
