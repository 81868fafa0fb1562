"""Fake ``ContinuousBatchingEngine``: the add_request / step surface and its three speculative paths.

Mirrors ``moe_infinity/serving/engine.py`` of TorchMoE/MoE-Infinity@0bfebf51a126613ca73e45426e9952b29ea46c51:

- post-#173 (persistent serving sessions, ``speculative_sessions``): with verify budgets and the session seam a
  ``SpecSessionDriver`` exists (``spec_session_driver.py`` @56fe90777f0c8b66af23f5ae84f06edc0b3893e1:
  ``SpecSessionDriver.begin`` passes ``collect_route_union=True``); each step drafts every live session,
  registers its demand, verifies the sessions the 2-D scheduler admits (``_prepare_speculative_rounds`` /
  ``_verify_speculative_rounds``) and begins sessions for newly admitted requests
  (``_begin_persistent_speculative``); commits call ``update_after_step(new_decode_seq_ids=[])``
  (``_publish_speculative_commit``), so the paged KV of a speculative sequence holds its prompt only while its
  target KV lives in the session's private cache;
- pre-#173 (no ``speculative_sessions``), and post-#173 without a driver: a fresh singleton request runs to
  completion inside one step, through ``_step_speculative_session`` (also ``collect_route_union=True``) when verify
  budgets and the seam exist, else through ``speculator.generate``; a multi-request batch decodes
  autoregressively (``_can_delegate_speculative`` needs a single-sequence batch);
- a standard step runs the batch once through ``model_runner.execute``; with the ``standard_step_reexecutes``
  fault it runs it three times, as ``step()`` does in that commit (``_execute_batch``, ``_execute_and_commit``,
  then ``_step_standard``'s own ``_execute_batch``); EfficientMoE/MoE-Infinity@079de9514a068cb38f6372139c85b1be37732d38
  runs it once.
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
_SEAM = ("begin_session", "draft_round", "verify_round")


@dataclass
class RequestOutput:
    request_id: str
    seq_id: int
    token_id: int
    token_text: str | None
    finished: bool
    finish_reason: str | None = None


@dataclass
class BatchMetadata:
    seq_ids: list[int]
    tokens: list[int]


class ModelRunner:
    def __init__(self, model: Any) -> None:
        self.model = model

    def execute(self, batch: BatchMetadata) -> None:
        self.model.forward_tokens(batch.tokens)


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
        self.kv_cache = PagedKVCache(int(config.get("num_kv_blocks") or 256), int(config["block_size"]))
        if "kv_allocator" not in FEATURES:
            del self.kv_cache.block_allocator
        budgets = {k: config[k] for k in _BUDGETS if k in config} if "verify_scheduler" in FEATURES else {}
        self.scheduler = Scheduler(
            self.kv_cache,
            int(config.get("max_batch_size", 32)),
            int(config.get("max_tokens_per_step", 2048)),
            **budgets,
        )
        self.model_runner = ModelRunner(model)
        rounds = (
            speculative_draft is not None
            and self.scheduler.verify_scheduling_enabled
            and all(callable(getattr(speculative_draft, n, None)) for n in _SEAM)
        )
        self._driver = rounds and "persistent_sessions" in FEATURES
        self._session_whole = rounds and not self._driver
        self._sequences: dict[int, _Sequence] = {}
        self._waiting: list[int] = []
        self._next = 0
        self.stats = {"max_in_flight": 0, "steps": 0, "config": dict(config), "persistent": self._driver}
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
        """Live persistent sessions, keyed by sequence id (empty without a session driver)."""
        return {s.seq_id: s.session for s in self._live("DRAFT")} if self._driver else {}

    def get_stats(self) -> dict[str, Any]:
        return {"num_steps": self.stats["steps"], "max_in_flight": self.stats["max_in_flight"]}

    def shutdown(self) -> None:
        record("shutdown", max_in_flight=self.stats["max_in_flight"], steps=self.stats["steps"])

    # -- one step -------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        self.stats["steps"] += 1
        outputs = self._speculative_rounds() if self._driver else []
        decoding = self._live("DECODE")
        admitted = self._admit()
        self.stats["max_in_flight"] = max(self.stats["max_in_flight"], len(self._live("DECODE", "DRAFT")))
        speculative = self.speculative_draft is not None and "ar_fallback" not in FAULTS
        if admitted and speculative and self._driver:
            for seq in admitted:
                outputs += self._begin_persistent(seq)
            admitted = []
        elif admitted and speculative and len(admitted) == 1 and not decoding:
            return outputs + self._whole_request(admitted[0])
        if admitted or decoding:
            outputs += self._step_standard(admitted + decoding)
        return outputs

    def _live(self, *statuses: str) -> list[_Sequence]:
        return [s for s in self._sequences.values() if s.status in statuses]

    def _admit(self) -> list[_Sequence]:
        admitted = []
        while self._waiting and len(self._live("DECODE", "DRAFT", "PREFILL")) < self.scheduler.max_batch_size:
            seq = self._sequences[self._waiting.pop(0)]
            self.kv_cache.allocate_sequence(seq.seq_id, num_tokens=len(seq.prompt))
            seq.status = "PREFILL"
            admitted.append(seq)
        return admitted

    def _step_standard(self, batch: list[_Sequence]) -> list[RequestOutput]:
        tokens = [t for s in batch for t in (s.prompt if s.status == "PREFILL" else s.output[-1:])]
        rows = BatchMetadata([s.seq_id for s in batch], tokens)
        for _ in range(3 if "standard_step_reexecutes" in FAULTS else 1):
            self.model_runner.execute(rows)
        outputs, completed, decode = [], [], []
        for seq in batch:
            token = next_token(seq.prompt + seq.output)
            done = token == self.eos_token_id or len(seq.output) + 1 >= seq.params.max_tokens
            seq.status = "DECODE"
            (completed if done else decode).append(seq.seq_id)
            outputs += self._emit(seq, [token], done)
        self.scheduler.update_after_step(completed_seq_ids=completed, new_decode_seq_ids=decode)
        return outputs

    # -- speculative paths ----------------------------------------------------------------------------------
    def _begin_persistent(self, seq: _Sequence) -> list[RequestOutput]:
        seq.session = self.speculative_draft.begin_session(
            [seq.prompt],
            max_new_tokens=seq.params.max_tokens,
            temperature=seq.params.temperature,
            stop_token_ids=[self.eos_token_id],
            top_k=seq.params.top_k,
            top_p=seq.params.top_p,
            generator=None,
            collect_route_union=True,
        )
        seq.status = "DRAFT"
        return self._publish(seq, seq.session.emitted)

    def _speculative_rounds(self) -> list[RequestOutput]:
        spec, outputs = self.speculative_draft, []
        for seq in self._live("DRAFT"):
            if seq.session.pending is None:
                draft = spec.draft_round(seq.session)
                self.scheduler.set_verify_demand(seq.seq_id, draft.tokens, draft.expert_bytes)
        for seq_id in self.scheduler.admit_verifies():
            seq = self._sequences[seq_id]
            before = len(seq.session.emitted)
            spec.verify_round(seq.session)
            self.scheduler.clear_verify_demand(seq_id)
            outputs += self._publish(seq, seq.session.emitted[before:])
        return outputs

    def _publish(self, seq: _Sequence, tokens: list[int]) -> list[RequestOutput]:
        finished = seq.session.finished
        outputs = self._emit(seq, tokens, finished)
        self.scheduler.update_after_step(
            completed_seq_ids=[seq.seq_id] if finished else [], new_decode_seq_ids=[]
        )
        if finished:
            seq.session.target_kv.crop(0)  # the driver releases the session's private caches
        return outputs

    def _whole_request(self, seq: _Sequence) -> list[RequestOutput]:
        spec = self.speculative_draft
        if self._session_whole:
            session = spec.begin_session(
                [seq.prompt],
                max_new_tokens=seq.params.max_tokens,
                stop_token_ids=[self.eos_token_id],
                collect_route_union=True,
            )
            while not session.finished:
                draft = spec.draft_round(session)
                self.scheduler.set_verify_demand(seq.seq_id, draft.tokens, draft.expert_bytes)
                for _ in range(1024):
                    if seq.seq_id in self.scheduler.admit_verifies():
                        break
                else:
                    raise RuntimeError(f"verify round for seq_id {seq.seq_id} was never admitted")
                spec.verify_round(session)
                self.scheduler.clear_verify_demand(seq.seq_id)
            tokens = session.emitted
        else:
            generated = spec.generate(
                [seq.prompt], max_new_tokens=seq.params.max_tokens, stop_token_ids=[self.eos_token_id]
            )
            tokens = generated[0][len(seq.prompt) :]
        outputs = self._emit(seq, tokens, True)
        self.scheduler.update_after_step(completed_seq_ids=[seq.seq_id], new_decode_seq_ids=[])
        return outputs

    def _emit(self, seq: _Sequence, tokens: list[int], finished: bool) -> list[RequestOutput]:
        outputs = []
        for i, token in enumerate(tokens):
            seq.output.append(token)
            last = finished and i == len(tokens) - 1
            outputs.append(
                RequestOutput(seq.request_id, seq.seq_id, token, None, last, "length" if last else None)
            )
        if finished:
            seq.status = "FINISHED"
        for output in outputs:
            if seq.callback is not None:
                seq.callback(output)
        return outputs


if "persistent_sessions" not in FEATURES:
    del ContinuousBatchingEngine.speculative_sessions

__all__ = ["ContinuousBatchingEngine", "ModelRunner", "RequestOutput"]
