"""The runner pool: one slot per GPU, the runner actor in it, the calls in flight, and what ``ray.wait`` says.

The pool is the only code that holds actor handles and object refs. It keeps an index from each ref in flight
to its slot (updated as calls are submitted and finish, never rebuilt), and turns what Ray reports into typed
events — ``Loaded``, ``LoadFailed``, ``CellDone``, ``CellFailed``, ``RunnerDied``, ``LoadTimedOut``,
``CellTimedOut`` — that the driver and the health policy act on. It decides nothing: which model a slot loads,
what a failure costs and when a box leaves rotation are theirs.

A slot's state (``SlotState``) changes in one method, ``RunnerPool._move``, along ``TRANSITIONS``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import ray
from ray.exceptions import RayError, RayTaskError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pd_dflash.engine import registry
from pd_dflash.spec import SweepSpec
from pd_dflash.sweep import preflight
from pd_dflash.sweep.placement import LoadKey, Task
from pd_dflash.sweep.preflight import Box
from pd_dflash.sweep.runner import RunnerActor


class SlotState(str, Enum):
    EMPTY = "empty"  # no runner
    LOADING = "loading"  # runner started, its model load in flight
    IDLE = "idle"  # model loaded, no call
    BUSY = "busy"  # model loaded, one or more calls (the first running, the others queued behind it)


#: Allowed moves: start → LOADING → IDLE ⇄ BUSY, and a kill from anywhere back to EMPTY.
TRANSITIONS: dict[SlotState, frozenset[SlotState]] = {
    SlotState.EMPTY: frozenset({SlotState.EMPTY, SlotState.LOADING}),
    SlotState.LOADING: frozenset({SlotState.IDLE, SlotState.EMPTY}),
    SlotState.IDLE: frozenset({SlotState.BUSY, SlotState.EMPTY}),
    SlotState.BUSY: frozenset({SlotState.BUSY, SlotState.IDLE, SlotState.EMPTY}),
}


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
    state: SlotState = SlotState.EMPTY
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

    @property
    def usable(self) -> bool:
        return self.box.out is None

    @property
    def holds_model(self) -> bool:
        return self.state is not SlotState.EMPTY


# -- events -----------------------------------------------------------------------------------------------
@dataclass
class Loaded:
    slot: Slot
    info: dict[str, Any]
    #: Driver-observed seconds from creating the runner to its model being loaded.
    observed_s: float


@dataclass
class LoadFailed:
    slot: Slot
    key: LoadKey
    error: RayError


@dataclass
class CellDone:
    slot: Slot
    call: Call
    out: dict[str, Any]


@dataclass
class CellFailed:
    """``run()`` itself raised (an engine's exceptions are already rows): the runner lives on."""

    slot: Slot
    call: Call
    error: RayTaskError


@dataclass
class RunnerDied:
    slot: Slot
    error: RayError


@dataclass
class LoadTimedOut:
    slot: Slot
    key: LoadKey


@dataclass
class CellTimedOut:
    """The running cell outlived its watchdog; the pool has already taken it off the slot."""

    slot: Slot
    call: Call


Event = Loaded | LoadFailed | CellDone | CellFailed | RunnerDied


class RunnerPool:
    def __init__(self, spec: SweepSpec) -> None:
        self.spec = spec
        self.slots: list[Slot] = []
        #: Every ref in flight → its slot and call (None for a model load).
        self._index: dict[Any, tuple[Slot, Call | None]] = {}
        self.loads = 0

    # -- slots and their state ------------------------------------------------------------------------------
    def add_box(self, box: Box) -> None:
        for i in range(box.capacity):
            self.slots.append(Slot(box=box, index=i))

    @staticmethod
    def _move(slot: Slot, to: SlotState) -> None:
        """The one place a slot's state changes; a transition not in ``TRANSITIONS`` is a bug and raises."""
        if to not in TRANSITIONS[slot.state]:
            raise RuntimeError(f"slot {slot.name}: no transition from {slot.state.value} to {to.value}")
        slot.state = to

    def _after_call(self, slot: Slot) -> None:
        self._move(slot, SlotState.BUSY if slot.calls else SlotState.IDLE)

    def holders(self, exclude: Slot) -> dict[LoadKey, int]:
        """Usable slots other than ``exclude`` per load key they hold (loading or loaded)."""
        held: dict[LoadKey, int] = {}
        for s in self.slots:
            if s is not exclude and s.holds_model and s.usable:
                held[s.key] = held.get(s.key, 0) + 1
        return held

    def in_flight(self) -> bool:
        return bool(self._index)

    # -- actions --------------------------------------------------------------------------------------------
    def start(self, slot: Slot, key: LoadKey) -> None:
        """Create a runner pinned to the slot's box and ask it to load ``key``'s model."""
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
        self._index[slot.loading] = (slot, None)
        self.loads += 1
        self._move(slot, SlotState.LOADING)

    def kill(self, slot: Slot) -> None:
        """Kill the slot's runner (if any) and forget its load; its calls must have been taken off already."""
        if slot.actor is not None:
            with contextlib.suppress(Exception):
                ray.kill(slot.actor, no_restart=True)
        self._index.pop(slot.loading, None)
        slot.actor = None
        slot.key = None
        slot.loading = None
        self._move(slot, SlotState.EMPTY)

    def submit(self, slot: Slot, task: Task) -> None:
        ref = slot.actor.run.remote(task.cell, task.attempt)
        now = time.monotonic()
        queued = bool(slot.calls)
        call = Call(ref=ref, task=task, submitted=now, started=None if queued else now, queued=queued)
        slot.calls.append(call)
        self._index[ref] = (slot, call)
        self._move(slot, SlotState.BUSY)

    def release(self, slot: Slot) -> list[tuple[Call, dict[str, Any] | None]]:
        """Kill the runner and hand back its calls, each with its result when one had already arrived."""
        calls, slot.calls = slot.calls, []
        for call in calls:
            self._index.pop(call.ref, None)
        self.kill(slot)
        released = []
        for i, call in enumerate(calls):
            out = _result_if_any(call.ref)
            if out is not None and i + 1 < len(calls) and calls[i + 1].started is None:
                calls[
                    i + 1
                ].started = time.monotonic()  # finished before the runner went: the next had started
            released.append((call, out))
        return released

    def _finish(self, slot: Slot, call: Call) -> None:
        """Take a finished call off its slot; the one queued behind it is now running."""
        slot.calls.remove(call)
        self._index.pop(call.ref, None)
        if slot.calls and slot.calls[0].started is None:
            slot.calls[0].started = time.monotonic()
        self._after_call(slot)

    # -- what Ray says --------------------------------------------------------------------------------------
    def wait(self, timeout: float) -> list[Any]:
        """Refs that finished: block up to ``timeout`` for one, then take every other one already done."""
        refs = list(self._index)
        ready, _ = ray.wait(refs, num_returns=1, timeout=timeout)
        if ready:
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        return ready

    def events(self, ready: list[Any]) -> Iterator[Event]:
        """One event per finished ref, produced lazily: a ref whose slot was released meanwhile is skipped."""
        for ref in ready:
            held = self._index.get(ref)
            if held is None:
                continue
            slot, call = held
            yield self._load_event(slot) if call is None else self._call_event(slot, call)

    def _load_event(self, slot: Slot) -> Loaded | LoadFailed:
        key = slot.key
        try:
            info = ray.get(slot.loading)
        except RayError as exc:
            return LoadFailed(slot, key, exc)
        self._index.pop(slot.loading, None)
        slot.loading = None
        self._move(slot, SlotState.IDLE)
        return Loaded(slot, info, time.monotonic() - slot.load_started)

    def _call_event(self, slot: Slot, call: Call) -> CellDone | CellFailed | RunnerDied:
        try:
            out = ray.get(call.ref)
        except RayTaskError as exc:
            self._finish(slot, call)
            return CellFailed(slot, call, exc)
        except RayError as exc:
            return RunnerDied(slot, exc)
        self._finish(slot, call)
        return CellDone(slot, call, out)

    # -- the watchdog's clock -------------------------------------------------------------------------------
    def next_deadline(self, cell_timeout_s: float, load_timeout_s: float) -> float | None:
        deadlines = [
            s.calls[0].started + cell_timeout_s
            for s in self.slots
            if s.calls and s.calls[0].started is not None
        ]
        deadlines += [s.load_started + load_timeout_s for s in self.slots if s.state is SlotState.LOADING]
        return min(deadlines, default=None)

    def expired(self, cell_timeout_s: float, load_timeout_s: float) -> Iterator[LoadTimedOut | CellTimedOut]:
        """Slots past a deadline, checked lazily (acting on one may release others of the same box)."""
        now = time.monotonic()
        for slot in self.slots:
            if slot.state is SlotState.LOADING and now - slot.load_started > load_timeout_s:
                yield LoadTimedOut(slot, slot.key)
                continue
            head = slot.calls[0] if slot.calls else None
            if head is None or head.started is None or now - head.started <= cell_timeout_s:
                continue
            slot.calls.pop(0)
            self._index.pop(head.ref, None)
            self._after_call(slot)
            yield CellTimedOut(slot, head)


def _result_if_any(ref: Any) -> dict[str, Any] | None:
    """The call's result if it already arrived (a runner may die right after returning one)."""
    ready, _ = ray.wait([ref], timeout=0)
    if not ready:
        return None
    try:
        return ray.get(ref)
    except RayError:
        return None
