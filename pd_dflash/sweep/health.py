"""What a failure costs: requeue, the watchdog, load failures, the circuit breaker and the cluster's membership.

- a runner process that dies (``RayActorError``: crash, OOM, lost node) → the cell it was running is requeued
  with attempt + 1, up to ``max_attempts`` tries in this run (then an ERROR row naming the cause); cells merely
  queued behind it are requeued as they were; the slot gets a new runner on the next fill;
- a cell that runs past ``cell_timeout_s`` → the runner is killed (Ray cannot interrupt a running method) and
  the cell gets a TIMEOUT row;
- a model load that fails or outlives ``load_timeout_s`` is counted per load key; after ``max_attempts``
  failures that key's cells become ERROR rows; a load that fails on a deterministic input error (the engine's
  ``InputError`` or ``Refused``: a model path that is not there, no CUDA) is not retried: the key's cells are
  REFUSED at once with the named reason (``runner.input_refusal``) — or, when another box holds the model
  loaded, the failing box is taken out of rotation (it lacks the input) and the cells run elsewhere;
- a box whose runners fail ``breaker_threshold`` times in a row, whose node leaves the cluster or whose device
  does not match the spec is taken out of rotation (log line + sweep.json) and its cells go to the other boxes;
  boxes that join the cluster get slots.

Each of these is also appended to the results directory's ``events.jsonl`` (``Sink.log``).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import ray
from ray.exceptions import RayActorError

from pd_dflash.schema import Status
from pd_dflash.spec import SweepSpec
from pd_dflash.sweep import preflight
from pd_dflash.sweep.placement import LoadKey, Placement
from pd_dflash.sweep.pool import CellTimedOut, LoadFailed, LoadTimedOut, RunnerDied, RunnerPool, Slot
from pd_dflash.sweep.preflight import Box
from pd_dflash.sweep.runner import DeviceMismatch, input_refusal
from pd_dflash.sweep.sink import Sink, cause_line, first_line
from pd_dflash.sweep.store import utc_now


class Health:
    def __init__(
        self,
        spec: SweepSpec,
        options: Any,
        boxes: list[Box],
        pool: RunnerPool,
        placement: Placement,
        sink: Sink,
        event: Callable[[str], None],
    ) -> None:
        self.spec = spec
        self.opts = options
        self.boxes = boxes
        self.pool = pool
        self.placement = placement
        self.sink = sink
        self._event = event
        self.load_failures: Counter[LoadKey] = Counter()
        self.box_streak: Counter[str] = Counter()
        self.out_of_rotation: list[dict[str, Any]] = []
        self._last_refresh = 0.0

    # -- outcomes of runner calls ---------------------------------------------------------------------------
    def succeeded(self, box: Box) -> None:
        """A cell came back from the box: its run of failures is over."""
        self.box_streak[box.label] = 0

    def load_failed(self, ev: LoadFailed) -> None:
        slot, key, exc = ev.slot, ev.key, ev.error
        if isinstance(exc, DeviceMismatch):
            self.pool.kill(slot)
            self.take_out(slot.box, f"device check failed: {getattr(exc, 'cause', exc)}")
        elif (refusal := input_refusal(exc)) is not None:
            self._refuse_key(slot, key, *refusal)
        elif isinstance(exc, RayActorError):
            if not self._node_alive(slot.box.node_id):  # the box is gone, the model is not to blame
                self.pool.kill(slot)
                self.take_out(slot.box, f"node left the cluster (runner died while loading {key[0]})")
                return
            reason = f"runner died while loading: {first_line(exc)}"
            self._count_load_failure(slot, key, reason, str(exc), died=True)
        else:
            self._count_load_failure(slot, key, f"model load failed: {cause_line(exc)}", str(exc), died=False)

    def _refuse_key(self, slot: Slot, key: LoadKey, status: Status, reason: str) -> None:
        """The load failed on an input error that a retry would meet again: every cell of the key, at once —
        unless another box holds the model loaded: then this box lacks it (out of rotation), the cells wait."""
        self.pool.kill(slot)
        if any(s.key == key and s.holds_model and s.loading is None for s in self.pool.slots):  # loaded there
            self.take_out(slot.box, f"cannot load {key[0]} here, as another box can: {reason}")
            return
        dropped = self.placement.drop_key(key)
        where = {"runner": slot.name, "model": key[0], "load_group": key[1]}
        self._event(
            f"{slot.name}: model {key[0]} cannot be loaded: {reason}; {len(dropped)} cells {status.value}"
        )
        self.sink.log("model_refused", **where, reason=reason, cells=len(dropped))
        for task in dropped:
            self.sink.fail(task, status, f"model cannot be loaded (not retried): {reason}", reason, slot)

    def load_timed_out(self, ev: LoadTimedOut) -> None:
        reason = f"model load did not finish within {self.opts.load_timeout_s:g} s"
        self._count_load_failure(ev.slot, ev.key, reason, "load timeout (runner killed)", died=False)

    def _count_load_failure(self, slot: Slot, key: LoadKey, reason: str, detail: str, *, died: bool) -> None:
        self.pool.kill(slot)
        self.load_failures[key] += 1
        failures = self.load_failures[key]
        self._event(f"{slot.name}: {reason} (load failure {failures}/{self.opts.max_attempts})")
        where = {"runner": slot.name, "model": key[0], "load_group": key[1]}
        self.sink.log("load_failed", **where, reason=reason, failures=failures)
        if failures >= self.opts.max_attempts:
            dropped = self.placement.drop_key(key)
            self._event(f"giving up on {key[0]} ({key[1]}): {len(dropped)} cells stored as ERROR")
            self.sink.log("model_given_up", **where, cells=len(dropped))
            why = f"model could not be loaded ({self.load_failures[key]} tries): {reason}"
            for task in dropped:
                self.sink.fail(task, Status.ERROR, why, detail, slot)
        self._box_failure(slot.box, reason, died=died)

    def runner_died(self, ev: RunnerDied) -> None:
        slot, cause = ev.slot, f"runner died: {first_line(ev.error)}"
        running = next((c for c in slot.calls if c.started is not None), None)
        what = f" running {running.task.cell.cell_id}" if running else ""
        self._event(f"{slot.name}: {cause}{what}; requeued")
        cell_id = running.task.cell.cell_id if running else None
        self.sink.log("runner_died", runner=slot.name, node_id=slot.box.node_id, cause=cause, cell_id=cell_id)
        self.release(slot, cause, interrupted=True)
        self._box_failure(slot.box, cause, died=True)

    def cell_timed_out(self, ev: CellTimedOut) -> None:
        slot, task = ev.slot, ev.call.task
        reason = (
            f"no result within --cell-timeout {self.opts.cell_timeout_s:g} s on {slot.name}; runner killed"
        )
        self._event(f"{slot.name}: cell {task.cell.cell_id} timed out; runner killed")
        what = {
            "cell_id": task.cell.cell_id,
            "attempt": task.attempt,
            "cell_timeout_s": self.opts.cell_timeout_s,
        }
        self.sink.log("timeout", runner=slot.name, **what)
        self.sink.fail(task, Status.TIMEOUT, reason, reason, slot)
        self.release(slot, "killed after a timeout", interrupted=False)
        self._box_failure(slot.box, "cell timeout", died=False)

    # -- requeue --------------------------------------------------------------------------------------------
    def release(self, slot: Slot, cause: str, *, interrupted: bool) -> None:
        """Kill the slot's runner and give its cells back: the running one costs a try when ``interrupted``."""
        for call, out in self.pool.release(slot):
            if out is not None:  # finished before the runner went: keep the row
                self.sink.record(slot, call, out)
                self.succeeded(slot.box)
                continue
            task = call.task
            if interrupted and call.started is not None:
                task.tries += 1
                task.last_failure = cause
                if task.tries >= self.opts.max_attempts:
                    reason = f"runner died {task.tries} times while running this cell (last: {cause})"
                    self.sink.fail(task, Status.ERROR, reason, f"last failure on {slot.name}: {cause}", slot)
                    self.sink.log(
                        "retries_exhausted", cell_id=task.cell.cell_id, tries=task.tries, cause=cause
                    )
                    continue
                task.attempt += 1
            self.placement.add(task)
            was_running = call.started is not None
            what = {"cell_id": task.cell.cell_id, "attempt": task.attempt, "was_running": was_running}
            self.sink.log("requeued", **what, runner=slot.name, cause=cause)

    def stop_runner(self, slot: Slot) -> None:
        """The sweep is over (or stopping): kill the runner, keep any result that already arrived."""
        for call, out in self.pool.release(slot):
            if out is not None:
                self.sink.record(slot, call, out)

    # -- boxes ----------------------------------------------------------------------------------------------
    def _box_failure(self, box: Box, cause: str, *, died: bool) -> None:
        if box.out:
            return
        self.box_streak[box.label] += 1
        if died and not self._node_alive(box.node_id):
            self.take_out(box, f"node left the cluster ({cause})")
        elif self.box_streak[box.label] >= self.opts.breaker_threshold:
            self.take_out(box, f"{self.box_streak[box.label]} runner failures in a row (last: {cause})")

    def take_out(self, box: Box, reason: str) -> None:
        if box.out:
            return
        box.out = reason
        self.out_of_rotation.append(
            {"box": box.label, "node_id": box.node_id, "reason": reason, "at": utc_now()}
        )
        self._event(f"box {box.label} taken out of rotation: {reason}")
        self.sink.log("box_out_of_rotation", box=box.label, node_id=box.node_id, reason=reason)
        for slot in self.pool.slots:
            if slot.box is box and slot.holds_model:
                self.release(slot, f"box {box.label} out of rotation: {reason}", interrupted=True)
        self.sink.update_run({"out_of_rotation": self.out_of_rotation})

    @staticmethod
    def _node_alive(node_id: str) -> bool:
        return any(n["NodeID"] == node_id and n.get("Alive") for n in ray.nodes())

    def refresh(self) -> None:
        """Notice nodes that left (do not wait for Ray's actor failure detection) and boxes that joined."""
        now = time.monotonic()
        if now - self._last_refresh < self.opts.refresh_s:
            return
        self._last_refresh = now
        nodes = ray.nodes()
        alive = {n["NodeID"] for n in nodes if n.get("Alive")}
        for box in self.boxes:
            if box.out is None and box.node_id not in alive:
                self.take_out(box, "node left the cluster")
        known = {b.node_id for b in self.boxes}
        for box in preflight.survey(self.spec, nodes):
            if box.node_id not in known and box.capacity > 0:
                self.boxes.append(box)
                self.pool.add_box(box)
                self._event(f"box {box.label} joined: {box.capacity} runner(s)")
                self.sink.log("box_joined", box=box.label, node_id=box.node_id, runners=box.capacity)
