"""The report's files as a person and a spreadsheet read them (report/render.py): the whole Markdown of a
small matrix, checked line by line against text written out here, and every CSV column of one line against an
independent computation.

The matrix: model m, B in {8, 16}, c = 1, two repeats of B0, B1, B2 and OURS (B0 measured once for both block
sizes); B1's second repeat failed; OURS measured 44 and 46 tokens/s.
"""

from __future__ import annotations

import csv
import io
import json
import math
import statistics

import pytest

from pd_dflash.report.aggregate import build_matrix
from pd_dflash.report.gates import Expectations, evaluate, overall
from pd_dflash.report.render import CSV_COLUMNS, dumps, matrix_csv, matrix_markdown
from pd_dflash.schema import Row, Status
from pd_dflash.spec import Gates, expand
from pd_dflash.upstream import UPSTREAM_CSV_COLUMNS
from tests.core.helpers import gate_spec, rows_of

T1 = 12.706204736174696  # t(0.975, 1)

MARKDOWN = """# PD-DFlash Phase-A result matrix

**go/no-go: INCONCLUSIVE (2/2 groups incomplete or invalid; not evaluated: ordering 2/2 groups)**

- rows read: 14; groups (model, B, c): 2, complete and valid: 0
- gates: coverage ≥ 0.8, waste ratio ≤ 0.5, speedup over B0 ≥ 1.0, ordering B0 < B1 < OURS ≤ B3: on, allowed blocked: none, allowed unmeasured: none
- cells are mean ± half-width of the Student-t 95% interval over repeats (no ± with one repeat); definitions in docs/metrics.md
- 2/2 groups incomplete or invalid (e.g. m|B8|c1: B1 repeat 1: ERROR (boom))
- ordering not evaluated in 2/2 groups (e.g. m|B8|c1: tokens/s not measured for B3)

## m

- B0 is measured once per (c, repeat) and shown in every block-size group it covers: B = 8, 16 (the same numbers in each).

### Output tokens/s (tok/s)

| B | c | B0 | B1 | B2 | OURS |
|---|---|---|---|---|---|
| 8 | 1 | 20 ± 0 | 30 | 33 ± 0 | 45 ± 13 |
| 16 | 1 | 20 ± 0 | 30 | 33 ± 0 | 45 ± 13 |

### Speedup over B0 (ratio of mean tokens/s) (x)

| B | c | B0 | B1 | B2 | OURS |
|---|---|---|---|---|---|
| 8 | 1 | 1 | 1.5 | 1.65 | 2.25 |
| 16 | 1 | 1 | 1.5 | 1.65 | 2.25 |

### Goodput at SLO (tok/s)

| B | c | B0 | B1 | B2 | OURS |
|---|---|---|---|---|---|
| 8 | 1 | 20 ± 0 | 30 | 33 ± 0 | 45 ± 0 |
| 16 | 1 | 20 ± 0 | 30 | 33 ± 0 | 45 ± 0 |

### Acceptance length τ (tokens/round)

| B | c | B0 | B1 | B2 | OURS |
|---|---|---|---|---|---|
| 8 | 1 | 1 ± 0 | 3 | 3 ± 0 | 3 ± 0 |
| 16 | 1 | 1 ± 0 | 3 | 3 ± 0 | 3 ± 0 |

### Per-round latency (ms)

| B | c | B0 | B1 | B2 | OURS |
|---|---|---|---|---|---|
| 8 | 1 | 62.5 ± 0 | 62.5 | 62.5 ± 0 | 62.5 ± 0 |
| 16 | 1 | 62.5 ± 0 | 62.5 | 62.5 ± 0 | 62.5 ± 0 |

### TTFT (mean over requests) (ms)

| B | c | B0 | B1 | B2 | OURS |
|---|---|---|---|---|---|
| 8 | 1 | 250 ± 0 | 250 | 250 ± 0 | 250 ± 0 |
| 16 | 1 | 250 ± 0 | 250 | 250 ± 0 | 250 ± 0 |

### Expert cache hit rate (ratio)

| B | c | B0 | B1 | B2 | OURS |
|---|---|---|---|---|---|
| 8 | 1 | 0.75 ± 0 | 0.75 | 0.75 ± 0 | 0.75 ± 0 |
| 16 | 1 | 0.75 ± 0 | 0.75 | 0.75 ± 0 | 0.75 ± 0 |

### Prefetch coverage (prediction recall) (ratio)

| B | c | B0 | B1 | B2 | OURS |
|---|---|---|---|---|---|
| 8 | 1 | 0.875 ± 0 | 0.875 | 0.875 ± 0 | 0.875 ± 0 |
| 16 | 1 | 0.875 ± 0 | 0.875 | 0.875 ± 0 | 0.875 ± 0 |

### Prefetched-in-time coverage (ratio)

| B | c | B0 | B1 | B2 | OURS |
|---|---|---|---|---|---|
| 8 | 1 | — | — | — | — |
| 16 | 1 | — | — | — | — |

### Route-ahead waste ratio (ratio)

| B | c | B0 | B1 | B2 | OURS |
|---|---|---|---|---|---|
| 8 | 1 | — | — | — | 0.25 ± 0 |
| 16 | 1 | — | — | — | 0.25 ± 0 |

### Wasted prefetch (GB)

| B | c | B0 | B1 | B2 | OURS |
|---|---|---|---|---|---|
| 8 | 1 | 1.024e-06 ± 0 | 1.024e-06 | 1.024e-06 ± 0 | 1.024e-06 ± 0 |
| 16 | 1 | 1.024e-06 ± 0 | 1.024e-06 | 1.024e-06 ± 0 | 1.024e-06 ± 0 |

### Gates

| B | c | completeness | bm1 | hide_inequality | speedup_over_b0 | coverage | waste | ordering |
|---|---|---|---|---|---|---|---|---|
| 8 | 1 | **FAIL** | pass | pass | pass | pass | pass | n/e |
| 16 | 1 | **FAIL** | pass | pass | pass | pass | pass | n/e |

- m|B8|c1 completeness (fail): B1 repeat 1: ERROR (boom)
- m|B8|c1 ordering (not evaluated): tokens/s not measured for B3
- m|B16|c1 completeness (fail): B1 repeat 1: ERROR (boom)
- m|B16|c1 ordering (not evaluated): tokens/s not measured for B3
"""


def scenario(gates: Gates | None = None, **kw):
    s = kw.pop("s", None) or gate_spec(repeats=2, block_sizes=(8, 16), baselines=("B0", "B1", "B2", "OURS"))
    rows = kw.pop("rows", None) or rows_of(
        s,
        status={("B1", 1): (Status.ERROR, "boom")},
        OURS={"output_tokens_per_second": lambda r: [44.0, 46.0][r], "warnings": ["synthetic"]},
        **kw,
    )
    matrix = build_matrix(rows)
    details = evaluate(matrix, gates or Gates(), Expectations.infer(matrix, s))
    return matrix, details, overall(details)


def test_the_markdown_of_a_small_matrix_line_by_line():
    matrix, details, summary = scenario()
    text = matrix_markdown(matrix, details, summary, Gates())
    assert text.splitlines() == MARKDOWN.splitlines()
    assert text.endswith("\n") and not text.endswith("\n\n")


def test_the_preamble_follows_the_gates_and_the_verdict():
    s = gate_spec(block_sizes=(8,))
    rows = rows_of(s, status={("B3", 0): (Status.UNAVAILABLE_CAPACITY, "too big")})
    cell = next(c for c in expand(s) if c.baseline == "B1")
    failed = Row.without_metrics(cell, Status.ERROR, "died")
    rows = [failed, *rows]  # a failed row, then its retry: superseded
    gates = Gates(
        allow_blocked=["B3"],
        allow_unmeasured=["kv_occupancy_bytes"],
        require_ordering=False,
        min_coverage=0.5,
    )
    matrix, details, summary = scenario(gates, s=s, rows=rows)
    lines = matrix_markdown(matrix, details, summary, gates).splitlines()
    assert (
        lines[2]
        == "**go/no-go: GO (bm1, hide_inequality, speedup_over_b0, coverage, waste pass in all 1 groups)**"
    )
    assert lines[4] == "- rows read: 5; groups (model, B, c): 1, complete and valid: 1"
    assert lines[5] == (
        "- gates: coverage ≥ 0.5, waste ratio ≤ 0.5, speedup over B0 ≥ 1.0, ordering B0 < B1 < OURS ≤ B3: off, "
        "allowed blocked: B3, allowed unmeasured: kv_occupancy_bytes"
    )
    assert lines[7] == f"- superseded failed row row 1 (cell {cell.cell_id}) by row 3 (cell {cell.cell_id})"
    assert lines[8] == "" and lines[9] == "## m"  # GO: no reasons listed
    # A baseline with no measured repeat shows its status; the gates table marks a disabled gate "off".
    assert "| 8 | 1 | 20 | 30 | UNAVAILABLE_CAPACITY | 45 |" in lines
    assert "| 8 | 1 | pass | pass | pass | pass | pass | pass | off |" in lines
    assert not [line for line in lines if line.startswith("- m|B8|c1")]  # no failed gate to explain


def test_a_missing_baseline_is_marked_and_has_no_speedup():
    s = gate_spec()
    matrix, details, summary = scenario(s=s, rows=rows_of(s, drop=[("B0", 0)]))
    lines = matrix_markdown(matrix, details, summary, Gates()).splitlines()
    tokens = lines.index("### Output tokens/s (tok/s)")
    assert lines[tokens + 4] == "| 8 | 1 | missing | 30 | 70 | 45 |"
    speedups = lines.index("### Speedup over B0 (ratio of mean tokens/s) (x)")
    assert lines[speedups + 4] == "| 8 | 1 | missing |  |  |  |"
    assert "- 1/1 groups incomplete or invalid (e.g. m|B8|c1: missing B0)" in lines
    assert "- m|B8|c1 speedup_over_b0 (not evaluated): B0 tokens/s not measured" in lines
    assert "| 8 | 1 | **FAIL** | pass | pass | n/e | pass | pass | n/e |" in lines


def test_every_csv_column_of_one_line():
    matrix, _, _ = scenario()
    table = list(csv.DictReader(io.StringIO(matrix_csv(matrix))))
    assert list(table[0]) == list(CSV_COLUMNS) and list(CSV_COLUMNS)[:15] == list(UPSTREAM_CSV_COLUMNS)
    # Sorted by (model, B, c), then baseline.
    assert [(r["block_size"], r["baseline"]) for r in table] == [
        (b, base) for b in ("8", "16") for base in ("B0", "B1", "B2", "OURS")
    ]
    ours = table[3]
    std = statistics.stdev([44.0, 46.0])
    half = T1 * std / math.sqrt(2)
    assert ours["status"] == "" and ours["output_tokens_per_second"] == "45.0"
    assert ours["wasted_prefetch_bytes"] == "1024" and ours["expert_occupancy_bytes"] == "1048576"
    assert (ours["n_repeats"], ours["repeats_aggregated"], ours["shared_across_block_sizes"]) == (
        "2",
        "0;1",
        "",
    )
    assert ours["speedup_over_b0"] == "2.25"
    assert ours["output_tokens_per_second_std"] == repr(std)
    assert float(ours["output_tokens_per_second_ci95_low"]) == pytest.approx(45.0 - half)
    assert float(ours["output_tokens_per_second_ci95_high"]) == pytest.approx(45.0 + half)
    assert ours["kv_occupancy_bytes_std"] == "0.0" and ours["kv_occupancy_bytes_ci95_low"] == "65536.0"
    assert (ours["t_draft_seconds"], ours["t_router_seconds"], ours["t_verify_seconds"]) == (
        "0.5",
        "0.125",
        "1.0",
    )
    assert ours["route_ahead_waste_ratio"] == "0.25" and ours["hide_inequality_fetch_seconds"] == "1.0"
    assert ours["hide_inequality_margin_seconds"] == "0.25" and ours["latency_ttft_seconds_p50"] == ""
    assert (ours["bm1_router_to_verify_ratio"], ours["bm1_pass"], ours["hide_hidden_on_means"]) == (
        "0.125",
        "True",
        "True",
    )
    assert ours["warnings"] == "synthetic" and ours["reason"] == ""
    b0, b1 = table[0], table[1]
    assert b0["shared_across_block_sizes"] == "8;16" and b0["speedup_over_b0"] == "1.0"
    assert b0["bm1_pass"] == "" and b0["hide_hidden_on_means"] == ""
    assert (
        b1["n_repeats"] == "1"
        and b1["repeats_aggregated"] == "0"
        and b1["output_tokens_per_second_std"] == ""
    )


def test_a_failed_baseline_keeps_its_status_and_reason_in_the_csv():
    s = gate_spec()
    matrix, _, _ = scenario(s=s, rows=rows_of(s, status={("B1", 0): (Status.ERROR, "boom")}))
    b1 = next(r for r in csv.DictReader(io.StringIO(matrix_csv(matrix))) if r["baseline"] == "B1")
    assert b1["status"] == "ERROR" and b1["reason"] == "boom" and b1["output_tokens_per_second"] == ""
    assert b1["speedup_over_b0"] == "" and b1["n_repeats"] == "0" and b1["repeats_aggregated"] == ""


def test_json_is_written_as_upstream_does_and_never_with_nan():
    assert dumps({"b": 1, "a": [1.5]}) == '{\n  "a": [\n    1.5\n  ],\n  "b": 1\n}\n'
    assert json.loads(dumps({"x": None})) == {"x": None}
    with pytest.raises(ValueError):
        dumps({"x": float("nan")})


def test_several_allowances_and_warnings_are_joined_and_scaled_intervals_stay_in_their_unit():
    s = gate_spec(repeats=2)
    rows = rows_of(
        s,
        OURS={"ttft_seconds": lambda r: [0.2, 0.3][r], "warnings": ["w1", "w2"]},
    )
    gates = Gates(allow_blocked=["B2", "B3"], allow_unmeasured=["ttft_seconds", "goodput_at_slo"])
    matrix, details, summary = scenario(gates, s=s, rows=rows)
    lines = matrix_markdown(matrix, details, summary, gates).splitlines()
    assert lines[5].endswith("allowed blocked: B2, B3, allowed unmeasured: ttft_seconds, goodput_at_slo")
    ttft = lines.index("### TTFT (mean over requests) (ms)")
    # 0.25 s ± t(0.975, 1) · std / √2 = ± 0.635 s, clipped below at 0: [0, 0.885] s, half-width 0.4425 s = 442 ms
    assert lines[ttft + 4] == "| 8 | 1 | 250 ± 0 | 250 ± 0 | 250 ± 0 | 250 ± 4.4e+02 |"
    ours = next(r for r in csv.DictReader(io.StringIO(matrix_csv(matrix))) if r["baseline"] == "OURS")
    assert ours["warnings"] == "w1; w2"


def test_a_model_id_with_a_bar_keeps_its_groups():
    s = gate_spec(models=("org/m|v2",))
    matrix, details, summary = scenario(s=s, rows=rows_of(s))
    lines = matrix_markdown(matrix, details, summary, Gates()).splitlines()
    assert "## org/m|v2" in lines and "| 8 | 1 | 20 | 30 | 70 | 45 |" in lines
    assert "| 8 | 1 | pass | pass | pass | pass | pass | pass | pass |" in lines


def test_blank_lines_only_where_there_is_something_to_separate():
    s = gate_spec()  # one block size: nothing shared; every gate passes: no notes
    matrix, details, summary = scenario(s=s, rows=rows_of(s))
    text = matrix_markdown(matrix, details, summary, Gates())
    lines = text.splitlines()
    model = lines.index("## m")
    assert lines[model + 1 : model + 3] == ["", "### Output tokens/s (tok/s)"]
    assert text.endswith("| 8 | 1 | pass | pass | pass | pass | pass | pass | pass |\n")


@pytest.mark.parametrize(("b0", "cell"), [(0.0, ""), (0.5, "60"), (1.0, "30")])
def test_speedup_cells_need_a_positive_b0(b0, cell):
    s = gate_spec()
    rows = rows_of(s, B0={"output_tokens_per_second": b0, "goodput_at_slo": b0})
    matrix, details, summary = scenario(s=s, rows=rows)
    lines = matrix_markdown(matrix, details, summary, Gates()).splitlines()
    speedups = lines.index("### Speedup over B0 (ratio of mean tokens/s) (x)")
    assert lines[speedups + 4].split(" | ")[3] == cell  # B1's column: 30 tok/s over B0's
