"""Local mode end to end (`python -m pd_dflash run` starts its own single-node Ray cluster with fake GPUs), with
the driver killed by SIGKILL mid-sweep and then resumed: every cell stored exactly once, only the cells that were
not stored are measured again (the engine records every cell it starts), and the resumed run leaves a complete
matrix of valid rows."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

from pd_dflash.rows import read_rows
from pd_dflash.schema import Status, parse_row
from pd_dflash.spec import expand, parse_spec
from tests.row_checks import assert_matrix_matches_rows
from tests.sweep.helpers import (
    kill_pids,
    processes_using,
    recorded,
    run_cli,
    spec_data,
    start_run,
    write_spec,
)

pytestmark = pytest.mark.ray


def stored_ids(out: Path) -> list[str]:
    path = out / "rows.jsonl"
    if not path.exists():
        return []
    rows, _ = read_rows(path, tolerate_torn_tail=True)
    return [r.cell_id for r in rows]


def test_local_run_killed_then_resumed_stores_every_cell_once_and_recomputes_only_unstored(tmp_path, ray_tmp):
    record = tmp_path / "ran.txt"
    data = spec_data(
        models=[
            {"id": "m1", "engine_options": {"seconds": 0.5}},
            {"id": "m2", "engine_options": {"seconds": 0.5}},
        ],
        repeats=2,
        env={"PD_DFLASH_TEST_RECORD": str(record)},
    )
    spec_path = write_spec(tmp_path / "spec.yaml", data)
    all_ids = {c.cell_id for c in expand(parse_spec(data))}
    out = tmp_path / "out"
    driver = start_run(spec_path, out, ray_tmp, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(stored_ids(out)) < 6 and driver.poll() is None:
            time.sleep(0.05)
        assert driver.poll() is None, "the sweep finished before it could be killed"
        assert len(stored_ids(out)) >= 6, "no rows stored in time"
        os.kill(driver.pid, signal.SIGKILL)
        driver.wait(timeout=10)
    finally:
        if driver.poll() is None:
            driver.kill()
    # The killed driver's cluster (raylet, workers, agents) must not outlive it: stop it by its temp dir.
    kill_pids(processes_using(ray_tmp))
    assert not processes_using(ray_tmp)

    stored_before = stored_ids(out)
    assert len(stored_before) == len(set(stored_before)) and set(stored_before) < all_ids
    ran_before = len(recorded(record))

    proc = run_cli(
        "run", str(spec_path), "--out", str(out), "--resume", "--no-progress", env={"RAY_TMPDIR": ray_tmp}
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr

    rows, torn = read_rows(out / "rows.jsonl", tolerate_torn_tail=True)
    assert torn is None
    ids = [r.cell_id for r in rows]
    assert Counter(ids) == Counter(all_ids)  # every cell exactly once
    assert all(r.status == Status.OK for r in rows)
    assert ids[: len(stored_before)] == stored_before  # nothing stored was rewritten
    rerun = recorded(record)[ran_before:]
    assert len(rerun) == len(set(rerun))
    assert set(rerun) == all_ids - set(stored_before)  # only the cells that were not stored
    assert f"{len(stored_before)} already stored" in proc.stdout

    # The resumed run's outputs: valid rows with their runner and environment, the record, the matrices.
    spec = parse_spec(data)
    for i, row in enumerate(rows):
        parse_row(row.to_json_dict(), where=f"row {i}")
        assert row.sweep == spec.name and row.attempt == 1 and row.engine["synthetic"] is True
        assert row.runner["gpu_ids"] in (["0"], ["1"]) and row.runner["device"] == "cpu"
        assert "device not validated" in row.runner["device_note"]
        assert row.environment["packages"]["ray"] and row.environment["spec_env"]
    record = json.loads((out / "sweep.json").read_text())
    assert record["fingerprint"] == spec.fingerprint() and len(record["runs"]) == 2
    assert record["runs"][-1]["mode"] == "resume" and record["runs"][-1]["cells_run"] == len(rerun)
    cluster = record["cluster"]
    assert (
        cluster["GPU"] == 2 and cluster["accelerator_types"] == ["RTX-PRO-6000"] and cluster["runners"] == 2
    )
    assert record["counts"]["OK"] == len(all_ids) == record["counts"]["total"]
    # The matrices hold exactly the stored rows: every value is the mean of the rows placed in its group.
    matrix = assert_matrix_matches_rows(out, rows)
    assert len(matrix) == 4 and all(sorted(g) == ["B0", "B1", "OURS"] for g in matrix.values())
    assert all(g[b]["n_repeats"] == 2 for g in matrix.values() for b in g)
    assert (out / "result_matrix.md").exists()
    assert (
        "preflight ok: 2 runners fit" in proc.stdout
        and f"{len(all_ids)}/{len(all_ids)} cells stored" in proc.stdout
    )
