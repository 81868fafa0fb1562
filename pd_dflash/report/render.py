"""Rendering the aggregated matrix: result_matrix.json, .csv (upstream columns first) and .md (for people)."""

from __future__ import annotations

import csv
import io
import json
from typing import Any

from pd_dflash.baselines import BASE, ORDER
from pd_dflash.report.aggregate import Matrix
from pd_dflash.report.basis import PIPELINE_CHECK, basis_text
from pd_dflash.report.brief import EXTRA_COLUMNS
from pd_dflash.report.gates import (
    DISABLED,
    FAIL,
    GATES,
    NOT_EVALUATED,
    PASS,
    VERDICT_GATES,
    bm1_on_means,
    hide_on_means,
)
from pd_dflash.spec import Gates
from pd_dflash.upstream import REQUIRED_METRICS, UPSTREAM_CSV_COLUMNS

_EXTRA_CSV = {c: c.replace(".", "_") for c in EXTRA_COLUMNS}
#: pd-dflash's columns after upstream's.
EXTRA_CSV_COLUMNS: tuple[str, ...] = (
    "n_repeats",
    "repeats_aggregated",
    "shared_across_block_sizes",
    "speedup_over_b0",
    *(f"{m}_{s}" for m in REQUIRED_METRICS for s in ("std", "ci95_low", "ci95_high")),
    *_EXTRA_CSV.values(),
    "bm1_router_to_verify_ratio",
    "bm1_pass",
    "hide_hidden_on_means",
    "warnings",
    "reason",
)
CSV_COLUMNS: tuple[str, ...] = (*UPSTREAM_CSV_COLUMNS, *EXTRA_CSV_COLUMNS)


def dumps(obj: Any) -> str:
    """JSON as upstream writes it: indent 2, sorted keys, trailing newline (and never NaN)."""
    return json.dumps(obj, indent=2, sort_keys=True, allow_nan=False) + "\n"


def _cell(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, float):
        return repr(value)
    return str(value)


def speedup(matrix: Matrix, key: str, baseline: str) -> float | None:
    b0 = matrix.mean(key, BASE, "output_tokens_per_second")
    x = matrix.mean(key, baseline, "output_tokens_per_second")
    return None if b0 is None or x is None or b0 <= 0 else x / b0


def matrix_csv(matrix: Matrix) -> str:
    """One line per (group, baseline), sorted by (model, B, c) then baseline; "" for anything absent."""
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(CSV_COLUMNS)
    lines = []
    for key, group in matrix.groups.items():
        for b, row in matrix.rows[key].items():
            stats = matrix.stats.get((key, b), {})
            bm1 = bm1_on_means(matrix, key, b)
            hide = hide_on_means(matrix, key, b)
            values: dict[str, Any] = {c: row.get(c) for c in UPSTREAM_CSV_COLUMNS}
            values.update(
                n_repeats=row["n_repeats"],
                repeats_aggregated=";".join(str(r) for r in row["repeats_aggregated"]),
                shared_across_block_sizes=";".join(str(x) for x in row.get("shared_across_block_sizes", [])),
                speedup_over_b0=speedup(matrix, key, b),
                bm1_router_to_verify_ratio=None if bm1 is None else bm1["bm1_router_to_verify_ratio"],
                bm1_pass=None if bm1 is None else bm1["bm1_pass"],
                hide_hidden_on_means=None if hide is None else hide["hidden"],
                warnings="; ".join(row.get("warnings", [])),
                reason=row.get("reason"),
            )
            for m in REQUIRED_METRICS:
                s = stats.get(m, {})
                for part in ("std", "ci95_low", "ci95_high"):
                    values[f"{m}_{part}"] = s.get(part)
            for col, name in _EXTRA_CSV.items():
                values[name] = stats.get(col, {}).get("mean")
            lines.append(((group.model, group.block_size, group.concurrency, b), values))
    for _, values in sorted(lines, key=lambda kv: kv[0]):
        writer.writerow([_cell(values.get(c)) for c in CSV_COLUMNS])
    return buf.getvalue()


# -- markdown -------------------------------------------------------------------------------------------

#: (column, title, unit, scale) of the tables a person reads; "speedup" is derived.
HEADLINE: tuple[tuple[str, str, str, float], ...] = (
    ("output_tokens_per_second", "Output tokens/s", "tok/s", 1.0),
    ("speedup", "Speedup over B0 (ratio of mean tokens/s)", "x", 1.0),
    ("goodput_at_slo", "Goodput at SLO", "tok/s", 1.0),
    ("acceptance_length_a", "Acceptance length τ", "tokens/round", 1.0),
    ("per_round_latency_seconds", "Per-round latency", "ms", 1e3),
    ("ttft_seconds", "TTFT (mean over requests)", "ms", 1e3),
    ("expert_cache_hit_rate", "Expert cache hit rate", "ratio", 1.0),
    ("route_ahead_prefetch_coverage", "Prefetch coverage (prediction recall)", "ratio", 1.0),
    ("prefetched_in_time_coverage", "Prefetched-in-time coverage", "ratio", 1.0),
    ("route_ahead.waste_ratio", "Route-ahead waste ratio", "ratio", 1.0),
    ("wasted_prefetch_bytes", "Wasted prefetch", "GB", 1e-9),
)
_MARK = {PASS: "pass", FAIL: "**FAIL**", NOT_EVALUATED: "n/e", DISABLED: "off"}


def _table_cell(matrix: Matrix, key: str, baseline: str, column: str, scale: float) -> str:
    row = matrix.rows.get(key, {}).get(baseline)
    if row is None:
        return "missing"
    if column == "speedup":
        s = speedup(matrix, key, baseline)
        return "" if s is None else f"{s:.3g}"
    stats = matrix.stats.get((key, baseline), {}).get(column)
    if stats is None:
        return row["status"] if row["n_repeats"] == 0 else "—"
    text = f"{stats['mean'] * scale:.4g}"
    if stats["ci95_low"] is not None:
        half = (stats["ci95_high"] - stats["ci95_low"]) / 2 * scale
        text += f" ± {half:.2g}"
    return text


def _basis_lines(overall: dict, confidence: dict | None, basis: dict | None) -> list[str]:
    """What the verdict rests on (report/basis.py) and the count of the confidence-aware gates."""
    if basis is None or confidence is None:
        return []
    lines = []
    if basis["pipeline_check"]:
        lines.append(
            f"- **{PIPELINE_CHECK}**: {', '.join(basis['not_hardware_because'])}. The gates check the pipeline "
            "end to end; they say nothing about route-ahead on a real device link."
        )
    lines.append(f"- {basis_text(basis)}")
    c = confidence["counts"]
    lines.append(
        f"- on means (upstream's rule): {overall['verdict']}; on 95% intervals: {confidence['verdict']} "
        f"({c['PASS']} pass, {c['FAIL']} fail, {c['INCONCLUSIVE']} inconclusive gate results)"
    )
    return lines


def _preamble(
    matrix: Matrix, overall: dict, gates: Gates, confidence: dict | None, basis: dict | None
) -> list[str]:
    lines = [
        "# PD-DFlash Phase-A result matrix",
        "",
        f"**{overall['line']}**",
        "",
        *_basis_lines(overall, confidence, basis),
        f"- rows read: {matrix.n_input_rows}; groups (model, B, c): {overall['groups']}, complete and valid: "
        f"{overall['groups_complete']}",
        f"- gates: coverage ≥ {gates.min_coverage}, waste ratio ≤ {gates.max_waste_ratio}, speedup over B0 ≥ "
        f"{gates.min_speedup_over_b0}, ordering B0 < B1 < OURS ≤ B3: {'on' if gates.require_ordering else 'off'}, "
        f"allowed blocked: {', '.join(gates.allow_blocked) or 'none'}, "
        f"allowed unmeasured: {', '.join(gates.allow_unmeasured) or 'none'}",
        "- cells are mean ± half-width of the Student-t 95% interval over repeats (no ± with one repeat); "
        "definitions in docs/metrics.md",
    ]
    lines.extend(f"- superseded failed row {old} by {new}" for old, new in matrix.superseded)
    if overall["verdict"] != "GO":
        lines.extend(f"- {reason}" for reason in overall["reasons"] + overall["also"])
    return lines


def _shared_note(verdicts: dict[str, dict], keys: list[str]) -> list[str]:
    shared = sorted(
        {(b, tuple(bs)) for k in keys for b, bs in verdicts[k].get("shared_across_block_sizes", {}).items()}
    )
    return ([""] if shared else []) + [
        f"- {b} is measured once per (c, repeat) and shown in every block-size group it covers: "
        f"B = {', '.join(str(x) for x in bs)} (the same numbers in each)."
        for b, bs in shared
    ]


def _metric_tables(matrix: Matrix, keys: list[str], baselines: list[str]) -> list[str]:
    header = "| B | c | " + " | ".join(baselines) + " |"
    rule = "|---|---|" + "---|" * len(baselines)
    lines: list[str] = []
    for column, title, unit, scale in HEADLINE:
        lines += ["", f"### {title} ({unit})", "", header, rule]
        for k in keys:
            _, b, c = k.rsplit("|", 2)
            cells = [_table_cell(matrix, k, base, column, scale) for base in baselines]
            lines.append(f"| {b[1:]} | {c[1:]} | " + " | ".join(cells) + " |")
    return lines


def _gates_table(verdicts: dict[str, dict], keys: list[str]) -> list[str]:
    lines = ["", "### Gates", "", "| B | c | " + " | ".join(GATES) + " |", "|---|---|" + "---|" * len(GATES)]
    notes = []
    for k in keys:
        _, b, c = k.rsplit("|", 2)
        gs = verdicts[k]["gates"]
        lines.append(f"| {b[1:]} | {c[1:]} | " + " | ".join(_MARK[gs[g]["status"]] for g in GATES) + " |")
        notes += [
            f"- {k} {g} ({gs[g]['status']}): {gs[g]['summary']}"
            for g in GATES
            if gs[g]["status"] in (FAIL, NOT_EVALUATED) and gs[g]["summary"]
        ]
    return lines + ([""] if notes else []) + notes


def _confidence_table(verdicts: dict[str, dict], keys: list[str]) -> list[str]:
    if not all("confidence" in verdicts[k] for k in keys):
        return []
    lines = [
        "",
        "### Gates on 95% intervals (PASS: the interval clears the threshold; FAIL: wholly on the wrong side)",
        "",
        "| B | c | " + " | ".join(VERDICT_GATES) + " |",
        "|---|---|" + "---|" * len(VERDICT_GATES),
    ]
    for k in keys:
        _, b, c = k.rsplit("|", 2)
        gs = verdicts[k]["confidence"]
        lines.append(f"| {b[1:]} | {c[1:]} | " + " | ".join(gs[g]["status"] for g in VERDICT_GATES) + " |")
    return lines


def matrix_markdown(
    matrix: Matrix,
    verdicts: dict[str, dict],
    overall: dict,
    gates: Gates,
    *,
    confidence: dict | None = None,
    basis: dict | None = None,
) -> str:
    """result_matrix.md: the verdict and its basis, then per model a table per headline metric and the gates
    tables (on means, and on intervals when the confidence-aware verdict was computed)."""
    lines = _preamble(matrix, overall, gates, confidence, basis)
    for model in sorted({key.rsplit("|", 2)[0] for key in verdicts}):
        keys = [k for k in verdicts if k.rsplit("|", 2)[0] == model]
        present = {b for k in keys for b in matrix.rows.get(k, {})}
        expected = {b for k in keys for b in verdicts[k]["missing"]}
        baselines = [b for b in ORDER if b in present | expected]
        lines += ["", f"## {model}", *_shared_note(verdicts, keys)]
        lines += _metric_tables(matrix, keys, baselines)
        lines += _gates_table(verdicts, keys)
        lines += _confidence_table(verdicts, keys)
    return "\n".join(lines) + "\n"
