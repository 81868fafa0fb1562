"""Helpers shared by the orchestrator tests: specs with the test engines, row files, process cleanup."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from pd_dflash.rows import read_rows
from pd_dflash.schema import Row
from pd_dflash.spec import SweepSpec, parse_spec

REPO = Path(__file__).resolve().parents[2]
FIXED = "tests.sweep.engines:FixedDurationEngine"
FAULT = "tests.sweep.engines:FaultEngine"


def spec_data(engine: str = FIXED, **over: Any) -> dict[str, Any]:
    """A small sweep: 2 models x 3 baselines x 1 block size x 2 concurrency x 1 repeat = 12 cells."""
    data: dict[str, Any] = {
        "name": "test-sweep",
        "engine": engine,
        "models": [
            {"id": "m1", "engine_options": {"seconds": 0.2}},
            {"id": "m2", "engine_options": {"seconds": 0.2}},
        ],
        "baselines": ["B0", "B1", "OURS"],
        "block_sizes": [8],
        "concurrency": [1, 2],
        "repeats": 1,
        "workload": {"requests": 4},
        "hardware": {"accelerator_type": "RTX-PRO-6000", "cpus_per_runner": 0},
        "local": {"fake_gpus": 2, "num_cpus": 1, "object_store_mb": 100},
    }
    data.update(over)
    return data


def make_spec(**over: Any) -> SweepSpec:
    return parse_spec(spec_data(**over))


def write_spec(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def stored_rows(out: Path) -> list[Row]:
    rows, torn = read_rows(out / "rows.jsonl", tolerate_torn_tail=True)
    assert torn is None, f"torn tail in {out}/rows.jsonl: {torn}"
    return rows


def recorded(path: Path) -> list[str]:
    """Cell ids the test engines started, in order (one line per start)."""
    if not path.exists():
        return []
    return [line.split()[0] for line in path.read_text().splitlines() if line.strip()]


def run_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 240
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pd_dflash", *args],
        cwd=REPO,
        env={**os.environ, **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def processes_using(path: str) -> list[int]:
    """Pids whose command line, working directory or open files mention ``path`` (a Ray temp dir we own)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if path in (entry / "cmdline").read_bytes().decode(errors="replace"):
                found.append(int(entry.name))
                continue
            for fd in (entry / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd).startswith(path):
                        found.append(int(entry.name))
                        break
        except OSError:
            continue
    return found


def kill_pids(pids: list[int]) -> None:
    """SIGKILL the given pids (only ever processes this test started) and wait until they are gone."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        alive = []
        for pid in pids:
            try:
                state = (Path("/proc") / str(pid) / "stat").read_text().split()[2]
            except OSError:
                continue
            if state != "Z":
                alive.append(pid)
        if not alive:
            return
        time.sleep(0.1)
