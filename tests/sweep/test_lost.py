"""Losing the cluster (issue 22, defect 7), the parts that need no cluster: the watch over the local node's
vital processes (real processes here), and the driver recording the loss in OUT once the collector is gone."""

from __future__ import annotations

import json
import signal
import subprocess
from types import SimpleNamespace

import pytest

from pd_dflash.spec import expand
from pd_dflash.sweep import lost as lost_module
from pd_dflash.sweep.lost import LocalWatch, lost_outcome, record_loss
from pd_dflash.sweep.options import ClusterLost, RunOptions
from pd_dflash.sweep.resume import Mode
from pd_dflash.sweep.store import SweepStore
from tests.sweep.helpers import make_spec, ok_row


@pytest.fixture
def sleepers():
    procs = {kind: subprocess.Popen(["sleep", "60"]) for kind in ("gcs_server", "raylet", "log_monitor")}
    yield procs
    for proc in procs.values():
        proc.kill()
        proc.wait()


def node_of(procs):
    return SimpleNamespace(all_processes={k: [SimpleNamespace(process=p)] for k, p in procs.items()})


@pytest.mark.parametrize("kind", ["gcs_server", "raylet"])
def test_the_watch_names_the_vital_process_that_died_and_how(sleepers, kind):
    watch = LocalWatch(node_of(sleepers))
    assert watch.lost() is None
    sleepers["log_monitor"].kill()  # not vital: the cluster still works
    sleepers["log_monitor"].wait()
    assert watch.lost() is None
    sleepers[kind].send_signal(signal.SIGKILL)
    sleepers[kind].wait()
    assert watch.lost() == f"{kind} (pid {sleepers[kind].pid}) killed by signal 9"


def test_the_watch_reports_an_exit_status():
    proc = subprocess.Popen(["sh", "-c", "exit 3"])
    proc.wait()
    assert LocalWatch(node_of({"raylet": proc})).lost() == f"raylet (pid {proc.pid}) exited with status 3"


def stored_sweep(tmp_path, spec, n=3):
    store = SweepStore(tmp_path, spec, Mode.RESUME)
    store.open(run_info={"note": "the run that lost its cluster"})
    for cell in expand(spec)[:n]:
        store.add(ok_row(cell))
    return store


def test_the_driver_records_the_loss_once_the_collector_s_lock_is_free(tmp_path, capsys):
    spec = make_spec()
    stored_sweep(tmp_path, spec).close()  # the collector is gone: its lock is released
    lost = ClusterLost("raylet (pid 42) killed by signal 9", cells_run=3, wall_s=1.5)
    outcome = lost_outcome(spec, RunOptions(out_dir=str(tmp_path)), lost, local=True)
    said = capsys.readouterr().err
    assert outcome.exit_code == 1 and outcome.outcome == "cluster_lost"
    assert "the local Ray cluster died (raylet (pid 42) killed by signal 9)" in said
    assert "3/12 cells are stored" in said and "--resume" in said and "not recorded" not in said
    record = json.loads((tmp_path / "sweep.json").read_text())
    run = record["runs"][-1]
    assert len(record["runs"]) == 1 and run["note"] == "the run that lost its cluster"
    assert run["outcome"] == "cluster_lost" and run["cluster_lost"] == lost.cause and run["cells_run"] == 3
    assert "collector_restarts" not in run and record["counts"]["stored"] == 3
    events = [json.loads(x) for x in (tmp_path / "events.jsonl").read_text().splitlines()]
    assert events[-1]["event"] == "cluster_lost" and events[-1]["cause"] == lost.cause
    assert (tmp_path / "result_matrix.json").exists()


def test_a_lock_still_held_is_waited_for_then_said(tmp_path, monkeypatch):
    spec = make_spec()
    holder = stored_sweep(tmp_path, spec)  # a collector process that has not died yet
    monkeypatch.setattr(lost_module, "LOCK_WAIT_S", 0.5)
    why, counts = record_loss(spec, RunOptions(out_dir=str(tmp_path)), ClusterLost("gcs_server died"))
    holder.close()
    assert "lock" in why and "not released within 0.5 s" in why and counts == {}
    assert json.loads((tmp_path / "sweep.json").read_text())["runs"][-1].get("outcome") is None


def test_a_lost_cluster_run_says_so_without_recording(tmp_path, capsys):
    outcome = lost_outcome(make_spec(), RunOptions(out_dir=str(tmp_path)), ClusterLost("x"), local=False)
    said = capsys.readouterr().err
    assert outcome.exit_code == 1 and "the connection to the Ray cluster was lost (x)" in said
    assert "not recorded in sweep.json: its results directory is on the head box" in said
    assert not (tmp_path / "sweep.json").exists()
