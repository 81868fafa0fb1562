"""`pd-dflash report` streams (issue 12, item 6): rows are read one at a time into small summaries, and each
repeat in result_matrix.json is its stored line, re-read from the file when its group is written. The figures
(200 MB in under a minute and 1 GB) are a benchmark, not a test: benchmarks/report_scale.py, docs/metrics.md."""

from __future__ import annotations

import json

from pd_dflash.report import open_inputs, write_outputs
from pd_dflash.report.brief import RowBrief
from pd_dflash.rows import append_row
from pd_dflash.schema import Row
from pd_dflash.spec import Gates
from tests.core.helpers import synth_rows


def test_report_keeps_summaries_and_copies_stored_lines(tmp_path):
    path = tmp_path / "rows.jsonl"
    for row in synth_rows(repeats={0, 1}):
        append_row(path, row)
    lines = path.read_text().splitlines()
    with open_inputs([tmp_path]) as (briefs, sources):  # a directory means its rows.jsonl
        assert len(briefs) == len(lines) and all(isinstance(b, RowBrief) for b in briefs)
        assert not any(isinstance(v, Row) for b in briefs for v in vars_of(b))
        assert briefs[5].fetch() == lines[5] and sources[5] == f"{path}:6"  # re-read from its offset
        write_outputs(briefs, tmp_path / "out", Gates(), sources=sources)
    matrix = json.loads((tmp_path / "out" / "result_matrix.json").read_text())
    stored = {json.dumps(json.loads(line), sort_keys=True) for line in lines}
    repeats = [r for g in matrix.values() for row in g.values() for r in row["repeats"]]
    assert {json.dumps(r, sort_keys=True) for r in repeats} == stored  # every row, exactly as stored


def vars_of(brief: RowBrief) -> list:
    return [getattr(brief, name) for name in brief.__slots__]
