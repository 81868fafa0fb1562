"""Driving MoE-Infinity's ContinuousBatchingEngine as a closed-loop client with c requests in flight.

The client keeps exactly ``concurrency`` requests submitted and unfinished (vLLM's ``--max-concurrency``): it
tops up after every ``step()`` and times each request from its own submission, so TTFT does not include
client-side queueing behind other requests. ``run_until_done()`` is the same loop without the top-up (it
would submit every request at once and make TTFT mostly queueing time).

What the adapter can observe: token callbacks (``on_token``) with the serving step they arrived in, the
speculator's per-round seam (``draft_round`` / ``verify_round`` results and wall time, or ``step_trace`` after
a whole-request ``generate``), the sessions ``begin_session`` opens (their route recorder and private target
KV cache), the model runner's executions, and the paged KV allocator. What it cannot: when inside a step a token
was computed, per-layer router time, and transfer timing (those come from nsys, ``pd-dflash overlap``).
"""

from __future__ import annotations

import functools
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

from pd_dflash.engine.moe_infinity.metrics import RequestTrace
from pd_dflash.engine.nvtx_ranges import nvtx_range

#: Consecutive steps without output before the loop calls it a stall (upstream's run_until_done raises at 1;
#: a 2-D-scheduled step may legitimately only draft).
MAX_IDLE_STEPS = 1024


@dataclass
class ClientRun:
    traces: list[RequestTrace]
    steps: int
    elapsed: float


def drive(
    serving: Any,
    prompts: list[list[int]],
    *,
    sampling_params: Callable[[], Any],
    concurrency: int,
    request_prefix: str,
    sync: Callable[[], None] = lambda: None,
    after_step: Callable[[], None] = lambda: None,
    clock: Callable[[], float] = time.perf_counter,
) -> ClientRun:
    """Serve every prompt with at most ``concurrency`` requests in flight; return per-request traces."""
    queue = deque(enumerate(prompts))
    active: dict[str, RequestTrace] = {}
    traces: list[RequestTrace] = []
    step = 0
    idle = 0

    def on_token(trace: RequestTrace) -> Callable[[Any], None]:
        def record(output: Any) -> None:
            now = clock()
            trace.tokens += 1
            if trace.first_token is None:
                trace.first_token = now
            if not trace.chunks or trace.chunks[-1][0] != step:
                trace.chunks.append((step, now))
            if getattr(output, "finished", False):
                trace.finished = now

        return record

    sync()
    start = clock()
    while queue or active:
        while queue and len(active) < concurrency:
            index, ids = queue.popleft()
            trace = RequestTrace(request_id=f"{request_prefix}{index}", submitted=clock())
            serving.add_request(
                request_id=trace.request_id,
                prompt_token_ids=list(ids),
                sampling_params=sampling_params(),
                on_token=on_token(trace),
            )
            active[trace.request_id] = trace
            traces.append(trace)
        outputs = serving.step()
        step += 1
        after_step()
        for rid in [rid for rid, t in active.items() if t.finished is not None]:
            del active[rid]
        idle = 0 if outputs else idle + 1
        if idle > MAX_IDLE_STEPS:
            raise RuntimeError(
                f"serving engine made no progress for {MAX_IDLE_STEPS} steps with requests pending: "
                f"{sorted(active)}"
            )
        if active and not serving.has_pending_requests():
            raise RuntimeError(f"serving engine dropped unfinished requests: {sorted(active)}")
    sync()
    return ClientRun(traces=traces, steps=step, elapsed=clock() - start)


@dataclass
class RoundLog:
    """Per-round observations from the speculator's seam during the timed loop."""

    #: Tokens committed per verify round (accept + 1, bonus included).
    committed: list[int] = field(default_factory=list)
    draft_seconds: list[float] = field(default_factory=list)
    verify_seconds: list[float] = field(default_factory=list)
    #: Expert bytes each drafted block declared to the verify scheduler (route-ahead projection).
    demand_bytes: list[int] = field(default_factory=list)
    #: Verify results without an ``accept`` (counted, never guessed).
    missing_accept: int = 0
    whole_request_generates: int = 0


def _record_commit(log: RoundLog, result: Any) -> None:
    """One verify result: its ``accept`` (accepted drafts) gives accept + 1 committed tokens; never guessed."""
    accept = getattr(result, "accept", None)
    if isinstance(accept, int) and not isinstance(accept, bool):
        log.committed.append(accept + 1)
    else:
        log.missing_accept += 1


def _record_draft(log: RoundLog, result: Any) -> None:
    nbytes = getattr(result, "expert_bytes", None)
    if isinstance(nbytes, int) and not isinstance(nbytes, bool):
        log.demand_bytes.append(nbytes)


def _timed_seam(
    fn: Callable,
    range_name: str,
    sink: list[float],
    observe: Callable[[Any], None],
    *,
    push_nvtx: bool,
    clock,
) -> Callable:
    """``fn`` timed into ``sink``, inside the NVTX range when the adapter emits it, its result observed."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = clock()
        with nvtx_range(range_name) if push_nvtx else nullcontext():
            result = fn(*args, **kwargs)
        sink.append(clock() - start)
        observe(result)
        return result

    return wrapper


def _whole_request_seam(fn: Callable, speculator: Any, log: RoundLog) -> Callable:
    """``generate`` runs a request to completion; its rounds are read from the speculator's ``step_trace``."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        result = fn(*args, **kwargs)
        log.whole_request_generates += 1
        for step in getattr(speculator, "step_trace", None) or []:
            _record_commit(log, step)
        return result

    return wrapper


@contextmanager
def patched(obj: Any, wrappers: dict[str, Callable]) -> Iterator[None]:
    """Install ``wrappers`` as instance attributes of ``obj``; restore what was there afterwards."""
    previous = {name: vars(obj).get(name, _MISSING) for name in wrappers}
    for name, wrapper in wrappers.items():
        setattr(obj, name, wrapper)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is _MISSING:
                delattr(obj, name)
            else:
                setattr(obj, name, value)


@contextmanager
def record_rounds(speculator: Any, *, push_nvtx: bool, clock=time.perf_counter) -> Iterator[RoundLog]:
    """Wrap the speculator's per-round seam on the instance; restore it afterwards.

    ``push_nvtx``: emit ``dflash_draft`` / ``target_verify`` around the seam when the library does not emit them
    itself (nested duplicates would double nsys's per-range sums).
    """
    log = RoundLog()
    seams = (
        ("draft_round", "dflash_draft", log.draft_seconds, lambda r: _record_draft(log, r)),
        ("verify_round", "target_verify", log.verify_seconds, lambda r: _record_commit(log, r)),
    )
    wrappers: dict[str, Callable] = {}
    for name, range_name, sink, observe in seams:
        fn = getattr(speculator, name, None)
        if callable(fn):
            wrappers[name] = _timed_seam(fn, range_name, sink, observe, push_nvtx=push_nvtx, clock=clock)
    generate = getattr(speculator, "generate", None)
    if callable(generate):
        wrappers["generate"] = _whole_request_seam(generate, speculator, log)
    with patched(speculator, wrappers):
        yield log


_MISSING = object()


@dataclass
class KVPeak:
    """Peak paged-KV blocks in use, sampled after every allocation and every serving step."""

    allocator: Any
    total_blocks: int | None
    peak_blocks: int = 0

    def sample(self) -> None:
        free = getattr(self.allocator, "num_free_blocks", None)
        if self.total_blocks is None or not isinstance(free, int):
            return
        self.peak_blocks = max(self.peak_blocks, self.total_blocks - free)


@contextmanager
def track_kv_peak(serving: Any) -> Iterator[KVPeak | None]:
    kv_cache = getattr(serving, "kv_cache", None)
    allocator = getattr(kv_cache, "block_allocator", None)
    if allocator is None:
        yield None
        return
    total = getattr(allocator, "num_blocks", None)
    if not isinstance(total, int):
        total = getattr(kv_cache, "num_blocks", None)
    peak = KVPeak(allocator, total if isinstance(total, int) else None)
    allocate = getattr(allocator, "allocate", None)
    wrappers: dict[str, Callable] = {}
    if callable(allocate) and hasattr(allocator, "__dict__"):  # slotted: sample per step only

        def wrapped(*args: Any, **kwargs: Any) -> Any:
            result = allocate(*args, **kwargs)
            peak.sample()
            return result

        wrappers["allocate"] = wrapped
    peak.sample()
    with patched(allocator, wrappers):
        yield peak


# -- sessions: route-ahead recording and private KV ---------------------------------------------------------------
class RouteRecorderTee:
    """One session's route recorder, fed to the speculator's ``RouteAheadStats`` as well.

    MoE-Infinity's serving drivers open every session with ``collect_route_union=True``; ``verify_round`` then
    feeds the session's ``RouteUnionCollector`` (the next round's admission projection) *instead of*
    ``route_ahead_stats``. Standing in the collector's slot, the tee passes every call to the collector unchanged
    and repeats the recorder calls (``begin_step``, ``observe_layer``, ``commit_step``) to ``RouteAheadStats``, so
    coverage and waste are the library's own counts of the same verify forwards.
    """

    def __init__(self, collector: Any, stats: Any) -> None:
        self._collector, self._stats = collector, stats

    def begin_step(self) -> None:
        self._stats.begin_step()
        self._collector.begin_step()

    def observe_layer(self, *args: Any, **kwargs: Any) -> None:
        self._stats.observe_layer(*args, **kwargs)
        self._collector.observe_layer(*args, **kwargs)

    def commit_step(self, *args: Any, **kwargs: Any) -> Any:
        self._stats.commit_step(*args, **kwargs)
        return self._collector.commit_step(*args, **kwargs)

    def __getattr__(
        self, name: str
    ) -> Any:  # union for the projection, observe_executor_attempt for the stats
        if hasattr(self._collector, name):
            return getattr(self._collector, name)
        return getattr(self._stats, name)


@dataclass
class SessionWatch:
    """What the sessions of the timed loop showed: route recorders teed, and their private target KV."""

    sessions: list[Any] = field(default_factory=list)
    #: Sessions whose route recorder was teed into RouteAheadStats.
    teed: int = 0
    #: Peak over verify rounds of Σ cached tokens in the live sessions' private target caches (None: unreadable).
    private_kv_peak_tokens: int | None = 0

    def sample_private_kv(self, current: Any) -> None:
        if self.private_kv_peak_tokens is None:
            return
        total = 0
        for session in self.sessions:
            if session is not current and getattr(session, "finished", False):
                continue
            length = getattr(getattr(session, "target_kv", None), "get_seq_length", None)
            value = length() if callable(length) else None
            if isinstance(value, bool) or not isinstance(value, int):
                self.private_kv_peak_tokens = None  # a cache the adapter cannot read: no partial sum
                return
            total += value
        self.private_kv_peak_tokens = max(self.private_kv_peak_tokens, total)


@contextmanager
def watch_sessions(speculator: Any) -> Iterator[SessionWatch]:
    """Wrap ``begin_session`` (tee the session's route recorder) and ``verify_round`` (sample private KV)."""
    watch = SessionWatch()
    begin, verify = getattr(speculator, "begin_session", None), getattr(speculator, "verify_round", None)
    if not (callable(begin) and callable(verify)):
        yield watch
        return

    @functools.wraps(begin)  # keeps the signature MoE-Infinity's SpecSessionDriver inspects
    def begin_session(*args: Any, **kwargs: Any) -> Any:
        session = begin(*args, **kwargs)
        watch.sessions.append(session)
        collector, stats = getattr(session, "collector", None), getattr(speculator, "route_ahead_stats", None)
        if collector is not None and stats is not None:
            session.collector = RouteRecorderTee(collector, stats)
            watch.teed += 1
        return session

    @functools.wraps(verify)
    def verify_round(session: Any, *args: Any, **kwargs: Any) -> Any:
        result = verify(session, *args, **kwargs)
        watch.sample_private_kv(current=session)
        return result

    with patched(speculator, {"begin_session": begin_session, "verify_round": verify_round}):
        yield watch


# -- model executions ----------------------------------------------------------------------------------------------
@dataclass
class ModelExecutions:
    """Calls of the serving engine's ``model_runner.execute`` and the sequence rows they carried."""

    calls: int = 0
    rows: int = 0


@contextmanager
def count_model_executions(serving: Any) -> Iterator[ModelExecutions | None]:
    runner = getattr(serving, "model_runner", None)
    execute = getattr(runner, "execute", None)
    if not callable(execute) or not hasattr(runner, "__dict__"):
        yield None
        return
    count = ModelExecutions()

    def counted(batch: Any, *args: Any, **kwargs: Any) -> Any:
        count.calls += 1
        count.rows += len(getattr(batch, "seq_ids", None) or ())
        return execute(batch, *args, **kwargs)

    with patched(runner, {"execute": counted}):
        yield count
