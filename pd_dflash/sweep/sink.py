"""The driver's side of the collector: open the results directory, forward rows and events, count them.

Rows and events go to the collector actor without waiting (``add.remote``, ``event.remote``); the replies are
checked on every pass of the loop, so a rejected row is reported while the sweep runs and a collector that
cannot store (``StorageError``: disk full, I/O error) sets ``storage_error``, on which the driver stops. The
per-run figures the benchmark reads (runner gaps, cell and load times) are kept here too.
"""

from __future__ import annotations

import hashlib
import os
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayError, RayTaskError

from pd_dflash.errors import InputError
from pd_dflash.rows import ROWS_FILE
from pd_dflash.schema import FAILED_STATUSES, Row, Status
from pd_dflash.spec import SweepSpec
from pd_dflash.sweep import preflight, stops
from pd_dflash.sweep.collector import Collector
from pd_dflash.sweep.manifest import environment_manifest
from pd_dflash.sweep.placement import Estimator, Task
from pd_dflash.sweep.pool import Call, Slot
from pd_dflash.sweep.preflight import Box
from pd_dflash.sweep.resume import Mode, StoredCell
from pd_dflash.sweep.store import StorageError, utc_now

NAMESPACE = "pd-dflash"
#: Rows set aside on resume that are named one by one in the log (events.jsonl lists every one).
SHOWN_SET_ASIDE = 10


@dataclass
class Figures:
    """Orchestration figures of one run (benchmarks/orchestrator.py)."""

    #: Runner-side idle gap between consecutive cells, and whether the second was queued behind the first.
    gaps_s: list[float] = field(default_factory=list)
    gap_queued: list[bool] = field(default_factory=list)
    cell_seconds: list[float] = field(default_factory=list)
    load_seconds: list[float] = field(default_factory=list)
    #: Driver-side: from ray.wait returning finished calls to the next cells submitted (rows forwarded too).
    react_s: list[float] = field(default_factory=list)


class Sink:
    def __init__(self, spec: SweepSpec, estimator: Estimator, event: Callable[[str], None]) -> None:
        self.spec = spec
        self.estimator = estimator
        self._event = event
        self.collector: Any = None
        self.out_dir: str | None = None
        self.adds: list[Any] = []
        self.finished = 0
        self.failed = 0
        self.figures = Figures()
        #: Why the collector cannot store any more (the sweep must stop), or None.
        self.storage_error: str | None = None
        #: Called with every row sent to the collector (the driver's adaptive waves read them).
        self.on_store: Callable[[Row], None] | None = None

    # -- opening --------------------------------------------------------------------------------------------
    def open(
        self, out_dir: str, mode: Mode, boxes: list[Box], options: dict[str, Any]
    ) -> dict[str, StoredCell]:
        """Start the collector for ``out_dir`` and open the directory; returns what is already stored."""
        self.out_dir = out_dir
        run_info = {
            "driver": {"host": socket.gethostname(), "pid": os.getpid(), "argv": sys.argv},
            "environment": environment_manifest(),
            "options": options,
            "cluster": preflight.cluster_summary(boxes),
        }
        self.collector = self._start_collector(out_dir, mode, run_info, options)
        timeout = options["preflight_timeout_s"]
        try:
            opened = stops.get(self.collector.open.remote(), timeout)
        except RayTaskError as exc:
            ray.kill(self.collector)
            cause = getattr(exc, "cause", None)
            if isinstance(cause, InputError):
                raise InputError(str(cause)) from None
            if isinstance(cause, (StorageError, OSError)):  # e.g. no space left for sweep.json
                raise preflight.PreflightError(f"cannot prepare the results directory: {cause}") from None
            raise
        except GetTimeoutError:
            ray.kill(self.collector)
            raise preflight.PreflightError(
                "the collector did not open the results directory in time"
            ) from None
        if opened["archived"]:
            self._event(f"--restart: previous contents archived to {opened['archived']}")
        if opened["torn_tail_moved_to"]:
            self._event(f"repaired a torn last line of {ROWS_FILE} (kept in {opened['torn_tail_moved_to']})")
        if opened["events_repaired"]:
            self._event(f"repaired events.jsonl: {opened['events_repaired']}")
        if opened["set_aside"]:
            self._say_set_aside(opened["set_aside"], opened["set_aside_to"])
        if opened["removed_stale_files"]:
            files = ", ".join(opened["removed_stale_files"])
            self._event(f"removed temporary files an interrupted write left: {files}")
        return {k: StoredCell(Status(s), a) for k, (s, a) in opened["stored"].items()}

    def _say_set_aside(self, entries: list[dict[str, Any]], where: str) -> None:
        cells = len({e["cell_id"] for e in entries})
        self._event(
            f"set aside {len(entries)} stored rows that `pd-dflash report` would refuse (kept in {where}); "
            f"their {cells} cells are measured again:"
        )
        for entry in entries[:SHOWN_SET_ASIDE]:
            self._event(f"  {ROWS_FILE} line {entry['line']} (cell {entry['cell_id']}): {entry['reason']}")
        if len(entries) > SHOWN_SET_ASIDE:
            self._event(f"  ... and {len(entries) - SHOWN_SET_ASIDE} more (events.jsonl lists each)")

    def _start_collector(
        self, out_dir: str, mode: Mode, run_info: dict[str, Any], options: dict[str, Any]
    ) -> Any:
        # The name makes a second driver on the same OUT fail fast; a previous run's collector that is still
        # being killed frees it within moments, a live one never does.
        name = "collector-" + hashlib.sha1(out_dir.encode()).hexdigest()[:16]
        deadline = time.monotonic() + 15
        while True:
            try:
                return Collector.options(name=name, namespace=NAMESPACE).remote(
                    out_dir,
                    self.spec,
                    mode,
                    run_info,
                    options["matrix_every_rows"],
                    options["matrix_every_s"],
                )
            except ValueError as exc:
                if time.monotonic() > deadline:
                    raise InputError(
                        f"another driver is running a sweep into this directory on this cluster ({exc})",
                        where=out_dir,
                    ) from None
                time.sleep(0.5)

    # -- rows -----------------------------------------------------------------------------------------------
    def store(self, row: Row, error_text: str | None) -> None:
        """Send a validated row to the collector (Ray pickles the model; nobody validates it again)."""
        self.adds.append(self.collector.add.remote(row, error_text))
        self.finished += 1
        if row.status in FAILED_STATUSES:
            self.failed += 1
        if self.on_store is not None:
            self.on_store(row)

    def current_rows(self, timeout_s: float) -> list[Row]:
        """The rows OUT holds now, one per cell (an adaptive resume replays its looks from them)."""
        return ray.get(self.collector.current_rows.remote(), timeout=timeout_s)

    def fail(self, task: Task, status: Status, reason: str, detail: str, slot: Slot | None) -> None:
        """Store a row without metrics for a cell that could not be measured (why: ``reason``)."""
        runner = {"box": slot.box.label, "node_id": slot.box.node_id} if slot else None
        row = Row.without_metrics(
            task.cell,
            status,
            reason,
            attempt=task.attempt,
            sweep=self.spec.name,
            runner=runner,
            finished_at=utc_now(),
        )
        self.store(row, detail)

    def record(self, slot: Slot, call: Call, out: dict[str, Any]) -> None:
        """Store what a runner measured, and learn from its duration."""
        self.store(out["row"], out["error"])
        self.estimator.observe(call.task.cell, out["seconds"])
        self.figures.cell_seconds.append(out["seconds"])
        if slot.last_finished is not None:
            self.figures.gaps_s.append(out["started"] - slot.last_finished)
            self.figures.gap_queued.append(call.queued)
        slot.last_finished = out["finished"]

    def log(self, kind: str, **fields: Any) -> None:
        """Append an event to the results directory's events.jsonl (runner deaths, requeues, timeouts...)."""
        self.adds.append(self.collector.event.remote({"event": kind, **fields}))

    def check_adds(self) -> None:
        if not self.adds:
            return
        done, self.adds = ray.wait(self.adds, num_returns=len(self.adds), timeout=0)
        for ref in done:
            try:
                said = ray.get(ref)
                if isinstance(said, str):  # an event call that repaired events.jsonl first
                    self._event(said)
            except StorageError as exc:
                if self.storage_error is None:
                    self.storage_error = str(getattr(exc, "cause", exc))
                    self._event(f"cannot store results: {self.storage_error}; stopping the sweep")
            except RayError as exc:
                self._event(
                    f"the collector rejected a row (not stored; resume will rerun it): {cause_line(exc)}"
                )

    def update_run(self, patch: dict[str, Any]) -> None:
        self.adds.append(self.collector.update_run.remote(patch))

    # -- the end --------------------------------------------------------------------------------------------
    def drain(self, timeout_s: float = 60.0) -> None:
        """Wait for the rows in flight to be stored (or rejected, which is reported)."""
        if self.adds:
            stops.wait(self.adds, timeout_s)
            self.check_adds()

    def final_matrices(self, plots: bool) -> None:
        """Have the collector write the final matrices (after every row sent so far: its calls run in order);
        waited for whole, so a stop meanwhile never leaves them half-written."""
        stops.get(self.collector.final_matrices.remote(plots))

    def finish(self, patch: dict[str, Any]) -> dict[str, Any]:
        """Record the run's outcome, release the directory, stop the collector; returns its summary."""
        summary = stops.get(self.collector.finish.remote(patch))
        ray.kill(self.collector)
        return summary


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


def cause_line(exc: BaseException) -> str:
    """``Type: first line`` of the exception a Ray error wraps (or of the error itself)."""
    cause = getattr(exc, "cause", None)
    if cause is not None:
        text = str(cause).strip()
        return f"{type(cause).__name__}: {text.splitlines()[0][:300] if text else ''}"
    return first_line(exc)
