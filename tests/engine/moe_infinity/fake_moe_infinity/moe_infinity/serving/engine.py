"""Fake ``ContinuousBatchingEngine``: the documented add_request / step / run_until_done surface.

Paths, as in MoE-Infinity: without a speculator, batched autoregressive prefill + decode; with a speculator,
verify budgets and the session seam, persistent speculative sessions (draft every live session, admit verifies
through the 2-D scheduler, verify the admitted ones); otherwise a fresh singleton request runs to completion in
one step through ``speculator.generate`` and a multi-request batch silently decodes autoregressively.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from moe_infinity import FAULTS, FEATURES, record
from moe_infinity._world import next_token
from moe_infinity.serving.scheduler import PagedKVCache, Scheduler

#: Live statistics of every engine built in this process (the tests read max_in_flight here).
ENGINE_STATS: list[dict[str, Any]] = []
_REQUIRED = ("dtype", "block_size", "num_layers", "num_kv_heads", "head_dim")
_BUDGETS = (
    "verify_token_budget",
    "verify_expert_byte_budget",
    "verify_token_deficit_cap",
    "verify_expert_byte_deficit_cap",
)


@dataclass
class RequestOutput:
    request_id: str
    seq_id: int
    token_id: int
    token_text: str | None
    finished: bool
    finish_reason: str | None = None


@dataclass
class _Sequence:
    seq_id: int
    request_id: str
    prompt: list[int]
    params: Any
    callback: Any
    output: list[int] = field(default_factory=list)
    status: str = "WAITING"  # WAITING, DECODE, DRAFT, FINISHED
    session: Any = None


class ContinuousBatchingEngine:
    def __init__(
        self, model: Any, engine: Any, config: dict, tokenizer: Any = None, speculative_draft: Any = None
    ) -> None:
        for key in _REQUIRED:
            if key not in config:
                raise KeyError(key)
        self.model, self.engine, self.config = model, engine, dict(config)
        self.speculative_draft = speculative_draft
        eos = config.get("eos_token_id")
        self.eos_token_id = eos if isinstance(eos, int) else model.config.eos_token_id
        num_blocks = config.get("num_kv_blocks") or 256
        self.kv_cache = PagedKVCache(int(num_blocks), int(config["block_size"]))
        if "kv_allocator" not in FEATURES:
            del self.kv_cache.block_allocator
        budgets = {k: config[k] for k in _BUDGETS if k in config}
        kwargs = budgets if "verify_scheduler" in FEATURES else {}
        self.scheduler = Scheduler(
            self.kv_cache,
            int(config.get("max_batch_size", 32)),
            int(config.get("max_tokens_per_step", 2048)),
            **kwargs,
        )
        enabled = getattr(self.scheduler, "verify_scheduling_enabled", False)
        seam = all(
            callable(getattr(speculative_draft, n, None))
            for n in ("begin_session", "draft_round", "verify_round")
        )
        self._persistent = bool(speculative_draft) and enabled and seam and "persistent_sessions" in FEATURES
        self._session_whole = bool(speculative_draft) and enabled and seam and not self._persistent
        self._sequences: dict[int, _Sequence] = {}
        self._waiting: list[int] = []
        self._next = 0
        self.stats = {"max_in_flight": 0, "steps": 0, "config": dict(config), "persistent": self._persistent}
        ENGINE_STATS.append(self.stats)
        record("ContinuousBatchingEngine", config=dict(config), speculative=speculative_draft is not None)

    # -- requests -------------------------------------------------------------------------------------------
    def add_request(
        self, request_id: str, prompt_token_ids: list[int], sampling_params: Any, on_token=None, n: int = 1
    ) -> None:
        if any(s.request_id == request_id for s in self._sequences.values()):
            raise ValueError(f"request_id '{request_id}' already exists")
        seq = _Sequence(self._next, request_id, list(prompt_token_ids), sampling_params, on_token)
        self._sequences[seq.seq_id] = seq
        self._waiting.append(seq.seq_id)
        self._next += 1

    def has_pending_requests(self) -> bool:
        return any(s.status != "FINISHED" for s in self._sequences.values())

    def run_until_done(self) -> dict[str, list[int]]:
        while self.has_pending_requests():
            if not self.step():
                raise RuntimeError("engine made no progress with pending requests")
        return {s.request_id: list(s.output) for s in self._sequences.values()}

    @property
    def speculative_sessions(self) -> dict[int, Any]:
        return {s.seq_id: s.session for s in self._sequences.values() if s.session and s.status == "DRAFT"}

    def get_stats(self) -> dict[str, Any]:
        return {"num_steps": self.stats["steps"], "max_in_flight": self.stats["max_in_flight"]}

    def shutdown(self) -> None:
        record("shutdown", max_in_flight=self.stats["max_in_flight"], steps=self.stats["steps"])

    # -- one step -------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self.stats["steps"] += 1
        outputs: list[RequestOutput] = []
        spec = self.speculative_draft
        if self._persistent:
            for seq in self._live("DRAFT"):
                if seq.session.pending is None:
                    draft = spec.draft_round(seq.session)
                    self.scheduler.set_verify_demand(seq.seq_id, draft.tokens, draft.expert_bytes)
            for seq_id in self.scheduler.admit_verifies():
                seq = self._sequences[seq_id]
                before = len(seq.session.emitted)
                spec.verify_round(seq.session)
                self.scheduler.clear_verify_demand(seq_id)
                outputs += self._emit(seq, seq.session.emitted[before:], seq.session.finished)
        admitted = self._admit()
        in_flight = len(self._live("DECODE", "DRAFT")) + len(admitted)
        self.stats["max_in_flight"] = max(self.stats["max_in_flight"], in_flight)
        decoding = self._live("DECODE")
        speculative = spec is not None and "ar_fallback" not in FAULTS
        if admitted and speculative and self._persistent:
            for seq in admitted:
                seq.session = spec.begin_session(
                    seq.prompt,
                    max_new_tokens=seq.params.max_tokens,
                    stop_token_ids=[self.eos_token_id],
                    collect_route_union=True,
                )
                seq.status = "DRAFT"
                outputs += self._emit(seq, seq.session.emitted, seq.session.finished)
        elif admitted and speculative and len(admitted) == 1:
            outputs += self._whole_request(admitted[0])
        elif admitted:
            self.model.forward_tokens([t for seq in admitted for t in seq.prompt])
            for seq in admitted:
                seq.status = "DECODE"
                outputs += self._emit(seq, [next_token(seq.prompt)], seq.params.max_tokens <= 1)
        if decoding:
            self.model.forward_tokens([seq.output[-1] for seq in decoding])
            for seq in decoding:
                token = next_token(seq.prompt + seq.output)
                done = token == self.eos_token_id or len(seq.output) + 1 >= seq.params.max_tokens
                outputs += self._emit(seq, [token], done)
        return outputs

    def _live(self, *statuses: str) -> list[_Sequence]:
        return [s for s in self._sequences.values() if s.status in statuses]

    def _admit(self) -> list[_Sequence]:
        admitted = []
        while (
            self._waiting
            and len(self._live("DECODE", "DRAFT")) + len(admitted) < self.scheduler.max_batch_size
        ):
            seq = self._sequences[self._waiting.pop(0)]
            self.kv_cache.ensure(seq.seq_id, len(seq.prompt))
            admitted.append(seq)
        return admitted

    def _whole_request(self, seq: _Sequence) -> list[RequestOutput]:
        spec = self.speculative_draft
        if self._session_whole:
            session = spec.begin_session(
                seq.prompt, max_new_tokens=seq.params.max_tokens, stop_token_ids=[self.eos_token_id]
            )
            while not session.finished:
                draft = spec.draft_round(session)
                self.scheduler.set_verify_demand(seq.seq_id, draft.tokens, draft.expert_bytes)
                while seq.seq_id not in self.scheduler.admit_verifies():
                    pass
                spec.verify_round(session)
                self.scheduler.clear_verify_demand(seq.seq_id)
            tokens = session.emitted
        else:
            generated = spec.generate(
                [seq.prompt], max_new_tokens=seq.params.max_tokens, stop_token_ids=[self.eos_token_id]
            )
            tokens = generated[0][len(seq.prompt) :]
        return self._emit(seq, tokens, True)

    def _emit(self, seq: _Sequence, tokens: list[int], finished: bool) -> list[RequestOutput]:
        outputs = []
        for i, token in enumerate(tokens):
            seq.output.append(token)
            last = finished and i == len(tokens) - 1
            outputs.append(
                RequestOutput(seq.request_id, seq.seq_id, token, None, last, "length" if last else None)
            )
        if tokens:
            self.kv_cache.ensure(seq.seq_id, len(seq.prompt) + len(seq.output))
        if finished:
            seq.status = "FINISHED"
            self.kv_cache.free_sequence(seq.seq_id)
        for output in outputs:
            if seq.callback is not None:
                seq.callback(output)
        return outputs


if "persistent_sessions" not in FEATURES:
    del ContinuousBatchingEngine.speculative_sessions

__all__ = ["ContinuousBatchingEngine", "RequestOutput"]
