"""``result_matrix.json``: ``{group_key: {baseline: row}}``, streamed one group at a time.

Each aggregated row is what the aggregation computed, with the repeats' merged ``cost_terms``, formatted as
upstream writes its matrix (indent 2, sorted keys). Its ``repeats`` list holds every repeat exactly as
``rows.jsonl`` stores it, one compact JSON object per line: a JSON-lines row is copied from its file (it was
validated when it was read), so the rows of a large sweep are neither held at once nor re-encoded.
"""

from __future__ import annotations

import io
import json
import re
import secrets
from typing import Any, TextIO

from pd_dflash.report.aggregate import Matrix, Placed, scaled_moments


def _merge_cost_terms(repeats: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The repeats' ``cost_terms`` as one: numeric keys: mean over the repeats that carry them (ints stay
    ints: rounded); text keys: kept when every repeat agrees, else listed as ``mixed: ...``."""
    values: dict[str, list[Any]] = {}
    for terms in repeats:
        for k, v in terms.items():
            if v is not None:
                values.setdefault(k, []).append(v)
    merged: dict[str, Any] = {}
    for k, vs in values.items():
        if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in vs):
            mean = scaled_moments(vs)[0]  # never overflows (1.7e308 twice)
            merged[k] = round(mean) if all(type(v) is int for v in vs) else mean
        elif len({str(v) for v in vs}) == 1:
            merged[k] = vs[0]
        else:
            merged[k] = "mixed: " + ", ".join(sorted({str(v) for v in vs}))
    return merged or None


def _stored_text(p: Placed) -> str:
    """A repeat as stored, as compact JSON text."""
    stored = p.row.fetch()
    if isinstance(stored, str):
        return stored
    return json.dumps(stored, separators=(",", ":"), allow_nan=False)


def aggregated_row(matrix: Matrix, key: str, baseline: str) -> dict[str, Any]:
    """One (group, baseline) row without its ``repeats``: the head plus the merged ``cost_terms``."""
    head = matrix.rows[key][baseline]
    repeats = matrix.groups[key].by_baseline[baseline]
    out = dict(head)
    cost_terms = _merge_cost_terms([p.row.cost_terms or {} for p in repeats if p.measured])
    if cost_terms and head["n_repeats"]:
        out["cost_terms"] = cost_terms
    return out


def _group_text(matrix: Matrix, key: str) -> str:
    """One group as indented JSON (nested one level), each repeat's stored text in place of a placeholder."""
    token = f"pd-dflash-repeat-{secrets.token_hex(8)}"
    texts: list[str] = []
    group = {}
    for b in matrix.rows[key]:
        row = aggregated_row(matrix, key, b)
        row["repeats"] = []
        for p in matrix.groups[key].by_baseline[b]:
            row["repeats"].append(f"{token}-{len(texts)}")
            texts.append(_stored_text(p))
        group[b] = row
    text = json.dumps(group, indent=2, sort_keys=True, allow_nan=False).replace("\n", "\n  ")
    return re.sub(f'"{token}-([0-9]+)"', lambda m: texts[int(m.group(1))], text)


def write_matrix_json(matrix: Matrix, out: TextIO) -> None:
    """Write result_matrix.json to ``out``, one group in memory at a time."""
    keys = sorted(matrix.rows)
    if not keys:
        out.write("{}\n")
        return
    out.write("{")
    for i, key in enumerate(keys):
        text = _group_text(matrix, key)
        out.write(("," if i else "") + "\n  " + json.dumps(key) + ": " + text)
    out.write("\n}\n")


def matrix_json(matrix: Matrix) -> str:
    """result_matrix.json as one string (for callers that keep the files in memory)."""
    buf = io.StringIO()
    write_matrix_json(matrix, buf)
    return buf.getvalue()
