"""What the store writes besides rows (pure, no Ray): the sweep record (sweep.json) across runs, the error
files, and the matrices rewritten from the current rows."""

from __future__ import annotations

import json
import re

import pytest

from pd_dflash.schema import Status
from pd_dflash.spec import expand
from pd_dflash.sweep.manifest import env_summary
from pd_dflash.sweep.resume import ARCHIVE_DIR, Mode
from pd_dflash.sweep.store import SweepStore, utc_now
from tests.sweep.helpers import failed_row, make_spec, ok_row

STAMP = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$")


def record(out) -> dict:
    return json.loads((out / "sweep.json").read_text())


def test_utc_now_is_an_iso_stamp_in_milliseconds_with_a_z():
    assert STAMP.match(utc_now())


def test_a_new_run_is_recorded_with_its_spec_cluster_and_counts(tmp_path, spec):
    store = SweepStore(tmp_path, spec, Mode.RESUME)
    store.open(run_info={"cluster": {"GPU": 2}, "driver": "host-a"})
    rec = record(tmp_path)
    assert rec["name"] == spec.name and rec["fingerprint"] == spec.fingerprint()
    assert rec["cells"] == len(expand(spec)) == 12
    assert rec["spec"]["env"] == env_summary(spec.env) and rec["spec"]["baselines"] == ["B0", "B1", "OURS"]
    assert STAMP.match(rec["created_at"]) and STAMP.match(rec["updated_at"])
    (run,) = rec["runs"]
    assert run["mode"] == "resume" and run["cluster"] == {"GPU": 2} and run["driver"] == "host-a"
    assert STAMP.match(run["started_at"])
    assert rec["cluster"] == {"GPU": 2} and rec["out_of_rotation"] == []
    assert rec["counts"] == {"stored": 0, "total": 12}
    store.close()


def test_the_run_record_is_updated_and_counts_follow_the_current_rows(tmp_path, spec):
    a, b, c = expand(spec)[:3]
    store = SweepStore(tmp_path, spec, Mode.RESUME)
    store.open(run_info={"cluster": {"GPU": 2}})
    store.add(ok_row(a))
    store.add(failed_row(b))
    store.add(failed_row(c))
    store.add(ok_row(c, attempt=2))  # the retry supersedes the ERROR
    boxes = [{"node_id": "n1", "reason": "dying"}]
    store.update_run({"outcome": "finished", "out_of_rotation": boxes, "cluster": {"GPU": 4}})
    rec = record(tmp_path)
    assert rec["runs"][-1]["outcome"] == "finished" and rec["runs"][-1]["out_of_rotation"] == boxes
    assert rec["out_of_rotation"] == boxes and rec["cluster"] == {"GPU": 4}
    assert rec["counts"] == {"OK": 2, "ERROR": 1, "stored": 3, "total": 12}
    assert store.counts() == rec["counts"]
    # A patch without the two keys leaves them as they were.
    store.update_run({"note": "x"})
    rec = record(tmp_path)
    assert rec["out_of_rotation"] == boxes and rec["cluster"] == {"GPU": 4} and rec["runs"][-1]["note"] == "x"
    # One current row per cell, the retry in place of its failure.
    assert [(r.cell_id, r.status, r.attempt) for r in store.current()] == [
        (a.cell_id, Status.OK, 1),
        (b.cell_id, Status.ERROR, 1),
        (c.cell_id, Status.OK, 2),
    ]
    store.close()


def test_a_second_run_of_the_same_spec_keeps_the_history_a_restart_starts_a_new_one(tmp_path, spec):
    first = SweepStore(tmp_path, spec, Mode.RESUME)
    first.open(run_info={"cluster": {"GPU": 2}})
    first.add(ok_row(expand(spec)[0]))
    first.close()
    created = record(tmp_path)["created_at"]
    second = SweepStore(tmp_path, spec, Mode.RETRY_ERRORS)
    second.open(run_info={})
    rec = record(tmp_path)
    assert [r["mode"] for r in rec["runs"]] == ["resume", "retry-errors"]
    assert rec["created_at"] == created and rec["cluster"] is None  # this run named no cluster
    assert rec["counts"] == {"OK": 1, "stored": 1, "total": 12}
    second.close()
    third = SweepStore(tmp_path, spec, Mode.RESTART)
    opened = third.open()
    rec = record(tmp_path)
    assert [r["mode"] for r in rec["runs"]] == ["restart"] and rec["counts"] == {"stored": 0, "total": 12}
    (archive,) = (tmp_path / ARCHIVE_DIR).iterdir()
    assert opened["archived"] == str(archive) and len(record(archive)["runs"]) == 2
    third.close()


def test_a_changed_spec_restarted_in_place_starts_its_own_history(tmp_path, spec):
    first = SweepStore(tmp_path, spec, Mode.RESUME)
    first.open()
    first.close()
    (tmp_path / "rows.jsonl").unlink(missing_ok=True)
    changed = make_spec(concurrency=[1, 2, 4])
    store = SweepStore(tmp_path, changed, Mode.RESUME)  # no rows: the record of the other spec is replaced
    store.open()
    rec = record(tmp_path)
    assert rec["fingerprint"] == changed.fingerprint() and len(rec["runs"]) == 1 and rec["cells"] == 18
    store.close()


def test_error_files_append_one_block_per_attempt(tmp_path, spec):
    cell = expand(spec)[0]
    store = SweepStore(tmp_path, spec, Mode.RESUME)
    store.open()
    first = failed_row(cell, finished_at="2026-01-02T03:04:05.000Z", runner={"box": "b1", "pid": 42})
    store.add(first, "Traceback 1\n\n")
    store.add(failed_row(cell, attempt=2), "Traceback 2")
    text = (tmp_path / "errors" / f"{cell.cell_id}.txt").read_text()
    blocks = text.split("\n\n")
    assert blocks[0] == (
        "=== ERROR attempt 1 at 2026-01-02T03:04:05.000Z box b1 pid 42 ===\n"
        f"cell: m1 {cell.baseline} B=8 c={cell.concurrency} repeat=0\n"
        "reason: boom\n"
        "Traceback 1"
    )
    assert re.match(r"=== ERROR attempt 2 at \S+Z box \? pid \? ===\n", blocks[1]) and blocks[1].endswith(
        "Traceback 2"
    )
    assert text.endswith("Traceback 2\n\n") and blocks[2:] == [""]
    # A row without error text writes no error file.
    store.add(ok_row(expand(spec)[1]))
    assert sorted(p.name for p in (tmp_path / "errors").iterdir()) == [f"{cell.cell_id}.txt"]
    store.close()


def test_matrices_are_rewritten_from_the_current_rows(tmp_path, spec):
    a, b = expand(spec)[:2]
    store = SweepStore(tmp_path, spec, Mode.RESUME)
    store.open()
    store.add(failed_row(a))
    store.add(ok_row(a, attempt=2))
    store.add(ok_row(b))
    verdict = store.write_matrices()
    matrix = json.loads((tmp_path / "result_matrix.json").read_text())
    row = matrix[f"m1|B8|c{a.concurrency}"][a.baseline]
    assert row["n_repeats"] == 1 and [r["attempt"] for r in row["repeats"]] == [2]  # the retry, not the ERROR
    # Every group of the spec is expected: 12 cells in 4 groups, 2 of them measured in part.
    assert len(verdict["groups"]) == 4 and verdict["exit_code"] == 1
    assert {"result_matrix.csv", "result_matrix.md", "verdict.json"} <= {p.name for p in tmp_path.iterdir()}
    assert record(tmp_path)["counts"] == {"OK": 2, "stored": 2, "total": 12}
    store.close()


def test_restarts_in_the_same_second_archive_side_by_side_in_utc(tmp_path, spec, monkeypatch):
    import os
    import stat
    import time
    from datetime import datetime, timezone

    monkeypatch.setenv("TZ", "Asia/Kolkata")  # UTC+05:30: a local-time stamp would be off by hours
    time.tzset()
    monkeypatch.setattr(time, "gmtime", lambda *a: time.struct_time((2026, 1, 2, 3, 4, 5, 4, 2, 0)))
    try:
        for _ in range(3):
            store = SweepStore(tmp_path, spec, Mode.RESTART)
            store.open()
            store.add(ok_row(expand(spec)[0]))
            store.close()
    finally:
        monkeypatch.undo()
        time.tzset()
    names = sorted(p.name for p in (tmp_path / ARCHIVE_DIR).iterdir())
    assert names == ["20260102T030405Z", "20260102T030405Z-2"]
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((tmp_path / ARCHIVE_DIR / names[1]).stat().st_mode) == 0o750 & ~umask
    assert datetime.strptime(names[0], "%Y%m%dT%H%M%SZ").replace(tzinfo=timezone.utc).year == 2026


def test_a_failed_event_write_names_the_events_file(tmp_path, spec, monkeypatch):
    import errno
    import os

    from pd_dflash.sweep.store import StorageError

    store = SweepStore(tmp_path, spec, Mode.RESUME)
    store.open()

    def full(fd, data):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "write", full)
    with pytest.raises(StorageError) as err:
        store.add_event({"event": "x"})
    monkeypatch.undo()
    assert str(err.value) == f"cannot write {tmp_path / 'events.jsonl'}: No space left on device (errno 28)"
    store.close()


def test_error_files_are_private_and_keep_the_text_as_given(tmp_path, spec):
    import os
    import stat

    cell = expand(spec)[0]
    store = SweepStore(tmp_path, spec, Mode.RESUME)
    store.open()
    store.add(failed_row(cell), "line one  \nends with X  \n\n")
    store.add(failed_row(cell, attempt=2), "the last word is X\n")  # only newlines are stripped, never an X
    store.close()
    umask = os.umask(0)
    os.umask(umask)
    path = tmp_path / "errors" / f"{cell.cell_id}.txt"
    assert stat.S_IMODE(path.stat().st_mode) == 0o640 & ~umask
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o750 & ~umask
    first, second = path.read_text().split("=== ERROR attempt 2", 1)
    assert first.endswith("reason: boom\nline one  \nends with X  \n\n")  # only trailing newlines go
    assert second.endswith("reason: boom\nthe last word is X\n\n")


def test_matrices_are_written_without_plots_unless_asked(tmp_path, spec):
    store = SweepStore(tmp_path, spec, Mode.RESUME)
    store.open()
    store.add(ok_row(expand(spec)[0]))
    store.write_matrices()
    assert not (tmp_path / "plots").exists()
    store.write_matrices(plots=True)
    assert sorted(p.suffix for p in (tmp_path / "plots").iterdir()) and all(
        p.suffix == ".png" for p in (tmp_path / "plots").iterdir()
    )
    store.close()


def test_the_sweep_record_is_indented_json_in_insertion_order(tmp_path, spec):
    store = SweepStore(tmp_path, spec, Mode.RESUME)
    store.open(run_info={"cluster": None})
    text = (tmp_path / "sweep.json").read_text()
    rec = json.loads(text)
    assert text == json.dumps(rec, indent=2) + "\n"
    assert list(rec) == [
        "name", "fingerprint", "cells", "spec", "created_at", "updated_at", "runs", "cluster", "out_of_rotation",
        "counts",
    ]  # fmt: skip
    store.close()


def test_collector_restarts_are_counted_and_a_minimal_record_is_completed(tmp_path, spec):
    (tmp_path / "sweep.json").write_text(json.dumps({"fingerprint": spec.fingerprint()}))
    store = SweepStore(tmp_path, spec, Mode.RESUME)
    store.open()  # a record without created_at or runs (an older or hand-made one)
    store.close()
    rec = record(tmp_path)
    assert STAMP.match(rec["created_at"]) and [r["mode"] for r in rec["runs"]] == ["resume"]
    for restarts in (1, 2):
        again = SweepStore(tmp_path, spec, Mode.RESUME)
        again.open(new_run=False)
        again.close()
        assert (
            record(tmp_path)["runs"][-1]["collector_restarts"] == restarts
            and len(record(tmp_path)["runs"]) == 1
        )


def test_a_changed_spec_gets_a_new_creation_time(tmp_path, spec):
    import time

    first = SweepStore(tmp_path, spec, Mode.RESUME)
    first.open()
    first.close()
    created = record(tmp_path)["created_at"]
    time.sleep(0.002)
    changed = SweepStore(tmp_path, make_spec(concurrency=[1, 2, 4]), Mode.RESUME)  # no rows: accepted
    changed.open()
    changed.close()
    assert record(tmp_path)["created_at"] != created


def test_an_unopened_store_holds_nothing_and_closing_twice_is_harmless(tmp_path, spec):
    store = SweepStore(tmp_path, spec, Mode.RESUME)
    assert store.stored() == {} and store.current() == [] and store.counts() == {"stored": 0, "total": 12}
    store.close()
    opened = store.open()
    assert (
        opened["archived"] is None
        and opened["torn_tail_moved_to"] is None
        and opened["removed_stale_files"] == []
    )
    store.close()
    store.close()


def test_the_lock_file_is_private_and_a_held_lock_names_the_directory(tmp_path, spec):
    import os
    import stat

    from pd_dflash.errors import InputError

    store = SweepStore(tmp_path, spec, Mode.RESUME)
    store.open()
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE((tmp_path / ".lock").stat().st_mode) == 0o600 & ~umask
    assert (tmp_path / ".lock").read_text() == f"{os.getpid()}\n"
    with pytest.raises(InputError) as err:
        SweepStore(tmp_path, spec, Mode.RESUME).open()
    assert (
        str(err.value)
        == f"{tmp_path}: another pd-dflash run is writing this results directory (its lock is held)"
    )
    store.close()


def test_restarting_a_directory_that_holds_only_archives_archives_nothing(tmp_path, spec):
    (tmp_path / ARCHIVE_DIR / "old").mkdir(parents=True)
    store = SweepStore(tmp_path, spec, Mode.RESTART)
    opened = store.open()
    store.close()
    assert opened["archived"] is None and [p.name for p in (tmp_path / ARCHIVE_DIR).iterdir()] == ["old"]


def test_a_reopened_store_still_knows_which_attempts_it_holds(tmp_path, spec):
    cell = expand(spec)[0]
    store = SweepStore(tmp_path, spec, Mode.RESUME)
    store.open()
    assert store.add(failed_row(cell, attempt=3)) and store.add(failed_row(cell, attempt=2))
    assert store.stored()[cell.cell_id].attempt == 3  # the highest attempt, not the last one stored
    store.close()
    again = SweepStore(tmp_path, spec, Mode.RESUME)
    again.open()
    assert again.add(failed_row(cell, attempt=2)) is False  # the same attempt again: a duplicate
    assert again.add(failed_row(cell, attempt=4)) is True and again.stored()[cell.cell_id].attempt == 4
    again.close()


def test_a_record_that_cannot_be_written_breaks_the_store_but_closing_still_releases_it(
    tmp_path, spec, monkeypatch
):
    import errno
    import os

    from pd_dflash.sweep.store import StorageError

    store = SweepStore(tmp_path, spec, Mode.RESUME)
    store.open()

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)  # the atomic rewrite's fsync fails
    with pytest.raises(StorageError) as err:
        store.update_run({"outcome": "x"})
    assert str(err.value) == f"cannot write {tmp_path / 'sweep.json'}: No space left on device (errno 28)"
    monkeypatch.undo()
    store.broken = None  # as if the failure had come at the last flush: close must not raise
    monkeypatch.setattr(os, "fsync", full)
    store.close()
    monkeypatch.undo()
    SweepStore(tmp_path, spec, Mode.RESUME).open()  # the lock was released


def test_error_files_are_utf8_whatever_the_locale(tmp_path, spec):
    """A traceback with non-ASCII text is stored as UTF-8 even where the locale's encoding is ASCII (the C
    locale): the locale never picks the encoding."""
    import locale
    import sys

    old = locale.setlocale(locale.LC_CTYPE)
    try:
        locale.setlocale(locale.LC_CTYPE, "C")
        if sys.flags.utf8_mode or locale.getpreferredencoding(False).lower() not in (
            "ansi_x3.4-1968",
            "ascii",
        ):
            pytest.skip("Python's UTF-8 mode is on: no locale makes text files ASCII here")
        store = SweepStore(tmp_path, spec, Mode.RESUME)
        path = store.write_error(failed_row(expand(spec)[0]), "caf\u00e9 \u03c4")
    finally:
        locale.setlocale(locale.LC_CTYPE, old)
    assert path.read_bytes().endswith(b"reason: boom\ncaf\xc3\xa9 \xcf\x84\n\n")


def test_a_date_in_an_engine_option_is_recorded_as_its_iso_text(tmp_path):
    """An unquoted YAML date (``since: 2024-01-02``) is a date object in the spec; sweep.json records the
    spec's JSON form, where it is the ISO text (JSON has no dates)."""
    import datetime

    options = {"seconds": 0.2, "since": datetime.date(2024, 1, 2)}
    spec = make_spec(models=[{"id": "m1", "engine_options": options}])
    store = SweepStore(tmp_path, spec, Mode.RESUME)
    store.open()
    store.close()
    assert record(tmp_path)["spec"]["models"][0]["engine_options"] == {"seconds": 0.2, "since": "2024-01-02"}


def test_a_store_that_never_failed_says_none_as_its_breakage(tmp_path, spec):
    """``broken`` is None until a write fails (the collector reports it as ``storage_error``: null)."""
    store = SweepStore(tmp_path, spec, Mode.RESUME)
    assert store.broken is None
    store.open()
    store.add(ok_row(expand(spec)[0]))
    store.add_event({"event": "x"})
    assert store.broken is None
    store.close()
