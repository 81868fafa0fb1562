"""The resume rules' refusals and records, word for word (sweep/resume.py; pure, no Ray)."""

from __future__ import annotations

import json
import os
import stat

import pytest

from pd_dflash.errors import InputError
from pd_dflash.rows import append_row
from pd_dflash.schema import Row, Status
from pd_dflash.spec import expand
from pd_dflash.sweep.resume import (
    Mode,
    cells_to_run,
    check_resumable,
    probe_writable,
    read_sweep_json,
    row_key,
    stored_cells,
)
from tests.sweep.helpers import make_spec, ok_row


def test_modes_print_as_their_flags():
    assert [str(m) for m in Mode] == ["resume", "restart", "retry-errors"]


def test_a_row_without_a_cell_id_is_keyed_by_its_upstream_identity():
    spec = make_spec()
    row = ok_row(expand(spec)[0])
    assert row_key(row) == row.cell_id
    assert row_key(row.model_copy(update={"cell_id": None})) == "m1|B0|8|1|0"


def test_the_next_attempt_of_a_retried_cell_follows_the_highest_stored_one():
    spec = make_spec()
    a, b = expand(spec)[:2]
    rows = [
        Row.without_metrics(a, Status.ERROR, "x", attempt=1),
        Row.without_metrics(a, Status.TIMEOUT, "x", attempt=3),
        Row.without_metrics(a, Status.ERROR, "x", attempt=2),
        ok_row(b),
    ]
    held = stored_cells(rows)
    assert (
        held[a.cell_id].attempt == 3 and held[a.cell_id].status == Status.ERROR and not held[a.cell_id].final
    )
    assert held[b.cell_id].final
    plan = cells_to_run([a, b], held, Mode.RETRY_ERRORS)
    assert [(c.cell_id, n) for c, n in plan] == [(a.cell_id, 4)]
    assert cells_to_run([a, b], held, Mode.RESUME) == []
    assert [n for _, n in cells_to_run(expand(spec)[:3], held, Mode.RESUME)] == [1]


def test_the_sweep_record_must_be_readable_json_of_an_object(tmp_path):
    path = tmp_path / "sweep.json"
    assert read_sweep_json(path) is None
    path.write_text("[1]")
    with pytest.raises(InputError) as err:
        read_sweep_json(path)
    assert str(err.value) == f"{path}: the sweep record must be a JSON object"
    path.write_text("{")
    with pytest.raises(InputError) as err:
        read_sweep_json(path)
    assert str(err.value).startswith(f"{path}: cannot read the sweep record: Expecting property name")


def test_rows_of_a_changed_spec_are_refused_word_for_word(tmp_path):
    spec = make_spec()
    append_row(tmp_path / "rows.jsonl", ok_row(expand(spec)[0]))
    (tmp_path / "sweep.json").write_text(json.dumps({"fingerprint": spec.fingerprint()}))
    changed = make_spec(concurrency=[1, 2, 4])
    check_resumable(tmp_path, spec, Mode.RESUME)  # the same spec: fine
    check_resumable(tmp_path, changed, Mode.RESTART)  # restart archives: fine
    with pytest.raises(InputError) as err:
        check_resumable(tmp_path, changed, Mode.RETRY_ERRORS)
    assert str(err.value) == (
        f"{tmp_path}: holds 1 rows of a spec with fingerprint {spec.fingerprint()}, but this spec's "
        f"fingerprint is {changed.fingerprint()} (the measurement changed). Use --restart to archive them under "
        "archive/ and start over, or choose another --out"
    )


def test_foreign_cells_are_refused_saying_whether_a_record_names_their_spec(tmp_path):
    spec, other = make_spec(), make_spec(concurrency=[3])
    foreign = expand(other)[0]
    append_row(tmp_path / "rows.jsonl", ok_row(foreign))
    with pytest.raises(InputError) as err:
        check_resumable(tmp_path, spec, Mode.RESUME)
    assert str(err.value) == (
        f"{tmp_path}: rows.jsonl holds 1 cells that are not in this spec (e.g. {foreign.cell_id}) and no "
        "sweep.json names their spec. Use --restart to archive them and start over, or choose another --out"
    )
    (tmp_path / "sweep.json").write_text(json.dumps({"fingerprint": spec.fingerprint()}))
    with pytest.raises(InputError) as err:
        check_resumable(tmp_path, spec, Mode.RESUME)
    assert str(err.value) == (
        f"{tmp_path}: rows.jsonl holds 1 cells that are not in this spec (e.g. {foreign.cell_id}) and the record "
        "is inconsistent. Use --restart to archive them and start over, or choose another --out"
    )


def test_an_empty_or_missing_rows_file_resumes_anything(tmp_path):
    spec = make_spec()
    check_resumable(tmp_path, spec, Mode.RESUME)
    (tmp_path / "rows.jsonl").write_text("")
    (tmp_path / "sweep.json").write_text(json.dumps({"fingerprint": "another"}))
    check_resumable(tmp_path, spec, Mode.RESUME)
    (tmp_path / "rows.jsonl").write_text('{"model": "m')  # only a torn line: still rows of a spec
    with pytest.raises(InputError, match="holds 0 rows of a spec with fingerprint another"):
        check_resumable(tmp_path, spec, Mode.RESUME)


def test_the_results_directory_is_created_and_probed(tmp_path):
    out = tmp_path / "a" / "b"
    probe_writable(out)
    assert out.is_dir() and list(out.iterdir()) == []
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o750 & ~umask
    (tmp_path / "file").write_text("x")
    with pytest.raises(InputError) as err:
        probe_writable(tmp_path / "file" / "out")
    assert (
        str(err.value) == f"{tmp_path / 'file' / 'out'}: results directory is not writable: Not a directory"
    )
