"""The collector actor: the only writer of the sweep directory, pinned to the head box.

It validates each row against the row contract, appends it durably (``SweepStore.add``: flush + fsync, a
duplicate of a stored cell is ignored), and rewrites the result matrices every N rows (at most every 10 s) or T
seconds, and at the end. Ray restarts it if its process dies (``max_restarts=-1``) and retries the call it was serving
(``max_task_retries=-1``); the store is reloaded from disk, so a retried row is recognised as a duplicate.
"""

from __future__ import annotations

import time
import traceback
from typing import Any

import ray

from pd_dflash.schema import parse_row
from pd_dflash.spec import SweepSpec
from pd_dflash.sweep.store import Mode, SweepStore

#: Ray's built-in resource of the head node: pins the collector next to the results directory.
HEAD_RESOURCE = "node:__internal_head__"
#: The matrices are rewritten every N rows, but not more often than this (the report costs CPU on the head).
MIN_MATRIX_INTERVAL_S = 10.0


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
        self.reconstructed = ray.get_runtime_context().was_current_actor_reconstructed
        # A restarted collector continues the same run: it must not archive again nor record a new run.
        self.store = SweepStore(out_dir, spec, Mode.RESUME if self.reconstructed else mode)
        self.run_info = run_info
        self.every_rows = every_rows
        self.every_s = every_s
        self.opened: dict[str, Any] | None = None
        self._since_matrix = 0
        self._matrix_at = time.monotonic()
        self.matrix_errors: list[str] = []

    def _ensure_open(self) -> dict[str, Any]:
        if self.opened is None:
            self.opened = self.store.open(run_info=self.run_info, new_run=not self.reconstructed)
        return self.opened

    def open(self) -> dict[str, Any]:
        """Lock and load OUT (check the fingerprint, archive on --restart, repair a torn tail)."""
        return self._ensure_open()

    def add(self, row: dict[str, Any], error_text: str | None = None) -> bool:
        """Validate and store one row; False when it duplicates a stored one."""
        self._ensure_open()
        stored = self.store.add(parse_row(row, where=f"row of cell {row.get('cell_id')}"), error_text)
        if stored:
            self._since_matrix += 1
        elapsed = time.monotonic() - self._matrix_at
        if self._since_matrix and (
            elapsed >= self.every_s
            or (self._since_matrix >= self.every_rows and elapsed >= MIN_MATRIX_INTERVAL_S)
        ):
            self._write_matrices(plots=False)
        return stored

    def update_run(self, patch: dict[str, Any]) -> None:
        self._ensure_open()
        self.store.update_run(patch)

    def _write_matrices(self, *, plots: bool) -> dict[str, Any] | None:
        self._since_matrix = 0
        self._matrix_at = time.monotonic()
        try:
            return self.store.write_matrices(plots=plots)
        except Exception as exc:  # a report failure must never cost a stored row or stop the sweep
            self.matrix_errors.append(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
            return None

    def finish(self, patch: dict[str, Any], plots: bool = True) -> dict[str, Any]:
        """Write the final matrices (with plots), record the run's outcome, release OUT."""
        self._ensure_open()
        outputs = self._write_matrices(plots=plots)
        self.store.update_run({**patch, "finished_at_collector": True})
        summary = {
            "counts": self.store.counts(),
            "outputs": _jsonable(outputs),
            "matrix_errors": list(self.matrix_errors),
            "current_statuses": {k: v.status.value for k, v in self.store.stored().items()},
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
