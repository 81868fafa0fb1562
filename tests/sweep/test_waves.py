"""The driver's adaptive waves (sweep/waves.py), without a cluster: which cells each landed row asks for."""

from __future__ import annotations

import pytest

from pd_dflash.errors import InputError
from pd_dflash.schema import Row, Status
from pd_dflash.spec import cell_count, expand, parse_spec
from pd_dflash.stopping import CELL_FAILURES, DECIDED
from pd_dflash.sweep.placement import Estimator, Placement, Task
from pd_dflash.sweep.resume import Mode, check_resumable, stored_cells
from pd_dflash.sweep.store import SweepStore
from pd_dflash.sweep.waves import Waves
from tests.core.helpers import base_spec, jittered

CLEAR = [0.95, 0.96, 0.94, 0.95, 0.95]
AT_THRESHOLD = [0.7, 0.9, 0.75, 0.85, 0.8]


def spec_of(**over):
    data = base_spec(baselines=["B0", "B1", "B3", "OURS"], repeats={"min": 3, "max": 5})
    data.update(over)
    return parse_spec(data)


def row_of(cell, coverage=None):
    """c = 1 groups measure a clear coverage, c = 4 groups one at the gate's threshold (never decided)."""
    coverage = coverage or (CLEAR if cell.concurrency == 1 else AT_THRESHOLD)
    over = {"route_ahead_prefetch_coverage": coverage[cell.repeat]} if cell.baseline == "OURS" else {}
    return Row.from_result(cell, jittered(cell.baseline, cell.repeat, **over))


def land_all(waves, cells):
    """Land every cell asked for, and what each landing asks for, until nothing more is asked."""
    landed, queue = [], list(cells)
    while queue:
        cell = queue.pop(0)
        landed.append(cell)
        queue.extend(waves.landed(row_of(cell)))
    return landed


def test_decided_groups_stop_at_min_undecided_ones_run_to_max_and_a_shared_b0_cell_is_asked_once():
    s = spec_of()
    waves = Waves(s, expand(s))
    first = [c for c, _ in waves.start([], {}, Mode.RESUME)]
    assert len(first) == cell_count(s, 3) and {c.repeat for c in first} == {0, 1, 2}
    landed = land_all(waves, first)
    ids = [c.cell_id for c in landed]
    assert len(ids) == len(set(ids)), "a cell was asked for twice"
    runs = {f"B{b}|c{c}": run for (_, b, c), run in waves.runs.items()}
    assert runs["B8|c1"].stop == runs["B16|c1"].stop == DECIDED and runs["B8|c1"].repeats == 3
    assert runs["B8|c4"].repeats == runs["B16|c4"].repeats == 5 and runs["B8|c4"].stop == "max reached"
    extra = [c for c in landed if c.repeat >= 3]
    assert {c.concurrency for c in extra} == {4}
    # Per extra repeat at c = 4: B1, B3, OURS at B = 8 and 16, and one B0 cell for both groups.
    assert len(extra) == 2 * (3 * 2 + 1)
    assert not waves.open_groups()
    assert waves.describe().endswith(f"{len(landed)} cells asked for of {cell_count(s)} at fixed max")


def test_a_resumed_driver_replays_the_same_looks_and_asks_only_for_what_is_not_stored():
    s = spec_of()
    first = Waves(s, expand(s))
    cells = [c for c, _ in first.start([], {}, Mode.RESUME)]
    stored, queue = [], list(cells)
    while queue and len(stored) < cell_count(s, 3) + 3:  # killed three rows into the first added wave
        cell = queue.pop(0)
        stored.append(row_of(cell))
        queue.extend(first.landed(stored[-1]))
    again = Waves(s, expand(s))
    asked = [c for c, _ in again.start(stored, stored_cells(stored), Mode.RESUME)]
    assert {c.cell_id for c in asked} == {c.cell_id for c in queue}
    assert not {c.cell_id for c in asked} & {r.cell_id for r in stored}
    assert {g: (r.repeats, r.stop) for g, r in again.runs.items()} == {
        g: (r.repeats, r.stop) for g, r in first.runs.items()
    }


def test_a_failed_cell_stops_its_group_unless_errors_are_retried():
    s = spec_of(block_sizes=[8], concurrency=[4])
    cells = expand(s)
    rows = [row_of(c) for c in cells if c.repeat < 3]
    rows[0] = Row.without_metrics(cells[0], Status.ERROR, "boom")
    waves = Waves(s, cells)
    assert waves.start(rows, stored_cells(rows), Mode.RESUME) == []
    ((_, run),) = waves.runs.items()
    assert run.stop == CELL_FAILURES
    retried = Waves(s, cells)
    assert retried.start(rows, stored_cells(rows), Mode.RETRY_ERRORS) == [(cells[0], 2)]  # its second attempt


def test_changed_bounds_are_a_changed_spec_refused_without_restart(tmp_path):
    s = spec_of()
    store = SweepStore(tmp_path, s, Mode.RESUME)
    store.open()
    store.add(row_of(expand(s)[0]))
    store.close()
    for bounds in ({"min": 3, "max": 6}, {"min": 2, "max": 5}, 5):
        changed = spec_of(repeats=bounds)
        with pytest.raises(InputError, match=r"fingerprint is \w+ \(the measurement changed\)"):
            check_resumable(tmp_path, changed, Mode.RESUME)
        check_resumable(tmp_path, changed, Mode.RESTART)
    check_resumable(tmp_path, spec_of(), Mode.RESUME)


def test_a_runner_keeps_a_model_an_open_group_may_still_ask_a_repeat_of():
    models = [{"id": m, "preset": "micro", "draft": "micro-dflash"} for m in ("m1", "m2")]
    s = spec_of(models=models, block_sizes=[8], concurrency=[4])
    waves = Waves(s, expand(s))
    sched = Placement(s.engine, Estimator(s))
    for cell, attempt in waves.start([], {}, Mode.RESUME):
        sched.add(Task(cell=cell, attempt=attempt))
    held = next(k for k in sched.pending if k[0] == "m1")
    while sched.pending_count(held):  # m1's first repeats all taken, none landed yet
        sched.take(held)
    sched.awaiting = waves.awaiting(s.engine, None)
    assert held in sched.awaiting and sched.choose_key({}, held) == held  # its groups may still ask more
    sched.awaiting = set()
    assert sched.choose_key({}, held)[0] == "m2"  # nothing more can come: it moves on
