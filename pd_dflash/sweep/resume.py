"""Which rows count, what a run must measure, and whether OUT can take this run (pure: no Ray).

Which row stands for a cell (the *current* row): a row with a final status (every status except ERROR and
TIMEOUT) is never superseded; otherwise the last stored row of the cell is current. ``--retry-errors`` therefore
appends a new attempt after an ERROR/TIMEOUT row instead of deleting it, and every reader of a sweep directory
(the collector's matrices, ``current_rows``) sees exactly one row per cell.

Which stored rows a resume trusts is what ``pd-dflash report`` accepts (``rows_to_set_aside``): a row must belong
to its cell (identity, drafter and covered block sizes those of its cell id), and a cell's rows must pass the
report's own duplicate check (``report.aggregate.place_rows``). The others are set aside by the store and their
cells measured again.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from pd_dflash.errors import InputError
from pd_dflash.rows import ROWS_FILE, RowSource, read_rows
from pd_dflash.schema import FINAL_STATUSES, Row, Status
from pd_dflash.spec import Cell, SweepSpec, expand

SWEEP_FILE = "sweep.json"
ARCHIVE_DIR = "archive"


class Mode(str, Enum):
    """What to do with rows already in OUT."""

    RESUME = "resume"  # skip every stored cell (the default)
    RESTART = "restart"  # archive OUT's contents and start over (a changed spec is accepted)
    RETRY_ERRORS = "retry-errors"  # like resume, and rerun cells whose current row is ERROR/TIMEOUT

    def __str__(self) -> str:
        return self.value


def row_key(row: Row) -> str:
    """A row's cell: its cell id, or its upstream identity for rows written without one."""
    return row.cell_id or "|".join(str(part) for part in row.identity)


def current_rows(rows: Iterable[Row]) -> list[Row]:
    """One row per cell: the last final row when there is one, else the last row (in order of first sight)."""
    chosen: dict[str, Row] = {}
    for row in rows:
        key = row_key(row)
        held = chosen.get(key)
        if held is None or held.status not in FINAL_STATUSES:
            chosen[key] = row
    return list(chosen.values())


def current_rows_of(out_dir: str | Path) -> list[Row]:
    """The current rows of a sweep directory (a torn last line is ignored, as resume would repair it)."""
    path = Path(out_dir) / ROWS_FILE
    if not path.exists():
        return []
    rows, _ = read_rows(path, tolerate_torn_tail=True)
    return current_rows(rows)


def row_mismatch(row: Row, cell: Cell) -> str | None:
    """Why ``row`` cannot be the row of ``cell`` (its cell id), or None: the identity, the drafter, the block
    sizes it covers and the repeat's sample seed are what the cell id measures. The collector refuses such a row; resume sets it aside."""
    if row.identity != cell.identity:
        return f"row identity {row.identity} does not match cell {cell.cell_id} {cell.identity}"
    if row.draft != cell.draft:
        return f"row draft {row.draft!r} does not match cell {cell.cell_id} draft {cell.draft!r}"
    covered = tuple(sorted(set(row.block_sizes_covered or [row.block_size])))
    if covered != tuple(sorted(set(cell.block_sizes_covered))):
        return (
            f"row block_sizes_covered {list(covered)} does not match cell {cell.cell_id} "
            f"{list(cell.block_sizes_covered)}"
        )
    # Rows from before independent repeats carry no seed: they drew every repeat from repeat 0's sample.
    seed = row.sample_seed if row.sample_seed is not None or cell.repeat else cell.sample_seed
    if seed != cell.sample_seed:
        return f"row sample_seed {seed} does not match cell {cell.cell_id} sample_seed {cell.sample_seed}"
    return None


def rows_to_set_aside(rows: list[tuple[Row, RowSource]], cells: dict[str, Cell]) -> dict[int, str]:
    """{index in ``rows``: why} for every stored row ``pd-dflash report`` would refuse or that is not its cell's.

    A row that disagrees with its cell id goes; then each cell's remaining rows go through the report's own
    duplicate check (``place_rows``: a final row followed by another row of its identity is a duplicate) and a
    cell it refuses loses all its rows (which of two final rows is genuine cannot be known), so it is measured
    again. Rows of cells outside the spec are ``check_resumable``'s to refuse.
    """
    from pd_dflash.report.aggregate import place_rows
    from pd_dflash.report.brief import brief_of

    why: dict[int, str] = {}
    by_cell: dict[str, list[int]] = {}
    for i, (row, _) in enumerate(rows):
        cell = cells.get(row.cell_id or "")
        if cell is None:
            continue
        mismatch = row_mismatch(row, cell)
        if mismatch:
            why[i] = mismatch
        else:
            by_cell.setdefault(cell.cell_id, []).append(i)
    for members in by_cell.values():
        if len(members) < 2:
            continue
        try:
            place_rows([brief_of(rows[i][0]) for i in members], [rows[i][1].label for i in members])
        except InputError as exc:
            why.update({i: str(exc) for i in members})
    return why


@dataclass(frozen=True)
class StoredCell:
    status: Status
    #: The highest attempt stored for the cell; a retry is stored as attempt + 1.
    attempt: int

    @property
    def final(self) -> bool:
        return self.status in FINAL_STATUSES


def stored_cells(rows: Iterable[Row]) -> dict[str, StoredCell]:
    rows = list(rows)
    attempts: dict[str, int] = {}
    for row in rows:
        attempts[row_key(row)] = max(attempts.get(row_key(row), 0), row.attempt)
    return {row_key(r): StoredCell(r.status, attempts[row_key(r)]) for r in current_rows(rows)}


def cells_to_run(cells: list[Cell], stored: dict[str, StoredCell], mode: Mode) -> list[tuple[Cell, int]]:
    """(cell, attempt of its next row) for every cell this run must measure, in expansion order."""
    todo = []
    for cell in cells:
        held = stored.get(cell.cell_id)
        if held is None:
            todo.append((cell, 1))
        elif mode == Mode.RETRY_ERRORS and not held.final:
            todo.append((cell, held.attempt + 1))
    return todo


def read_sweep_json(path: Path) -> dict[str, Any] | None:
    if not path.exists():
        return None
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise InputError(f"cannot read the sweep record: {exc}", where=str(path)) from None
    if not isinstance(data, dict):
        raise InputError("the sweep record must be a JSON object", where=str(path))
    return data


def check_resumable(out_dir: Path, spec: SweepSpec, mode: Mode) -> None:
    """Raise InputError when OUT holds rows of another spec and the mode does not allow replacing them."""
    if mode == Mode.RESTART:
        return
    rows_path = out_dir / ROWS_FILE
    if not rows_path.exists():
        return
    rows, torn = read_rows(rows_path, tolerate_torn_tail=True)
    if not rows and torn is None:
        return
    fingerprint = spec.fingerprint()
    record = read_sweep_json(out_dir / SWEEP_FILE)
    stored_fp = record.get("fingerprint") if record else None
    if stored_fp is not None and stored_fp != fingerprint:
        raise InputError(
            f"holds {len(rows)} rows of a spec with fingerprint {stored_fp}, but this spec's fingerprint is "
            f"{fingerprint} (the measurement changed). Use --restart to archive them under "
            f"{ARCHIVE_DIR}/ and start over, or choose another --out",
            where=str(out_dir),
        )
    expected = {c.cell_id for c in expand(spec)}
    foreign = sorted({row_key(r) for r in rows} - expected)
    if foreign:
        raise InputError(
            f"{ROWS_FILE} holds {len(foreign)} cells that are not in this spec (e.g. {foreign[0]}) "
            f"and {'no ' + SWEEP_FILE + ' names their spec' if stored_fp is None else 'the record is inconsistent'}"
            ". Use --restart to archive them and start over, or choose another --out",
            where=str(out_dir),
        )


def probe_writable(out_dir: Path) -> None:
    """Create OUT and write, fsync and remove a probe file there; InputError when that fails."""
    try:
        out_dir.mkdir(mode=0o750, parents=True, exist_ok=True)
        # a fresh name, created exclusively: a link left under that name is never followed out of OUT
        probe = out_dir / f".probe-{os.getpid()}-{secrets.token_hex(4)}"
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, b"probe\n")
            os.fsync(fd)
        finally:
            os.close(fd)
            probe.unlink()
    except OSError as exc:
        raise InputError(
            f"results directory is not writable: {exc.strerror or exc}", where=str(out_dir)
        ) from None
