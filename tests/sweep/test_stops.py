"""Local mode (`pd-dflash run` starts its own single-node Ray cluster) stopped by SIGINT or SIGTERM mid-sweep:
the runners stop, sweep.json records the stored count and the outcome `stopped`, the matrices are written
from the rows stored so far, the exit status is 130 / 143, and nothing prints a stack dump. While it runs, every
Ray process of the local cluster listens on the loopback interface only. SIGHUP (an ssh session that drops) stops
it exactly as SIGTERM does (exit 129)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pd_dflash.sweep.resume import current_rows
from tests.sweep.helpers import (
    REPO,
    is_loopback,
    listening_sockets,
    processes_using,
    spec_data,
    stored_so_far,
    wait_for_rows,
    write_spec,
)

pytestmark = pytest.mark.ray

#: The driver's command line with the stop signals' dispositions set as the test relies on: a suite started under
#: ``nohup`` (SIGHUP ignored) or as a background job of a script (SIGINT ignored) passes them on to every child,
#: and a driver that inherits SIG_IGN for SIGHUP keeps ignoring it by design (it asked to outlive the terminal).
DEFAULT_DISPOSITIONS = (
    "import signal, sys; "
    "signal.signal(signal.SIGHUP, signal.SIG_DFL); signal.signal(signal.SIGTERM, signal.SIG_DFL); "
    "signal.signal(signal.SIGINT, signal.default_int_handler); "
    "from pd_dflash.cli import main; sys.exit(main(sys.argv[1:]))"
)


def start_with_default_dispositions(spec_path: Path, out: Path, ray_tmp: str) -> subprocess.Popen:
    """``pd-dflash run`` as ``start_run`` starts it, with SIGHUP, SIGTERM and SIGINT at their defaults whatever
    this process inherited."""
    cmd = [
        sys.executable,
        "-c",
        DEFAULT_DISPOSITIONS,
        "run",
        str(spec_path),
        "--out",
        str(out),
        "--no-progress",
    ]
    env = {**os.environ, "RAY_TMPDIR": ray_tmp}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize(
    ("sig", "code"),
    [(signal.SIGINT, 130), (signal.SIGTERM, 143), (signal.SIGHUP, 129)],
    ids=["SIGINT", "SIGTERM", "SIGHUP"],
)
def test_a_signal_stops_the_sweep_cleanly_and_records_what_is_stored(tmp_path, ray_tmp, sig, code):
    data = spec_data(
        models=[
            {"id": "m1", "engine_options": {"seconds": 0.5}},
            {"id": "m2", "engine_options": {"seconds": 0.5}},
        ],
        repeats=3,
    )
    spec_path = write_spec(tmp_path / "spec.yaml", data)
    out = tmp_path / "out"
    driver = start_with_default_dispositions(spec_path, out, ray_tmp)
    try:
        wait_for_rows(driver, out, 4)
        ray_pids = processes_using(ray_tmp)
        sockets = listening_sockets([driver.pid, *ray_pids])
        assert len(ray_pids) >= 3 and sockets, (ray_pids, sockets)  # GCS, raylet, workers... all seen
        exposed = [s for s in sockets if not is_loopback(s[0])]
        assert not exposed, f"Ray listens beyond loopback in local mode: {exposed}"
        driver.send_signal(sig)
        stdout, stderr = driver.communicate(timeout=90)
    finally:
        if driver.poll() is None:
            driver.kill()
    assert driver.returncode == code, stdout + stderr
    assert "Traceback" not in stdout + stderr, stdout + stderr
    assert f"stopped by {sig.name}" in stderr
    # The runners and the rest of the local cluster are gone with the driver.
    time.sleep(0.5)
    assert not [p for p in processes_using(ray_tmp) if Path(f"/proc/{p}").exists()]

    rows = current_rows(stored_so_far(out))
    total = 2 * 3 * 2 * 3
    assert 4 <= len(rows) < total
    record = json.loads((out / "sweep.json").read_text())
    run = record["runs"][-1]
    assert run["outcome"] == "stopped" and run["signal"] == sig.name
    assert record["counts"]["stored"] == len(rows) and record["counts"]["total"] == total
    assert run["cells_not_run"] == total - run["cells_run"] > 0
    matrix = json.loads((out / "result_matrix.json").read_text())
    assert {f"{r.model}|B{r.block_size}|c{r.concurrency}" for r in rows} <= set(matrix)
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events] == ["stopped"] and events[0]["signal"] == sig.name
