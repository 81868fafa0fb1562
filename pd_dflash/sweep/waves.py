"""Adaptive repeats in the driver: a group gets one more repeat only while its verdict is undecided.

Every group starts with ``min`` repeats. Once all of a group's repeats so far have rows, it is looked at
(``report.adaptive.Design``: its verdict gates on the stopping rule's intervals). While a gate is INCONCLUSIVE and
it has fewer than ``max`` repeats, every cell of its next repeat is requested; a B0 cell shared by several groups
is requested once, by the first that asks. A decided group, one at max and one whose cells failed ask for
nothing more. Other groups' cells keep running meanwhile: the driver only adds tasks to the placement queues, so
model affinity and the placement bound hold as for any cell.

The cells of every repeat up to ``max`` are expanded from the start, so an added repeat has the id it always had;
on resume the looks are replayed from the stored rows (a look reads only repeats below its count, so a row that
landed early changes nothing) and reach the same decisions: no cell is measured twice.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence

from pd_dflash.engine.registry import EngineTraits
from pd_dflash.report.adaptive import Design, GroupRun, replay
from pd_dflash.schema import FINAL_STATUSES, Row
from pd_dflash.spec import Cell, SweepSpec
from pd_dflash.stopping import STOP_REASONS
from pd_dflash.sweep.placement import LoadKey, load_key
from pd_dflash.sweep.resume import Mode, StoredCell, cells_to_run


class Waves:
    def __init__(self, spec: SweepSpec, cells: Sequence[Cell]) -> None:
        self.design = Design(spec, cells)
        self.gates = spec.gates
        self.rows: dict[tuple, Row] = {}
        self.runs = {gid: GroupRun(self.design.bounds.min) for gid in self.design.members}
        self.requested: set[str] = set()
        #: Rows stored since the last ``due`` (the driver's sink appends each one).
        self.arrived: list[Row] = []
        self.stored: dict[str, StoredCell] = {}
        self.mode = Mode.RESUME

    def _keep(self, row: Row) -> None:
        held = self.rows.get(row.identity)
        if held is None or held.status not in FINAL_STATUSES:
            self.rows[row.identity] = row

    def _request(self, gid: tuple, repeats: int) -> list[Cell]:
        """The group's cells up to ``repeats`` that no group asked for yet and that have no row."""
        out = []
        for cell in self.design.cells_of(gid, repeats):
            if cell.cell_id not in self.requested:
                self.requested.add(cell.cell_id)
                if cell.identity not in self.rows:
                    out.append(cell)
        return out

    def start(self, rows: Iterable[Row], stored: dict[str, StoredCell], mode: Mode) -> list[tuple[Cell, int]]:
        """Replay the looks the stored rows allow; (cell, attempt) of every cell the groups need now.

        With ``--retry-errors`` a stored ERROR/TIMEOUT row is not read: its cell runs again and is looked at then.
        """
        self.stored, self.mode = stored, mode
        for row in rows:
            if row.identity in self.design.groups_of and (
                mode != Mode.RETRY_ERRORS or row.status in FINAL_STATUSES
            ):
                self._keep(row)
        self.runs = replay(self.design, self.rows.values(), self.gates)
        needed = [c for gid, run in self.runs.items() for c in self._request(gid, run.repeats)]
        return cells_to_run(needed, stored, mode)

    def due(self) -> Iterator[tuple[Cell, int]]:
        """(cell, attempt) of the repeats the rows stored since ask for; a row stored meanwhile (a refusal of a
        cell just asked for) is taken too."""
        while self.arrived:
            yield from cells_to_run(self.landed(self.arrived.pop(0)), self.stored, self.mode)

    def landed(self, row: Row) -> list[Cell]:
        """A row was stored: take the looks it completes; the cells of the repeats that asks for."""
        groups = self.design.groups_of.get(row.identity)
        if not groups:
            return []
        self._keep(row)
        out: list[Cell] = []
        for gid in groups:
            run = self.runs[gid]
            if self.design.advance(gid, run, self.rows, self.gates):
                out.extend(self._request(gid, run.repeats))
        return out

    def open_groups(self) -> list[tuple]:
        return [gid for gid, run in self.runs.items() if run.stop is None]

    def awaiting(self, engine: str, traits: EngineTraits | None) -> set[LoadKey]:
        """The load keys an open group may still ask a repeat of (a runner holding one keeps it)."""
        keys = set()
        for gid in self.open_groups():
            run = self.runs[gid]
            if run.repeats < self.design.bounds.max:
                keys.update(load_key(engine, c, traits) for c in self.design.members[gid][run.repeats])
        return keys

    def describe(self) -> str:
        """One line for the log: how the groups stopped and the cells asked for against the fixed-max design."""
        stopped = dict.fromkeys(STOP_REASONS, 0)
        for run in self.runs.values():
            if run.stop:
                stopped[run.stop] += 1
        parts = [f"{n} {why}" for why, n in stopped.items() if n]
        if self.open_groups():
            parts.append(f"{len(self.open_groups())} not stopped")
        bounds = self.design.bounds
        at_max = sum(len(per) for cells in self.design.members.values() for per in cells)
        shared = at_max - len(
            {c.cell_id for cells in self.design.members.values() for per in cells for c in per}
        )
        return (
            f"adaptive repeats ({bounds.min}-{bounds.max}): {len(self.runs)} groups, {', '.join(parts)}; "
            f"{len(self.requested)} cells asked for of {at_max - shared} at fixed max"
        )
