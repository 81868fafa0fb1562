"""``pd-dflash validate``: upstream's ``validate_result_matrix`` checks on a result_matrix.json, and that each
group key ``model|B{b}|c{c}`` names the model, block size and concurrency of the rows filed under it."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pd_dflash.errors import InputError, excerpt
from pd_dflash.safe_load import MAX_DOCUMENT_BYTES, decode_utf8, load_json, read_bounded
from pd_dflash.schema import Status, check_number
from pd_dflash.upstream import CAPACITY_EXEMPT, REQUIRED_METRICS, UPSTREAM_BASELINES


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
        if b == CAPACITY_EXEMPT and row.get("status") == Status.UNAVAILABLE_CAPACITY.value:
            continue
        for m in REQUIRED_METRICS:
            if m not in row:
                errors.append(f"{b} missing metric: {m}")
            else:
                try:
                    check_number(m, row[m])
                except ValueError:
                    errors.append(f"{b}.{m} must be a finite, non-negative number; got {excerpt(row[m])}")
    return errors


_KEY = re.compile(r"^(?P<model>.+)\|B(?P<block>[0-9]+)\|c(?P<conc>[0-9]+)$")


def key_errors(key: str, rows_by_baseline: dict[str, Any]) -> list[str]:
    """The group key must be ``model|B{b}|c{c}``, and a row under it that carries a model, block size or
    concurrency must carry the key's (upstream's validator does not require them, so absent is accepted)."""
    found = _KEY.match(key)
    if found is None:
        return [f"group key {excerpt(key)} is not model|B<block_size>|c<concurrency>"]
    expected = {"model": found["model"], "block_size": int(found["block"]), "concurrency": int(found["conc"])}
    errors = []
    for b, row in rows_by_baseline.items():
        if not isinstance(row, dict):
            continue
        for field, want in expected.items():
            got = row.get(field, _ABSENT)
            if got is not _ABSENT and (got != want or isinstance(got, bool)):
                errors.append(f"{b}.{field} is {excerpt(got)} but the group key says {excerpt(want)}")
    return errors


_ABSENT = object()


#: The bytes a JSON document can start with (NaN and Infinity included: the checks name them).
_JSON_STARTS = frozenset(b'{["-0123456789tfnNI')


def _not_json_at_all(head: bytes, where: str) -> None:
    """Refuse at once a file whose first non-blank byte starts no JSON document (``/dev/zero``), with the very
    error the whole file would give, before anything more is read. (Only an ASCII byte: a non-UTF-8 file is
    named as such by the normal path.)"""
    stripped = head.lstrip()
    if stripped and stripped[0] < 0x80 and stripped[0] not in _JSON_STARTS:
        at = len(head) - len(stripped)
        load_json(head[: at + 1].decode("ascii"), where=where, name_line=True)


def validate_matrix_file(path: Path) -> dict[str, dict[str, Any]]:
    """Every group of a result_matrix.json with its errors: ``{key: {"valid": bool, "errors": [...]}}``."""
    try:
        with open(path, "rb") as fh:
            head = fh.read(4096)
            _not_json_at_all(head, str(path))
            fh.seek(0)
            raw = read_bounded(fh, MAX_DOCUMENT_BYTES, where=str(path), what="a result matrix")
    except OSError as exc:
        raise InputError(f"cannot read matrix: {exc.strerror or exc}", where=str(path)) from None
    # NaN/Infinity are read, then named by the checks
    matrix = load_json(decode_utf8(raw, where=str(path)), where=str(path), name_line=True)
    if not isinstance(matrix, dict) or not all(isinstance(v, dict) for v in matrix.values()):
        raise InputError("a result matrix is a JSON object {group_key: {baseline: row}}", where=str(path))
    if not matrix:
        raise InputError("holds no groups: nothing to validate", where=str(path))
    results = {}
    for key, group in sorted(matrix.items()):
        errors = key_errors(key, group) + validate_group(group)
        results[key] = {"valid": not errors, "errors": errors}
    return results
