"""`ray start --head` in a private temp dir, then `ray job submit` of jobs/phase_a.py: the documented cluster
path, end to end on this machine. The head is stopped by the pids of its temp dir (never a global `ray stop`).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from pd_dflash.schema import Status
from pd_dflash.spec import expand, parse_spec
from tests.sweep.helpers import REPO, kill_pids, processes_using, spec_data, stored_rows, write_spec

pytestmark = [pytest.mark.ray, pytest.mark.slow]

BIN = Path(sys.executable).parent


def free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


@pytest.fixture
def head():
    temp = tempfile.mkdtemp(prefix="pdj", dir="/tmp")
    gcs, dash, client, agent_http, agent_grpc, metrics, runtime_env, node_mgr, obj_mgr = free_ports(9)
    env = {**os.environ, "PATH": f"{BIN}:{os.environ['PATH']}", "RAY_AUTH_MODE": "disabled"}
    cmd = [
        str(BIN / "ray"),
        "start",
        "--head",
        f"--temp-dir={temp}",
        "--node-ip-address=127.0.0.1",
        f"--port={gcs}",
        "--include-dashboard=true",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-port={dash}",
        f"--ray-client-server-port={client}",
        f"--dashboard-agent-listen-port={agent_http}",
        f"--dashboard-agent-grpc-port={agent_grpc}",
        f"--metrics-export-port={metrics}",
        f"--runtime-env-agent-port={runtime_env}",
        f"--node-manager-port={node_mgr}",
        f"--object-manager-port={obj_mgr}",
        "--num-cpus=2",
        "--num-gpus=2",
        "--object-store-memory=104857600",
        '--resources={"accelerator_type:RTX-PRO-6000": 1}',
        "--disable-usage-stats",
    ]
    try:
        started = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=120)
        assert started.returncode == 0, started.stdout + started.stderr
        yield f"http://127.0.0.1:{dash}", env
    finally:
        kill_pids(processes_using(temp))
        shutil.rmtree(temp, ignore_errors=True)


def test_ray_job_submit_runs_the_sweep_and_writes_its_matrix(head, tmp_path):
    address, env = head
    data = spec_data(name="job-sweep", hardware={"accelerator_type": "RTX-PRO-6000", "cpus_per_runner": 0.5})
    spec_path = write_spec(tmp_path / "spec.yaml", data)
    out = tmp_path / "results"
    submission = f"pd-dflash-test-{os.getpid()}-{int(time.time())}"
    proc = subprocess.run(
        [
            str(BIN / "ray"),
            "job",
            "submit",
            "--address",
            address,
            "--working-dir",
            str(REPO),
            "--submission-id",
            submission,
            "--",
            "python",
            "jobs/phase_a.py",
            "--spec",
            str(spec_path),
            "--out",
            str(out),
            "--insecure",  # the test head runs with RAY_AUTH_MODE=disabled
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    logs = proc.stdout + proc.stderr
    assert proc.returncode == 0, logs
    assert "succeeded" in logs.lower(), logs
    from ray.job_submission import JobStatus, JobSubmissionClient

    assert JobSubmissionClient(address).get_job_status(submission) == JobStatus.SUCCEEDED
    spec = parse_spec(data)
    rows = stored_rows(out)
    assert sorted(r.cell_id for r in rows) == sorted(c.cell_id for c in expand(spec))
    assert all(r.status == Status.OK for r in rows)
    assert (out / "result_matrix.json").exists() and (out / "result_matrix.md").exists()
    record = json.loads((out / "sweep.json").read_text())
    assert record["cluster"]["runners"] == 2 and "jobs/phase_a.py" in " ".join(
        record["runs"][-1]["driver"]["argv"]
    )
    # Progress reached the job's logs as plain lines.
    assert "preflight ok" in logs and "12/12 cells stored" in logs
