"""The driver's policy: which runner serves which model and cell, what to do with each event, the summary.

One loop keeps at most ``queue_depth`` calls on each runner: it fills the slots (``_fill``: model affinity,
stealing and rebalancing from ``placement``), waits for the pool's next events (``pool.RunnerPool``), forwards
rows to the collector (``sink.Sink``) and hands failures to the health policy (``health.Health``). Starting Ray
(local mode or a cluster) is ``cluster.run_sweep``'s job.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import ActorDiedError, RaySystemError

from pd_dflash.engine import registry
from pd_dflash.engine.registry import EngineTraits
from pd_dflash.rows import ROWS_FILE
from pd_dflash.schema import FAILED_STATUSES, Row, Status
from pd_dflash.spec import Cell, SweepSpec, expand
from pd_dflash.sweep import preflight
from pd_dflash.sweep.health import Health
from pd_dflash.sweep.options import ClusterLost, Outcome, RunOptions, SweepInterrupted
from pd_dflash.sweep.placement import Estimator, Placement, Task, load_key
from pd_dflash.sweep.pool import (
    CellDone,
    CellFailed,
    CellTimedOut,
    Event,
    Loaded,
    LoadFailed,
    RunnerDied,
    RunnerPool,
    Slot,
    SlotState,
)
from pd_dflash.sweep.preflight import Box
from pd_dflash.sweep.progress import Progress, format_duration
from pd_dflash.sweep.resume import Mode, StoredCell, cells_to_run
from pd_dflash.sweep.sink import Sink, cause_line
from pd_dflash.sweep.stops import StopRequest
from pd_dflash.sweep.store import utc_now
from pd_dflash.sweep.waves import Waves

#: The progress line is refreshed at most this often (no terminal redraws faster; the ETA costs estimates).
SHOW_EVERY_S = 0.2


class SweepDriver:
    def __init__(
        self,
        spec: SweepSpec,
        options: RunOptions,
        progress: Progress | None = None,
        *,
        local: bool = False,
        stop: StopRequest | None = None,
    ) -> None:
        self.spec = spec
        #: Set by the signal handler (``stops.stop_on_signals``); looked at between Ray calls, never inside one.
        self.stop = stop or StopRequest()
        #: Local mode (a loopback-only cluster this process started) or a cluster run (auth is checked).
        self.local = local
        self.opts = options
        self.cells = expand(spec)
        self.estimator = Estimator(spec)
        self.placement = Placement(spec.engine, self.estimator)
        self.progress = progress or Progress(len(self.cells), tty=options.progress)
        self.boxes: list[Box] = []
        self.pool = RunnerPool(spec)
        self.sink = Sink(spec, self.estimator, self._event)
        self.health = Health(spec, options, self.boxes, self.pool, self.placement, self.sink, self._event)
        self.todo = 0
        self.done_before = 0  # cells stored before this run that it does not measure again
        self.waves = Waves(spec, self.cells) if spec.adaptive else None  # adaptive repeats (None: fixed)
        #: The engine's traits as preflight found them on a box (the driver never imports the engine).
        self.traits: EngineTraits | None = None
        self._shown_at = 0.0
        self._started = time.monotonic()
        #: What killed the cluster under the sweep, or None while it lives (``lost.LocalWatch`` in local mode).
        self.cluster_lost: Callable[[], str | None] = lambda: None

    def _event(self, message: str) -> None:
        self.progress.event(message)

    # -- setup ----------------------------------------------------------------------------------------------
    def preflight(self) -> None:
        if not self.local:
            mode = preflight.cluster_auth_mode(timeout_s=self.opts.preflight_timeout_s)
            warning = preflight.check_auth(mode, insecure=self.opts.insecure)
            if warning:
                self._event(warning)
        self.boxes[:] = preflight.survey(self.spec, ray.nodes())
        preflight.check_resources(self.spec, self.boxes)
        preflight.check_out_dir(
            self.opts.out_dir, self.spec, self.opts.mode, timeout_s=self.opts.preflight_timeout_s
        )
        self.traits = preflight.check_engine(self.spec, self.boxes, timeout_s=self.opts.preflight_timeout_s)
        registry.check_reads(self.spec, self.traits)  # a custom engine's declared reads, known only now
        self.placement.traits = self.traits
        fits = ", ".join(f"{b.label}: {b.capacity}" for b in self.boxes if b.capacity)
        self._event(
            f"preflight ok: {sum(b.capacity for b in self.boxes)} runners fit "
            f"({fits}); each needs {preflight.describe_request(self.spec.hardware)}"
        )

    def _plan(self, stored: dict[str, StoredCell]) -> None:
        mode = self.opts.mode
        todo = cells_to_run(self.cells, stored, mode)
        if self.waves is not None:  # the repeats every group needs now (looks replayed from the stored rows)
            todo = self.waves.start(self.sink.current_rows(self.opts.preflight_timeout_s), stored, mode)
            self.sink.on_store = self.waves.arrived.append
        retried = sum(1 for c, _ in todo if c.cell_id in stored)
        skipped_failed = sum(
            1 for s in stored.values() if not s.final and self.opts.mode != Mode.RETRY_ERRORS
        )
        blocked = sum(self._queue(cell, attempt) for cell, attempt in todo)
        self.todo = len(todo)
        self.done_before = len(stored) - retried if self.waves else len(self.cells) - len(todo)
        self._next_waves()
        keys = sorted({load_key(self.spec.engine, c, self.traits) for c, _ in todo})
        self._event(
            f"sweep {self.spec.name} (fingerprint {self.spec.fingerprint()}): {len(self.cells)} cells, "
            f"{len(stored)} already stored, {len(todo)} to run ({retried} retried, {blocked} refused by the "
            f"engine) over {len(keys)} model load key(s); results in {self.opts.out_dir}"
        )
        if skipped_failed:
            self._event(
                f"{skipped_failed} stored cells are ERROR/TIMEOUT; rerun with --retry-errors to retry them"
            )

    def _queue(self, cell: Cell, attempt: int) -> bool:
        """Queue a cell for a runner, or store its REFUSED row when the engine will not run it (True)."""
        reason = registry.blocked_reason_for(self.traits, self.spec.engine, cell)
        if not reason:
            self.placement.add(Task(cell=cell, attempt=attempt))
            return False
        row = Row.without_metrics(
            cell,
            Status.REFUSED,
            reason,
            refusal="documented",  # the engine's declared scope (registry), not counted
            attempt=attempt,
            sweep=self.spec.name,
            finished_at=utc_now(),
        )
        self.sink.store(row, None)
        return True

    def _next_waves(self) -> None:
        """Adaptive repeats: queue the repeats that the rows stored since ask for."""
        if self.waves is not None:
            for cell, attempt in self.waves.due():
                self.todo += 1
                self._queue(cell, attempt)
            self.progress.total = self.done_before + self.todo  # the cells asked for so far
            self.placement.awaiting = self.waves.awaiting(self.spec.engine, self.traits)

    # -- which runner does what -----------------------------------------------------------------------------
    def _fill(self) -> None:
        for slot in self.pool.slots:
            full = slot.state is SlotState.BUSY and len(slot.calls) >= self.opts.queue_depth
            if slot.usable and slot.state is not SlotState.LOADING and not full:
                self._fill_slot(slot)

    def _fill_slot(self, slot: Slot) -> None:
        if slot.state is SlotState.EMPTY:
            key = self.placement.choose_key(self.pool.holders(slot))
            if key is not None:
                self._start(slot, key)
            return
        holders = self.pool.holders(slot)
        if slot.state is SlotState.IDLE:
            key = self.placement.choose_key(holders, slot.key, rebalance=not slot.rebalanced)
            if key is None:
                return
            if key != slot.key:
                self._switch(slot, key)
                return
        if len(slot.calls) >= self.opts.queue_depth:
            return
        if slot.calls and not self._may_queue_behind(slot, holders):
            return
        task = self.placement.take(slot.key)
        if task is not None:
            self.pool.submit(slot, task)

    def _may_queue_behind(self, slot: Slot, holders: dict) -> bool:
        """Queue a cell behind the running one only while the key has plenty left (at the tail an idle runner
        must be able to take it instead) and the runner is not about to move to another key."""
        if self.placement.pending_count(slot.key) < 2 * (holders.get(slot.key, 0) + 1):
            return False
        return slot.rebalanced or not self.placement.rebalance_target(holders, slot.key)

    def _switch(self, slot: Slot, key: Any) -> None:
        own_left = self.placement.pending_count(slot.key)
        if own_left:
            slot.rebalanced = True
        why = f"rebalancing ({own_left} cells of it left)" if own_left else "its model is done"
        self._event(f"{slot.name}: switching from {slot.key[0]} to {key[0]}: {why}")
        self.pool.kill(slot)
        self._start(slot, key)

    def _start(self, slot: Slot, key: Any) -> None:
        self.pool.start(slot, key)
        self._event(f"{slot.name}: loading {key[0]} ({key[1]})")

    # -- events ---------------------------------------------------------------------------------------------
    def _handle(self, ev: Event) -> None:
        if isinstance(ev, CellDone):
            self.sink.record(ev.slot, ev.call, ev.out)
            self.health.succeeded(ev.slot.box)
        elif isinstance(ev, Loaded):
            self._loaded(ev)
        elif isinstance(ev, CellFailed):
            reason = f"runner error: {cause_line(ev.error)}"
            self.sink.fail(ev.call.task, Status.ERROR, reason, str(ev.error), ev.slot)
        elif isinstance(ev, RunnerDied):
            self.health.runner_died(ev)
        elif isinstance(ev, LoadFailed):
            self.health.load_failed(ev)

    def _loaded(self, ev: Loaded) -> None:
        # What a switch costs is the driver-observed time: a new process plus the engine's own load.
        self.estimator.observe_load(ev.slot.key, ev.observed_s)
        self.sink.figures.load_seconds.append(ev.observed_s)
        self._event(
            f"{ev.slot.name}: loaded {ev.slot.key[0]} in {ev.info['load_seconds']:.1f} s "
            f"({ev.observed_s:.1f} s with the runner start)"
        )

    def _check_deadlines(self) -> None:
        for ev in self.pool.expired(self.opts.cell_timeout_s, self.opts.load_timeout_s):
            if isinstance(ev, CellTimedOut):
                self.health.cell_timed_out(ev)
            else:
                self.health.load_timed_out(ev)

    def _wait_timeout(self) -> float:
        now = time.monotonic()
        soonest = self.pool.next_deadline(self.opts.cell_timeout_s, self.opts.load_timeout_s)
        until = (now + self.opts.poll_s if soonest is None else soonest) - now
        return max(0.0, min(self.opts.poll_s, until + 0.01))

    # -- the loop -------------------------------------------------------------------------------------------
    def _loop(self) -> None:
        """Run until every cell has a row, no box is left, or the collector cannot store any more."""
        while not self.sink.storage_error:
            self.stop.check()  # every pass: the waits below return within poll_s
            lost = self.cluster_lost()
            if lost:
                raise ClusterLost(lost)
            self.health.refresh()
            self._next_waves()
            self._fill()
            if not self.pool.in_flight():
                if not self.placement.has_pending() or not any(s.usable for s in self.pool.slots):
                    return
                # Every usable runner is idle by choice and nothing runs: cannot happen unless all holders
                # vanished at once; the next pass (after a refresh) reassigns. Avoid a busy spin.
                time.sleep(self.opts.poll_s)
                continue
            ready = self.pool.wait(self._wait_timeout())
            noticed = time.perf_counter()
            for ev in self.pool.events(ready):
                self._handle(ev)
            self._next_waves()
            if ready:
                self._fill()  # a runner may be waiting for its next cell: dispatch before the bookkeeping
                self.sink.figures.react_s.append(time.perf_counter() - noticed)
            self._check_deadlines()
            self.sink.check_adds()
            self._show()

    def _eta(self) -> float | None:
        if not self.sink.figures.cell_seconds:
            return None
        active = sum(1 for s in self.pool.slots if s.holds_model and s.usable) or 1
        running = sum(self.estimator.estimate(c.task.cell) for s in self.pool.slots for c in s.calls)
        return (self.placement.total_pending_work() + running / 2) / active

    def _show(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._shown_at < SHOW_EVERY_S:
            return
        self._shown_at = now
        running = Counter(s.box.label for s in self.pool.slots if s.calls)
        self.progress.update(
            done=self.done_before + self.sink.finished,
            failed=self.sink.failed,
            running=dict(running),
            eta_s=self._eta(),
            force=force,
        )

    def run(self) -> Outcome:
        """Preflight, plan, the loop, the summary. Raises ``ClusterLost`` when the cluster dies under it."""
        started = self._started = time.monotonic()
        try:
            return self._run(started)
        except ClusterLost as lost:
            lost.cells_run, lost.wall_s = self.sink.finished, time.monotonic() - started
            raise
        except (ActorDiedError, RaySystemError, ConnectionError) as exc:
            # In local mode the watch says whether the cluster died; on a cluster, Ray's own word that an actor
            # died with its node or owner (the collector restarts otherwise) or that the system failed.
            cause = self.cluster_lost() if self.local else cause_line(exc)
            if cause is None:
                raise
            raise ClusterLost(
                cause, cells_run=self.sink.finished, wall_s=time.monotonic() - started
            ) from None

    def _run(self, started: float) -> Outcome:
        self.preflight()
        self.stop.check()  # a stop during preflight: nothing was written (cluster.run_sweep says so)
        stored = self.sink.open(self.opts.out_dir, self.opts.mode, self.boxes, self.opts.recorded())
        self.todo = len(cells_to_run(self.cells, stored, self.opts.mode))  # what a stop now leaves not run
        loop_started = loop_finished = time.time()
        try:
            self.stop.check()  # from here on a stop is recorded in OUT
            self._plan(stored)
            for box in self.boxes:
                self.pool.add_box(box)
            self._show(force=True)
            loop_started = time.time()
            self._loop()
        except SweepInterrupted as exc:  # self.stop holds it: recorded by _finish
            self._event(f"{exc.name} received: stopping the runners and writing what is stored")
        finally:
            loop_finished = time.time()
            if self.cluster_lost() is None:  # a dead cluster's runners are gone, their results with them
                for slot in self.pool.slots:
                    self.health.stop_runner(slot)
            self.progress.close()
        summary, stop = self._finish()
        wall = time.monotonic() - started
        unrun = max(0, self.todo - self.sink.finished)
        exit_code = self._summarise(summary, wall, unrun, stop)
        return Outcome(
            exit_code=exit_code,
            out_dir=self.opts.out_dir,
            counts=summary["counts"],
            cells_run=self.sink.finished,
            unrun=unrun,
            loads=self.pool.loads,
            wall_s=wall,
            out_of_rotation=self.health.out_of_rotation,
            outcome=self._outcome(stop, unrun),
            stopped=stop.name if stop else summary["storage_error"],
            stats={
                **self.sink.figures.__dict__,
                "runners": len(self.pool.slots),
                "loop_started": loop_started,
                "loop_finished": loop_finished,
                "load_keys": len({load_key(self.spec.engine, c, self.traits) for c in self.cells}),
            },
        )

    def _finish(self) -> tuple[dict[str, Any], SweepInterrupted | None]:
        """Collect the rows in flight, write the final matrices, then decide and record the outcome; returns the
        collector's summary and the stop recorded. A signal before the record (collecting, the matrices) makes
        it "stopped"; the matrices being written are completed (staging.py). One after the record changes nothing."""
        in_loop = self.stop.requested  # that stop was announced where the loop ended
        self.sink.drain(10.0 if self.stop.requested else 60.0)
        self.sink.final_matrices(self.opts.plots and not self.stop.requested)
        stop = self.stop.interrupted()
        if stop is not None:
            if not in_loop:
                self._event(f"{stop.name} received after the last cell: recording the sweep as stopped")
            self.sink.log("stopped", signal=stop.name)
        wall = time.monotonic() - self._started
        unrun = max(0, self.todo - self.sink.finished)
        summary = self.sink.finish(self._run_record(wall, unrun, stop))
        if summary["storage_error"] and not self.sink.storage_error:  # noticed at the end (rows.jsonl gone)
            self.sink.storage_error = summary["storage_error"]
        return summary, stop

    def _outcome(self, stop: SweepInterrupted | None, unrun: int) -> str:
        if stop is not None:
            return "stopped"
        if self.sink.storage_error:
            return "storage_failed"
        return "no_box_left" if unrun else "finished"

    def _run_record(self, wall: float, unrun: int, stop: SweepInterrupted | None) -> dict[str, Any]:
        record = {
            "finished_at": utc_now(),
            "wall_seconds": round(wall, 3),
            "model_loads": self.pool.loads,
            "cells_run": self.sink.finished,
            "cells_not_run": unrun,
            "out_of_rotation": self.health.out_of_rotation,
            "outcome": self._outcome(stop, unrun),
        }
        if stop is not None:
            record["signal"] = stop.name
        return record

    def _summarise(
        self, summary: dict[str, Any], wall: float, unrun: int, stop: SweepInterrupted | None
    ) -> int:
        """Log the outcome and return the exit code: 0 when every cell has a row, none failed and the matrices
        were written; 1 otherwise; 128 + the signal's number when a signal stopped the sweep."""
        counts = summary["counts"]
        failed_now = sum(1 for s in summary["current_statuses"].values() if Status(s) in FAILED_STATUSES)
        for err in summary["matrix_errors"]:
            self._event(f"writing the result matrices failed: {err.splitlines()[0]}")
        statuses = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()) if k not in ("stored", "total"))
        out = self.opts.out_dir
        if summary["storage_error"]:  # the counts are what the store believed: no summary of them
            self._event(
                f"sweep {self.spec.name}: stopped after {format_duration(wall)}: {summary['storage_error']}. "
                "Nothing more was stored; fix the cause and rerun with the same --out to resume"
            )
            return 1
        self._event(
            f"sweep {self.spec.name}: {counts['stored']}/{counts['total']} cells stored ({statuses}) in "
            f"{format_duration(wall)}; {self.pool.loads} model loads; rows in {out}/{ROWS_FILE}"
            + (f"; matrix in {out}/result_matrix.md" if summary["outputs"] else "")
        )
        if self.waves is not None:
            self._event(self.waves.describe())
        if summary["outputs"]:
            self._event(summary["outputs"]["overall"]["line"])
        if failed_now:
            self._event(f"{failed_now} cells failed (ERROR/TIMEOUT, see errors/); --retry-errors reruns them")
        if stop is not None:
            self._event(f"stopped by {stop.name}: {unrun} cells not run; rerun with the same --out to resume")
            return 128 + stop.signum
        if unrun:
            self._event(f"{unrun} cells not run: no box left in rotation (rerun to resume them)")
        refused = summary.get("refused_input", 0)  # of the user's own making (schema.RefusalKind)
        if refused:
            self._event(
                f"{refused} cells REFUSED for what the spec or its inputs ask (each row's reason says what; "
                "documented refusals are not counted): fix it and rerun with --restart"
            )
        stored_all = counts["stored"] == counts["total"]
        complete = (
            not (self.waves.open_groups() or unrun) if self.waves else stored_all
        )  # adaptive: all stopped
        return 0 if complete and not failed_now and not refused and not summary["matrix_errors"] else 1
