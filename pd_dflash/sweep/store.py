"""The sweep directory and the resume rules, in one place (pure: no Ray).

Layout of a sweep directory ``OUT``::

    rows.jsonl          append-only source of truth, one row per line (flush + fsync per row)
    sweep.json          spec, fingerprint, versions, cluster summary, runs, boxes taken out of rotation
    errors/<cell>.txt   one file per failed cell (tracebacks, timeouts), appended per attempt
    result_matrix.*     rewritten atomically from the current rows (pd_dflash.report)
    archive/<stamp>/    what ``--restart`` moved aside (nothing is ever deleted)

Which row stands for a cell (the *current* row): a row with a final status (every status except ERROR and
TIMEOUT) is never superseded; otherwise the last stored row of the cell is current. ``--retry-errors`` therefore
appends a new attempt after an ERROR/TIMEOUT row instead of deleting it, and every reader of a sweep directory
(the collector's matrices, ``current_rows``) sees exactly one row per cell.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timezone
from enum import Enum
from pathlib import Path
from typing import Any

from pd_dflash.errors import InputError
from pd_dflash.rows import ROWS_FILE, append_row, read_rows, repair_torn_tail, write_atomic
from pd_dflash.schema import FINAL_STATUSES, Row, Status
from pd_dflash.spec import Cell, SweepSpec, expand

SWEEP_FILE = "sweep.json"
ERRORS_DIR = "errors"
ARCHIVE_DIR = "archive"
LOCK_FILE = ".lock"


class Mode(str, Enum):
    """What to do with rows already in OUT."""

    RESUME = "resume"  # skip every stored cell (the default)
    RESTART = "restart"  # archive OUT's contents and start over (a changed spec is accepted)
    RETRY_ERRORS = "retry-errors"  # like resume, and rerun cells whose current row is ERROR/TIMEOUT

    def __str__(self) -> str:
        return self.value


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


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


# -- read-only inspection (preflight) ---------------------------------------------------------------------


def _read_sweep_json(path: Path) -> dict[str, Any] | None:
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
    record = _read_sweep_json(out_dir / SWEEP_FILE)
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
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / f".probe-{os.getpid()}"
        with open(probe, "w") as fh:
            fh.write("probe\n")
            fh.flush()
            os.fsync(fh.fileno())
        probe.unlink()
    except OSError as exc:
        raise InputError(
            f"results directory is not writable: {exc.strerror or exc}", where=str(out_dir)
        ) from None


# -- the store (owned by the collector) -------------------------------------------------------------------


class SweepStore:
    """Owns one sweep directory while a sweep runs: holds its lock, appends rows, rewrites the matrices."""

    def __init__(self, out_dir: str | Path, spec: SweepSpec, mode: Mode) -> None:
        self.out_dir = Path(out_dir)
        self.spec = spec
        self.mode = mode
        self.cells = {c.cell_id: c for c in expand(spec)}
        self.rows: list[Row] = []
        self._attempts_seen: set[tuple[str, int]] = set()
        self._stored: dict[str, StoredCell] = {}
        self._lock_fd: int | None = None
        self.record: dict[str, Any] = {}

    @property
    def rows_path(self) -> Path:
        return self.out_dir / ROWS_FILE

    # opening ---------------------------------------------------------------------------------------------
    def open(self, *, run_info: dict[str, Any] | None = None, new_run: bool = True) -> dict[str, Any]:
        """Lock OUT, check or archive what it holds, repair a torn tail, load the rows, record this run.

        ``new_run=False`` reopens for the same run (a restarted collector): the run record is continued.
        """
        probe_writable(self.out_dir)
        self._lock()
        try:
            archived = None
            if self.mode == Mode.RESTART and self._has_content():
                archived = self._archive()
            check_resumable(self.out_dir, self.spec, self.mode)
            torn_aside = None
            if self.rows_path.exists():
                rows, torn = read_rows(self.rows_path, tolerate_torn_tail=True)
                if torn is not None:
                    torn_aside = str(repair_torn_tail(self.rows_path, torn))
                self.rows = rows
            for row in self.rows:
                self._attempts_seen.add((row_key(row), row.attempt))
            self._stored = stored_cells(self.rows)
            self._start_record(run_info or {}, new_run=new_run)
        except BaseException:
            self.close()
            raise
        return {
            "stored": {k: (v.status.value, v.attempt) for k, v in self._stored.items()},
            "rows": len(self.rows),
            "archived": archived,
            "torn_tail_moved_to": torn_aside,
        }

    def _lock(self) -> None:
        if self._lock_fd is not None:
            return
        fd = os.open(self.out_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise InputError(
                "another pd-dflash run is writing this results directory (its lock is held)",
                where=str(self.out_dir),
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    def close(self) -> None:
        """Record the final counts and release the lock."""
        if self._lock_fd is not None and self.record:
            self._flush_record()
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def _has_content(self) -> bool:
        return any(p.name not in (ARCHIVE_DIR, LOCK_FILE) for p in self.out_dir.iterdir())

    def _archive(self) -> str:
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        target = self.out_dir / ARCHIVE_DIR / stamp
        n = 1
        while target.exists():
            n += 1
            target = self.out_dir / ARCHIVE_DIR / f"{stamp}-{n}"
        target.mkdir(parents=True)
        for p in sorted(self.out_dir.iterdir()):
            if p.name in (ARCHIVE_DIR, LOCK_FILE):
                continue
            shutil.move(str(p), str(target / p.name))
        return str(target)

    # the record (sweep.json) -----------------------------------------------------------------------------
    def _start_record(self, run_info: dict[str, Any], *, new_run: bool) -> None:
        previous = _read_sweep_json(self.out_dir / SWEEP_FILE)
        if not new_run and previous is not None and previous.get("runs"):
            self.record = previous
            run = self.record["runs"][-1]
            run["collector_restarts"] = run.get("collector_restarts", 0) + 1
            self._flush_record()
            return
        keep_history = previous is not None and previous.get("fingerprint") == self.spec.fingerprint()
        self.record = {
            "name": self.spec.name,
            "fingerprint": self.spec.fingerprint(),
            "cells": len(self.cells),
            "spec": self.spec.model_dump(mode="json"),
            "created_at": (previous or {}).get("created_at", utc_now()) if keep_history else utc_now(),
            "updated_at": utc_now(),
            "runs": list((previous or {}).get("runs", [])) if keep_history else [],
        }
        self.record["runs"].append({"started_at": utc_now(), "mode": str(self.mode), **run_info})
        self.record["cluster"] = run_info.get("cluster")
        self.record["out_of_rotation"] = []
        self._flush_record()

    def update_run(self, patch: dict[str, Any]) -> None:
        """Merge facts about the current run (cluster, out-of-rotation boxes, outcome) into sweep.json."""
        self.record["runs"][-1].update(patch)
        if "out_of_rotation" in patch:
            self.record["out_of_rotation"] = patch["out_of_rotation"]
        if "cluster" in patch:
            self.record["cluster"] = patch["cluster"]
        self._flush_record()

    def _flush_record(self) -> None:
        self.record["updated_at"] = utc_now()
        self.record["counts"] = self.counts()
        write_atomic(self.out_dir / SWEEP_FILE, json.dumps(self.record, indent=2, sort_keys=False) + "\n")

    # rows ------------------------------------------------------------------------------------------------
    def stored(self) -> dict[str, StoredCell]:
        return dict(self._stored)

    def current(self) -> list[Row]:
        return current_rows(self.rows)

    def counts(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for held in self._stored.values():
            counts[held.status.value] = counts.get(held.status.value, 0) + 1
        counts["stored"] = len(self._stored)
        counts["total"] = len(self.cells)
        return counts

    def add(self, row: Row, error_text: str | None = None) -> bool:
        """Store a row unless it duplicates one: a final row of its cell, or the same attempt of the cell.

        A row must belong to this spec (its cell id and identity); anything else is a bug and raises.
        """
        cell = self.cells.get(row.cell_id or "")
        if cell is None:
            raise InputError(f"row for unknown cell {row.cell_id!r} (not in spec {self.spec.name})")
        if row.identity != cell.identity:
            raise InputError(
                f"row identity {row.identity} does not match cell {cell.cell_id} {cell.identity}"
            )
        if row.draft != cell.draft:  # the drafter is part of what the cell id measures
            raise InputError(
                f"row draft {row.draft!r} does not match cell {cell.cell_id} draft {cell.draft!r}"
            )
        held = self._stored.get(cell.cell_id)
        if (held is not None and held.final) or (cell.cell_id, row.attempt) in self._attempts_seen:
            return False
        if error_text:
            self.write_error(row, error_text)
        append_row(self.rows_path, row)
        self.rows.append(row)
        self._attempts_seen.add((cell.cell_id, row.attempt))
        self._stored[cell.cell_id] = StoredCell(row.status, max(row.attempt, held.attempt if held else 0))
        return True

    def write_error(self, row: Row, text: str) -> Path:
        """Append one attempt's failure to ``errors/<cell_id>.txt`` (fsynced: it outlives any crash)."""
        path = self.out_dir / ERRORS_DIR / f"{row.cell_id}.txt"
        path.parent.mkdir(exist_ok=True)
        runner = row.runner or {}
        header = (
            f"=== {row.status.value} attempt {row.attempt} at {row.finished_at or utc_now()} "
            f"box {runner.get('box', '?')} pid {runner.get('pid', '?')} ===\n"
            f"cell: {row.model} {row.baseline} B={row.block_size} c={row.concurrency} repeat={row.repeat}\n"
            f"reason: {row.reason}\n"
        )
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(header + text.rstrip("\n") + "\n\n")
            fh.flush()
            os.fsync(fh.fileno())
        return path

    # matrices --------------------------------------------------------------------------------------------
    def write_matrices(self, *, plots: bool = False) -> dict[str, Any] | None:
        """Rewrite result_matrix.* from the current rows (the report writes each file atomically)."""
        from pd_dflash.report import write_outputs

        self._flush_record()
        return write_outputs(self.current(), self.out_dir, self.spec.gates, plots=plots, spec=self.spec)
