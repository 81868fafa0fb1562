"""Fake ``DFlashSpeculator``: sessions, the per-round seam and route-ahead, as the real one wires them.

Mirrors TorchMoE/MoE-Infinity@0bfebf51a126613ca73e45426e9952b29ea46c51 ``moe_infinity/spec_decode/dflash.py``:

- ``begin_session(..., collect_route_union=False)``: prefill + anchor; the session owns its target KV in a
  private dynamic cache (``target_kv``) and, when ``collect_route_union`` is set, a ``RouteUnionCollector``.
- ``draft_round``: drafts a block and returns ``DraftResult(tokens, expert_union, expert_bytes)`` where the union
  and bytes are the projection captured from the PREVIOUS verify (empty on the first round).
- ``verify_round``: ``stats = session.collector if it is set else self.route_ahead_stats``; the verify runs under
  the route-ahead context bound to ``_resolve_route_ahead_prefetcher()``; afterwards the collector's union becomes
  the next projection (``project_expert_bytes`` over ``expert_nbytes_map``), else ``stats.commit_step``. So with
  ``collect_route_union`` (every real serving driver sets it) ``route_ahead_stats`` never sees a step.
- ``generate``: the synchronous driver of the same state machine, without a collector.

The executor falls back to its own prefetcher when the hook binds none, which exists only with
``speculative_prefetch`` on (``expert_executor.py`` ``_maybe_route_ahead_prefetch``, TorchMoE/MoE-Infinity@0690efef).
The accept rule is greedy: leading drafts the target agrees with, plus one bonus token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from moe_infinity import FAULTS, FEATURES, record
from moe_infinity._world import (
    DRAFT_BLOCK_SIZE,
    DRAFT_SECONDS,
    LAYERS,
    draft_agrees,
    forward_pause,
    next_token,
    route,
)
from moe_infinity.runtime import route_ahead_seam
from moe_infinity.spec_decode._route_ahead_stats import RouteAheadStats, RouteUnionCollector


@dataclass
class DFlashConfig:
    block_size: int
    mask_token_id: int = 0
    target_layer_ids: list[int] = field(default_factory=lambda: [0, LAYERS - 1])


class NativeStepTrace(NamedTuple):
    prev_start: int
    accept: int
    start: int
    emitted_len: int


class DynamicCache:
    """The session's private target KV: only its length matters here (``get_seq_length`` / ``crop``)."""

    def __init__(self) -> None:
        self.length = 0

    def get_seq_length(self) -> int:
        return self.length

    def crop(self, length: int) -> None:
        self.length = min(self.length, length)


@dataclass
class SpecSession:
    context: list[int]  # prompt + emitted (the last emitted token is the anchor, not yet cached)
    emitted: list[int]
    max_new_tokens: int
    stop_ids: set[int]
    target_kv: DynamicCache
    collector: RouteUnionCollector | None = None
    finished: bool = False
    projected_expert_union: frozenset = frozenset()
    projected_expert_bytes: int = 0
    pending: list[int] | None = None


@dataclass(frozen=True)
class DraftResult:
    tokens: int
    expert_union: frozenset
    expert_bytes: int


@dataclass(frozen=True)
class VerifyResult:
    accepted_token_ids: list[int]
    accept: int
    finished: bool


def _ids(prompt: Any) -> list[int]:
    if hasattr(prompt, "tolist"):
        prompt = prompt.tolist()
    if prompt and isinstance(prompt[0], list):
        prompt = prompt[0]
    return [int(t) for t in prompt]


class DFlashSpeculator:
    def __init__(self, moe: Any, draft_model_path: str, device: str | None = None, dtype: Any = None) -> None:
        self.moe = moe
        self.target = moe.model
        self.config = DFlashConfig(block_size=DRAFT_BLOCK_SIZE)
        self.step_trace: list[NativeStepTrace] = []
        self.route_ahead_stats: RouteAheadStats | None = None
        record("DFlashSpeculator", draft=draft_model_path, dtype=str(dtype))

    def enable_route_ahead_stats(self) -> RouteAheadStats:
        if self.route_ahead_stats is None:
            self.route_ahead_stats = RouteAheadStats()
        else:
            self.route_ahead_stats.reset()
        return self.route_ahead_stats

    def _resolve_route_ahead_prefetcher(self) -> Any:
        return getattr(self.moe.engine, "expert_prefetcher", None)

    def _bound_prefetcher(self) -> Any:
        """What the verify's route-ahead context binds, with the executor's own fallback."""
        engine = self.moe.engine
        if "route_ahead_seam" in FEATURES and "ignore_route_ahead_switch" not in FAULTS:
            prefetcher = self._resolve_route_ahead_prefetcher()
        else:
            prefetcher = engine.expert_prefetcher
        if prefetcher is None and getattr(self.moe.engine_config, "speculative_prefetch", False):
            prefetcher = engine.expert_prefetcher
        return prefetcher

    # -- the per-round seam -----------------------------------------------------------------------------
    def _begin_session(
        self,
        input_ids,
        *,
        max_new_tokens=256,
        temperature=0.0,
        stop_token_ids=None,
        top_k=0,
        top_p=1.0,
        generator=None,
        collect_route_union=False,
        target_cache_adapter=None,
    ) -> SpecSession:
        ids = _ids(input_ids)
        self.target.forward_tokens(ids)
        anchor = next_token(ids)
        session = SpecSession(
            [*ids, anchor], [anchor], int(max_new_tokens), set(stop_token_ids or []), DynamicCache()
        )
        session.target_kv.length = len(ids)
        session.collector = RouteUnionCollector() if collect_route_union else None
        session.finished = anchor in session.stop_ids or session.max_new_tokens <= 1
        return session

    def _draft_round(self, session: SpecSession) -> DraftResult:
        if session.finished or session.pending is not None:
            raise RuntimeError("draft_round needs an unfinished session without a pending block")
        block = [session.context[-1]]
        for j in range(1, self.config.block_size):
            position = len(session.context) + j - 1
            truth = next_token(session.context[:-1] + block)
            block.append(truth if draft_agrees(position) else 1 + truth % 500)
        forward_pause(DRAFT_SECONDS)
        session.pending = block
        return DraftResult(len(block), session.projected_expert_union, session.projected_expert_bytes)

    def _verify_round(self, session: SpecSession) -> VerifyResult:
        if session.pending is None:
            raise RuntimeError("verify_round needs a drafted block")
        block, session.pending = session.pending, None
        stats = session.collector if session.collector is not None else self.route_ahead_stats
        if stats is not None:
            stats.begin_step()
        self._verify_forward(block, stats)
        cached = session.context[:-1]
        accept = 0
        truths = [next_token(cached + block[:j]) for j in range(1, len(block) + 1)]
        while accept < len(block) - 1 and block[accept + 1] == truths[accept]:
            accept += 1
        committed = truths[: accept + 1]
        keep = min(len(committed), session.max_new_tokens - len(session.emitted))
        stop = keep < len(committed)
        for i, tok in enumerate(committed[:keep]):
            if tok in session.stop_ids:
                keep, stop = i + 1, True
                break
        cache_committed = min(keep, accept) + 1
        session.emitted.extend(committed[:keep])
        session.context = session.context + committed[:keep]
        session.target_kv.length = len(cached) + cache_committed
        self._commit_recorders(session, stats, cache_committed)
        self.step_trace.append(
            NativeStepTrace(
                len(cached), cache_committed - 1, len(cached) + cache_committed, len(session.emitted)
            )
        )
        session.finished = stop or len(session.emitted) >= session.max_new_tokens
        return VerifyResult(committed[:keep], cache_committed - 1, session.finished)

    begin_session = _begin_session
    draft_round = _draft_round
    verify_round = _verify_round

    def _verify_forward(self, block: list[int], stats: Any) -> None:
        prefetcher, engine = self._bound_prefetcher(), self.moe.engine
        for layer in range(LAYERS):
            rows = [set(route(t, layer)) for t in block]
            if "experts_bypass_executor" not in FAULTS:
                route_ahead_seam(layer, rows, prefetcher, stats)
            for row in rows:
                for e in row:
                    engine.access(layer, e)
        forward_pause()

    def _commit_recorders(self, session: SpecSession, stats: Any, kept_rows: int) -> None:
        if session.collector is not None:
            session.collector.commit_step(kept_rows=kept_rows)
            nbytes = getattr(self.moe.engine.expert_prefetcher, "expert_nbytes_map", None) or {}
            session.projected_expert_union = frozenset(session.collector.union)
            session.projected_expert_bytes = sum(nbytes.get(key, 0) for key in session.projected_expert_union)
        elif stats is not None:
            stats.commit_step(kept_rows=kept_rows)

    def generate(
        self,
        input_ids,
        max_new_tokens=256,
        temperature=0.0,
        stop_token_ids=None,
        top_k=0,
        top_p=1.0,
        **kwargs,
    ) -> list[list[int]]:
        self.step_trace = []
        session = self._begin_session(input_ids, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids)
        while not session.finished:
            self._draft_round(session)
            self._verify_round(session)
        return [_ids(input_ids) + session.emitted]


if "route_ahead_stats" not in FEATURES:
    del DFlashSpeculator.enable_route_ahead_stats
if "session_seam" not in FEATURES:
    del DFlashSpeculator.begin_session, DFlashSpeculator.draft_round, DFlashSpeculator.verify_round
if "route_ahead_seam" not in FEATURES:
    del DFlashSpeculator._resolve_route_ahead_prefetcher
