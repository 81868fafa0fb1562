"""The sweep directory rules (pure, no Ray): current row per cell, resume plan, dedupe, torn tail, restart."""

from __future__ import annotations

import json

import pytest

from pd_dflash.errors import InputError
from pd_dflash.rows import append_row
from pd_dflash.schema import Row, Status
from pd_dflash.spec import expand
from pd_dflash.sweep.store import (
    ARCHIVE_DIR,
    Mode,
    SweepStore,
    cells_to_run,
    current_rows,
    current_rows_of,
    stored_cells,
)
from tests.sweep.engines import synthetic_result
from tests.sweep.helpers import make_spec, stored_rows


def ok_row(cell, attempt=1):
    return Row.from_result(cell, synthetic_result(cell, 4, 0.1), attempt=attempt, sweep="t")


def failed_row(cell, status=Status.ERROR, attempt=1):
    return Row.without_metrics(cell, status, "boom", attempt=attempt, sweep="t")


@pytest.fixture
def spec():
    return make_spec()


def test_current_row_a_final_row_is_never_superseded(spec):
    a, b, c = expand(spec)[:3]
    rows = [
        failed_row(a),
        ok_row(a, attempt=2),  # retry succeeded: supersedes the ERROR
        ok_row(b),
        failed_row(b, attempt=2),  # cannot supersede a final row
        failed_row(c, Status.TIMEOUT),
        failed_row(c, Status.ERROR, attempt=2),  # the last of two failures is current
    ]
    current = {r.cell_id: r for r in current_rows(rows)}
    assert len(current) == 3
    assert (current[a.cell_id].status, current[a.cell_id].attempt) == (Status.OK, 2)
    assert (current[b.cell_id].status, current[b.cell_id].attempt) == (Status.OK, 1)
    assert (current[c.cell_id].status, current[c.cell_id].attempt) == (Status.ERROR, 2)
    held = stored_cells(rows)
    assert held[c.cell_id].attempt == 2 and not held[c.cell_id].final and held[a.cell_id].final


def test_cells_to_run_resume_skips_every_stored_cell_retry_reruns_failures(spec):
    cells = expand(spec)
    rows = [ok_row(cells[0]), failed_row(cells[1]), failed_row(cells[2], Status.TIMEOUT, attempt=2)]
    held = stored_cells(rows)
    resume = cells_to_run(cells, held, Mode.RESUME)
    assert [c.cell_id for c, _ in resume] == [c.cell_id for c in cells[3:]]
    assert all(attempt == 1 for _, attempt in resume)
    retry = dict((c.cell_id, a) for c, a in cells_to_run(cells, held, Mode.RETRY_ERRORS))
    assert cells[0].cell_id not in retry
    assert retry[cells[1].cell_id] == 2 and retry[cells[2].cell_id] == 3
    assert len(retry) == len(cells) - 1


def test_store_appends_validates_and_ignores_duplicates(tmp_path, spec):
    cells = expand(spec)
    store = SweepStore(tmp_path, spec, Mode.RESUME)
    store.open(run_info={"note": "test"})
    assert store.add(ok_row(cells[0])) is True
    assert store.add(ok_row(cells[0], attempt=2)) is False  # a final row is stored: duplicate
    assert store.add(failed_row(cells[1]), "Traceback: boom") is True
    assert store.add(failed_row(cells[1])) is False  # same attempt again (a retried collector call)
    assert store.add(ok_row(cells[1], attempt=2)) is True  # a retry supersedes the ERROR row
    other = make_spec(name="x", concurrency=[3])
    with pytest.raises(InputError, match="unknown cell"):
        store.add(ok_row(expand(other)[0]))
    store.close()
    rows = stored_rows(tmp_path)
    assert [(r.cell_id, r.status, r.attempt) for r in rows] == [
        (cells[0].cell_id, Status.OK, 1),
        (cells[1].cell_id, Status.ERROR, 1),
        (cells[1].cell_id, Status.OK, 2),
    ]
    assert len(current_rows_of(tmp_path)) == 2
    error_file = (tmp_path / "errors" / f"{cells[1].cell_id}.txt").read_text()
    assert "ERROR attempt 1" in error_file and "Traceback: boom" in error_file
    record = json.loads((tmp_path / "sweep.json").read_text())
    assert record["fingerprint"] == spec.fingerprint() and record["runs"][0]["note"] == "test"
    assert record["counts"]["stored"] == 2


def test_reopening_repairs_a_torn_tail_and_keeps_every_stored_row(tmp_path, spec):
    cells = expand(spec)
    store = SweepStore(tmp_path, spec, Mode.RESUME)
    store.open()
    store.add(ok_row(cells[0]))
    store.close()
    with open(tmp_path / "rows.jsonl", "a") as fh:
        fh.write('{"model": "m1", "baseline": "B')  # a write cut by a crash
    store = SweepStore(tmp_path, spec, Mode.RESUME)
    opened = store.open()
    assert opened["torn_tail_moved_to"] and opened["rows"] == 1
    assert list(opened["stored"]) == [cells[0].cell_id]
    store.add(ok_row(cells[1]))
    store.close()
    assert [r.cell_id for r in stored_rows(tmp_path)] == [cells[0].cell_id, cells[1].cell_id]
    assert '"baseline": "B' in (tmp_path / "rows.jsonl.torn").read_text()
    assert len(json.loads((tmp_path / "sweep.json").read_text())["runs"]) == 2


def test_changed_fingerprint_is_refused_naming_both_and_restart_archives(tmp_path, spec):
    cells = expand(spec)
    store = SweepStore(tmp_path, spec, Mode.RESUME)
    store.open()
    store.add(ok_row(cells[0]))
    store.close()
    changed = make_spec(concurrency=[1, 2, 4])
    with pytest.raises(InputError) as err:
        SweepStore(tmp_path, changed, Mode.RESUME).open()
    assert spec.fingerprint() in str(err.value) and changed.fingerprint() in str(err.value)
    with pytest.raises(InputError):
        SweepStore(tmp_path, changed, Mode.RETRY_ERRORS).open()
    store = SweepStore(tmp_path, changed, Mode.RESTART)
    opened = store.open()
    store.close()
    assert opened["rows"] == 0 and opened["archived"]
    archived = list((tmp_path / ARCHIVE_DIR).iterdir())
    assert len(archived) == 1
    assert [r.cell_id for r in stored_rows(archived[0])] == [cells[0].cell_id]
    assert json.loads((archived[0] / "sweep.json").read_text())["fingerprint"] == spec.fingerprint()
    assert json.loads((tmp_path / "sweep.json").read_text())["fingerprint"] == changed.fingerprint()


def test_rows_of_another_spec_without_a_record_are_refused(tmp_path, spec):
    other = make_spec(concurrency=[3])
    append_row(tmp_path / "rows.jsonl", ok_row(expand(other)[0]))
    with pytest.raises(InputError, match="not in this spec"):
        SweepStore(tmp_path, spec, Mode.RESUME).open()


def test_a_second_writer_is_refused_while_the_first_holds_the_lock(tmp_path, spec):
    first = SweepStore(tmp_path, spec, Mode.RESUME)
    first.open()
    with pytest.raises(InputError, match="another pd-dflash run"):
        SweepStore(tmp_path, spec, Mode.RESUME).open()
    first.close()
    SweepStore(tmp_path, spec, Mode.RESUME).open()


def test_reopen_for_the_same_run_continues_its_record(tmp_path, spec):
    store = SweepStore(tmp_path, spec, Mode.RESTART)
    store.open()
    store.add(ok_row(expand(spec)[0]))
    store.close()
    again = SweepStore(tmp_path, spec, Mode.RESUME)  # what a restarted collector does
    opened = again.open(new_run=False)
    assert opened["rows"] == 1 and not opened["archived"]
    record = json.loads((tmp_path / "sweep.json").read_text())
    assert len(record["runs"]) == 1 and record["runs"][0]["collector_restarts"] == 1
