"""The deficit schedulers (``decoding/deficit.py``) on the decode loop's admission seam (``seams.Admission``).

Each scheduling step, every in-flight request has one pending block (its next verify round, drafted). The
adapter turns them into ``VerifyDemand``s and returns the admitted blocks: those are verified together in this
step's batched forward; the others keep their block (no redraft) and wait.

- tokens: the block's width (B for a verify round, the prompt length for a prefill);
- expert bytes (OURS): the route-ahead fetch the block ADDS to the batch — bytes of its predicted experts that
  are neither resident nor already counted for an earlier demand, in the scheduler's own order (seated, then
  arrival). Admission takes a prefix of that order, so the admitted demands' bytes sum to the bytes of the
  batch's union of predicted, non-resident experts: the fetch the verify will really issue;
- arrival: the step at which the block became pending, so a deferred round keeps its place (FIFO, no
  starvation: the liveness argument of decoding/deficit.py);
- in flight: none. The engine's verify finishes within its step, so every round, of a running request or a new
  one, is admitted through the budgets (route-ahead's history prefetch does not seat the next round).
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pd_dflash.engine.interface import Refused
from pd_dflash.engine.reference.decoding.deficit import (
    EXPERT_BYTES,
    DeficitScheduler,
    StepOutcome,
    TokenDeficitScheduler,
    TwoDimDeficitScheduler,
    VerifyDemand,
)
from pd_dflash.engine.reference.decoding.target import Block
from pd_dflash.engine.reference.options import ReferenceOptions
from pd_dflash.engine.reference.seams import Key, Prefetcher
from pd_dflash.schema import Status
from pd_dflash.spec import Cell

if TYPE_CHECKING:
    from pd_dflash.engine.reference.offload.store import HostExpertStore

#: Steps kept verbatim in the trace (the rest is summarised).
TRACE_STEPS = 64


@dataclass(frozen=True)
class TokenBudget:
    """The token dimension of a cell's deficit admission (docs/reference-engine.md).

    Defaults: budget c·B (every in-flight request can verify a full block each step; a prefill longer than that
    is spread over steps by the deficit), cap max(2·budget, longest prompt, B)."""

    budget: int
    cap: int
    #: The largest single demand of the cell: the longest prompt or the block size.
    largest: int

    @classmethod
    def of(cls, cell: Cell, options: ReferenceOptions, longest_prompt: int) -> TokenBudget:
        """``Refused`` when the cap is below the largest single demand (that round could never be admitted)."""
        largest = max(longest_prompt, cell.block_size)
        budget = options.scheduler_budget_tokens or cell.concurrency * cell.block_size
        cap = options.scheduler_cap_tokens or max(2 * budget, largest)
        if cap < largest:
            raise Refused(
                Status.REFUSED,
                f"engine_options.scheduler_cap_tokens={cap} is below the largest single demand of this "
                f"cell, {largest} tokens (the longest prompt or the block size): that round could never "
                f"be admitted. Fix: set it to at least {largest}",
            )
        return cls(budget, cap, largest)


def token_deficit_admission(tokens: TokenBudget) -> DeficitAdmission:
    """Admission ``token_deficit``: the token deficit alone."""
    return DeficitAdmission(TokenDeficitScheduler(tokens.budget, tokens.cap))


def two_dim_deficit_admission(
    name: str,
    tokens: TokenBudget,
    options: ReferenceOptions,
    store: HostExpertStore,
    top_k: int,
    prefetcher: Prefetcher | None,
    is_resident: Callable[[Key], bool],
    link_bytes_per_second: float | None,
) -> DeficitAdmission:
    """Admission ``two_dim_deficit``: the 2-D deficit, whose byte dimension prices each request's expected fetch
    by its prefetcher's ``keys``; ``Refused`` when the bytes cap is below the largest single demand of the cell or the
    configuration (``name``) has no prefetcher to price bytes with.

    The bytes budget is a RATE, ``link_bytes_per_second`` (the link's bytes per second of wall time between
    scheduling steps, ``ByteRate``), or absent when the link rate is unknown (never binds);
    ``scheduler_budget_bytes`` fixes it per step instead (an ablation); bytes cap = the largest route-ahead
    fetch one round can make.
    """
    if prefetcher is None:
        raise Refused(
            Status.REFUSED,
            f"{name}'s 2-D deficit scheduler prices each verify's expert bytes by its prefetcher's "
            "prediction, but its configuration has no prefetcher (baselines.py). Fix: give it a prefetcher",
        )
    opts = options
    e, k, nbytes, layers = store.num_experts, top_k, store.expert_nbytes, len(store.layer_ids)
    largest_bytes = layers * min(tokens.largest * k, e) * nbytes
    cap_bytes = opts.scheduler_cap_bytes or max(opts.scheduler_budget_bytes or 0, largest_bytes)
    rate = None if opts.scheduler_budget_bytes else link_bytes_per_second
    # Fixed per step (the option), or the cap as the nominal budget: a rate sets each step's own, and with
    # neither the byte dimension is absent (it never binds: every step may carry up to the cap).
    budget_bytes = opts.scheduler_budget_bytes or cap_bytes
    if cap_bytes < largest_bytes:
        raise Refused(
            Status.REFUSED,
            f"engine_options.scheduler_cap_bytes={cap_bytes} is below the largest single route-ahead fetch of "
            f"this cell, {largest_bytes} B ({tokens.largest} rows × top-{k} over {e} experts in each of "
            f"{layers} MoE layers × {nbytes} B): that round could never be admitted. Fix: set "
            f"it to at least {largest_bytes}",
        )
    return DeficitAdmission(
        TwoDimDeficitScheduler(tokens.budget, budget_bytes, tokens.cap, cap_bytes),
        fetch_keys=prefetcher.keys,
        is_resident=is_resident,
        expert_nbytes=nbytes,
        in_flight=prefetcher.in_flight,
        byte_rate=ByteRate(rate) if rate else None,
    )


class ByteRate:
    """OURS's byte budget as a rate: each scheduling step may admit the bytes the link moves in the wall time
    since the previous step (``bytes_per_second`` × elapsed, at least 1). A step that admits nothing costs time:
    it sleeps until the first deferred demand's missing bytes have accrued (the link keeps moving the prefetches
    already issued meanwhile), so carrying a deficit is never free."""

    def __init__(self, bytes_per_second: float, clock=time.perf_counter, sleep=time.sleep) -> None:
        if not bytes_per_second > 0:
            raise ValueError(f"bytes_per_second must be > 0, got {bytes_per_second!r}")
        self.bytes_per_second, self.clock, self.sleep = float(bytes_per_second), clock, sleep
        self.last: float | None = None
        self.waited_seconds = 0.0

    def reset(self) -> None:
        self.last, self.waited_seconds = self.clock(), 0.0

    def budget(self) -> int:
        """This step's bytes: the link's rate over the time since the previous step."""
        now = self.clock()
        elapsed = 0.0 if self.last is None else now - self.last
        self.last = now
        return max(1, int(elapsed * self.bytes_per_second))

    def idle(self, missing_bytes: int) -> None:
        """Nothing admitted: wait for the link to move the missing bytes."""
        seconds = max(0, missing_bytes) / self.bytes_per_second
        if seconds > 0:
            self.sleep(seconds)
            self.waited_seconds += seconds


class DeficitAdmission:
    def __init__(
        self,
        scheduler: DeficitScheduler,
        *,
        fetch_keys: Callable[[object], set] | None = None,
        is_resident: Callable[[tuple[int, int]], bool] | None = None,
        expert_nbytes: int = 0,
        in_flight: Callable[[object], bool] | None = None,
        byte_rate: ByteRate | None = None,
    ) -> None:
        self.scheduler, self.byte_rate = scheduler, byte_rate
        self.name = "two_dim_deficit" if isinstance(scheduler, TwoDimDeficitScheduler) else "token_deficit"
        self.fetch_keys, self.is_resident, self.expert_nbytes = fetch_keys, is_resident, expert_nbytes
        self.in_flight = in_flight or (lambda rid: False)
        self.reset()

    def reset(self) -> None:
        """Start a measurement (after warm-up): counters, trace and the scheduler's carry restart."""
        dims = len(self.scheduler.dimensions)
        self.scheduler.reset()
        if self.byte_rate is not None:
            self.byte_rate.reset()
        self.steps = self.idle_steps = self.deferring_steps = self.deferred_total = self.seated_total = 0
        self.binding: Counter = Counter()
        self.admitted_histogram: Counter = Counter()
        self.max_used = [0] * dims
        self.max_carried = [0] * dims
        self.trace: list[dict] = []

    def select(self, blocks: list[Block]) -> list[Block]:
        by_rid = {b.request.rid: b for b in blocks}
        order = sorted(range(len(blocks)), key=lambda i: blocks[i].ready_step)
        flags = {b.request.rid: self.in_flight(b.request.rid) for b in blocks}
        ordered = [blocks[i] for i in order if flags[blocks[i].request.rid]]
        ordered += [blocks[i] for i in order if not flags[blocks[i].request.rid]]
        counted: set = set()
        demands = []
        for b in ordered:
            rid = b.request.rid
            nbytes = 0
            if self.fetch_keys is not None and self.is_resident is not None:
                new = {k for k in self.fetch_keys(rid) if k not in counted and not self.is_resident(k)}
                counted |= new
                nbytes = len(new) * self.expert_nbytes
            demands.append(VerifyDemand(rid, len(b.tokens), nbytes, flags[rid], b.ready_step))
        budget = {EXPERT_BYTES: self.byte_rate.budget()} if self.byte_rate is not None else None
        outcome = self.scheduler.step(demands, budget)
        self._record(outcome, demands)
        if not outcome.admitted and outcome.deferred and self.byte_rate is not None:
            first = next(d for d in demands if d.request_id == outcome.deferred[0])
            k = self.scheduler.dimensions.index(EXPERT_BYTES)
            self.byte_rate.idle(first.expert_bytes - (outcome.available[k] - outcome.used[k]))
        return [by_rid[rid] for rid in outcome.admitted]

    def _record(self, outcome: StepOutcome, demands: list[VerifyDemand]) -> None:
        self.steps += 1
        n = len(outcome.admitted)
        self.admitted_histogram[n] += 1
        self.idle_steps += n == 0
        self.seated_total += len(outcome.seated)
        if outcome.deferred:
            self.deferring_steps += 1
            self.deferred_total += len(outcome.deferred)
            first = next(d for d in demands if d.request_id == outcome.deferred[0])
            for k, dim in enumerate(self.scheduler.dimensions):
                if getattr(first, dim) > outcome.available[k] - outcome.used[k]:
                    self.binding[dim] += 1
        self.max_used = [max(a, b) for a, b in zip(self.max_used, outcome.used, strict=True)]
        self.max_carried = [max(a, b) for a, b in zip(self.max_carried, outcome.carried, strict=True)]
        if len(self.trace) < TRACE_STEPS:
            self.trace.append(
                {
                    "admitted": len(outcome.admitted),
                    "seated": len(outcome.seated),
                    "deferred": len(outcome.deferred),
                    "available": list(outcome.available),
                    "used": list(outcome.used),
                    "carried": list(outcome.carried),
                }
            )

    def describe(self) -> dict:
        dims = list(self.scheduler.dimensions)
        return {
            "kind": self.name,
            "dimensions": dims,
            "budget": dict(zip(dims, self.scheduler.budget, strict=True)),
            **(
                {
                    "expert_bytes_budget": "rate",
                    "expert_bytes_per_second": self.byte_rate.bytes_per_second,
                    "idle_wait_seconds": self.byte_rate.waited_seconds,
                }
                if self.byte_rate is not None
                else {}
            ),
            "cap": dict(zip(dims, self.scheduler.cap, strict=True)),
            "steps": self.steps,
            "idle_steps": self.idle_steps,
            "steps_with_deferral": self.deferring_steps,
            "deferred_demands": self.deferred_total,
            "seated_demands": self.seated_total,
            # Steps whose first deferred demand did not fit in this dimension (the budget that bound).
            "binding_steps": {d: self.binding.get(d, 0) for d in dims},
            "admitted_per_step_histogram": {str(k): v for k, v in sorted(self.admitted_histogram.items())},
            "max_used": dict(zip(dims, self.max_used, strict=True)),
            "max_carried": dict(zip(dims, self.max_carried, strict=True)),
            "trace_first_steps": self.trace,
        }
