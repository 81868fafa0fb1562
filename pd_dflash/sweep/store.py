"""The sweep directory while a sweep runs: the collector's ``SweepStore`` (pure: no Ray).

Layout of a sweep directory ``OUT``::

    rows.jsonl          append-only source of truth, one row per line (flush + fsync per row)
    sweep.json          spec (env as names + hash), fingerprint, versions, cluster summary, runs and outcomes,
                        boxes taken out of rotation
    events.jsonl        runner deaths, requeues, timeouts, load failures, boxes out of rotation, stops (one
                        JSON object per line, appended like rows)
    errors/<cell>.txt   one file per failed cell (tracebacks, timeouts), appended per attempt
    result_matrix.*     rewritten from the current rows (pd_dflash.report), as one set: all new or none
    rows.jsonl.torn, events.jsonl.torn   torn last lines a crash left, moved aside when OUT is opened
    rows.set-aside.jsonl                 stored rows ``pd-dflash report`` would refuse, moved aside on resume
    archive/<stamp>/    what ``--restart`` moved aside (nothing is ever deleted)

Which rows count and what a run must measure (the resume rules) are in ``resume.py``.

A write that fails (disk full, I/O error) breaks the store: it raises ``StorageError`` and refuses every later
write, so nothing is appended after a failed append and the driver stops the sweep. So does a rows.jsonl that is
no longer the file the store opened (removed, replaced, written by someone else: checked before and after each
append and before the matrices): the rows would go where nobody reads them. Files are created 0640
and directories 0750 at most (the collector also runs with umask 027): results may hold unpublished figures.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shutil
import stat
import time
from collections.abc import Iterator
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pd_dflash.errors import InputError
from pd_dflash.rows import (
    ROWS_FILE,
    RowSource,
    UnsafeAppend,
    append_json,
    append_row,
    iter_rows,
    read_line_at,
    read_rows,
    repair_tail,
    repair_torn_tail,
    write_atomic,
)
from pd_dflash.schema import Row
from pd_dflash.spec import SweepSpec, expand
from pd_dflash.sweep.manifest import env_summary
from pd_dflash.sweep.out_names import (
    ERRORS_DIR,
    EVENTS_FILE,
    LOCK_FILE,
    PLOTS_DIR,
    SET_ASIDE_FILE,
    check_out_names,
    real_dir,
    refuse_link,
)
from pd_dflash.sweep.resume import (
    ARCHIVE_DIR,
    SWEEP_FILE,
    Mode,
    StoredCell,
    check_resumable,
    current_rows,
    probe_writable,
    read_sweep_json,
    row_key,
    row_mismatch,
    rows_to_set_aside,
    stored_cells,
)
from pd_dflash.sweep.staging import write_matrix_set

#: Temporary files a crash can leave (atomic rewrites, the writability probe); removed when OUT is opened.
STALE_PATTERNS = (".*.tmp*", ".probe-*")


class StorageError(RuntimeError):
    """OUT cannot be written (disk full, I/O error, permissions): nothing more can be stored."""


def utc_now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


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
        #: Why OUT cannot be written any more (the first failed write), or None.
        self.broken: str | None = None
        #: (device, inode, size, mtime) of rows.jsonl as this store last left it; None while it does not exist.
        self._rows_stat: tuple[int, int, int, int] | None = None

    @property
    def rows_path(self) -> Path:
        return self.out_dir / ROWS_FILE

    # opening ---------------------------------------------------------------------------------------------
    def open(
        self, *, run_info: dict[str, Any] | None = None, new_run: bool = True, count_restart: bool = True
    ) -> dict[str, Any]:
        """Lock OUT, check or archive what it holds, repair what a crash left, load the rows, record this run.

        ``new_run=False`` reopens for the same run: the run record is continued (a restarted collector is
        counted in it, unless ``count_restart=False``: the driver recording a lost cluster).
        """
        probe_writable(self.out_dir)
        check_out_names(self.out_dir)  # no fixed name is a link out of OUT (the lock's included)
        self._lock()
        try:
            check_out_names(self.out_dir)  # again, now that no other sweep can change OUT
            archived = None
            if self.mode == Mode.RESTART and self._has_content():
                archived = self._archive()
            check_resumable(self.out_dir, self.spec, self.mode)
            removed = self._remove_stale_files()
            torn_aside = self._load_rows()
            set_aside = self._set_aside_refused()
            events = repair_tail(self.out_dir / EVENTS_FILE)
            self._rows_stat = self._stat_rows()
            self._start_record(run_info or {}, new_run=new_run, count_restart=count_restart)
            for entry in set_aside:
                self.add_event({"event": "row_set_aside", **entry})
        except BaseException:
            self.close()
            raise
        return {
            "stored": {k: (v.status.value, v.attempt) for k, v in self._stored.items()},
            "rows": len(self.rows),
            "archived": archived,
            "torn_tail_moved_to": torn_aside,
            "set_aside": set_aside,
            "set_aside_to": str(self.out_dir / SET_ASIDE_FILE) if set_aside else None,
            "events_repaired": events.describe() if events else None,
            "removed_stale_files": removed,
        }

    def _load_rows(self) -> str | None:
        """Read the rows (a torn last line is moved aside: returns where), and index what is stored."""
        torn_aside = None
        if self.rows_path.exists():
            rows, torn = read_rows(self.rows_path, tolerate_torn_tail=True)
            if torn is not None:
                torn_aside = str(repair_torn_tail(self.rows_path, torn))
            self.rows = rows
        self._index()
        return torn_aside

    def _index(self) -> None:
        self._attempts_seen = {(row_key(row), row.attempt) for row in self.rows}
        self._stored = stored_cells(self.rows)

    def _set_aside_refused(self) -> list[dict[str, Any]]:
        """Move the stored rows ``pd-dflash report`` would refuse (``rows_to_set_aside``) to rows.set-aside.jsonl,
        verbatim with their line and reason, and rewrite rows.jsonl without them; their cells have no row now.

        The side file is written (fsynced) before rows.jsonl is replaced atomically: a crash in between leaves
        the rows in both places, and the next open sets them aside again. Nothing is lost either way.
        """
        if not self.rows:
            return []
        read = list(iter_rows(self.rows_path))
        why = rows_to_set_aside(read, self.cells)
        if not why:
            return []
        doomed = {read[i][1].offset: (read[i], reason) for i, reason in why.items()}
        entries = []
        for (row, source), reason in doomed.values():
            entries.append({"line": _line_number(source), "cell_id": row.cell_id, "reason": reason})
            text = read_line_at(source)
            append_json(self.out_dir / SET_ASIDE_FILE, {"at": utc_now(), **entries[-1], "text": text})
        _rewrite_without(self.rows_path, set(doomed))
        self.rows = [row for i, (row, _) in enumerate(read) if i not in why]
        self._index()
        return sorted(entries, key=lambda e: e["line"])

    # the rows file is still the one this store writes ------------------------------------------------------
    def _stat_rows(self) -> tuple[int, int, int, int] | None:
        try:
            st = os.stat(self.rows_path)
        except FileNotFoundError:
            return None
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)

    def check_rows_file(self) -> None:
        """StorageError (the store breaks) when rows.jsonl is not as this store left it: removed, replaced by
        another file, or written by someone else. Rows appended then would be stored where nobody reads them."""
        if self.broken:
            raise StorageError(self.broken)
        now, was = self._stat_rows(), self._rows_stat
        if now == was:
            return
        if was is None:
            what = "it appeared, written by another process"
        elif now is None:
            what = "it was removed"
        elif now[:2] != was[:2]:
            what = "it was replaced by another file"
        else:
            what = f"another process changed it (size {now[2]} bytes, {was[2]} expected)"
        self._rows_moved(what)

    def _rows_moved(self, what: str) -> None:
        self.broken = (
            f"{self.rows_path} is no longer the file this sweep writes: {what} while the sweep ran. Stopping: "
            f"{len(self.rows)} rows this sweep holds are not all in it; put the file back (or move it away) "
            "and rerun with the same --out to resume from what it then holds"
        )
        raise StorageError(self.broken)

    def _remove_stale_files(self) -> list[str]:
        """Temporary files of writes a crash interrupted (only this store writes OUT while it holds the lock)."""
        removed = []
        for folder in (self.out_dir, self.out_dir / PLOTS_DIR):
            for pattern in STALE_PATTERNS:
                for path in sorted(folder.glob(pattern)) if real_dir(folder) else []:
                    if path.is_dir() and not path.is_symlink():
                        shutil.rmtree(path)  # a staging directory of the matrices (staging.py)
                    else:
                        path.unlink(missing_ok=True)
                    removed.append(str(path.relative_to(self.out_dir)))
        return removed

    def _lock(self) -> None:
        if self._lock_fd is not None:
            return
        path = self.out_dir / LOCK_FILE
        try:  # ELOOP: a link made since check_out_names; EISDIR, ENXIO (a socket)...
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        except OSError as exc:
            raise refuse_link(exc, path) from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise InputError("must be a regular file (the sweep's lock)", where=str(path))
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
        """Record the final counts (when OUT can still be written) and release the lock."""
        if self._lock_fd is not None and self.record and not self.broken:
            with contextlib.suppress(StorageError):
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
        target.mkdir(mode=0o750, parents=True)
        for p in sorted(self.out_dir.iterdir()):
            if p.name in (ARCHIVE_DIR, LOCK_FILE):
                continue
            shutil.move(str(p), str(target / p.name))
        return str(target)

    # writing ---------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _writing(self, what: str) -> Iterator[None]:
        """Turn a failed write into ``StorageError`` and break the store: no write follows a failed one."""
        if self.broken:
            raise StorageError(self.broken)
        try:
            yield
        except OSError as exc:
            where = exc.filename or self.out_dir / what
            self.broken = f"cannot write {where}: {exc.strerror or exc} (errno {exc.errno})"
            raise StorageError(self.broken) from None

    # the record (sweep.json) -----------------------------------------------------------------------------
    def _start_record(self, run_info: dict[str, Any], *, new_run: bool, count_restart: bool = True) -> None:
        previous = read_sweep_json(self.out_dir / SWEEP_FILE)
        if not new_run and previous is not None and previous.get("runs"):
            self.record = previous
            run = self.record["runs"][-1]
            if count_restart:
                run["collector_restarts"] = run.get("collector_restarts", 0) + 1
            self._flush_record()
            return
        keep_history = previous is not None and previous.get("fingerprint") == self.spec.fingerprint()
        self.record = {
            "name": self.spec.name,
            "fingerprint": self.spec.fingerprint(),
            "cells": len(self.cells),
            "spec": {**self.spec.model_dump(mode="json"), "env": env_summary(self.spec.env)},
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
        with self._writing(SWEEP_FILE):
            write_atomic(self.out_dir / SWEEP_FILE, json.dumps(self.record, indent=2, sort_keys=False) + "\n")

    # rows and events -------------------------------------------------------------------------------------
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
        mismatch = row_mismatch(row, cell)
        if mismatch:
            raise InputError(mismatch)
        held = self._stored.get(cell.cell_id)
        if (held is not None and held.final) or (cell.cell_id, row.attempt) in self._attempts_seen:
            return False
        self.check_rows_file()
        with self._writing(ROWS_FILE):
            if error_text:
                self.write_error(row, error_text)
            append_row(self.rows_path, row)
        after, before = self._stat_rows(), self._rows_stat
        if after is None or (before is not None and after[:2] != before[:2]):
            self._rows_moved("it was removed or replaced while a row was appended")  # the row went elsewhere
        self._rows_stat = after
        self.rows.append(row)
        self._attempts_seen.add((cell.cell_id, row.attempt))
        self._stored[cell.cell_id] = StoredCell(row.status, max(row.attempt, held.attempt if held else 0))
        return True

    def add_event(self, event: dict[str, Any]) -> str | None:
        """Append one event (a runner death, a requeue, a timeout...) to events.jsonl.

        Events are not the source of truth: a torn last line found there (a crash, another writer) is moved to
        events.jsonl.torn and the event appended after it; returns what was repaired, else None.
        """
        path = self.out_dir / EVENTS_FILE
        line = {"at": utc_now(), **event}
        with self._writing(EVENTS_FILE):
            try:
                append_json(path, line)
                return None
            except UnsafeAppend:
                repaired = repair_tail(path)
                append_json(path, line)
        return f"repaired {path}: {repaired.describe()}" if repaired else None

    def write_error(self, row: Row, text: str) -> Path:
        """Append one attempt's failure to ``errors/<cell_id>.txt`` (fsynced: it outlives any crash)."""
        path = self.out_dir / ERRORS_DIR / f"{row.cell_id}.txt"
        path.parent.mkdir(mode=0o750, exist_ok=True)
        if not real_dir(path.parent):  # a link made while the sweep runs: fail the write, never follow it
            raise OSError(
                errno.ELOOP, "is not a directory of the results directory (a link?)", str(path.parent)
            )
        runner = row.runner or {}
        header = (
            f"=== {row.status.value} attempt {row.attempt} at {row.finished_at or utc_now()} "
            f"box {runner.get('box', '?')} pid {runner.get('pid', '?')} ===\n"
            f"cell: {row.model} {row.baseline} B={row.block_size} c={row.concurrency} repeat={row.repeat}\n"
            f"reason: {row.reason}\n"
        )
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o640)
        with open(fd, "a", encoding="utf-8") as fh:
            fh.write(header + text.rstrip("\n") + "\n\n")
            fh.flush()
            os.fsync(fh.fileno())
        return path

    # matrices --------------------------------------------------------------------------------------------
    def write_matrices(self, *, plots: bool = False) -> dict[str, Any] | None:
        """Rewrite result_matrix.* from the current rows as one set (``staging.write_matrix_set``), once rows.jsonl
        is checked to be the file these rows are in."""
        self.check_rows_file()
        self._flush_record()
        return write_matrix_set(self.current(), self.out_dir, self.spec, plots=plots)


def _line_number(source: RowSource) -> int:
    return int(source.label.rsplit(":", 1)[1])


def _rewrite_without(path: Path, offsets: set[int | None]) -> None:
    """Replace ``path`` atomically by its lines minus those starting at ``offsets`` (kept lines byte for byte)."""
    kept = bytearray()
    with open(path, "rb") as fh:
        offset = 0
        for line in fh:
            if offset not in offsets:
                kept += line
            offset += len(line)
    write_atomic(path, bytes(kept))
