"""Which cell a runner measures next (pure: no Ray). The driver owns the runners; this owns the queues.

- **Model affinity**: cells are queued per load key ``(model id, load group)``; a runner that holds a model
  takes the longest pending cell of that model, so a model is loaded once per runner.
- **Longest first** (LPT) within a key: the tail of the sweep is made of short cells.
- **Work stealing**: a runner whose model has nothing left switches (one model load) to the key that most needs
  help: first a key no runner holds, else the key with the most pending work per runner, and only when its
  pending work per runner after the switch exceeds the key's estimated load time (otherwise the switch costs
  more than it saves). This gives McNaughton's allocation on average: runners spread over keys in proportion to
  their work, with at most ``runners + keys − 1`` loads when estimates are right.
- **Estimates** come from the spec (requests × max_new_tokens × baseline factor / √concurrency) and are refined
  by measured cell times: the measured time of the same coordinates (another repeat) when known, else the spec
  estimate scaled by the measured/estimated ratio of the (model, baseline), else of the whole sweep.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field

from pd_dflash.engine import registry
from pd_dflash.spec import Cell, SweepSpec

LoadKey = tuple[str, str]

#: Relative cost of one generated token per baseline (AR decodes one token per target forward; speculative
#: baselines commit several per verify; B3 moves no expert bytes). Only a starting point: measurements rule.
BASELINE_FACTOR = {"B0": 1.0, "B1": 0.7, "B2": 0.7, "OURS": 0.6, "B3": 0.5}


@dataclass
class Task:
    cell: Cell
    #: The attempt number of the row this task will store (cumulative over runs of the sweep).
    attempt: int
    #: Times a runner died while running this cell in this run (capped by --max-attempts).
    tries: int = 0
    #: Why the last try failed (runner death), for the final ERROR row.
    last_failure: str | None = None


def load_key(engine: str, cell: Cell) -> LoadKey:
    return (cell.model, registry.load_group(engine, cell))


class Estimator:
    """Cell and load durations in seconds (relative until the first measurement arrives)."""

    def __init__(self, spec: SweepSpec) -> None:
        self.requests = spec.workload.requests
        self._by_coords: dict[tuple, list[float]] = defaultdict(list)
        self._ratio_sums: dict[tuple[str, str], list[float]] = defaultdict(lambda: [0.0, 0.0])
        self._global = [0.0, 0.0]
        self._loads: dict[LoadKey, list[float]] = defaultdict(list)

    @staticmethod
    def _coords(cell: Cell) -> tuple:
        return (cell.model, cell.baseline, cell.block_size, cell.concurrency)

    def raw(self, cell: Cell) -> float:
        tokens = self.requests * cell.max_new_tokens
        return tokens * BASELINE_FACTOR.get(cell.baseline, 1.0) / math.sqrt(cell.concurrency) * 1e-3

    def estimate(self, cell: Cell) -> float:
        same = self._by_coords.get(self._coords(cell))
        if same:
            return sum(same) / len(same)
        measured, raw = self._ratio_sums.get((cell.model, cell.baseline), (0.0, 0.0))
        if raw > 0:
            return self.raw(cell) * measured / raw
        if self._global[1] > 0:
            return self.raw(cell) * self._global[0] / self._global[1]
        return self.raw(cell)

    def observe(self, cell: Cell, seconds: float) -> None:
        self._by_coords[self._coords(cell)].append(seconds)
        pair = self._ratio_sums[(cell.model, cell.baseline)]
        pair[0] += seconds
        pair[1] += self.raw(cell)
        self._global[0] += seconds
        self._global[1] += self.raw(cell)

    def observe_load(self, key: LoadKey, seconds: float) -> None:
        self._loads[key].append(seconds)

    def load_estimate(self, key: LoadKey) -> float:
        """Measured load time of the key, else of any key, else one typical cell (a guess, on purpose)."""
        if self._loads.get(key):
            return sum(self._loads[key]) / len(self._loads[key])
        every = [s for times in self._loads.values() for s in times]
        if every:
            return sum(every) / len(every)
        return self._global[0] / max(1, len(self._by_coords)) if self._global[1] else 0.0


@dataclass
class Scheduler:
    engine: str
    estimator: Estimator
    pending: dict[LoadKey, list[Task]] = field(default_factory=lambda: defaultdict(list))

    def add(self, task: Task) -> None:
        self.pending[load_key(self.engine, task.cell)].append(task)

    def has_pending(self) -> bool:
        return any(self.pending.values())

    def pending_count(self, key: LoadKey | None = None) -> int:
        if key is not None:
            return len(self.pending.get(key, ()))
        return sum(len(v) for v in self.pending.values())

    def pending_work(self, key: LoadKey) -> float:
        return sum(self.estimator.estimate(t.cell) for t in self.pending.get(key, ()))

    def total_pending_work(self) -> float:
        return sum(self.pending_work(k) for k in self.pending)

    def take(self, key: LoadKey) -> Task | None:
        """The longest pending cell of a key (removed from the queue), or None."""
        queue = self.pending.get(key)
        if not queue:
            return None
        best = max(range(len(queue)), key=lambda i: self.estimator.estimate(queue[i].cell))
        return queue.pop(best)

    def drop_key(self, key: LoadKey) -> list[Task]:
        """Remove and return every pending task of a key (e.g. its model cannot be loaded)."""
        return self.pending.pop(key, [])

    def choose_key(self, holders: dict[LoadKey, int], current: LoadKey | None = None) -> LoadKey | None:
        """The key a runner should serve next.

        ``holders`` counts the *other* runners holding (or loading) each key. A runner keeps its ``current``
        key while it has pending cells; otherwise it moves to an unheld key (an unavoidable load) or steals
        from the busiest key when that saves more than a load costs and the key has more pending cells than
        holders. None: stay idle.
        """
        if current is not None and self.pending.get(current):
            return current
        keys = [k for k, q in self.pending.items() if q]
        if not keys:
            return None
        unheld = [k for k in keys if holders.get(k, 0) == 0]
        if unheld:
            return max(unheld, key=lambda k: (self.pending_work(k), k))
        # A key with no more pending cells than holders has nothing to give to one more runner.
        keys = [k for k in keys if len(self.pending[k]) > holders[k]]
        if not keys:
            return None
        best = max(keys, key=lambda k: (self.pending_work(k) / holders[k], k))
        if self.pending_work(best) / (holders[best] + 1) > self.estimator.load_estimate(best):
            return best
        return None
