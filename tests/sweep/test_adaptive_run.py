"""Adaptive repeats end to end in local mode: groups stop when decided, undecided ones run to max, and a sweep
stopped by SIGTERM in the middle of a wave resumes to the same decisions without measuring a cell twice."""

from __future__ import annotations

import json
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

from pd_dflash.spec import cell_count, parse_spec
from tests.sweep.helpers import (
    recorded,
    run_cli,
    spec_data,
    start_run,
    stored_rows,
    stored_so_far,
    write_spec,
)

pytestmark = pytest.mark.ray

CLEAR = [0.95, 0.96, 0.94, 0.95, 0.95]
AT_THRESHOLD = [0.7, 0.9, 0.75, 0.85, 0.8]


def adaptive_data(record: Path, seconds: float = 0.2) -> dict:
    return spec_data(
        engine="tests.sweep.gate_engine:GateEngine",
        models=[
            {"id": "m1", "engine_options": {"seconds": seconds, "coverage": {"1": CLEAR, "4": AT_THRESHOLD}}}
        ],
        baselines=["B0", "B1", "B3", "OURS"],
        concurrency=[1, 4],
        repeats={"min": 3, "max": 5},
        env={"PD_DFLASH_TEST_RECORD": str(record)},
    )


def check_consistent(out: Path) -> dict:
    """The done-when of issue 30 on a finished sweep directory; returns the verdict."""
    verdict = json.loads((out / "verdict.json").read_text())
    rows = stored_rows(out)
    ids = [r.cell_id for r in rows]
    assert len(ids) == len(set(ids)), f"duplicated cell ids: {[i for i, n in Counter(ids).items() if n > 1]}"
    for key, group in verdict["groups"].items():
        a = group["adaptive"]
        assert a["stop"] in ("decided", "max reached", "cell failures"), key
        statuses = {g["status"] for g in group["confidence"].values()}
        if a["repeats"] < 5:
            assert a["stop"] == "decided" and "INCONCLUSIVE" not in statuses, key
        if "INCONCLUSIVE" in statuses:
            assert a["repeats"] == 5 and a["stop"] == "max reached", key
    return verdict


def test_an_adaptive_local_run_stops_decided_groups_and_runs_open_ones_to_max(tmp_path, ray_tmp):
    data = adaptive_data(tmp_path / "ran.txt")
    out = tmp_path / "out"
    done = run_cli(
        "run",
        str(write_spec(tmp_path / "spec.yaml", data)),
        "--out",
        str(out),
        "--no-progress",
        env={"RAY_TMPDIR": ray_tmp},
    )
    assert done.returncode == 0, done.stdout + done.stderr
    verdict = check_consistent(out)
    groups = verdict["groups"]
    assert groups["m1|B8|c1"]["adaptive"]["repeats"] == 3 and groups["m1|B8|c4"]["adaptive"]["repeats"] == 5
    spec = parse_spec(data)
    rows = stored_rows(out)
    assert len(rows) == verdict["adaptive"]["cells_run"] == cell_count(spec, 3) + 4 * 2 < cell_count(spec)
    assert {r.concurrency for r in rows if r.repeat >= 3} == {4}
    assert sorted(recorded(tmp_path / "ran.txt")) == sorted(r.cell_id for r in rows)  # each measured once
    assert (
        "adaptive repeats (3-5): 2 groups, 1 decided, 1 max reached; 32 cells asked for of 40" in done.stdout
    )
    # `pd-dflash report OUT` without --spec reads the design from OUT/sweep.json: the run's own decisions
    again = run_cli("report", str(out), "--out", str(tmp_path / "again"))
    assert "adaptive repeats design read from" in again.stderr, again.stderr
    reported = json.loads((tmp_path / "again" / "verdict.json").read_text())
    assert reported["confidence"] == verdict["confidence"] and reported["adaptive"] == verdict["adaptive"]


def test_sigterm_in_a_wave_then_resume_measures_no_cell_twice_and_reaches_the_same_decisions(
    tmp_path, ray_tmp
):
    record = tmp_path / "ran.txt"
    # Cells of 1.5 s: a wave outlasts the stop (the driver looks at a signal once per pass of its loop).
    spec_path = write_spec(tmp_path / "spec.yaml", adaptive_data(record, seconds=1.5))
    out = tmp_path / "out"
    driver = start_run(spec_path, out, ray_tmp, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and driver.poll() is None:  # until the first added repeat lands
            if any(r.repeat >= 3 for r in stored_so_far(out)):
                break
            time.sleep(0.05)
        assert driver.poll() is None, "the sweep ended before its first added repeat could be interrupted"
        driver.send_signal(signal.SIGTERM)
        assert driver.wait(timeout=120) == 128 + signal.SIGTERM
    finally:
        if driver.poll() is None:
            driver.kill()
    before = stored_rows(out)
    assert len(before) < 32, "nothing was left to resume"
    resumed = run_cli(
        "run", str(spec_path), "--out", str(out), "--resume", "--no-progress", env={"RAY_TMPDIR": ray_tmp}
    )
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    verdict = check_consistent(out)
    assert [r.cell_id for r in stored_rows(out)][: len(before)] == [r.cell_id for r in before]
    ran = recorded(record)
    stored = {r.cell_id for r in stored_rows(out)}
    # A cell started before SIGTERM may run again (its row was never stored); a stored one never does.
    again = [c for c, n in Counter(ran).items() if n > 1]
    assert not set(again) & {r.cell_id for r in before}
    assert set(ran) == stored
    assert {k: (g["adaptive"]["repeats"], g["adaptive"]["stop"]) for k, g in verdict["groups"].items()} == {
        "m1|B8|c1": (3, "decided"),
        "m1|B8|c4": (5, "max reached"),
    }
