"""Losing the Ray cluster mid-sweep: noticing it, and recording it in OUT from the driver.

When the local node's raylet or GCS dies (killed, OOM), every actor dies with it — the collector too — and Ray
answers the driver's next call with "The actor is dead because its owner has died" (or, for the GCS, ends the
process a minute later). In local mode the driver started those processes itself, so it watches them
(``LocalWatch``): the loop checks them on every pass and stops with ``ClusterLost``. Then, with the cluster's
processes gone and the collector's lock on OUT free, the driver opens OUT itself and records the loss in
sweep.json (``outcome: cluster_lost``) and events.jsonl, writes the matrices from the stored rows, and says to
rerun with ``--resume``. A cluster run cannot do that (OUT is on the head box): it says the cluster was lost.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path
from typing import Any

from pd_dflash.spec import SweepSpec
from pd_dflash.sweep.options import ClusterLost, Outcome, RunOptions
from pd_dflash.sweep.resume import Mode
from pd_dflash.sweep.store import LOCK_FILE, SweepStore, utc_now

#: The local node's processes whose death ends the cluster (Ray's process type names).
VITAL = ("gcs_server", "raylet")
#: How long the driver waits for the dead collector's lock on OUT to be released.
LOCK_WAIT_S = 15.0


class LocalWatch:
    """The vital processes of the local cluster this driver started (``ray._private.node.Node``)."""

    def __init__(self, node: Any) -> None:
        self.node = node

    def lost(self) -> str | None:
        """What died (``raylet (pid 123) killed by signal 9``), or None while every vital process runs."""
        processes = getattr(self.node, "all_processes", {}) or {}
        for kind in VITAL:
            for info in processes.get(kind, []):
                code = info.process.poll()
                if code is not None:
                    how = f"killed by signal {-code}" if code < 0 else f"exited with status {code}"
                    return f"{kind} (pid {info.process.pid}) {how}"
        return None

    def stop(self) -> None:
        """Kill what is left of the local cluster (its other processes, then its workers with the raylet)."""
        with contextlib.suppress(Exception):
            self.node.kill_all_processes(check_alive=False, allow_graceful=False, wait=True)


def record_loss(spec: SweepSpec, options: RunOptions, lost: ClusterLost) -> tuple[str | None, dict[str, int]]:
    """Record the lost cluster in OUT (events.jsonl, the run's outcome in sweep.json) and rewrite the matrices
    from the stored rows; returns why that could not be done (else None) and the stored counts."""
    if not _wait_for_lock(Path(options.out_dir) / LOCK_FILE, LOCK_WAIT_S):
        return f"the collector's lock on {options.out_dir} was not released within {LOCK_WAIT_S:g} s", {}
    store = SweepStore(options.out_dir, spec, Mode.RESUME)
    try:
        store.open(new_run=False, count_restart=False)
        store.add_event({"event": "cluster_lost", "cause": lost.cause})
        store.update_run(
            {
                "finished_at": utc_now(),
                "outcome": "cluster_lost",
                "cluster_lost": lost.cause,
                "wall_seconds": round(lost.wall_s, 3),
                "cells_run": lost.cells_run,
            }
        )
        with contextlib.suppress(Exception):  # the matrices are a convenience; the rows are what counts
            store.write_matrices(plots=False)
        return None, store.counts()
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}", store.counts()
    finally:
        store.close()


def _wait_for_lock(path: Path, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)  # a link: ELOOP, then store.open refuses it
        except (
            OSError
        ):  # none, or not a lock anyone holds (a link, a directory): store.open names what is wrong
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            fcntl.flock(fd, fcntl.LOCK_UN)
            return True
        except OSError:
            if time.monotonic() > deadline:
                return False
        finally:
            os.close(fd)
        time.sleep(0.2)


def lost_outcome(spec: SweepSpec, options: RunOptions, lost: ClusterLost, *, local: bool) -> Outcome:
    """Say what happened (no traceback), record it where OUT is reachable, and return exit status 1."""
    import sys

    where = "the local Ray cluster died" if local else "the connection to the Ray cluster was lost"
    not_recorded, counts = (
        record_loss(spec, options, lost) if local else ("its results directory is on the head box", {})
    )
    stored = (
        f"{counts['stored']}/{counts['total']} cells are stored" if counts else "the stored rows are kept"
    )
    print(
        f"pd-dflash run: error: {where} ({lost.cause}) after {lost.cells_run} results of this run; {stored} "
        f"in {options.out_dir}. Rerun the same command with --resume to measure the rest"
        + (f" (the loss is not recorded in sweep.json: {not_recorded})" if not_recorded else ""),
        file=sys.stderr,
    )
    return Outcome(
        exit_code=1,
        out_dir=options.out_dir,
        counts=counts,
        cells_run=lost.cells_run,
        unrun=0,
        loads=0,
        wall_s=lost.wall_s,
        out_of_rotation=[],
        outcome="cluster_lost",
        stopped=lost.cause,
    )
