"""Measuring one cell: a ContinuousBatchingEngine per cell, a warm-up, then the timed closed-loop run.

Per cell a ``ContinuousBatchingEngine`` with ``max_batch_size = c`` serves ``workload.requests`` requests with c
in flight (``serving.drive``). Counters are reset after the warm-up so they cover the timed loop only; what the
loop observed (request traces, verify rounds, native counters, KV peak) comes back as an :class:`Observation`
that ``results.assemble`` turns into the row.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from typing import Any

from pd_dflash.engine import nvml
from pd_dflash.engine.interface import EngineContext
from pd_dflash.engine.moe_infinity import metrics as m
from pd_dflash.engine.moe_infinity.cells import CellPlan
from pd_dflash.engine.moe_infinity.features import ROUTE_AHEAD_SEAM, Build
from pd_dflash.engine.moe_infinity.loading import Loaded
from pd_dflash.engine.moe_infinity.options import MoEInfinityOptions
from pd_dflash.engine.moe_infinity.prompts import build_prompts
from pd_dflash.engine.moe_infinity.serving import (
    ClientRun,
    KVPeak,
    ModelExecutions,
    RoundLog,
    SessionWatch,
    count_model_executions,
    drive,
    patched,
    record_rounds,
    track_kv_peak,
    watch_sessions,
)
from pd_dflash.spec import Cell
from pd_dflash.upstream import ROUTE_AHEAD_KEYS

ELEMENT_SIZE = {"bfloat16": 2, "float16": 2, "half": 2, "float32": 4, "float": 4, "float8_e4m3fn": 1}

#: A native reading: (value or None, the accessor it came from or why it is absent).
Reading = tuple[float | None, str | None]


@dataclass
class CounterBaseline:
    """Native counters at the start of the timed loop."""

    exposed_reset: bool
    exposed_before: float | None
    wasted_before: float | None
    warnings: list[str] = field(default_factory=list)


@dataclass
class Loop:
    """What the instruments saw during the timed loop."""

    run: ClientRun
    rounds: RoundLog | None
    kv: KVPeak | None
    occupancy_samples: list[float]
    sessions: SessionWatch | None
    executions: ModelExecutions | None
    #: Most persistent speculative sessions alive after a serving step (None: no ``speculative_sessions``).
    peak_speculative_sessions: int | None


@dataclass
class Observation:
    """Everything the timed loop observed, before any metric is derived from it."""

    loop: Loop
    bindings: dict[str, int]
    #: ``RouteAheadStats.as_dict()`` of the speculator over the timed loop (ROUTE_AHEAD_KEYS only), or None.
    stats: dict[str, Any] | None
    hit: Reading
    occupancy: Reading
    exposed_after: float | None
    wasted_after: float | None
    #: The native getters behind hit rate, occupancy and waste (None where the wrapper has none).
    native_getters: dict[str, str | None]
    #: Peak paged-KV bytes in use (blocks x block bytes), the native KV reading, and KV bytes per token.
    paged_kv_bytes: int | None
    native_kv: Reading
    token_kv_bytes: int
    baseline: CounterBaseline
    timings: dict[str, float]
    telemetry_start: dict[str, Any] | None

    @property
    def run(self) -> ClientRun:
        return self.loop.run

    @property
    def rounds(self) -> RoundLog | None:
        return self.loop.rounds


@dataclass
class Device:
    """The runner's device: CUDA synchronisation and cache release, no-ops on the CPU."""

    cuda: bool

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def release(self, serving: Any) -> None:
        shutdown = getattr(serving, "shutdown", None)
        if callable(shutdown):
            shutdown()
        gc.collect()
        if self.cuda:
            import torch

            torch.cuda.empty_cache()


# -- the serving engine ---------------------------------------------------------------------------------------
def geometry(model: Any) -> dict[str, Any]:
    """KV geometry of the target from its HF config (text_config for multimodal wrappers)."""
    config = getattr(model, "config", None)
    text = getattr(config, "text_config", None) or config

    def field_of(*names: str) -> int | None:
        for n in names:
            v = getattr(text, n, None)
            if isinstance(v, int) and not isinstance(v, bool):
                return v
        return None

    layers = field_of("num_hidden_layers", "num_layers")
    heads = field_of("num_attention_heads")
    kv_heads = field_of("num_key_value_heads") or heads
    hidden = field_of("hidden_size")
    head_dim = field_of("head_dim") or (hidden // heads if heads and hidden else None)
    dtype = str(getattr(model, "dtype", "bfloat16")).replace("torch.", "")
    if not (layers and kv_heads and head_dim) or dtype not in ELEMENT_SIZE:
        raise RuntimeError(
            f"cannot size the serving KV cache from the model config: num_hidden_layers={layers}, "
            f"num_key_value_heads={kv_heads}, head_dim={head_dim}, dtype={dtype}"
        )
    return {"num_layers": layers, "num_kv_heads": kv_heads, "head_dim": head_dim, "dtype": dtype}


def build_serving(
    options: MoEInfinityOptions,
    loaded: Loaded,
    cell: Cell,
    plan: CellPlan,
    prompts: list[list[int]],
    ratio: float,
) -> Any:
    from moe_infinity.serving.engine import ContinuousBatchingEngine

    bs, c = cell.block_size, max(1, cell.concurrency)
    longest = max(len(p) for p in prompts)
    config: dict[str, Any] = {
        **options.serving_config,
        **geometry(loaded.moe.model),
        "block_size": bs,
        "num_kv_blocks": math.ceil((longest + cell.max_new_tokens + bs) / bs) * c + c,
        "max_batch_size": c,
        "device_memory_ratio": ratio,
        **(plan.verify_budgets or {}),
    }
    if options.ignore_eos:
        config["eos_token_id"] = -1  # never produced: every request generates max_new_tokens
    speculator = loaded.speculator if plan.speculative else None
    serving = ContinuousBatchingEngine(
        model=loaded.moe.model,
        engine=loaded.moe.engine,
        config=config,
        tokenizer=None,
        speculative_draft=speculator,
    )
    if plan.verify_budgets is not None and not getattr(
        getattr(serving, "scheduler", None), "verify_scheduling_enabled", False
    ):
        raise RuntimeError("verify budgets were passed but the serving scheduler did not enable them")
    return serving


def sampling(temperature: float, max_tokens: int) -> Callable[[], Any]:
    from moe_infinity.serving.sequence import SamplingParams

    return lambda: SamplingParams(temperature=temperature, top_k=0, top_p=1.0, max_tokens=int(max_tokens))


def token_kv_bytes(model: Any) -> int:
    """Target KV bytes per cached token: layers x (K, V) x KV heads x head dim x element size."""
    g = geometry(model)
    return g["num_layers"] * 2 * g["num_kv_heads"] * g["head_dim"] * ELEMENT_SIZE[g["dtype"]]


def paged_kv_bytes(model: Any, cell: Cell, kv: KVPeak | None) -> int | None:
    """Peak paged-KV blocks in use x block bytes (the serving engine's block size is the cell's B)."""
    if kv is None or kv.peak_blocks <= 0:
        return None
    return kv.peak_blocks * cell.block_size * token_kv_bytes(model)


# -- the speculator for one cell --------------------------------------------------------------------------------
@contextmanager
def drafter_block_size(speculator: Any, block_size: int) -> Iterator[None]:
    """DFlash drafts ``config.block_size`` tokens per round; a cell's B may be below the trained block size."""
    config = speculator.config
    previous = config.block_size
    config.block_size = block_size
    try:
        yield
    finally:
        config.block_size = previous


@contextmanager
def route_ahead(speculator: Any, on: bool | None, build: Build) -> Iterator[dict[str, int]]:
    """Bind (ON) or withhold (OFF) the verify-time route-ahead prefetcher; count what was bound."""
    bindings = {"bound": 0, "withheld": 0}
    if on is None or not build.route_ahead_switch:
        yield bindings
        return
    original = getattr(speculator, ROUTE_AHEAD_SEAM)

    def resolve() -> Any:
        prefetcher = original() if on else None
        bindings["bound" if prefetcher is not None else "withheld"] += 1
        return prefetcher

    with patched(speculator, {ROUTE_AHEAD_SEAM: resolve}):
        yield bindings


def route_ahead_dict(speculator: Any) -> dict[str, Any] | None:
    stats = getattr(speculator, "route_ahead_stats", None) if speculator is not None else None
    as_dict = getattr(stats, "as_dict", None)
    if not callable(as_dict):
        return None
    raw = as_dict()
    return {k: raw[k] for k in ROUTE_AHEAD_KEYS if k in raw}


# -- the steps of a measurement ---------------------------------------------------------------------------------
def _warm_up(serving: Any, warm: list[list[int]], cell: Cell, temperature: float, device: Device) -> None:
    if warm:
        drive(
            serving,
            warm,
            sampling_params=sampling(temperature, cell.block_size),
            concurrency=min(cell.concurrency, len(warm)),
            request_prefix="warmup-",
            sync=device.sync,
        )


def _reset_counters(engine: Any, speculator: Any) -> CounterBaseline:
    """Restart what can be restarted so counters cover the timed loop; remember the rest as deltas."""
    if speculator is not None and callable(getattr(speculator, "enable_route_ahead_stats", None)):
        speculator.enable_route_ahead_stats()
    warnings = []
    if not m.call_if_present(engine, "expert_prefetcher", "expert_dispatcher", "clear_expert_cache_counts"):
        warnings.append(m.HIT_RATE_CUMULATIVE)
    exposed_reset = m.call_if_present(engine, "reset_exposed_fetch_seconds")
    exposed_before, _ = m.exposed_fetch_seconds(engine)
    wasted_before, _ = m.native_wasted_prefetch_bytes(engine)
    return CounterBaseline(exposed_reset, exposed_before, wasted_before, warnings)


def _timed_loop(
    serving: Any,
    prompts: list[list[int]],
    cell: Cell,
    temperature: float,
    loaded: Loaded,
    speculator: Any,
    device,
) -> Loop:
    """The closed-loop run, with the verify seam, sessions and model executions recorded and peaks sampled."""
    engine = loaded.moe.engine
    peaks: dict[str, Any] = {"occupancy": [], "sessions": None}
    with ExitStack() as stack:
        sessions = stack.enter_context(watch_sessions(speculator)) if speculator else None
        rounds = (
            stack.enter_context(record_rounds(speculator, push_nvtx=not loaded.build.library_nvtx))
            if speculator
            else None
        )
        kv = stack.enter_context(track_kv_peak(serving))
        executions = stack.enter_context(count_model_executions(serving))

        def after_step() -> None:  # peaks over the timed loop, sampled after every serving step
            if kv is not None:
                kv.sample()
            value, _ = m.expert_occupancy_bytes(engine)
            if value is not None:
                peaks["occupancy"].append(value)
            live = getattr(serving, "speculative_sessions", None)
            if isinstance(live, dict):
                peaks["sessions"] = max(peaks["sessions"] or 0, len(live))

        run = drive(
            serving,
            prompts,
            sampling_params=sampling(temperature, cell.max_new_tokens),
            concurrency=cell.concurrency,
            request_prefix="req-",
            sync=device.sync,
            after_step=after_step,
        )
    return Loop(run, rounds, kv, peaks["occupancy"], sessions, executions, peaks["sessions"])


def _peak_occupancy(engine: Any, samples: list[float]) -> Reading:
    occupancy, source = m.expert_occupancy_bytes(engine)
    if occupancy is None:
        return None, source
    return max([occupancy, *samples]), f"{source} (peak over serving steps)"


def measure(
    ctx: EngineContext, options: MoEInfinityOptions, loaded: Loaded, cell: Cell, plan: CellPlan, ratio, cuda
):
    """Serve the cell's workload once untimed (warm-up) and once timed; return what was observed."""
    workload, engine, device = ctx.workload, loaded.moe.engine, Device(cuda)
    temperature = float(workload.temperature)
    speculator = loaded.speculator if plan.speculative else None
    timings: dict[str, float] = {}
    telemetry_start = nvml.telemetry(0) if cuda else None
    seed = cell.sample_seed  # the repeat's sample: prompts, their order and the sampler's generator
    prompts = build_prompts(loaded.tokenizer, workload, workload.requests, seed=seed)
    warm = build_prompts(loaded.tokenizer, workload, workload.warmup_rounds, seed=seed, salt=1)
    import torch

    torch.manual_seed(seed)
    with ExitStack() as stack:
        t = time.perf_counter()
        bindings: dict[str, int] = {}
        if speculator is not None:
            stack.enter_context(drafter_block_size(speculator, cell.block_size))
            bindings = stack.enter_context(route_ahead(speculator, plan.route_ahead, loaded.build))
        serving = build_serving(options, loaded, cell, plan, prompts + warm, ratio)
        stack.callback(device.release, serving)
        timings["serving_setup_seconds"] = time.perf_counter() - t
        t = time.perf_counter()
        _warm_up(serving, warm, cell, temperature, device)
        timings["warmup_seconds"] = time.perf_counter() - t
        baseline = _reset_counters(engine, speculator)
        loop = _timed_loop(serving, prompts, cell, temperature, loaded, speculator, device)
        timings["timed_seconds"] = loop.run.elapsed
        model = loaded.moe.model
        return Observation(
            loop=loop,
            bindings=bindings,
            stats=route_ahead_dict(speculator),
            hit=m.hit_rate(engine),
            occupancy=_peak_occupancy(engine, loop.occupancy_samples),
            exposed_after=m.exposed_fetch_seconds(engine)[0],
            wasted_after=m.native_wasted_prefetch_bytes(engine)[0],
            native_getters={k: m.native_getter(engine, k) for k in m.NATIVE_GETTERS},
            paged_kv_bytes=paged_kv_bytes(model, cell, loop.kv),
            native_kv=m.native_kv_occupancy_bytes(engine),
            token_kv_bytes=token_kv_bytes(model),
            baseline=baseline,
            timings=timings,
            telemetry_start=telemetry_start,
        )
