"""The sweep directory rules (pure, no Ray): current row per cell, resume plan, dedupe, torn tail, restart,
storage failures, stale temporary files, events, what is recorded of the spec's env."""

from __future__ import annotations

import errno
import json
import os
import stat

import pytest

from pd_dflash.errors import InputError
from pd_dflash.rows import append_row
from pd_dflash.schema import Status
from pd_dflash.spec import expand
from pd_dflash.sweep.manifest import env_summary, redact
from pd_dflash.sweep.resume import (
    ARCHIVE_DIR,
    Mode,
    cells_to_run,
    current_rows,
    current_rows_of,
    stored_cells,
)
from pd_dflash.sweep.store import StorageError, SweepStore
from tests.sweep.helpers import failed_row, make_spec, ok_row, stored_rows


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


def test_a_failed_write_breaks_the_store_and_nothing_is_written_after_it(tmp_path, spec, monkeypatch):
    cells = expand(spec)
    store = SweepStore(tmp_path, spec, Mode.RESUME)
    store.open()
    store.add(ok_row(cells[0]))
    size = (tmp_path / "rows.jsonl").stat().st_size

    def full_disk(fd, data):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", full_disk)
    with pytest.raises(StorageError, match="No space left on device") as err:
        store.add(ok_row(cells[1]))
    assert "rows.jsonl" in str(err.value)
    monkeypatch.undo()  # space comes back: the store still writes nothing (the driver is stopping)
    for attempt in (lambda: store.add(ok_row(cells[2])), lambda: store.add_event({"event": "x"})):
        with pytest.raises(StorageError, match="No space left on device"):
            attempt()
    store.close()
    assert (tmp_path / "rows.jsonl").stat().st_size == size and not (tmp_path / "events.jsonl").exists()
    reopened = SweepStore(tmp_path, spec, Mode.RESUME)  # resume: the stored row is intact
    assert list(reopened.open()["stored"]) == [cells[0].cell_id]
    reopened.close()


def test_reopening_removes_temporary_files_a_crash_left_and_says_so(tmp_path, spec):
    store = SweepStore(tmp_path, spec, Mode.RESUME)
    store.open()
    store.close()
    (tmp_path / ".sweep.json.tmp-4242").write_text('{"half": ')  # an atomic rewrite cut by a crash
    (tmp_path / "plots").mkdir()
    (tmp_path / "plots" / ".m1.png.tmp-4242").write_bytes(b"\x89PNG")
    (tmp_path / ".probe-4242").write_text("probe\n")
    store = SweepStore(tmp_path, spec, Mode.RESUME)
    opened = store.open()
    store.close()
    assert sorted(opened["removed_stale_files"]) == [
        ".probe-4242",
        ".sweep.json.tmp-4242",
        "plots/.m1.png.tmp-4242",
    ]
    assert sorted(p.name for p in tmp_path.rglob(".*") if p.name != ".lock") == []


def test_events_are_appended_as_one_json_object_per_line(tmp_path, spec):
    store = SweepStore(tmp_path, spec, Mode.RESUME)
    store.open()
    store.add_event({"event": "runner_died", "cell_id": "abc", "cause": "runner died: exit 17"})
    store.add_event({"event": "requeued", "cell_id": "abc", "attempt": 2})
    store.close()
    lines = (tmp_path / "events.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in lines]
    assert [e["event"] for e in events] == ["runner_died", "requeued"] and all(e["at"] for e in events)
    assert stat.S_IMODE((tmp_path / "events.jsonl").stat().st_mode) & 0o027 == 0


def test_the_sweep_record_keeps_env_names_and_a_hash_never_values(tmp_path):
    spec = make_spec(env={"HF_TOKEN": "hf_abcdefgh12345678", "HF_HUB_OFFLINE": "1"})
    store = SweepStore(tmp_path, spec, Mode.RESUME)
    store.open()
    store.close()
    text = (tmp_path / "sweep.json").read_text()
    assert "hf_abcdefgh12345678" not in text
    recorded_env = json.loads(text)["spec"]["env"]
    assert (
        recorded_env["names"] == ["HF_HUB_OFFLINE", "HF_TOKEN"] and len(recorded_env["values_sha256"]) == 64
    )
    other = env_summary({"HF_TOKEN": "hf_abcdefgh12345679", "HF_HUB_OFFLINE": "1"})
    assert other["values_sha256"] != recorded_env["values_sha256"]  # a changed value shows


def test_redact_replaces_env_values_in_nested_text_but_not_short_values():
    env = {"HF_TOKEN": "hf_abcdefgh12345678", "WANDB_KEY": "hf_abcdefgh12345678xyz", "ONE": "1"}
    value = {"a": ["token hf_abcdefgh12345678xyz!", 3], "b": "hf_abcdefgh12345678", "gpu_ids": ["1"]}
    assert redact(value, env) == {"a": ["token <env WANDB_KEY>!", 3], "b": "<env HF_TOKEN>", "gpu_ids": ["1"]}
    assert redact("nothing here", {}) == "nothing here"
