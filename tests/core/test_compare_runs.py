"""scripts/compare_runs.py meets the CLI standard (issue 29 item 7): it reads a sweep directory or a row file,
keys rows by their full identity (the ablation values included: rows that differ only there used to collide and
give "0 differences"), refuses what ``pd-dflash report`` refuses with exit 2 naming the file (a torn line, a
directory without rows, a matrix, a duplicated row, an empty file), and never calls "0 values compared"
agreement."""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from pd_dflash.spec import expand
from tests.sweep.helpers import make_spec, ok_row

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "compare_runs.py"


def _script():
    spec = importlib.util.spec_from_file_location("compare_runs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


COMPARE = _script()


def compare(*inputs: Path) -> subprocess.CompletedProcess:
    """The script's main in this process (its output captured), as a CompletedProcess."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = COMPARE.main([str(p) for p in inputs])
        except SystemExit as exit_:
            code = exit_.code
    return subprocess.CompletedProcess(inputs, code, out.getvalue(), err.getvalue())


def test_the_script_runs_on_its_own_and_exits_2_without_a_traceback(tmp_path):
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), str(tmp_path), str(tmp_path)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert f"{tmp_path}: is a directory without rows.jsonl" in proc.stderr


def row_dicts(**over) -> list[dict]:
    rows = [json.loads(ok_row(cell).model_dump_json(exclude_none=True)) for cell in expand(make_spec())]
    for row in rows:
        row.update(over)
    return rows


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def ablated(rows: list[dict]) -> list[dict]:
    """Each row twice, at two cache fractions, with different deterministic values (generated tokens)."""
    out = []
    for row in rows:
        for fraction, tokens in ((0.25, 100), (0.5, 200)):
            out.append({**row, "ablation": {"expert_cache_fraction": fraction}, "generated_tokens": tokens})
    return out


def test_identical_runs_agree_and_a_sweep_directory_is_read_as_its_rows(tmp_path):
    rows = row_dicts()
    before = write_rows(tmp_path / "before" / "rows.jsonl", rows)
    after = write_rows(tmp_path / "after.jsonl", rows)
    proc = compare(before.parent, after)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"{len(rows)} vs {len(rows)} rows" in proc.stdout and " 0 differences" in proc.stdout
    assert ", 0 deterministic values compared" not in proc.stdout


def test_rows_that_differ_only_in_their_ablation_values_are_told_apart(tmp_path):
    rows = ablated(row_dicts())
    before = write_rows(tmp_path / "before.jsonl", rows)
    swapped = [{**r, "generated_tokens": 300 - r["generated_tokens"]} for r in rows]
    after = write_rows(tmp_path / "after.jsonl", swapped)
    proc = compare(before, after)
    assert proc.returncode == 1, proc.stdout
    assert f"{len(rows)} differences" in proc.stdout and "expert_cache_fraction" in proc.stdout
    assert compare(before, before).returncode == 0


def test_nothing_compared_is_no_agreement(tmp_path):
    a = write_rows(tmp_path / "a.jsonl", row_dicts())
    b = write_rows(
        tmp_path / "b.jsonl", [{**r, "model": r["model"] + "-x"} for r in row_dicts()]
    )  # none shared
    proc = compare(a, b)
    assert proc.returncode == 1 and "cells differ" in proc.stdout
    assert ", 0 deterministic values compared" in proc.stdout and "no agreement" in proc.stderr


def test_a_duplicated_row_is_refused_as_the_report_refuses_it(tmp_path):
    rows = row_dicts()
    dup = write_rows(tmp_path / "dup.jsonl", [*rows, rows[0]])
    proc = compare(dup, dup)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert str(dup) in proc.stderr and "duplicate identity" in proc.stderr


@pytest.mark.parametrize("bad", ["torn", "empty", "directory", "matrix", "missing", "not-utf8"])
def test_bad_input_exits_2_naming_the_file(tmp_path, bad):
    good = write_rows(tmp_path / "good.jsonl", row_dicts())
    path = tmp_path / f"{bad}.jsonl"
    if bad == "torn":
        path.write_text(good.read_text() + '{"model": "m1", "basel')
        named = f"{path}:{len(row_dicts()) + 1}"
    elif bad == "empty":
        path.write_text("")
        named = str(path)
    elif bad == "directory":
        path = tmp_path / "a-dir"
        path.mkdir()
        named = str(path)
    elif bad == "matrix":
        path = tmp_path / "result_matrix.json"
        path.write_text(json.dumps({"m1|B8|c1": {"B0": {"output_tokens_per_second": 1.0}}}))
        named = str(path)
    elif bad == "missing":
        named = str(path)
    else:
        path.write_bytes(b"\xff\xfe not text\n")
        named = str(path)
    for args in ((path, good), (good, path)):
        proc = compare(*args)
        assert proc.returncode == 2, (bad, proc.stdout, proc.stderr)
        assert "Traceback" not in proc.stderr and named in proc.stderr, proc.stderr


def test_upstream_rows_without_repeat_are_read_as_the_report_reads_them(tmp_path):
    rows = [{k: v for k, v in r.items() if k not in ("repeat", "cell_id")} for r in row_dicts()]
    repeated = row_dicts()
    a = tmp_path / "upstream.json"
    a.write_text(json.dumps(rows))
    b = write_rows(tmp_path / "b.jsonl", repeated)
    proc = compare(a, b)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert proc.returncode in (0, 1) and f"{len(rows)} vs {len(repeated)} rows" in proc.stdout
