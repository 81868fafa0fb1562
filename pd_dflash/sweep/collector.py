"""The collector actor: the only writer of the sweep directory, pinned to the head box.

It takes each row as the runner or the driver validated it (a ``Row``, never re-validated: neither hands it
anything unchecked), removes the spec's env values from what it stores, appends the
row durably (``SweepStore.add``: flush + fsync, a duplicate of a stored cell is ignored), appends events, and
rewrites the result matrices every N rows or T seconds, and at the end. A failed write breaks the store: every
later ``add`` raises ``StorageError``, which the driver takes as the order to stop. Ray restarts the collector if
its process dies (``max_restarts=-1``) and retries the call it was serving (``max_task_retries=-1``); the store
is reloaded from disk, so a retried row is recognised as a duplicate.
"""

from __future__ import annotations

import contextlib
import os
import time
import traceback
from typing import Any

import ray

from pd_dflash.schema import Row
from pd_dflash.spec import SweepSpec
from pd_dflash.sweep.manifest import redact
from pd_dflash.sweep.resume import Mode
from pd_dflash.sweep.store import StorageError, SweepStore

#: Ray's built-in resource of the head node: pins the collector next to the results directory.
HEAD_RESOURCE = "node:__internal_head__"
#: The matrices are rewritten every N rows, but not more often than this (the report costs CPU on the head)...
MIN_MATRIX_INTERVAL_S = 10.0
#: ...nor more often than this many times the last rewrite took (the report of a large sweep takes seconds).
MATRIX_COST_FACTOR = 10.0
#: The row fields an engine or a runner may echo an environment value into; they are redacted before storing.
REDACTED_FIELDS = frozenset({"engine", "runner", "reason", "warnings"})
#: Files the collector creates are 0640, its directories 0750.
UMASK = 0o027


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1, resources={HEAD_RESOURCE: 0.001})
class Collector:
    def __init__(
        self,
        out_dir: str,
        spec: SweepSpec,
        mode: Mode,
        run_info: dict[str, Any],
        every_rows: int = 20,
        every_s: float = 30.0,
    ) -> None:
        os.umask(UMASK)  # this process writes only OUT
        self.reconstructed = ray.get_runtime_context().was_current_actor_reconstructed
        # A restarted collector continues the same run: it must not archive again nor record a new run.
        self.store = SweepStore(out_dir, spec, Mode.RESUME if self.reconstructed else mode)
        self.env = dict(spec.env)
        self.run_info = run_info
        self.every_rows = every_rows
        self.every_s = every_s
        self.opened: dict[str, Any] | None = None
        self._since_matrix = 0
        self._matrix_at = time.monotonic()
        self._matrix_interval = MIN_MATRIX_INTERVAL_S
        self.matrix_errors: list[str] = []
        #: The final matrices' verdict (``final_matrices``), and whether they were written by this process.
        self.final: dict[str, Any] | None = None
        self.final_written = False

    def _ensure_open(self) -> dict[str, Any]:
        if self.opened is None:
            self.opened = self.store.open(run_info=self.run_info, new_run=not self.reconstructed)
        return self.opened

    def open(self) -> dict[str, Any]:
        """Lock and load OUT (check the fingerprint, archive on --restart, repair what a crash left)."""
        return self._ensure_open()

    def add(self, row: Row, error_text: str | None = None) -> bool:
        """Redact and store one validated row; False when it duplicates a stored one. Raises ``StorageError``."""
        self._ensure_open()
        if self.store.broken:
            raise StorageError(self.store.broken)
        if not isinstance(row, Row):
            raise TypeError(f"the collector stores validated rows (schema.Row), got {type(row).__name__}")
        stored = self.store.add(self._redacted(row), redact(error_text, self.env))
        if stored:
            self._since_matrix += 1
        elapsed = time.monotonic() - self._matrix_at
        if self._since_matrix and (
            elapsed >= max(self.every_s, self._matrix_interval)
            or (self._since_matrix >= self.every_rows and elapsed >= self._matrix_interval)
        ):
            self._write_matrices(plots=False)
        return stored

    def _redacted(self, row: Row) -> Row:
        """``row`` with the spec's env values replaced in the fields that may echo them, in their stored (JSON)
        form: redaction only replaces text, so the row stays what the runner validated."""
        echoed = row.model_dump(mode="json", include=REDACTED_FIELDS)
        return row.model_copy(update={k: redact(v, self.env) for k, v in echoed.items()})

    def event(self, event: dict[str, Any]) -> str | None:
        """Append an event (runner death, requeue, timeout, ...) to events.jsonl; returns what was repaired
        there (a torn last line moved aside), else None. Raises ``StorageError``."""
        self._ensure_open()
        return self.store.add_event(redact(event, self.env))

    def current_rows(self) -> list[Row]:
        """The current row of every stored cell (``resume.current_rows``)."""
        self._ensure_open()
        return self.store.current()

    def update_run(self, patch: dict[str, Any]) -> None:
        self._ensure_open()
        self.store.update_run(patch)

    def _write_matrices(self, *, plots: bool) -> dict[str, Any] | None:
        self._since_matrix = 0
        started = time.monotonic()
        try:
            return self.store.write_matrices(plots=plots)
        except Exception as exc:  # a report failure must never cost a stored row or stop the sweep
            self.matrix_errors.append(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            return None
        finally:
            self._matrix_at = time.monotonic()
            cost = self._matrix_at - started
            self._matrix_interval = max(MIN_MATRIX_INTERVAL_S, MATRIX_COST_FACTOR * cost)

    def final_matrices(self, plots: bool = True) -> None:
        """Write the final matrices from every row stored (the driver then decides the outcome: ``finish``)."""
        self._ensure_open()
        with contextlib.suppress(StorageError):  # rows.jsonl still the file the rows went to? (store.broken)
            self.store.check_rows_file()
        self.final = None if self.store.broken else self._write_matrices(plots=plots)
        self.final_written = True

    def finish(self, patch: dict[str, Any], plots: bool = True) -> dict[str, Any]:
        """Record the run's outcome and release OUT (as far as OUT can be written); the final matrices first,
        unless ``final_matrices`` wrote them (a collector restarted in between writes them again)."""
        self._ensure_open()
        if not self.final_written:
            self.final_matrices(plots)
        with contextlib.suppress(StorageError):  # store.broken says why; the driver reports it
            self.store.update_run({**patch, "finished_at_collector": True})
        summary = {
            "counts": self.store.counts(),
            "outputs": _jsonable(self.final),
            "matrix_errors": list(self.matrix_errors),
            "current_statuses": {k: v.status.value for k, v in self.store.stored().items()},
            "refused_input": sum(r.counted_refusal for r in self.store.current()),
            "storage_error": self.store.broken,
        }
        self.store.close()
        self.opened = None
        return summary


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)
