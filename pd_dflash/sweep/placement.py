"""Which cell a runner measures next (pure: no Ray). The driver owns the runners; this owns the queues.

- **Model affinity**: cells are queued per load key ``(model id, load group)``; a runner that holds a model
  takes the longest pending cell of that model, so a model is loaded once per runner.
- **Longest first** (LPT) within a key: the tail of the sweep is made of short cells.
- **Work stealing**: a runner whose model has nothing left switches (one model load) to the key that most needs
  help: first a key no runner holds, else the key with the most pending work per runner, and only when its
  pending work per runner after the switch exceeds the key's estimated load time (otherwise the switch costs
  more than it saves). This gives McNaughton's allocation on average: runners spread over keys in proportion to
  their work, with at most ``runners + keys − 1`` loads when estimates are right.
- **Estimates** come from the spec (requests × max_new_tokens × baseline factor × concurrency^b) and are fitted
  to measured cell times as they arrive: the concurrency exponent b over the whole sweep, a scale per (model,
  baseline), and the measured time itself for another repeat of the same coordinates (see ``Estimator``).
"""

from __future__ import annotations

import math
from collections import defaultdict, deque
from dataclasses import dataclass, field

from pd_dflash.baselines import configuration
from pd_dflash.engine import registry
from pd_dflash.engine.registry import EngineTraits
from pd_dflash.spec import Cell, SweepSpec

LoadKey = tuple[str, str]
#: Cells with the same estimate (``Estimator.group``): the queues of a key are kept per group, so picking the
#: longest cell costs one estimate per group, not per pending cell, however many repeats a sweep has.
GroupKey = tuple


@dataclass
class Task:
    cell: Cell
    #: The attempt number of the row this task will store (cumulative over runs of the sweep).
    attempt: int
    #: Times a runner died while running this cell in this run (capped by --max-attempts).
    tries: int = 0
    #: Why the last try failed (runner death), for the final ERROR row.
    last_failure: str | None = None


def load_key(engine: str, cell: Cell, traits: EngineTraits | None = None) -> LoadKey:
    """The cell's model and load group; pass ``traits`` to avoid importing a custom engine here."""
    group = registry.load_group_for(traits, cell) if traits else registry.load_group(engine, cell)
    return (cell.model, group)


class Estimator:
    """Cell and load durations in seconds.

    A cell of (model, baseline) group g is modelled as ``tokens x baseline factor x exp(a_g + b log c)``: b, how
    time scales with concurrency c, is the within-group least-squares slope over every measured cell (-0.5 until
    some group has two concurrency levels measured); a_g is the group's mean log residual (relative units before
    any measurement). The measured time of the same
    coordinates (another repeat) wins when there is one. A group not measured yet takes its model's mean scale
    (models differ more than baselines), else the sweep's. Running sums keep every estimate O(1).
    """

    DEFAULT_SLOPE = -0.5
    UNMEASURED_INTERCEPT = math.log(1e-3)

    def __init__(self, spec: SweepSpec) -> None:
        self.requests = spec.workload.requests
        #: coordinates -> [n, sum of seconds] of the cells measured there
        self._by_coords: dict[tuple, list[float]] = {}
        #: (model, baseline) -> [n, sum x, sum y, sum xx, sum xy] with x = log c, y = log(seconds / base)
        self._groups: dict[tuple[str, str], list[float]] = {}
        #: model -> [n, sum x, sum y]: the scale of a model's baselines not measured yet
        self._models: dict[str, list[float]] = {}
        self._slope = self.DEFAULT_SLOPE
        self._mean_intercept = self.UNMEASURED_INTERCEPT
        self._cells_seen = 0
        self._seconds_seen = 0.0
        self._loads: dict[LoadKey, list[float]] = defaultdict(list)
        self._estimates: dict[GroupKey, float] = {}

    @staticmethod
    def _coords(cell: Cell) -> tuple:
        return (cell.model, cell.baseline, cell.block_size, cell.concurrency)

    @classmethod
    def group(cls, cell: Cell) -> GroupKey:
        """What the estimate depends on: cells of one group always have the same estimate."""
        return (*cls._coords(cell), cell.max_new_tokens)

    def _base(self, cell: Cell) -> float:
        return self.requests * cell.max_new_tokens * configuration(cell.baseline).placement_factor

    @property
    def slope(self) -> float:
        return self._slope

    def estimate(self, cell: Cell) -> float:
        """Seconds (relative units before any measurement); cached per group until the next observation."""
        key = self.group(cell)
        cached = self._estimates.get(key)
        if cached is None:
            cached = self._estimates[key] = self._estimate(cell)
        return cached

    def _estimate(self, cell: Cell) -> float:
        same = self._by_coords.get(self._coords(cell))
        if same:
            return same[1] / same[0]
        group = self._groups.get((cell.model, cell.baseline)) or self._models.get(cell.model)
        intercept = (group[2] - self._slope * group[1]) / group[0] if group else self._mean_intercept
        return self._base(cell) * math.exp(intercept + self._slope * math.log(cell.concurrency))

    def observe(self, cell: Cell, seconds: float) -> None:
        self._estimates.clear()
        same = self._by_coords.setdefault(self._coords(cell), [0, 0.0])
        same[0] += 1
        same[1] += seconds
        self._cells_seen += 1
        self._seconds_seen += seconds
        x, y = math.log(cell.concurrency), math.log(max(seconds, 1e-6) / self._base(cell))
        g = self._groups.setdefault((cell.model, cell.baseline), [0.0, 0.0, 0.0, 0.0, 0.0])
        m = self._models.setdefault(cell.model, [0.0, 0.0, 0.0])
        for i, v in enumerate((1.0, x, y, x * x, x * y)):
            g[i] += v
            if i < 3:
                m[i] += v
        num = den = 0.0
        for n, sx, sy, sxx, sxy in self._groups.values():
            num += sxy - sx * sy / n
            den += sxx - sx * sx / n
        self._slope = num / den if den > 1e-9 else self.DEFAULT_SLOPE
        total = sum(g[0] for g in self._groups.values())
        self._mean_intercept = sum(g[2] - self._slope * g[1] for g in self._groups.values()) / total

    def measured(self, model: str) -> bool:
        """Whether a cell of this model has been measured (its estimates are then in seconds)."""
        return model in self._models

    def observe_load(self, key: LoadKey, seconds: float) -> None:
        self._loads[key].append(seconds)

    def load_estimate(self, key: LoadKey) -> float:
        """Measured load time of the key, else of any key, else one typical cell (a guess, on purpose)."""
        if self._loads.get(key):
            return sum(self._loads[key]) / len(self._loads[key])
        every = [s for times in self._loads.values() for s in times]
        if every:
            return sum(every) / len(every)
        return self._seconds_seen / self._cells_seen if self._cells_seen else 0.0


@dataclass
class Placement:
    engine: str
    estimator: Estimator
    #: The engine's traits when the caller has them (the driver gets a custom engine's from preflight).
    traits: EngineTraits | None = None
    #: key -> estimate group -> tasks in arrival order; empty groups and keys are removed.
    pending: dict[LoadKey, dict[GroupKey, deque[Task]]] = field(default_factory=dict)
    _counts: dict[LoadKey, int] = field(default_factory=lambda: defaultdict(int))
    #: Keys with nothing pending that an adaptive group may still ask a repeat of (``waves.Waves.awaiting``): a
    #: runner holding one keeps it rather than load another model and come back.
    awaiting: set[LoadKey] = field(default_factory=set)

    def add(self, task: Task) -> None:
        key = load_key(self.engine, task.cell, self.traits)
        groups = self.pending.setdefault(key, {})
        groups.setdefault(Estimator.group(task.cell), deque()).append(task)
        self._counts[key] += 1

    def has_pending(self) -> bool:
        return any(self._counts.values())

    def pending_count(self, key: LoadKey | None = None) -> int:
        if key is not None:
            return self._counts.get(key, 0)
        return sum(self._counts.values())

    def pending_work(self, key: LoadKey) -> float:
        groups = self.pending.get(key, {})
        return sum(len(q) * self.estimator.estimate(q[0].cell) for q in groups.values())

    def total_pending_work(self) -> float:
        return sum(self.pending_work(k) for k in self.pending)

    def take(self, key: LoadKey) -> Task | None:
        """The longest pending cell of a key (removed from the queue), or None."""
        groups = self.pending.get(key)
        if not groups:
            return None
        best = max(groups, key=lambda g: self.estimator.estimate(groups[g][0].cell))
        task = groups[best].popleft()
        if not groups[best]:
            del groups[best]
            if not groups:
                del self.pending[key]
        self._counts[key] -= 1
        return task

    def drop_key(self, key: LoadKey) -> list[Task]:
        """Remove and return every pending task of a key (e.g. its model cannot be loaded)."""
        self._counts.pop(key, None)
        return [t for q in self.pending.pop(key, {}).values() for t in q]

    def choose_key(
        self, holders: dict[LoadKey, int], current: LoadKey | None = None, *, rebalance: bool = False
    ) -> LoadKey | None:
        """The key a runner should serve next (None: stay idle).

        ``holders`` counts the *other* runners holding (or loading) each key. A runner whose key has pending
        cells keeps it, unless ``rebalance`` allows a move (see ``rebalance_target``). A runner without work
        takes a key no runner holds first (an unavoidable load), else steals from the key with the most pending
        work per holder, W/h, when the switch pays: one more runner that first loads for L seconds finishes the
        key at (W + L)/(h + 1) instead of W/h; it steals when W/(h + 1) > L, i.e. when the time saved is of the
        order of the load it costs.
        """
        if current is not None and self._counts.get(current):
            return (self.rebalance_target(holders, current) if rebalance else None) or current
        if current is not None and current in self.awaiting:
            return current
        keys = [k for k in self.pending if self._counts[k]]
        if not keys:
            return None
        unheld = [k for k in keys if holders.get(k, 0) == 0]
        if unheld:
            return max(unheld, key=lambda k: (self.pending_work(k), k))
        # A key with no more pending cells than holders has nothing to give to one more runner.
        keys = [k for k in keys if self._counts[k] > holders[k]]
        if not keys:
            return None
        best = max(keys, key=lambda k: (self.pending_work(k) / holders[k], k))
        if self.pending_work(best) / (holders[best] + 1) > self.estimator.load_estimate(best):
            return best
        return None

    def rebalance_target(self, holders: dict[LoadKey, int], current: LoadKey) -> LoadKey | None:
        """Move a runner from ``current`` (A), which still has work, to the key B with the most work per holder.

        Before any measurement the split of runners over models is a guess: each model's cost is unknown. Once
        both keys have measured cells, the runner moves when B's projected end drops, (W_B + L_B)/(h_B + 1) <
        W_B/h_B, without A becoming the later one: W_A/(h_A - 1) <= (W_B + L_B)/(h_B + 1). That is McNaughton's
        wrap-around: a runner works on A, then finishes its share on B. The driver allows one such move per
        runner, so estimate noise cannot make runners oscillate.
        """
        h_a = holders.get(current, 0) + 1
        if h_a < 2 or not self.estimator.measured(current[0]):
            return None
        candidates = [
            k
            for k in self.pending
            if k != current
            and holders.get(k, 0) > 0
            and self._counts[k] > holders[k]
            and self.estimator.measured(k[0])
        ]
        if not candidates:
            return None
        key = max(candidates, key=lambda k: (self.pending_work(k) / holders[k], k))
        w_a, w_b, h_b = self.pending_work(current), self.pending_work(key), holders[key]
        after_b = (w_b + self.estimator.load_estimate(key)) / (h_b + 1)
        if after_b < w_b / h_b and w_a / (h_a - 1) <= after_b:
            return key
        return None
