"""Helpers shared by the orchestrator tests: specs with the test engines, rows and row files, process cleanup."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

from pd_dflash.rows import read_rows
from pd_dflash.schema import Row, Status
from pd_dflash.spec import Cell, SweepSpec, parse_spec
from tests.sweep.engines import synthetic_result

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


def ok_row(cell: Cell, attempt: int = 1, seconds: float = 0.1) -> Row:
    """The OK row of ``cell`` the store tests add: a synthetic result of 4 requests in ``seconds``."""
    return Row.from_result(cell, synthetic_result(cell, 4, seconds), attempt=attempt, sweep="t")


def failed_row(cell: Cell, status: Status = Status.ERROR, attempt: int = 1, **over: Any) -> Row:
    """A row of ``cell`` without metrics (reason "boom"); ``over`` sets bookkeeping fields (runner, times)."""
    return Row.without_metrics(cell, status, "boom", attempt=attempt, sweep="t", **over)


def write_spec(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def stored_rows(out: Path) -> list[Row]:
    rows, torn = read_rows(out / "rows.jsonl", tolerate_torn_tail=True)
    assert torn is None, f"torn tail in {out}/rows.jsonl: {torn}"
    return rows


def stored_so_far(out: Path) -> list[Row]:
    """The rows stored until now (a sweep may still be writing, or not have created the file yet)."""
    path = out / "rows.jsonl"
    if not path.exists():
        return []
    rows, _ = read_rows(path, tolerate_torn_tail=True)
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


def start_run(spec_path: Path, out: Path, ray_tmp: str, **popen: Any) -> subprocess.Popen:
    """``pd-dflash run`` as a driver process of its own (local mode, its Ray cluster under ``ray_tmp``), left
    running; ``popen`` replaces the Popen arguments (output piped as text unless told otherwise)."""
    cmd = [sys.executable, "-m", "pd_dflash", "run", str(spec_path), "--out", str(out), "--no-progress"]
    options: dict[str, Any] = {
        "cwd": REPO,
        "env": {**os.environ, "RAY_TMPDIR": ray_tmp},
        "stdout": subprocess.PIPE,
        "stderr": subprocess.PIPE,
        "text": True,
    }
    return subprocess.Popen(cmd, **{**options, **popen})


def wait_for_rows(driver: subprocess.Popen, out: Path, n: int, timeout: float = 120.0) -> None:
    """Until ``n`` rows are stored while the driver still runs (or fail the test when that takes too long)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and len(stored_so_far(out)) < n and driver.poll() is None:
        time.sleep(0.05)
    assert driver.poll() is None and len(stored_so_far(out)) >= n, "the sweep did not get going in time"


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


def listening_sockets(pids: list[int]) -> list[tuple[str, int, int]]:
    """(address, port, pid) of every TCP socket in LISTEN state held by the given processes (from /proc)."""
    by_inode: dict[str, tuple[str, int]] = {}
    for family, table in ((socket.AF_INET, "/proc/net/tcp"), (socket.AF_INET6, "/proc/net/tcp6")):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A":  # TCP_LISTEN
                continue
            hex_ip, hex_port = fields[1].split(":")
            raw = bytes.fromhex(hex_ip)
            # /proc prints each 32-bit word of the address in host (little-endian) order
            raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
            by_inode[fields[9]] = (socket.inet_ntop(family, raw), int(hex_port, 16))
    found = []
    for pid in pids:
        with contextlib.suppress(OSError):
            for fd in (Path("/proc") / str(pid) / "fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("socket:[") and target[8:-1] in by_inode:
                        found.append((*by_inode[target[8:-1]], pid))
    return found


def is_loopback(address: str) -> bool:
    return ipaddress.ip_address(address.removeprefix("::ffff:")).is_loopback


@contextlib.contextmanager
def small_filesystem(path: Path, size: str):
    """A tmpfs of ``size`` mounted at ``path`` (needs root or CAP_SYS_ADMIN: skips the test otherwise)."""
    import pytest

    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=0755", "tmpfs", str(path)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def resize_filesystem(path: Path, size: str) -> None:
    subprocess.run(["mount", "-o", f"remount,size={size}", str(path)], check=True, capture_output=True)
