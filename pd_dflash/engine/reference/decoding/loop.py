"""The step loop: continuous batching of c requests, at most ONE batched target forward per step.

A step (``run_requests``):

1. entry — waiting requests enter until ``concurrency`` are in flight (a new request's first block is its
   prompt, so its prefill counts toward its TTFT);
2. proposal — every in-flight request without a pending block gets one from ``decoding.propose`` (AR: its last
   token; speculative: ``[anchor, d1 .. d_{B−1}]`` from ONE batched drafter forward — the ``dflash_draft``
   window);
3. ``hooks.plan(blocks)`` — route-ahead runs the target's routers on the new blocks (``route_ahead_router``);
4. admission — ``admission.select(pending)`` picks whose blocks are verified now (B1/AR: everyone; B2/OURS:
   the deficit schedulers). A step that admits nothing runs no forward (an idle step, no time passes);
5. ``hooks.begin_round`` — the prefetch hook (the AR prefetcher issues the first layer; route-ahead issues the
   predicted experts of every layer, layer-pipelined);
6. the target forward (``TargetModel.forward``, ``target_verify``): embeddings, then per decoder layer ONE
   attention call over every block (padded rows, each request's row of the KV arena) and the MoE block ONCE over
   the concatenated tokens of all requests (the experts fetched are the union over the verified requests), then
   norm + LM head on the rows each block needs;
7. ``decoding.commit`` — the accept rule: committed tokens and kept rows (rejected rows are rolled back: the
   request's KV length drops, ``decoding/kv_arena.py``);
8. ``hooks.end_round(kept_spans)``; finished requests leave and free their KV arena row.

A round is a step that ran a forward; its record carries the draft, router, issue and verify times and their
wall-clock windows (the link's transfers are compared against them: the BM4 overlap).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from pd_dflash.engine.nvtx_ranges import nvtx_range
from pd_dflash.engine.reference import seams
from pd_dflash.engine.reference.decoding.target import Block, Commit, Request, TargetModel
from pd_dflash.engine.reference.seams import Admission, Decoding

#: An admission that admits nothing this many steps in a row is broken (liveness is proven for the deficit
#: schedulers; this only turns a bug into an error instead of a hang).
MAX_IDLE_STEPS = 100_000


@dataclass
class RoundRecord:
    start: float
    seconds: float
    forward_seconds: float
    requests: int
    tokens: int
    #: Committed tokens per verified block, and which blocks were prefills (not verify rounds).
    committed: list[int]
    #: Bytes of the KV entries in use by the requests in flight (positions × K + V bytes per position).
    kv_bytes: int
    #: Bytes the KV arena has allocated (every row × its capacity, whatever it holds).
    kv_allocated_bytes: int = 0
    prefill: list[bool] = field(default_factory=list)
    draft_seconds: float = 0.0
    router_seconds: float = 0.0
    issue_seconds: float = 0.0
    #: Scheduling steps this round waited through with nothing admitted (idle steps before its forward).
    idle_steps: int = 0
    #: (kind, start, end) wall-clock windows of the round's phases: draft, router, issue, verify.
    windows: list[tuple[str, float, float]] = field(default_factory=list)


class RoundHooks:
    """No-op round hooks (the ``seams.RoundHooks`` that ``OffloadRuntime`` implements), for a loop without offload."""

    def plan(self, blocks: list[Block]) -> bool:
        """Predict the new blocks' experts before scheduling; True when a router pass ran."""
        return False

    def begin_round(self, owners: list[tuple[Any, int]]) -> None: ...
    def end_round(self, *, kept_spans: list[tuple[int, int]], finished: set | None = None) -> None: ...
    def forget(self, rid: Any) -> None: ...


class AdmitAll:
    """Admission ``all`` (AR, B1, B3): every pending block is verified every step."""

    name = "none"

    def select(self, blocks: list[Block]) -> list[Block]:
        return list(blocks)

    def reset(self) -> None:
        pass  # nothing carried between steps

    def describe(self) -> dict[str, Any]:
        return {"kind": self.name}


def run_requests(
    target: TargetModel,
    requests: Sequence[Request],
    *,
    concurrency: int,
    decoding: Decoding,
    hooks: seams.RoundHooks,
    admission: Admission | None = None,
    clock: Callable[[], float] = time.perf_counter,
) -> list[RoundRecord]:
    """Serve ``requests`` with ``concurrency`` in flight until all are done; returns one record per round.

    Each step lets requests enter, proposes and admits; a step that admits nothing is idle (it runs no
    forward), the others run one round. A round's record covers every step since the previous round's."""
    target.reserve(requests, concurrency, decoding.block_size)
    loop = _Serving(target, requests, concurrency, decoding, hooks, admission or AdmitAll(), clock)
    rounds: list[RoundRecord] = []
    start, idle, windows = None, 0, []
    while loop.waiting or loop.active:
        now = clock()
        start = now if start is None else start
        loop.enter(now)
        windows += loop.propose()
        batch = loop.select()
        if not batch:
            idle += 1
            if idle > MAX_IDLE_STEPS:
                raise RuntimeError(f"the admission admitted nothing for {idle} steps in a row")
            continue
        rounds.append(loop.run_round(batch, start=start, idle_steps=idle, windows=windows))
        start, idle, windows = None, 0, []
    return rounds


class _Serving:
    """The step loop's state: requests waiting, in flight, and the blocks they have pending."""

    def __init__(
        self,
        target: TargetModel,
        requests: Sequence[Request],
        concurrency: int,
        decoding: Decoding,
        hooks: seams.RoundHooks,
        admission: Admission,
        clock: Callable[[], float],
    ) -> None:
        self.target, self.decoding, self.hooks, self.admission = target, decoding, hooks, admission
        self.concurrency, self.clock = concurrency, clock
        self.waiting = deque(requests)
        self.active: list[Request] = []
        self.pending: dict[Any, Block] = {}
        self.step = 0

    def enter(self, now: float) -> None:
        """Waiting requests enter until ``concurrency`` are in flight, each with a KV arena row of its own."""
        while self.waiting and len(self.active) < self.concurrency:
            request = self.waiting.popleft()
            request.cache, request.admitted_at = self.target.new_cache(), now
            self.active.append(request)

    def propose(self) -> list[tuple[str, float, float]]:
        """A block for every in-flight request without one, then the hooks' router pass; returns the draft and
        router windows that count (a drafter pass of prefills only drafts nothing)."""
        fresh = [r for r in self.active if r.rid not in self.pending]
        if not fresh:
            return []
        # A speculative proposal drafts only for requests past their prefill (a prompt is proposed as it is).
        drafting = self.decoding.speculative and any(r.cached for r in fresh)
        t0 = self.clock()
        with nvtx_range("dflash_draft") if drafting else nullcontext():
            blocks = self.decoding.propose(fresh)
        t1 = self.clock()
        routed = self.hooks.plan(blocks)  # route-ahead: the router pass (its own NVTX range)
        t2 = self.clock()
        for b in blocks:
            b.ready_step = self.step
            self.pending[b.request.rid] = b
        windows = []
        if drafting:
            windows.append(("draft", t0, t1))
        if routed:
            windows.append(("router", t1, t2))
        return windows

    def select(self) -> list[Block]:
        """The admission's pick among the pending blocks; they stop being pending."""
        batch = self.admission.select([self.pending[r.rid] for r in self.active])
        self.step += 1
        for b in batch:
            del self.pending[b.request.rid]
        return batch

    def run_round(
        self, batch: list[Block], *, start: float, idle_steps: int, windows: list[tuple[str, float, float]]
    ) -> RoundRecord:
        """Issue the prefetch, verify the batch in one forward, commit, and retire the finished requests."""
        issue_start = self.clock()
        self.hooks.begin_round([(b.request.rid, len(b.tokens)) for b in batch])
        forward_start = self.clock()
        with nvtx_range("target_verify"):
            logits, captured = self.target.forward(batch, capture=self.decoding.capture)
        forward_end = self.clock()
        commits, spans, rows = self._commit(batch, logits, captured)
        finished = [r for r in self.active if r.done]
        self.hooks.end_round(kept_spans=spans, finished={r.rid for r in finished})
        end = self.clock()
        kv = self.target.kv_bytes(self.active)
        self._retire(batch, finished, end)
        return RoundRecord(
            start=start,
            seconds=end - start,
            forward_seconds=forward_end - forward_start,
            requests=len(batch),
            tokens=rows,
            committed=[c.committed for c in commits],
            kv_bytes=kv,
            kv_allocated_bytes=self.target.arena.allocated_bytes,
            prefill=[b.prefill for b in batch],
            draft_seconds=_window_seconds(windows, "draft"),
            router_seconds=_window_seconds(windows, "router"),
            issue_seconds=forward_start - issue_start,
            idle_steps=idle_steps,
            windows=[*windows, ("issue", issue_start, forward_start), ("verify", forward_start, forward_end)],
        )

    def _commit(
        self, batch: list[Block], logits: list[torch.Tensor], captured: dict[int, torch.Tensor]
    ) -> tuple[list[Commit], list[tuple[int, int]], int]:
        """The accept rule per block; returns the commits, each block's kept row span and the rows verified."""
        commits, spans, row = [], [], 0
        for b, lg in zip(batch, logits, strict=True):
            rows = {i: h[0, row : row + len(b.tokens)] for i, h in captured.items()}
            c = self.decoding.commit(b, lg, rows)
            commits.append(c)
            spans.append((row, row + c.kept_rows))
            row += len(b.tokens)
        return commits, spans, row

    def _retire(self, batch: list[Block], finished: list[Request], end: float) -> None:
        """Stamp first tokens; finished requests leave and free their KV arena row and drafter context."""
        for b in batch:
            if b.request.first_token_at is None and b.request.output:
                b.request.first_token_at = end
        for r in finished:
            self.target.release_cache(r.cache)
            r.finished_at, r.cache, r.features = end, None, None
            self.active.remove(r)
            self.pending.pop(r.rid, None)
            self.hooks.forget(r.rid)


def _window_seconds(windows: list[tuple[str, float, float]], kind: str) -> float:
    return sum((end - start for k, start, end in windows if k == kind), 0.0)
