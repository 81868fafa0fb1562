"""The store under hostile conditions (issue 22, defects 1, 2, 3; pure, no Ray): a rows.jsonl that is no longer
the file the store opened, stored rows that ``pd-dflash report`` would refuse, and a torn events.jsonl."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from pd_dflash.report import open_inputs
from pd_dflash.report.aggregate import build_matrix
from pd_dflash.rows import append_row, encode_row
from pd_dflash.spec import expand
from pd_dflash.sweep.resume import Mode, cells_to_run
from pd_dflash.sweep.store import SET_ASIDE_FILE, StorageError, SweepStore
from tests.sweep.helpers import failed_row, ok_row, stored_rows


def opened(out, spec):
    store = SweepStore(out, spec, Mode.RESUME)
    return store, store.open()


# -- defect 1: rows.jsonl is no longer the file the store opened -------------------------------------------


def _remove(path):
    path.unlink()


def _replace_by_a_copy(path):  # same content, another inode (cp + mv, an rsync, an editor's save)
    shutil.copy(path, path.with_name("copy"))
    os.replace(path.with_name("copy"), path)


def _replace_by_an_empty_file(path):
    path.with_name("empty").write_text("")
    os.replace(path.with_name("empty"), path)


def _truncate_in_place(path):
    os.truncate(path, 0)


def _append_by_another_writer(path):
    with open(path, "ab") as fh:
        fh.write(path.read_bytes().splitlines(keepends=True)[0])


def _rewrite_in_place(path):  # same inode, different content (cp onto it)
    data = path.read_bytes()
    with open(path, "r+b") as fh:
        fh.write(data[: len(data) // 2])
        fh.truncate()


TAMPERS = [
    _remove,
    _replace_by_a_copy,
    _replace_by_an_empty_file,
    _truncate_in_place,
    _append_by_another_writer,
    _rewrite_in_place,
]


@pytest.mark.parametrize("tamper", TAMPERS, ids=[t.__name__.strip("_") for t in TAMPERS])
def test_a_rows_file_changed_under_the_store_stops_it_before_the_next_row(tmp_path, spec, tamper):
    cells = expand(spec)
    store, _ = opened(tmp_path, spec)
    store.add(ok_row(cells[0]))
    store.add(ok_row(cells[1]))
    path = tmp_path / "rows.jsonl"
    tamper(path)
    after_tamper = path.read_bytes() if path.exists() else None
    with pytest.raises(StorageError) as err:
        store.add(ok_row(cells[2]))
    message = str(err.value)
    assert str(path) in message and "no longer the file this sweep writes" in message
    assert store.broken == message
    # Nothing more is written anywhere: not the row, not an event, not the matrices, not the record.
    for attempt in (
        lambda: store.add(ok_row(cells[3])),
        lambda: store.add_event({"event": "x"}),
        lambda: store.write_matrices(),
    ):
        with pytest.raises(StorageError):
            attempt()
    record = (tmp_path / "sweep.json").read_text()
    store.close()
    assert (path.read_bytes() if path.exists() else None) == after_tamper
    assert not (tmp_path / "events.jsonl").exists() and not (tmp_path / "result_matrix.json").exists()
    assert (tmp_path / "sweep.json").read_text() == record  # no count of rows that are not there


@pytest.mark.parametrize("tamper", TAMPERS, ids=[t.__name__.strip("_") for t in TAMPERS])
def test_a_rows_file_changed_after_the_last_row_is_noticed_at_the_end(tmp_path, spec, tamper):
    store, _ = opened(tmp_path, spec)
    store.add(ok_row(expand(spec)[0]))
    tamper(tmp_path / "rows.jsonl")
    with pytest.raises(StorageError, match="no longer the file this sweep writes"):
        store.check_rows_file()
    store.close()


def test_a_rows_file_created_by_someone_else_before_the_first_row_is_noticed(tmp_path, spec):
    store, _ = opened(tmp_path, spec)
    append_row(tmp_path / "rows.jsonl", ok_row(expand(spec)[0]))
    with pytest.raises(StorageError, match="it appeared, written by another process"):
        store.add(ok_row(expand(spec)[1]))
    store.close()


def test_the_store_s_own_appends_and_reopening_are_not_taken_for_a_change(tmp_path, spec):
    cells = expand(spec)
    store, _ = opened(tmp_path, spec)
    for cell in cells[:3]:
        assert store.add(ok_row(cell))
    store.check_rows_file()
    store.write_matrices()
    store.close()
    store, _ = opened(tmp_path, spec)  # a resumed run starts from the file as it is
    assert store.add(ok_row(cells[3]))
    store.check_rows_file()
    store.close()
    assert len(stored_rows(tmp_path)) == 4


# -- defect 2: resume trusts only rows the report accepts --------------------------------------------------


def write_lines(out, rows):
    out.mkdir(exist_ok=True)
    with open(out / "rows.jsonl", "wb") as fh:
        for row in rows:
            fh.write(encode_row(row))


def report_accepts(out) -> None:
    with open_inputs([out]) as (briefs, sources):
        build_matrix(briefs, sources)  # raises InputError on anything the report refuses


def set_aside_lines(out) -> list[dict]:
    return [json.loads(line) for line in (out / SET_ASIDE_FILE).read_text().splitlines()]


def lie(row, cell):
    """``row`` claiming to be ``cell``'s: its cell id, with the identity of the cell it was measured for."""
    return row.model_copy(update={"cell_id": cell.cell_id})


CASES = {
    # two final rows for one cell, a tampered copy first (the report: duplicate identity)
    "duplicate_tampered_first": lambda c: ([ok_row(c[0], seconds=9.0), ok_row(c[0]), ok_row(c[1])], {0, 1}),
    # a final row followed by a later failure of the same cell (the collector never writes that)
    "final_then_error": lambda c: ([ok_row(c[0]), failed_row(c[0], attempt=2), ok_row(c[1])], {0, 1}),
    # three copies of one row
    "three_copies": lambda c: ([ok_row(c[0])] * 3 + [ok_row(c[1])], {0, 1, 2}),
    # a row whose identity is another cell's, which has its own row (the report: duplicate identity)
    "identity_of_a_stored_cell": lambda c: ([lie(ok_row(c[1]), c[0]), ok_row(c[1])], {0}),
    # a row whose identity is another cell's, which has no row (the report would fill the wrong cell)
    "identity_of_an_unstored_cell": lambda c: ([lie(ok_row(c[1]), c[0]), ok_row(c[2])], {0}),
    # the identity of no cell at all
    "identity_of_no_cell": lambda c: (
        [ok_row(c[0]).model_copy(update={"concurrency": 99}), ok_row(c[1])],
        {0},
    ),
    "another_drafter": lambda c: ([ok_row(c[0]).model_copy(update={"draft": "other"}), ok_row(c[1])], {0}),
    "block_sizes_covered": lambda c: (
        [ok_row(c[0]).model_copy(update={"block_sizes_covered": [8, 16]}), ok_row(c[1])],
        {0},
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_resume_sets_aside_what_the_report_refuses_and_measures_those_cells_again(tmp_path, spec, case):
    cells = [c for c in expand(spec) if c.baseline != "B0"]  # B0 covers every block size: not for lying
    rows, doomed = CASES[case](cells)
    out = tmp_path / "out"
    write_lines(out, rows)
    before = (out / "rows.jsonl").read_bytes().splitlines(keepends=True)
    store, info = opened(out, spec)
    # What was set aside is said, line by line, with the reason, and kept verbatim in the side file.
    assert [e["line"] for e in info["set_aside"]] == sorted(i + 1 for i in doomed)
    assert all(e["reason"] for e in info["set_aside"]) and info["set_aside_to"] == str(out / SET_ASIDE_FILE)
    aside = set_aside_lines(out)
    assert [a["text"].encode() + b"\n" for a in aside] == [before[i] for i in sorted(doomed)]
    events = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["line"]) for e in events] == [("row_set_aside", i + 1) for i in sorted(doomed)]
    # rows.jsonl keeps every other line byte for byte, and the report now accepts it.
    assert (out / "rows.jsonl").read_bytes() == b"".join(b for i, b in enumerate(before) if i not in doomed)
    report_accepts(out)
    # Every cell without a valid row is measured again, and its new row is stored.
    doomed_cells = {rows[i].cell_id for i in doomed}
    todo = {c.cell_id for c, _ in cells_to_run(expand(spec), store.stored(), Mode.RESUME)}
    assert doomed_cells <= todo and not (todo & set(store.stored()))
    for cell in (c for c in cells if c.cell_id in doomed_cells):
        assert store.add(ok_row(cell))
    store.close()
    report_accepts(out)
    # A second resume finds nothing more to set aside.
    store, again = opened(out, spec)
    store.close()
    assert again["set_aside"] == [] and len(set_aside_lines(out)) == len(doomed)


def test_resume_keeps_a_retried_cell_s_history_that_the_report_accepts(tmp_path, spec):
    cells = expand(spec)
    rows = [
        failed_row(cells[0]),
        failed_row(cells[0], attempt=2),
        ok_row(cells[0], attempt=3),
        ok_row(cells[1]),
    ]
    write_lines(tmp_path, rows)
    store, info = opened(tmp_path, spec)
    store.close()
    assert info["set_aside"] == [] and not (tmp_path / SET_ASIDE_FILE).exists()
    assert info["stored"][cells[0].cell_id] == ("OK", 3) and len(stored_rows(tmp_path)) == 4


# -- defect 3: a torn events.jsonl is repaired, never a reason to stop -------------------------------------


def test_a_torn_events_line_found_at_open_is_moved_aside_and_said(tmp_path, spec):
    store, _ = opened(tmp_path, spec)
    store.add_event({"event": "runner_died", "cell_id": "a"})
    store.close()
    with open(tmp_path / "events.jsonl", "a") as fh:
        fh.write('{"at": "2026-12-01T00:00:00.000Z", "event": "requ')  # a write cut by a crash
    store, info = opened(tmp_path, spec)
    assert "moved an incomplete last line" in info["events_repaired"]
    assert store.add_event({"event": "requeued"}) is None
    store.add(ok_row(expand(spec)[0]))
    store.close()
    events = [json.loads(x)["event"] for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert events == ["runner_died", "requeued"]
    assert '"event": "requ' in (tmp_path / "events.jsonl.torn").read_text()


def test_a_torn_events_line_appearing_mid_run_is_moved_aside_and_the_event_stored(tmp_path, spec):
    store, _ = opened(tmp_path, spec)
    store.add_event({"event": "one"})
    with open(tmp_path / "events.jsonl", "a") as fh:
        fh.write('{"event": "half')
    said = store.add_event({"event": "two"})
    assert said is not None and str(tmp_path / "events.jsonl") in said and "events.jsonl.torn" in said
    assert store.broken is None and store.add(ok_row(expand(spec)[0]))
    store.close()
    events = [json.loads(x)["event"] for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert events == ["one", "two"]


def test_an_events_file_whose_last_event_lacks_its_newline_keeps_it(tmp_path, spec):
    (tmp_path / "events.jsonl").write_text('{"event": "one"}')
    store, info = opened(tmp_path, spec)
    store.add_event({"event": "two"})
    store.close()
    assert "newline" in info["events_repaired"]
    events = [json.loads(x)["event"] for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert events == ["one", "two"]


# -- defect 14: a full disk during the matrix write -------------------------------------------------------

MATRIX_FILES = ("result_matrix.json", "result_matrix.csv", "result_matrix.md", "verdict.json")


def _fill(disk, leave: int):
    """Fill the filesystem at ``disk`` until ``leave`` bytes are free (tmpfs counts whole pages)."""
    filler = disk / "filler"
    filler.unlink(missing_ok=True)
    st = os.statvfs(disk)
    size = max(0, st.f_bavail * st.f_frsize - leave)
    with open(filler, "wb") as fh:
        fh.write(b"\0" * size)
    return filler


def test_a_full_disk_during_the_matrix_write_names_the_file_and_leaves_no_stale_matrix(tmp_path, spec):
    from pd_dflash.sweep.staging import MatrixWriteError
    from tests.sweep.helpers import small_filesystem

    cells = expand(spec)
    with small_filesystem(tmp_path / "disk", "4m") as disk:
        out = disk / "out"
        store, _ = opened(out, spec)
        for cell in cells[:6]:
            store.add(ok_row(cell))
        store.write_matrices()  # the set of an earlier rewrite is there
        assert all((out / name).exists() for name in MATRIX_FILES)
        for cell in cells[6:]:
            store.add(ok_row(cell))
        page = os.statvfs(disk).f_frsize
        failed_at, succeeded = [], 0
        # From room for little more than the record up to room for the whole new set, page by page: every
        # file of the set runs out of space in turn.
        for pages in range(2, 40):
            filler = _fill(disk, pages * page)
            try:
                store.write_matrices()
            except MatrixWriteError as exc:
                message = str(exc)
                named = [
                    n for n in MATRIX_FILES if f"cannot write {out / n}: No space left on device" in message
                ]
                assert len(named) == 1, message
                failed_at.append(named[0])
                # No partial or stale set: neither the files written before the failure nor the old ones.
                assert not [p.name for p in out.iterdir() if p.name.startswith(("result_matrix", "verdict"))]
                assert "pd-dflash report" in message
            else:
                succeeded += 1
                matrix = json.loads((out / "result_matrix.json").read_text())
                assert sum(len(g) for g in matrix.values()) == len(cells)
                assert all((out / name).exists() for name in MATRIX_FILES)
            finally:
                filler.unlink()
            assert not [p.name for p in out.iterdir() if ".tmp" in p.name]  # no staging left either
            assert store.broken is None and len(stored_rows(out)) == len(cells)
            if succeeded:
                break
        store.close()
    assert succeeded and len(set(failed_at)) >= 2, failed_at
