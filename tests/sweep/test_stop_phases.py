"""A signal stops the sweep the same way wherever it lands (issue 29 item 4). The handler only records the stop
(``sweep/stops.py``): one that raised made the outcome depend on where the signal landed — inside ``ray.wait``
(pool.py) or ``ray.get`` (sink.py) Ray returned with the exception set, a ``SystemError``, exit 1 and a
sweep.json saying "finished". Each phase is hit on purpose here:

- preflight: the engine's import on the box signals while the driver waits for that task (nothing is written);
- opening OUT, the loop (the engine signals while the driver is blocked in ``ray.wait`` for its cell),
  collecting the last rows, and the final matrices (while the driver waits for the collector writing them, once
  a blocking ``ray.get``): exit 128 + the signal, sweep.json's outcome "stopped" with the signal, an event
  "stopped", and the matrices complete (every file of the set, agreeing with the rows) — never half a set.

One Ray cluster serves every case (a cluster run, ``insecure``), so each sweep costs seconds, not a cluster start.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from pd_dflash.sweep import sink as sink_module  # noqa: E402
from pd_dflash.sweep.cluster import run_sweep  # noqa: E402
from pd_dflash.sweep.options import RunOptions  # noqa: E402
from pd_dflash.sweep.resume import current_rows  # noqa: E402
from tests.sweep.helpers import REPO, make_spec, stored_so_far  # noqa: E402
from tests.sweep.signal_engine import ENTRY_POINT as SIGNAL_ENGINE  # noqa: E402
from tests.sweep.signal_on_import import ENTRY_POINT as SIGNAL_ON_IMPORT  # noqa: E402
from tests.sweep.signal_on_import import ENV as ON_IMPORT_ENV  # noqa: E402

pytestmark = pytest.mark.ray

MATRIX_SET = ("result_matrix.json", "result_matrix.csv", "result_matrix.md", "verdict.json")
CELLS = 3 * 2 * 2  # baselines x concurrency x repeats, one model


@pytest.fixture(scope="module")
def cluster():
    """A single-node Ray cluster in this process: one GPU of the spec's accelerator type."""
    here = os.getcwd()
    os.chdir(REPO)  # the workers import the test engines from the working directory
    if ray.is_initialized():
        ray.shutdown()
    ray.init(
        num_cpus=2,
        num_gpus=1,
        resources={"accelerator_type:RTX-PRO-6000": 1},
        object_store_memory=100 * 2**20,
        include_dashboard=False,
        log_to_driver=False,
    )
    try:
        yield
    finally:
        ray.shutdown()
        os.chdir(here)


def sweep(
    tmp_path: Path, engine: str = SIGNAL_ENGINE, env: dict | None = None, plots: bool = True, **engine_options
):
    spec = make_spec(
        engine=engine,
        models=[{"id": "m1", "engine_options": {"seconds": 0.1, **engine_options}}],
        repeats=2,
        env=env or {},
    )
    out = tmp_path / "out"
    # poll_s long: while a cell runs the driver sits in one ray.wait (the loop's pass ends only on an event)
    opts = RunOptions(out_dir=str(out), progress=False, poll_s=5.0, plots=plots, insecure=True)
    return run_sweep(spec, opts), out


def assert_stopped(outcome, out: Path, sig: signal.Signals) -> list:
    """What a stop leaves, whatever the phase: the exit code, the outcome recorded, the matrices complete."""
    assert outcome.exit_code == 128 + sig and outcome.outcome == "stopped" and outcome.stopped == sig.name
    record = json.loads((out / "sweep.json").read_text())
    run = record["runs"][-1]
    assert run["outcome"] == "stopped" and run["signal"] == sig.name, run
    rows = current_rows(stored_so_far(out))
    assert record["counts"]["stored"] == len(rows) and run["cells_run"] + run["cells_not_run"] == CELLS
    events = [json.loads(line) for line in (out / "events.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events if e["event"] == "stopped"] == ["stopped"]
    present = [name for name in MATRIX_SET if (out / name).exists()]
    assert present in ([], list(MATRIX_SET)), present  # a set, or nothing
    if present:
        matrix = json.loads((out / "result_matrix.json").read_text())
        assert {f"{r.model}|B{r.block_size}|c{r.concurrency}" for r in rows} <= set(matrix)
        json.loads((out / "verdict.json").read_text())
    assert not list(out.glob(".matrices.tmp-*"))  # no staging directory left
    return rows


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP], ids=lambda s: s.name)
def test_a_signal_while_the_driver_is_blocked_in_ray_wait_stops_the_sweep(
    tmp_path, cluster, sig, hangup_default
):
    outcome, out = sweep(
        tmp_path, signal_pid=os.getpid(), signal_name=sig.name, marker=str(tmp_path / "signalled")
    )
    assert (tmp_path / "signalled").exists()  # the cell did signal, while the driver waited for it
    rows = assert_stopped(outcome, out, sig)
    assert 0 < len(rows) < CELLS
    assert all((out / name).exists() for name in MATRIX_SET)


def test_a_signal_during_preflight_stops_before_anything_is_written(tmp_path, cluster):
    marker = tmp_path / "signalled"
    outcome, out = sweep(tmp_path, engine=SIGNAL_ON_IMPORT, env={ON_IMPORT_ENV: f"{os.getpid()}:{marker}"})
    assert marker.exists()
    assert outcome.exit_code == 143 and outcome.outcome == "stopped" and outcome.stopped == "SIGTERM"
    assert not (out / "rows.jsonl").exists() and not (out / "sweep.json").exists()


def signal_before(monkeypatch, method: str) -> None:
    """``Sink.<method>`` sends this process SIGTERM as it starts, then does its work: the signal lands in it."""
    original = getattr(sink_module.Sink, method)

    def signalled(self, *args, **kwargs):
        os.kill(os.getpid(), signal.SIGTERM)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(sink_module.Sink, method, signalled)


def test_a_signal_while_out_is_opened_records_a_stopped_run_with_nothing_run(tmp_path, cluster, monkeypatch):
    signal_before(monkeypatch, "open")
    outcome, out = sweep(tmp_path)
    rows = assert_stopped(outcome, out, signal.SIGTERM)
    assert rows == [] and outcome.cells_run == 0


def test_a_signal_while_the_last_rows_are_collected_records_them_and_stops(tmp_path, cluster, monkeypatch):
    signal_before(monkeypatch, "drain")
    outcome, out = sweep(tmp_path)
    rows = assert_stopped(outcome, out, signal.SIGTERM)
    assert len(rows) == CELLS  # every cell was measured; the stop came after: recorded as a stop all the same
    assert not (out / "plots").exists()  # a stop writes no plots


def test_a_signal_while_the_final_matrices_are_written_lets_them_complete(tmp_path, cluster, monkeypatch):
    """The signal is sent once the collector's staging directory exists (the driver waits for the collector:
    it cannot have returned), or, should the set be written before the watcher sees it, as the wait returns."""
    original = sink_module.Sink.final_matrices
    landed = []

    def watched(self, plots):
        out = Path(self.out_dir)
        done = threading.Event()

        def watch():
            while not done.is_set():
                if list(out.glob(".matrices.tmp-*")):
                    landed.append("while writing")
                    os.kill(os.getpid(), signal.SIGTERM)
                    return
                time.sleep(0.001)

        watcher = threading.Thread(target=watch, daemon=True)
        watcher.start()
        try:
            return original(self, plots)
        finally:
            done.set()
            watcher.join()
            if not landed:
                landed.append("as the wait returned")
                os.kill(os.getpid(), signal.SIGTERM)

    monkeypatch.setattr(sink_module.Sink, "final_matrices", watched)
    outcome, out = sweep(tmp_path)
    rows = assert_stopped(outcome, out, signal.SIGTERM)
    assert len(rows) == CELLS and landed
    assert all((out / name).exists() for name in MATRIX_SET)
    assert list((out / "plots").glob("*.png"))  # the set being written when the signal came is completed
