"""The slot state machine of the runner pool (no cluster needed: the transitions are plain Python)."""

from __future__ import annotations

import pytest

from pd_dflash.sweep.pool import TRANSITIONS, RunnerPool, Slot, SlotState
from pd_dflash.sweep.preflight import Box


def slot() -> Slot:
    return Slot(
        box=Box(node_id="n", ip="127.0.0.1", label="b", resources={}, is_head=True, capacity=1), index=0
    )


def test_a_slot_moves_only_along_the_allowed_transitions():
    s = slot()
    for to in (SlotState.LOADING, SlotState.IDLE, SlotState.BUSY, SlotState.BUSY, SlotState.IDLE):
        RunnerPool._move(s, to)
        assert s.state is to
    RunnerPool._move(s, SlotState.EMPTY)
    for illegal in (SlotState.IDLE, SlotState.BUSY):  # nothing runs on a slot without a loaded runner
        with pytest.raises(RuntimeError, match="no transition from empty"):
            RunnerPool._move(s, illegal)
    assert s.state is SlotState.EMPTY
    assert all(SlotState.EMPTY in allowed for allowed in TRANSITIONS.values())  # a kill is always possible
