"""Hostile inputs to ``report`` and ``validate``: unbounded files, a rows file changed while the report runs, and
duplicate JSON keys (issue 22, defects 8-10). Each is a named error (exit 2) or, for a file replaced meanwhile,
a matrix that still agrees with itself."""

from __future__ import annotations

import json
import os

import pytest

from pd_dflash import safe_load
from pd_dflash.cli import main
from pd_dflash.errors import InputError
from pd_dflash.report import open_inputs, write_outputs
from pd_dflash.report import validate as validate_module
from pd_dflash.rows import ROWS_FILE, append_row, encode_row
from pd_dflash.spec import Gates
from tests.core.helpers import gate_spec, rows_of


def _rows_file(tmp_path, **by_baseline):
    path = tmp_path / ROWS_FILE
    for row in rows_of(gate_spec(repeats=2), **by_baseline):
        append_row(path, row)
    return path


# -- defect 8: bounded reads ----------------------------------------------------------------------------------


def test_report_and_validate_of_dev_zero_are_named_errors(tmp_path, capsys):
    assert main(["report", "/dev/zero", "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "/dev/zero:1: line longer than 16777216 bytes: not a row" in err
    assert main(["validate", "/dev/zero"]) == 2
    assert "/dev/zero:1: invalid JSON: Expecting value (column 1)" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_line_beyond_the_bound_is_refused_before_it_is_parsed(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(safe_load, "MAX_LINE_BYTES", 1 << 16)
    path = _rows_file(tmp_path)
    row = json.loads(path.read_text().splitlines()[0])
    row["warnings"] = ["x" * (1 << 17)]  # a valid row, only too long
    with path.open("a") as fh:
        fh.write(json.dumps(row) + "\n")
    assert main(["report", str(path), "--out", str(tmp_path / "out")]) == 2
    assert f"{path}:9: line longer than 65536 bytes" in capsys.readouterr().err


def test_a_document_beyond_the_bound_is_refused(tmp_path, monkeypatch, capsys):
    from pd_dflash import rows

    monkeypatch.setattr(validate_module, "MAX_DOCUMENT_BYTES", 1 << 16)
    monkeypatch.setattr(rows, "MAX_DOCUMENT_BYTES", 1 << 16)
    big = tmp_path / "m.json"
    big.write_text("{" + " " * (1 << 17) + "}")
    assert main(["validate", str(big)]) == 2
    assert f"{big}: a result matrix larger than 65536 bytes: refused" in capsys.readouterr().err
    whole = tmp_path / "rows.json"
    whole.write_text("[" + " " * (1 << 17) + "]")
    assert main(["report", str(whole), "--out", str(tmp_path / "out")]) == 2
    assert (
        f"{whole}: a row file read whole (JSON, not lines) larger than 65536 bytes" in capsys.readouterr().err
    )


# -- defect 9: the rows file is read once ---------------------------------------------------------------------


def _matrix(out):
    return json.loads((out / "result_matrix.json").read_text())


def test_a_rows_file_replaced_while_the_report_runs_gives_the_matrix_of_what_was_read(tmp_path):
    first = tmp_path / "first"
    first.mkdir()
    path = _rows_file(first)
    pristine = tmp_path / "pristine"
    with open_inputs([path]) as (briefs, sources):
        write_outputs(briefs, pristine, Gates(), sources=sources)
    with open_inputs([path]) as (briefs, sources):
        # another box's copy lands over it (rsync and cp -f write a new file and rename it)
        other = tmp_path / "other"
        other.mkdir()
        replacement = _rows_file(other, B1={"output_tokens_per_second": 31.0})
        os.replace(replacement, path)
        write_outputs(briefs, tmp_path / "out", Gates(), sources=sources)
    assert _matrix(tmp_path / "out") == _matrix(pristine)
    for group in _matrix(tmp_path / "out").values():  # every repeat is the row the aggregate was built from
        for row in group.values():
            tokens = [r["output_tokens_per_second"] for r in row["repeats"]]
            assert row["output_tokens_per_second"] == sum(tokens) / len(tokens)


def test_a_rows_file_rewritten_in_place_while_the_report_runs_is_refused_and_nothing_is_written(tmp_path):
    path = _rows_file(tmp_path)
    text = path.read_bytes()
    with open_inputs([path]) as (briefs, sources):
        with path.open("r+b") as fh:  # the same length, other numbers: rewritten in place
            fh.write(text.replace(b'"output_tokens_per_second":30.0', b'"output_tokens_per_second":31.0'))
        with pytest.raises(InputError) as err:
            write_outputs(briefs, tmp_path / "out", Gates(), sources=sources)
    assert "the file changed while it was being read" in str(err.value)
    assert str(err.value).startswith(f"{path}:")
    assert list((tmp_path / "out").glob("*")) == []


# -- defect 10: duplicate JSON keys ---------------------------------------------------------------------------


def test_a_row_line_with_a_key_twice_is_refused_naming_the_line(tmp_path, capsys):
    path = _rows_file(tmp_path)
    lines = path.read_text().splitlines()
    lines[2] = lines[2][:-1] + ',"output_tokens_per_second":99.0}'
    path.write_text("\n".join(lines) + "\n")
    assert main(["report", str(path), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert f"{path}:3: duplicate key 'output_tokens_per_second': JSON would keep only the last" in err
    assert not (tmp_path / "out").exists()


def test_a_whole_json_row_file_and_a_matrix_with_a_key_twice_are_refused_naming_the_line(tmp_path, capsys):
    rows = rows_of(gate_spec())
    whole = tmp_path / "upstream.json"
    objs = [json.loads(encode_row(r)) for r in rows]
    text = json.dumps(objs, indent=2)
    text = text.replace('"baseline": "B1",', '"baseline": "B1",\n    "baseline": "B2",', 1)
    whole.write_text(text)
    line = text.splitlines().index('    "baseline": "B2",')  # 0-based: the object opened on the line before
    assert main(["report", str(whole), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "duplicate key 'baseline'" in err and f"{whole}:" in err
    opened = int(err.split(f"{whole}:", 1)[1].split(":", 1)[0])
    assert text.splitlines()[opened - 1].strip() == "{" and opened <= line

    with open_inputs([_rows_file(tmp_path)]) as (briefs, sources):
        write_outputs(briefs, tmp_path / "out", Gates(), sources=sources)
    matrix = tmp_path / "out" / "result_matrix.json"
    lines = matrix.read_text().splitlines()
    at = next(i for i, s in enumerate(lines) if s.strip().startswith('"n_repeats"'))
    lines.insert(at, lines[at])
    matrix.write_text("\n".join(lines) + "\n")
    assert main(["validate", str(matrix)]) == 2
    err = capsys.readouterr().err
    assert "duplicate key 'n_repeats'" in err and f"{matrix}:" in err
