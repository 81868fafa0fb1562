"""Deficit schedulers for concurrency c: which pending verify rounds join this scheduling step's batch.

B2 uses ``TokenDeficitScheduler`` (tokens only, no expert-byte coupling); OURS uses ``TwoDimDeficitScheduler``
over {tokens, expert bytes}, upstream's ``serving/scheduler.py::admit_verify_demands`` rule (docs/reference-engine.md,
"Deficit schedulers"):

1. seat every in-flight demand first (unconditionally, they have priority);
2. pool = budget + carried − seated, per dimension;
3. admit the other demands in arrival order while each one fits the pool in *every* dimension, subtracting it;
   the first one that does not fit stops admission for this step (head-of-line: nothing younger overtakes it);
4. carried = clamp(pool, 0, cap), per dimension.

For OURS a demand's ``expert_bytes`` is its route-ahead fetch (bytes of predicted experts not yet resident), so
a round's verify is admitted only when that fetch fits the byte budget too.

Liveness: the cap must be ≥ the largest single demand in each dimension (ValueError otherwise) and every budget
is ≥ 1. Then the oldest waiting demand w is always admitted: nothing younger is admitted before it, so the
in-flight set only shrinks until its members finish; once none is seated, each step with w unadmitted raises
carried by the full budget (carried' = min(budget + carried, cap)), so within ⌈cap/budget⌉ steps carried = cap
≥ w and pool = budget + cap ≥ w. Hence a demand larger than the per-step budget still progresses, and the wait
of the k-th waiting demand is at most k · (R + ⌈cap/budget⌉ + 1) steps, where R bounds how many steps an
in-flight request stays in flight (``tests/engine/test_scheduling.py`` checks this bound).

Pure Python: the decode loop builds ``VerifyDemand`` objects and calls ``step`` once per scheduling step.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass

TOKENS = "tokens"
EXPERT_BYTES = "expert_bytes"


@dataclass(frozen=True)
class VerifyDemand:
    """One request's next verify round: its width in tokens and the expert bytes its prefetch must move.

    ``in_flight`` marks a round the engine has already committed to (e.g. a request already in the running
    batch, or a round whose prefetch was issued): it is seated unconditionally. ``arrival`` orders the others
    (smaller = earlier; ties keep list order).
    """

    request_id: Hashable
    tokens: int
    expert_bytes: int = 0
    in_flight: bool = False
    arrival: int = 0

    def __post_init__(self) -> None:
        for name in (TOKENS, EXPERT_BYTES):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(
                    f"VerifyDemand {self.request_id!r}: {name} must be an int ≥ 0, got {value!r}"
                )


@dataclass(frozen=True)
class StepOutcome:
    """The outcome of one scheduling step (per-dimension tuples follow the scheduler's ``dimensions``)."""

    #: Seated in-flight ids (arrival order), then newly admitted ids (arrival order): the verify batch.
    admitted: tuple[Hashable, ...]
    seated: tuple[Hashable, ...]
    #: Pending, not in flight, not admitted this step (arrival order).
    deferred: tuple[Hashable, ...]
    #: budget + carried at the start of the step.
    available: tuple[int, ...]
    #: Demand of everything in ``admitted``.
    used: tuple[int, ...]
    #: Carried into the next step, each in [0, cap].
    carried: tuple[int, ...]


class DeficitScheduler:
    """A deficit scheduler over the named ``dimensions`` (attributes of ``VerifyDemand``)."""

    dimensions: tuple[str, ...] = ()

    def __init__(self, budget: Mapping[str, int], cap: Mapping[str, int]):
        if not self.dimensions:
            raise TypeError("use TokenDeficitScheduler or TwoDimDeficitScheduler")
        for what, values in (("budget", budget), ("cap", cap)):
            missing = [d for d in self.dimensions if d not in values]
            extra = [d for d in values if d not in self.dimensions]
            if missing or extra:
                raise ValueError(
                    f"{what} needs exactly the dimensions {list(self.dimensions)}, got {list(values)}"
                )
        for d in self.dimensions:
            if isinstance(budget[d], bool) or not isinstance(budget[d], int) or budget[d] < 1:
                raise ValueError(
                    f"budget {d} must be an int ≥ 1 (a zero budget never carries), got {budget[d]!r}"
                )
            if isinstance(cap[d], bool) or not isinstance(cap[d], int) or cap[d] < 0:
                raise ValueError(f"cap {d} must be an int ≥ 0, got {cap[d]!r}")
        self.budget = tuple(int(budget[d]) for d in self.dimensions)
        self.cap = tuple(int(cap[d]) for d in self.dimensions)
        self._carried = tuple(0 for _ in self.dimensions)

    @property
    def carried(self) -> dict[str, int]:
        return dict(zip(self.dimensions, self._carried, strict=True))

    def reset(self) -> None:
        self._carried = tuple(0 for _ in self.dimensions)

    def check_demand(self, demand: VerifyDemand) -> None:
        """ValueError (naming the dimension) when a single demand exceeds the cap: it could never be admitted."""
        for d, cap in zip(self.dimensions, self.cap, strict=True):
            value = getattr(demand, d)
            if value > cap:
                raise ValueError(
                    f"{type(self).__name__}: {d} cap {cap} is below request {demand.request_id!r}'s single "
                    f"demand of {value} {d}; the cap must be ≥ the largest single demand in each dimension"
                )

    def step(self, demands: Sequence[VerifyDemand], budget: Mapping[str, int] | None = None) -> StepOutcome:
        """Admit this step's verify batch from the pending demands (one per request) and update the carry.

        ``budget`` overrides this step's budget in the dimensions it names (each an int ≥ 1): a budget that is a
        rate (OURS's expert bytes: bytes the link moves in the time since the previous step)."""
        ids = [dm.request_id for dm in demands]
        if len(set(ids)) != len(ids):
            dup = sorted({str(i) for i in ids if ids.count(i) > 1})
            raise ValueError(f"one demand per request per step; duplicated request ids {dup}")
        for dm in demands:
            self.check_demand(dm)
        order = sorted(range(len(demands)), key=lambda i: demands[i].arrival)
        seated = [demands[i] for i in order if demands[i].in_flight]
        waiting = [demands[i] for i in order if not demands[i].in_flight]
        step_budget = self._step_budget(budget or {})
        available = tuple(b + c for b, c in zip(step_budget, self._carried, strict=True))
        pool = list(available)
        for dm in seated:
            for k, d in enumerate(self.dimensions):
                pool[k] -= getattr(dm, d)
        admitted: list[VerifyDemand] = []
        deferred: list[VerifyDemand] = []
        for dm in waiting:
            need = [getattr(dm, d) for d in self.dimensions]
            if not deferred and all(n <= p for n, p in zip(need, pool, strict=True)):
                admitted.append(dm)
                pool = [p - n for p, n in zip(pool, need, strict=True)]
            else:
                deferred.append(dm)  # head-of-line: once one waits, everything younger waits too
        self._carried = tuple(min(max(p, 0), cap) for p, cap in zip(pool, self.cap, strict=True))
        batch = seated + admitted
        used = tuple(sum(getattr(dm, d) for dm in batch) for d in self.dimensions)
        return StepOutcome(
            admitted=tuple(dm.request_id for dm in batch),
            seated=tuple(dm.request_id for dm in seated),
            deferred=tuple(dm.request_id for dm in deferred),
            available=available,
            used=used,
            carried=self._carried,
        )

    def _step_budget(self, override: Mapping[str, int]) -> tuple[int, ...]:
        for d, value in override.items():
            if d not in self.dimensions:
                raise ValueError(
                    f"budget override for unknown dimension {d!r}; dimensions {list(self.dimensions)}"
                )
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"budget {d} must be an int ≥ 1, got {value!r}")
        return tuple(int(override.get(d, b)) for d, b in zip(self.dimensions, self.budget, strict=True))


class TokenDeficitScheduler(DeficitScheduler):
    """B2: token-deficit scheduling, no expert-byte coupling (a demand's ``expert_bytes`` is ignored)."""

    dimensions = (TOKENS,)

    def __init__(self, budget_tokens: int, cap_tokens: int):
        super().__init__({TOKENS: budget_tokens}, {TOKENS: cap_tokens})


class TwoDimDeficitScheduler(DeficitScheduler):
    """OURS: the 2-D deficit scheduler over {tokens, expert bytes} (upstream ``admit_verify_demands``)."""

    dimensions = (TOKENS, EXPERT_BYTES)

    def __init__(self, budget_tokens: int, budget_bytes: int, cap_tokens: int, cap_bytes: int):
        super().__init__(
            {TOKENS: budget_tokens, EXPERT_BYTES: budget_bytes}, {TOKENS: cap_tokens, EXPERT_BYTES: cap_bytes}
        )
