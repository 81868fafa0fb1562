"""The driver: preflight, runners, the scheduling loop, the watchdog, the circuit breaker.

One loop (ray-anchors.md §1.4) keeps at most ``queue_depth`` calls on each runner, streams results with
``ray.wait``, forwards rows to the collector and reacts to failures:

- a runner process that dies (``RayActorError``: crash, OOM, lost node) → the cell it was running is requeued
  with attempt + 1, up to ``max_attempts`` tries in this run (then an ERROR row naming the cause); cells merely
  queued behind it are requeued as they were; the runner is recreated where resources allow;
- a cell that runs past ``cell_timeout_s`` → the runner is killed (Ray cannot interrupt a running method) and
  the cell gets a TIMEOUT row;
- an engine exception → the runner already turned it into an ERROR row; the sweep goes on;
- a box whose runners fail ``breaker_threshold`` times in a row, or whose node leaves the cluster, is taken
  out of rotation (log line + sweep.json) and its cells go to the other boxes.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pd_dflash.engine import registry
from pd_dflash.errors import InputError
from pd_dflash.rows import ROWS_FILE
from pd_dflash.schema import FAILED_STATUSES, Row, Status
from pd_dflash.spec import SweepSpec, expand
from pd_dflash.sweep import preflight
from pd_dflash.sweep.collector import Collector
from pd_dflash.sweep.manifest import environment_manifest
from pd_dflash.sweep.preflight import Box
from pd_dflash.sweep.progress import Progress, format_duration
from pd_dflash.sweep.runner import DeviceMismatch, RunnerActor
from pd_dflash.sweep.scheduler import Estimator, LoadKey, Scheduler, Task, load_key
from pd_dflash.sweep.store import (
    Mode,
    StoredCell,
    cells_to_run,
    check_resumable,
    probe_writable,
    utc_now,
)

NAMESPACE = "pd-dflash"


@dataclass
class RunOptions:
    out_dir: str
    mode: Mode = Mode.RESUME
    max_attempts: int = 3
    #: Per-cell watchdog; a cell running longer is killed and stored as TIMEOUT.
    cell_timeout_s: float = 3600.0
    #: A model load (runner start included) running longer is killed and counted as a load failure.
    load_timeout_s: float = 3600.0
    preflight_timeout_s: float = 180.0
    #: None: a bar on a terminal, log lines otherwise; False: log lines.
    progress: bool | None = None
    #: Calls kept on a runner: the running one plus one queued behind it (hides the dispatch round trip).
    queue_depth: int = 2
    breaker_threshold: int = 3
    poll_s: float = 0.5
    refresh_s: float = 2.0
    matrix_every_rows: int = 20
    matrix_every_s: float = 30.0
    #: Render the PNG plots with the final matrices (seconds of matplotlib; periodic rewrites never do).
    plots: bool = True


@dataclass
class Outcome:
    exit_code: int
    out_dir: str
    counts: dict[str, int]
    #: Cells this run measured (rows stored, any status), and cells it could not run (no box left).
    cells_run: int
    unrun: int
    loads: int
    wall_s: float
    out_of_rotation: list[dict[str, Any]]
    #: Orchestration figures (benchmarks/orchestrator.py): per-cell runner gaps, cell and load times.
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass
class Call:
    ref: Any
    task: Task
    submitted: float
    #: When the cell started running (monotonic, as the driver knows it); None while queued behind another.
    started: float | None = None
    #: Submitted while another cell was running on the runner (so it could start without a round trip).
    queued: bool = False


@dataclass
class Slot:
    """A place for one runner on one box (one GPU)."""

    box: Box
    index: int
    actor: Any = None
    key: LoadKey | None = None
    loading: Any = None
    load_started: float = 0.0
    calls: list[Call] = field(default_factory=list)
    #: Runner-side wall clock when its previous cell finished (for the dispatch-gap figure).
    last_finished: float | None = None
    #: A slot moves to another model while its own still has work at most once (no oscillation).
    rebalanced: bool = False

    @property
    def name(self) -> str:
        return f"{self.box.label}/{self.index}"


class SweepDriver:
    def __init__(self, spec: SweepSpec, options: RunOptions, progress: Progress | None = None) -> None:
        self.spec = spec
        self.opts = options
        self.cells = expand(spec)
        self.estimator = Estimator(spec)
        self.scheduler = Scheduler(spec.engine, self.estimator)
        self.progress = progress or Progress(len(self.cells), tty=options.progress)
        self.boxes: list[Box] = []
        self.slots: list[Slot] = []
        self.collector: Any = None
        self.adds: list[Any] = []
        self.load_failures: Counter[LoadKey] = Counter()
        self.box_streak: Counter[str] = Counter()
        self.out_of_rotation: list[dict[str, Any]] = []
        self.loads = 0
        self.finished_this_run = 0
        self.failed_this_run = 0
        self.todo = 0
        self.gaps: list[float] = []
        self.gap_queued: list[bool] = []
        self.cell_seconds: list[float] = []
        self.load_seconds: list[float] = []
        self._last_refresh = 0.0

    # -- setup ----------------------------------------------------------------------------------------------
    def _event(self, message: str) -> None:
        self.progress.event(message)

    def preflight(self) -> None:
        self.boxes = preflight.survey(self.spec, ray.nodes())
        preflight.check_resources(self.spec, self.boxes)
        preflight.check_out_dir(
            self.opts.out_dir, self.spec, self.opts.mode, timeout_s=self.opts.preflight_timeout_s
        )
        preflight.check_engine(self.spec, self.boxes, timeout_s=self.opts.preflight_timeout_s)
        fits = ", ".join(f"{b.label}: {b.capacity}" for b in self.boxes if b.capacity)
        self._event(
            f"preflight ok: {sum(b.capacity for b in self.boxes)} runners fit "
            f"({fits}); each needs {preflight.describe_request(self.spec.hardware)}"
        )

    def _open_collector(self) -> dict[str, StoredCell]:
        name = "collector-" + hashlib.sha1(self.opts.out_dir.encode()).hexdigest()[:16]
        run_info = {
            "driver": {"host": socket.gethostname(), "pid": os.getpid(), "argv": sys.argv},
            "environment": environment_manifest(),
            "options": {
                k: (str(v) if isinstance(v, Mode) else v)
                for k, v in self.opts.__dict__.items()
                if k not in ("progress",)
            },
            "cluster": preflight.cluster_summary(self.boxes),
        }
        # The name makes a second driver on the same OUT fail fast; a previous run's collector that is still
        # being killed frees it within moments, a live one never does.
        deadline = time.monotonic() + 15
        while True:
            try:
                self.collector = Collector.options(name=name, namespace=NAMESPACE).remote(
                    self.opts.out_dir,
                    self.spec,
                    self.opts.mode,
                    run_info,
                    self.opts.matrix_every_rows,
                    self.opts.matrix_every_s,
                )
                break
            except ValueError as exc:
                if time.monotonic() > deadline:
                    raise InputError(
                        f"another driver is running a sweep into this directory on this cluster ({exc})",
                        where=self.opts.out_dir,
                    ) from None
                time.sleep(0.5)
        try:
            opened = ray.get(self.collector.open.remote(), timeout=self.opts.preflight_timeout_s)
        except RayTaskError as exc:
            ray.kill(self.collector)
            cause = getattr(exc, "cause", None)
            if isinstance(cause, InputError):
                raise InputError(str(cause)) from None
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
        return {k: StoredCell(Status(s), a) for k, (s, a) in opened["stored"].items()}

    def _plan(self, stored: dict[str, StoredCell]) -> None:
        todo = cells_to_run(self.cells, stored, self.opts.mode)
        retried = sum(1 for c, _ in todo if c.cell_id in stored)
        skipped_failed = sum(
            1 for cid, s in stored.items() if not s.final and self.opts.mode != Mode.RETRY_ERRORS
        )
        blocked = 0
        for cell, attempt in todo:
            reason = registry.blocked_reason(self.spec.engine, cell)
            if reason:
                blocked += 1
                row = Row.without_metrics(
                    cell, Status.REFUSED, reason, attempt=attempt, sweep=self.spec.name, finished_at=utc_now()
                )
                self._store(row.to_json_dict(), None)
                self._count(Status.REFUSED.value)
            else:
                self.scheduler.add(Task(cell=cell, attempt=attempt))
        self.todo = len(todo)
        keys = sorted({load_key(self.spec.engine, c) for c, _ in todo})
        self._event(
            f"sweep {self.spec.name} (fingerprint {self.spec.fingerprint()}): {len(self.cells)} cells, "
            f"{len(stored)} already stored, {len(todo)} to run ({retried} retried, {blocked} refused by the "
            f"engine) over {len(keys)} model load key(s); results in {self.opts.out_dir}"
        )
        if skipped_failed:
            self._event(
                f"{skipped_failed} stored cells are ERROR/TIMEOUT; rerun with --retry-errors to retry them"
            )

    # -- runners --------------------------------------------------------------------------------------------
    def _build_slots(self) -> None:
        for box in self.boxes:
            self._add_box_slots(box)

    def _add_box_slots(self, box: Box) -> None:
        for i in range(box.capacity):
            self.slots.append(Slot(box=box, index=i))

    def _usable(self, slot: Slot) -> bool:
        return slot.box.out is None

    def _holders(self, exclude: Slot) -> dict[LoadKey, int]:
        held: Counter[LoadKey] = Counter()
        for s in self.slots:
            if s is not exclude and s.key is not None and s.actor is not None and self._usable(s):
                held[s.key] += 1
        return held

    def _start_runner(self, slot: Slot, key: LoadKey) -> None:
        memory = registry.host_memory_bytes(self.spec.engine, self.spec.model(key[0]))
        options = preflight.runner_options(self.spec.hardware, memory)
        slot.actor = RunnerActor.options(
            **options,
            scheduling_strategy=NodeAffinitySchedulingStrategy(slot.box.node_id, soft=False),
        ).remote(self.spec, slot.box.label)
        slot.key = key
        slot.loading = slot.actor.load.remote(*key)
        slot.load_started = time.monotonic()
        slot.last_finished = None
        self.loads += 1
        self._event(f"{slot.name}: loading {key[0]} ({key[1]})")

    def _kill(self, slot: Slot) -> None:
        if slot.actor is not None:
            with contextlib.suppress(Exception):
                ray.kill(slot.actor, no_restart=True)
        slot.actor = None
        slot.key = None
        slot.loading = None

    def _submit(self, slot: Slot, task: Task) -> None:
        ref = slot.actor.run.remote(task.cell, task.attempt)
        now = time.monotonic()
        queued = bool(slot.calls)
        slot.calls.append(
            Call(ref=ref, task=task, submitted=now, started=None if queued else now, queued=queued)
        )

    def _fill(self) -> None:
        for slot in self.slots:
            if not self._usable(slot) or slot.loading is not None:
                continue
            if slot.actor is None:
                key = self.scheduler.choose_key(self._holders(slot))
                if key is not None:
                    self._start_runner(slot, key)
                continue
            holders = self._holders(slot)
            if not slot.calls:
                key = self.scheduler.choose_key(holders, slot.key, rebalance=not slot.rebalanced)
                if key is None:
                    continue
                if key != slot.key:
                    own_left = self.scheduler.pending_count(slot.key)
                    if own_left:
                        slot.rebalanced = True
                    why = f"rebalancing ({own_left} cells of it left)" if own_left else "its model is done"
                    self._event(f"{slot.name}: switching from {slot.key[0]} to {key[0]}: {why}")
                    self._kill(slot)
                    self._start_runner(slot, key)
                    continue
            if len(slot.calls) >= self.opts.queue_depth:
                continue
            if slot.calls:
                # Queue a cell behind the running one only while the key has plenty left (at the tail an idle
                # runner must be able to take it instead) and the runner is not about to move to another key.
                if self.scheduler.pending_count(slot.key) < 2 * (holders.get(slot.key, 0) + 1):
                    continue
                if not slot.rebalanced and self.scheduler.rebalance_target(holders, slot.key):
                    continue
            task = self.scheduler.take(slot.key)
            if task is not None:
                self._submit(slot, task)

    # -- results --------------------------------------------------------------------------------------------
    def _store(self, row: dict[str, Any], error_text: str | None) -> None:
        self.adds.append(self.collector.add.remote(row, error_text))

    def _count(self, status: str) -> None:
        self.finished_this_run += 1
        if Status(status) in FAILED_STATUSES:
            self.failed_this_run += 1

    def _failure_row(self, task: Task, status: Status, reason: str, slot: Slot | None) -> dict[str, Any]:
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
        return row.to_json_dict()

    def _fail_task(self, task: Task, status: Status, reason: str, detail: str, slot: Slot | None) -> None:
        row = self._failure_row(task, status, reason, slot)
        self._store(row, detail)
        self._count(status.value)

    def _on_load_done(self, slot: Slot) -> None:
        key = slot.key
        try:
            info = ray.get(slot.loading)
        except DeviceMismatch as exc:
            self._kill(slot)
            self._take_out(slot.box, f"device check failed: {getattr(exc, 'cause', exc)}")
            return
        except RayActorError as exc:
            if not self._node_alive(slot.box.node_id):  # the box is gone, the model is not to blame
                self._kill(slot)
                self._take_out(slot.box, f"node left the cluster (runner died while loading {key[0]})")
                return
            self._load_failed(
                slot, key, f"runner died while loading: {_first_line(exc)}", str(exc), died=True
            )
            return
        except RayError as exc:
            self._load_failed(slot, key, f"model load failed: {_cause_line(exc)}", str(exc), died=False)
            return
        slot.loading = None
        # What a switch costs is the driver-observed time: a new process plus the engine's own load.
        observed = time.monotonic() - slot.load_started
        self.estimator.observe_load(key, observed)
        self.load_seconds.append(observed)
        self._event(
            f"{slot.name}: loaded {key[0]} in {info['load_seconds']:.1f} s ({observed:.1f} s with the runner start)"
        )

    def _load_failed(self, slot: Slot, key: LoadKey, reason: str, detail: str, *, died: bool) -> None:
        self._kill(slot)
        self.load_failures[key] += 1
        self._event(
            f"{slot.name}: {reason} (load failure {self.load_failures[key]}/{self.opts.max_attempts})"
        )
        if self.load_failures[key] >= self.opts.max_attempts:
            dropped = self.scheduler.drop_key(key)
            self._event(f"giving up on {key[0]} ({key[1]}): {len(dropped)} cells stored as ERROR")
            for task in dropped:
                self._fail_task(
                    task,
                    Status.ERROR,
                    f"model could not be loaded ({self.load_failures[key]} tries): {reason}",
                    detail,
                    slot,
                )
        self._box_failure(slot.box, reason, died=died)

    def _on_call_done(self, slot: Slot, call: Call) -> None:
        try:
            out = ray.get(call.ref)
        except RayTaskError as exc:
            # run() itself raised (the engine's exceptions are already rows): store an ERROR row.
            slot.calls.remove(call)
            self._advance(slot)
            self._fail_task(call.task, Status.ERROR, f"runner error: {_cause_line(exc)}", str(exc), slot)
            return
        except (RayActorError, RayError) as exc:
            self._runner_failed(slot, f"runner died: {_first_line(exc)}")
            return
        slot.calls.remove(call)
        self._advance(slot)
        self._record(slot, call, out)

    def _record(self, slot: Slot, call: Call, out: dict[str, Any]) -> None:
        self._store(out["row"], out["error"])
        self._count(out["row"]["status"])
        self.estimator.observe(call.task.cell, out["seconds"])
        self.cell_seconds.append(out["seconds"])
        if slot.last_finished is not None:
            self.gaps.append(out["started"] - slot.last_finished)
            self.gap_queued.append(call.queued)
        slot.last_finished = out["finished"]
        self.box_streak[slot.box.label] = 0

    @staticmethod
    def _result_if_any(ref: Any) -> dict[str, Any] | None:
        """The call's result if it already arrived (a runner may die right after returning one)."""
        ready, _ = ray.wait([ref], timeout=0)
        if not ready:
            return None
        try:
            return ray.get(ref)
        except RayError:
            return None

    def _advance(self, slot: Slot) -> None:
        if slot.calls and slot.calls[0].started is None:
            slot.calls[0].started = time.monotonic()

    # -- failures -------------------------------------------------------------------------------------------
    def _release(self, slot: Slot, cause: str, *, interrupted: bool) -> None:
        """Kill the slot's runner and give its cells back: the running one costs a try when ``interrupted``."""
        calls, slot.calls = slot.calls, []
        self._kill(slot)
        for i, call in enumerate(calls):
            out = self._result_if_any(call.ref)
            if out is not None:  # finished before the runner went: keep the row; the next one had started
                self._record(slot, call, out)
                if i + 1 < len(calls) and calls[i + 1].started is None:
                    calls[i + 1].started = time.monotonic()
                continue
            task = call.task
            if interrupted and call.started is not None:
                task.tries += 1
                task.last_failure = cause
                if task.tries >= self.opts.max_attempts:
                    self._fail_task(
                        task,
                        Status.ERROR,
                        f"runner died {task.tries} times while running this cell (last: {cause})",
                        f"last failure on {slot.name}: {cause}",
                        slot,
                    )
                    continue
                task.attempt += 1
            self.scheduler.add(task)

    def _runner_failed(self, slot: Slot, cause: str) -> None:
        running = next((c for c in slot.calls if c.started is not None), None)
        what = f" running {running.task.cell.cell_id}" if running else ""
        self._event(f"{slot.name}: {cause}{what}; requeued")
        self._release(slot, cause, interrupted=True)
        self._box_failure(slot.box, cause, died=True)

    def _box_failure(self, box: Box, cause: str, *, died: bool) -> None:
        if box.out:
            return
        self.box_streak[box.label] += 1
        if died and not self._node_alive(box.node_id):
            self._take_out(box, f"node left the cluster ({cause})")
        elif self.box_streak[box.label] >= self.opts.breaker_threshold:
            self._take_out(box, f"{self.box_streak[box.label]} runner failures in a row (last: {cause})")

    def _take_out(self, box: Box, reason: str) -> None:
        if box.out:
            return
        box.out = reason
        self.out_of_rotation.append(
            {"box": box.label, "node_id": box.node_id, "reason": reason, "at": utc_now()}
        )
        self._event(f"box {box.label} taken out of rotation: {reason}")
        for slot in self.slots:
            if slot.box is box and (slot.actor is not None or slot.calls):
                self._release(slot, f"box {box.label} out of rotation: {reason}", interrupted=True)
        self.collector.update_run.remote({"out_of_rotation": self.out_of_rotation})

    def _node_alive(self, node_id: str) -> bool:
        return any(n["NodeID"] == node_id and n.get("Alive") for n in ray.nodes())

    def _refresh_boxes(self) -> None:
        """Notice nodes that left (do not wait for Ray's actor failure detection) and boxes that joined."""
        now = time.monotonic()
        if now - self._last_refresh < self.opts.refresh_s:
            return
        self._last_refresh = now
        nodes = ray.nodes()
        alive = {n["NodeID"] for n in nodes if n.get("Alive")}
        for box in self.boxes:
            if box.out is None and box.node_id not in alive:
                self._take_out(box, "node left the cluster")
        known = {b.node_id for b in self.boxes}
        for box in preflight.survey(self.spec, nodes):
            if box.node_id not in known and box.capacity > 0:
                self.boxes.append(box)
                self._add_box_slots(box)
                self._event(f"box {box.label} joined: {box.capacity} runner(s)")

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for slot in self.slots:
            if slot.loading is not None and now - slot.load_started > self.opts.load_timeout_s:
                self._load_failed(
                    slot,
                    slot.key,
                    f"model load did not finish within {self.opts.load_timeout_s:g} s",
                    "load timeout (runner killed)",
                    died=False,
                )
                continue
            head = slot.calls[0] if slot.calls else None
            if head is None or head.started is None or now - head.started <= self.opts.cell_timeout_s:
                continue
            slot.calls.pop(0)
            reason = f"no result within --cell-timeout {self.opts.cell_timeout_s:g} s on {slot.name}; runner killed"
            self._event(f"{slot.name}: cell {head.task.cell.cell_id} timed out; runner killed")
            self._fail_task(head.task, Status.TIMEOUT, reason, reason, slot)
            self._release(slot, "killed after a timeout", interrupted=False)
            self._box_failure(slot.box, "cell timeout", died=False)

    # -- the loop -------------------------------------------------------------------------------------------
    def _refs(self) -> dict[Any, tuple[Slot, Call | None]]:
        refs: dict[Any, tuple[Slot, Call | None]] = {}
        for slot in self.slots:
            if slot.loading is not None:
                refs[slot.loading] = (slot, None)
            for call in slot.calls:
                refs[call.ref] = (slot, call)
        return refs

    def _wait_timeout(self) -> float:
        now = time.monotonic()
        deadlines = [
            c.started + self.opts.cell_timeout_s
            for s in self.slots
            for c in s.calls[:1]
            if c.started is not None
        ]
        deadlines += [s.load_started + self.opts.load_timeout_s for s in self.slots if s.loading is not None]
        soonest = min(deadlines, default=now + self.opts.poll_s) - now
        return max(0.0, min(self.opts.poll_s, soonest + 0.01))

    def _check_adds(self) -> None:
        if not self.adds:
            return
        done, self.adds = ray.wait(self.adds, num_returns=len(self.adds), timeout=0)
        for ref in done:
            try:
                ray.get(ref)
            except RayError as exc:
                self._event(
                    f"the collector rejected a row (not stored; resume will rerun it): {_cause_line(exc)}"
                )

    def _eta(self) -> float | None:
        if not self.cell_seconds:
            return None
        active = sum(1 for s in self.slots if s.actor is not None and self._usable(s)) or 1
        running = sum(self.estimator.estimate(c.task.cell) for s in self.slots for c in s.calls)
        return (self.scheduler.total_pending_work() + running / 2) / active

    def _show(self, force: bool = False) -> None:
        running: Counter[str] = Counter()
        for slot in self.slots:
            if slot.calls:
                running[slot.box.label] += 1
        self.progress.update(
            done=len(self.cells) - self.todo + self.finished_this_run,
            failed=self.failed_this_run,
            running=dict(running),
            eta_s=self._eta(),
            force=force,
        )

    def _loop(self) -> int:
        while True:
            self._refresh_boxes()
            self._fill()
            refs = self._refs()
            if not refs:
                if not self.scheduler.has_pending():
                    return 0
                if not any(self._usable(s) for s in self.slots):
                    return self.scheduler.pending_count()
                # Every usable runner is idle by choice and nothing runs: cannot happen unless all holders
                # vanished at once; the next pass (after a refresh) reassigns. Avoid a busy spin.
                time.sleep(self.opts.poll_s)
                continue
            ready, _ = ray.wait(list(refs), num_returns=1, timeout=self._wait_timeout())
            if ready:
                ready, _ = ray.wait(list(refs), num_returns=len(refs), timeout=0)
            for ref in ready:
                slot, call = refs[ref]
                if call is None:
                    if slot.loading is ref:
                        self._on_load_done(slot)
                elif call in slot.calls:
                    self._on_call_done(slot, call)
            if ready:
                self._fill()  # a runner may be waiting for its next cell: dispatch before the bookkeeping
            self._check_deadlines()
            self._check_adds()
            self._show()

    def run(self) -> Outcome:
        started = time.monotonic()
        self.preflight()
        stored = self._open_collector()
        unrun = 0
        try:
            self._plan(stored)
            self._build_slots()
            self._show(force=True)
            loop_started = time.time()
            unrun = self._loop()
            loop_finished = time.time()
        finally:
            for slot in self.slots:
                self._kill(slot)
            self.progress.close()
        if self.adds:
            ray.wait(self.adds, num_returns=len(self.adds), timeout=60)
            self._check_adds()
        wall = time.monotonic() - started
        if unrun:
            self._event(f"{unrun} cells not run: no box left in rotation (rerun to resume them)")
        patch = {
            "finished_at": utc_now(),
            "wall_seconds": round(wall, 3),
            "model_loads": self.loads,
            "cells_run": self.finished_this_run,
            "cells_not_run": unrun,
            "out_of_rotation": self.out_of_rotation,
        }
        summary = ray.get(self.collector.finish.remote(patch, self.opts.plots))
        ray.kill(self.collector)
        counts = summary["counts"]
        failed_now = sum(1 for s in summary["current_statuses"].values() if Status(s) in FAILED_STATUSES)
        for err in summary["matrix_errors"]:
            self._event(f"writing the result matrices failed: {err.splitlines()[0]}")
        complete = counts["stored"] == counts["total"]
        ok = complete and not failed_now and not summary["matrix_errors"]
        statuses = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()) if k not in ("stored", "total"))
        self._event(
            f"sweep {self.spec.name}: {counts['stored']}/{counts['total']} cells stored ({statuses}) in "
            f"{format_duration(wall)}; {self.loads} model loads; rows in {self.opts.out_dir}/{ROWS_FILE}"
            + (f"; matrix in {self.opts.out_dir}/result_matrix.md" if summary["outputs"] else "")
        )
        if summary["outputs"]:
            self._event(summary["outputs"]["overall"]["line"])
        if failed_now:
            self._event(f"{failed_now} cells failed (ERROR/TIMEOUT, see errors/); --retry-errors reruns them")
        return Outcome(
            exit_code=0 if ok else 1,
            out_dir=self.opts.out_dir,
            counts=counts,
            cells_run=self.finished_this_run,
            unrun=unrun,
            loads=self.loads,
            wall_s=wall,
            out_of_rotation=self.out_of_rotation,
            stats={
                "gaps_s": self.gaps,
                "gap_queued": self.gap_queued,
                "cell_seconds": self.cell_seconds,
                "load_seconds": self.load_seconds,
                "runners": len(self.slots),
                "loop_started": loop_started,
                "loop_finished": loop_finished,
                "load_keys": len({load_key(self.spec.engine, c) for c in self.cells}),
            },
        )


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0][:300] if text else type(exc).__name__


def _cause_line(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None)
    if cause is not None:
        return f"{type(cause).__name__}: {str(cause).strip().splitlines()[0][:300] if str(cause).strip() else ''}"
    return _first_line(exc)


def local_cluster_args(spec: SweepSpec) -> dict[str, Any]:
    """``ray.init`` arguments of local mode: a single-node cluster with fake GPUs and the spec's resources."""
    hw = spec.hardware
    gpus = spec.local.fake_gpus
    resources: dict[str, float] = {}
    if hw.accelerator_type:
        resources[f"{preflight.ACCELERATOR_PREFIX}{hw.accelerator_type}"] = 1
    if hw.custom_resource:
        resources[hw.custom_resource] = gpus
    runners = gpus // hw.gpus_per_cell
    cpus = spec.local.num_cpus or max(1, int(-(-runners * hw.cpus_per_runner // 1)))
    return {
        "num_cpus": cpus,
        "num_gpus": gpus,
        "resources": resources,
        "include_dashboard": False,
        "object_store_memory": spec.local.object_store_mb * 2**20,
        "namespace": NAMESPACE,
        "log_to_driver": False,
    }


def run_sweep(spec: SweepSpec, options: RunOptions, *, address: str | None = None) -> Outcome:
    """Run a sweep: join ``address`` (or $RAY_ADDRESS, or an already connected Ray), else start local mode."""
    options.out_dir = os.path.abspath(options.out_dir)
    owns_ray = False
    if not ray.is_initialized():
        address = address or os.environ.get("RAY_ADDRESS")
        if address:
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
        else:
            # Local mode: this process is the head box, so OUT can be checked before a cluster is started.
            out = Path(options.out_dir)
            probe_writable(out)
            check_resumable(out, spec, options.mode)
            # address="local": always start our own cluster, never join one another process left running.
            ray.init(address="local", **local_cluster_args(spec))
        owns_ray = True
    try:
        return SweepDriver(spec, options).run()
    finally:
        if owns_ray:
            ray.shutdown()
