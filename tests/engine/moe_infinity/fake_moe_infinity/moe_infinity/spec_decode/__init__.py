"""Fake ``DFlashSpeculator`` with upstream's route-ahead statistics and per-round session seam.

Greedy accept rule: the verify accepts the leading drafts the target agrees with, emits them plus
one bonus token, and caches anchor + accepted drafts. Route-ahead: during verify, each layer pins
and prefetches the routed expert union of the block through the prefetcher bound by
``_resolve_route_ahead_prefetcher``; with no prefetcher the layer reports predicted = [].
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

from moe_infinity import FAULTS, FEATURES, record
from moe_infinity._world import (
    DRAFT_BLOCK_SIZE,
    DRAFT_SECONDS,
    EXPERT_NBYTES,
    LAYERS,
    draft_agrees,
    forward_pause,
    next_token,
    route,
)


class RouteAheadStats:
    """Upstream's set math: A = union of all rows, U_keep = union of kept rows, P = predicted."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._pending: list[tuple[set[int], list[set[int]], dict[int, int] | None]] = []
        self.c = dict.fromkeys(("steps", "layers", "predicted", "actual", "covered", "kept", "wasted"), 0)
        self.bytes: dict[str, int] | None = None

    def begin_step(self) -> None:
        self._pending = []

    def observe_layer(self, layer_id, predicted_ids, rows, expert_nbytes=None) -> None:
        self._pending.append((set(predicted_ids), [set(r) for r in rows], expert_nbytes))

    def commit_step(self, kept_rows: int) -> None:
        if not self._pending:
            return
        self.c["steps"] += 1
        for predicted, rows, nbytes in self._pending:
            actual = set().union(*rows)
            keep = set().union(*rows[: max(0, min(kept_rows, len(rows)))])
            self.c["layers"] += 1
            self.c["predicted"] += len(predicted)
            self.c["actual"] += len(actual)
            self.c["covered"] += len(predicted & actual)
            self.c["kept"] += len(keep)
            self.c["wasted"] += len(predicted - keep)
            if nbytes is not None and "wasted_bytes" in FEATURES:
                b = self.bytes or {"predicted": 0, "kept": 0, "wasted": 0}
                b["predicted"] += sum(nbytes.get(e, 0) for e in predicted)
                b["kept"] += sum(nbytes.get(e, 0) for e in predicted & keep)
                b["wasted"] += sum(nbytes.get(e, 0) for e in predicted - keep)
                self.bytes = b
        self._pending = []

    def as_dict(self) -> dict[str, Any]:
        c, b = self.c, self.bytes
        return {
            "steps": c["steps"],
            "layers_observed": c["layers"],
            "predicted_experts": c["predicted"],
            "actual_experts": c["actual"],
            "covered_experts": c["covered"],
            "kept_experts": c["kept"],
            "wasted_experts": c["wasted"],
            "coverage": c["covered"] / c["actual"] if c["actual"] else 1.0,
            "waste_ratio": c["wasted"] / c["predicted"] if c["predicted"] else 0.0,
            "predicted_prefetch_bytes": b["predicted"] if b else None,
            "kept_prefetch_bytes": b["kept"] if b else None,
            "wasted_prefetch_bytes": b["wasted"] if b else None,
        }


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


@dataclass
class Session:
    context: list[int]  # prompt + emitted (the last emitted token is the anchor, not yet cached)
    emitted: list[int]
    max_new_tokens: int
    stop_ids: set[int]
    finished: bool = False
    pending: list[int] | None = None


@dataclass(frozen=True)
class Draft:
    tokens: int
    expert_bytes: int


@dataclass(frozen=True)
class VerifyResult:
    accept: int


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

    def _verify_prefetcher(self) -> Any:
        """What the verify-time route-ahead context binds (always the engine's without the hook)."""
        if "route_ahead_seam" in FEATURES and "ignore_route_ahead_switch" not in FAULTS:
            return self._resolve_route_ahead_prefetcher()
        return self.moe.engine.expert_prefetcher

    # -- the per-round seam -----------------------------------------------------------------------------
    def begin_session(
        self,
        prompt,
        max_new_tokens=256,
        temperature=0.0,
        stop_token_ids=None,
        top_k=0,
        top_p=1.0,
        collect_route_union=False,
        **kwargs,
    ) -> Session:
        return self._begin(prompt, max_new_tokens, stop_token_ids)

    def draft_round(self, session: Session) -> Draft:
        return self._draft(session)

    def verify_round(self, session: Session) -> VerifyResult:
        return self._verify(session)

    def _begin(self, prompt, max_new_tokens, stop_token_ids) -> Session:
        ids = _ids(prompt)
        self.target.forward_tokens(ids)
        anchor = next_token(ids)
        session = Session([*ids, anchor], [anchor], int(max_new_tokens), set(stop_token_ids or []))
        session.finished = anchor in session.stop_ids or session.max_new_tokens <= 1
        return session

    def _draft(self, session: Session) -> Draft:
        block = [session.context[-1]]
        for j in range(1, self.config.block_size):
            position = len(session.context) + j - 1
            truth = next_token(session.context[:-1] + block)
            block.append(truth if draft_agrees(position) else 1 + truth % 500)
        forward_pause(DRAFT_SECONDS)
        session.pending = block
        union = {(layer, e) for layer in range(LAYERS) for t in block for e in route(t, layer)}
        return Draft(tokens=len(block), expert_bytes=len(union) * EXPERT_NBYTES)

    def _verify(self, session: Session) -> VerifyResult:
        if session.pending is None:
            raise RuntimeError("verify_round needs a drafted block")
        block, session.pending = session.pending, None
        stats = self.route_ahead_stats
        if stats is not None:
            stats.begin_step()
        prefetcher = self._verify_prefetcher()
        engine = self.moe.engine
        for layer in range(LAYERS):
            rows = [set(route(t, layer)) for t in block]
            predicted: set[int] = set()
            if prefetcher is not None:
                predicted = set().union(*rows)
                prefetcher.prefetch(layer, sorted(predicted))
            if stats is not None:
                nbytes = dict.fromkeys(predicted, EXPERT_NBYTES) if predicted else None
                stats.observe_layer(layer, sorted(predicted), rows, nbytes)
            for row in rows:
                for e in row:
                    engine.access(layer, e)
        forward_pause()
        cached = session.context[:-1]
        truths, accept = [], 0
        for j in range(1, len(block) + 1):
            truths.append(next_token(cached + block[:j]))
            if j < len(block) and block[j] == truths[-1] and accept == j - 1:
                accept = j
        committed = truths[: accept + 1]
        keep = min(len(committed), session.max_new_tokens - len(session.emitted))
        stop = keep < len(committed)
        for i, tok in enumerate(committed[:keep]):
            if tok in session.stop_ids:
                keep, stop = i + 1, True
                break
        cache_committed = min(keep, accept) + 1
        prev = len(cached)
        session.emitted.extend(committed[:keep])
        session.context = session.context + committed[:keep]
        if stats is not None:
            stats.commit_step(kept_rows=cache_committed)
        self.step_trace.append(
            NativeStepTrace(prev, cache_committed - 1, prev + cache_committed, len(session.emitted))
        )
        session.finished = stop or len(session.emitted) >= session.max_new_tokens
        return VerifyResult(accept=cache_committed - 1)

    def generate(
        self,
        input_ids,
        max_new_tokens=256,
        temperature=0.0,
        stop_token_ids=None,
        top_k=0,
        top_p=1.0,
        attention_mask=None,
    ) -> list[list[int]]:
        self.step_trace = []
        session = self._begin(input_ids, max_new_tokens, stop_token_ids)
        while not session.finished:
            self._draft(session)
            self._verify(session)
        return [_ids(input_ids) + session.emitted]


if "route_ahead_stats" not in FEATURES:
    del DFlashSpeculator.enable_route_ahead_stats
if "session_seam" not in FEATURES:
    del DFlashSpeculator.begin_session, DFlashSpeculator.draft_round, DFlashSpeculator.verify_round
if "route_ahead_seam" not in FEATURES:
    del DFlashSpeculator._resolve_route_ahead_prefetcher

__all__ = ["DFlashConfig", "DFlashSpeculator", "NativeStepTrace", "RouteAheadStats"]
