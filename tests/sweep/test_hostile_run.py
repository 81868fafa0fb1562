"""A local-mode sweep (`python -m pd_dflash run`, its own single-node Ray cluster) under the hostile round of issue
22: the local node's raylet or GCS killed mid-run (defect 7), rows.jsonl removed or replaced mid-run (defect 1),
a resume over tampered rows and a torn events.jsonl (defects 2, 3), and a hangup under nohup (defect 13)."""

from __future__ import annotations

import json
import os
import shutil
import signal
from collections import Counter
from pathlib import Path

import pytest

from pd_dflash.rows import encode_row
from pd_dflash.schema import Status
from pd_dflash.spec import expand, parse_spec
from pd_dflash.sweep.resume import current_rows
from tests.sweep.helpers import (
    kill_pids,
    processes_using,
    run_cli,
    spec_data,
    start_run,
    stored_so_far,
    wait_for_rows,
    write_spec,
)

pytestmark = pytest.mark.ray


def short_spec(tmp_path, repeats=2, seconds=0.4):
    data = spec_data(
        models=[
            {"id": "m1", "engine_options": {"seconds": seconds}},
            {"id": "m2", "engine_options": {"seconds": seconds}},
        ],
        repeats=repeats,
    )
    return write_spec(tmp_path / "spec.yaml", data), parse_spec(data)


def finish(driver, timeout=120.0):
    try:
        stdout, stderr = driver.communicate(timeout=timeout)
    finally:
        if driver.poll() is None:
            driver.kill()
    return stdout, stderr


def pids_of(ray_tmp: str, program: str) -> list[int]:
    found = []
    for pid in processes_using(ray_tmp):
        try:
            argv0 = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[0].decode()
        except OSError:
            continue
        if Path(argv0).name == program:
            found.append(pid)
    return found


@pytest.mark.parametrize("program", ["raylet", "gcs_server"])
def test_losing_the_local_node_is_said_recorded_and_resumable(tmp_path, ray_tmp, program):
    spec_path, spec = short_spec(tmp_path)
    out = tmp_path / "out"
    driver = start_run(spec_path, out, ray_tmp)
    wait_for_rows(driver, out, 3)
    victims = pids_of(ray_tmp, program)
    assert len(victims) == 1, victims
    os.kill(victims[0], signal.SIGKILL)
    stdout, stderr = finish(driver)
    assert driver.returncode == 1, stdout + stderr
    assert "Traceback" not in stdout + stderr, stderr
    assert f"the local Ray cluster died ({program} (pid {victims[0]}) killed by signal 9)" in stderr
    assert "--resume" in stderr and "cells stored (" not in stdout  # no summary of a sweep that did not end
    record = json.loads((out / "sweep.json").read_text())
    run = record["runs"][-1]
    assert run["outcome"] == "cluster_lost" and program in run["cluster_lost"]
    assert "collector_restarts" not in run
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "cluster_lost" and program in events[-1]["cause"]
    rows = stored_so_far(out)
    assert len({r.cell_id for r in rows}) == len(rows) and record["counts"]["stored"] == len(rows)
    if program == "raylet":  # and the run resumes cleanly: every cell once
        kill_pids(processes_using(ray_tmp))
        proc = run_cli(
            "run", str(spec_path), "--out", str(out), "--resume", "--no-progress", env={"RAY_TMPDIR": ray_tmp}
        )
        assert proc.returncode == 0, proc.stdout + proc.stderr
        ids = [r.cell_id for r in stored_so_far(out)]
        assert Counter(ids) == Counter(c.cell_id for c in expand(spec))


def _remove(path: Path) -> None:
    path.unlink()


def _replace(path: Path) -> None:
    shutil.copy(path, path.with_name("copy"))
    os.replace(path.with_name("copy"), path)


@pytest.mark.parametrize("tamper", [_remove, _replace], ids=["removed", "replaced"])
def test_a_rows_file_removed_or_replaced_mid_run_stops_the_sweep_named(tmp_path, ray_tmp, tamper):
    spec_path, spec = short_spec(tmp_path)
    out = tmp_path / "out"
    driver = start_run(spec_path, out, ray_tmp)
    wait_for_rows(driver, out, 3)
    tamper(out / "rows.jsonl")
    stdout, stderr = finish(driver)
    said = stdout + stderr
    assert driver.returncode == 1, said
    assert "Traceback" not in said
    assert f"{out / 'rows.jsonl'} is no longer the file this sweep writes" in stderr
    total = len(expand(spec))
    assert (
        f"{total}/{total} cells stored" not in said and "cells stored (" not in said
    )  # never a false summary
    assert not (out / "result_matrix.json").exists() or json.loads((out / "result_matrix.json").read_text())


def test_resume_sets_aside_tampered_rows_repairs_events_and_remeasures(tmp_path, ray_tmp):
    spec_path, spec = short_spec(tmp_path, repeats=1, seconds=0.1)
    out = tmp_path / "out"
    first = run_cli("run", str(spec_path), "--out", str(out), "--no-progress", env={"RAY_TMPDIR": ray_tmp})
    assert first.returncode == 0, first.stdout + first.stderr
    rows = stored_so_far(out)
    a, b, c = rows[0], rows[1], rows[2]
    tampered = a.model_copy(update={"output_tokens_per_second": 1e9})
    lying = c.model_copy(update={"cell_id": b.cell_id})  # b's id, c's identity; b's own row is gone
    kept = [r for r in rows if r.cell_id not in (a.cell_id, b.cell_id)]
    with open(out / "rows.jsonl", "wb") as fh:
        for row in [tampered, a, lying, *kept]:
            fh.write(encode_row(row))
    with open(out / "events.jsonl", "a") as fh:
        fh.write('{"at": "2026-12-01T00:00:00.000Z", "event": "runner_di')  # torn by a crash
    proc = run_cli(
        "run", str(spec_path), "--out", str(out), "--resume", "--no-progress", env={"RAY_TMPDIR": ray_tmp}
    )
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said
    assert "set aside 3 stored rows that `pd-dflash report` would refuse" in said
    assert "duplicate identity" in said and "does not match cell" in said
    assert "repaired events.jsonl" in said and (out / "events.jsonl.torn").exists()
    final = current_rows(stored_so_far(out))
    by_id = {r.cell_id: r for r in final}
    assert len(final) == len(expand(spec)) == len(stored_so_far(out))
    assert by_id[a.cell_id].output_tokens_per_second != 1e9 and by_id[b.cell_id].identity == b.identity
    assert all(r.status == Status.OK for r in final)
    report = run_cli("report", str(out), "--out", str(tmp_path / "report"), "--spec", str(spec_path))
    assert report.returncode == 0, report.stdout + report.stderr  # the report accepts what resume kept


def test_a_hangup_under_nohup_is_ignored_and_the_sweep_finishes(tmp_path, ray_tmp):
    spec_path, spec = short_spec(tmp_path, repeats=1, seconds=0.3)
    out = tmp_path / "out"

    def as_nohup():
        signal.signal(signal.SIGHUP, signal.SIG_IGN)

    driver = start_run(spec_path, out, ray_tmp, preexec_fn=as_nohup)
    wait_for_rows(driver, out, 2)
    driver.send_signal(signal.SIGHUP)
    stdout, stderr = finish(driver)
    assert driver.returncode == 0, stdout + stderr
    assert json.loads((out / "sweep.json").read_text())["runs"][-1]["outcome"] == "finished"
    assert len(current_rows(stored_so_far(out))) == len(expand(spec))
