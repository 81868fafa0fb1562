"""``ReferenceEngine``: pd-dflash's own offloaded-MoE engine behind the ``Engine`` interface.

Load once (model + host expert store + device), then per cell: build the cell's expert cache (bounded and
linked for offloaded baselines, fully resident for B3), its decoding, prefetcher and scheduler, warm up, measure
the timed requests with continuous batching at the cell's concurrency, and assemble the row.

| baseline | decoding | prefetcher | scheduler |
|---|---|---|---|
| B0 | AR | the AR prefetcher (activation-aware) | none |
| B1 | speculative (the drafter) | the AR prefetcher, unchanged | none (every request verifies every step) |
| B2 | speculative | the AR prefetcher | token deficit |
| B3 | AR, experts resident | the AR prefetcher, observe-only | none |
| OURS | speculative, with the route-ahead proxy | route-ahead | 2-D deficit (tokens, expert bytes) |
"""

from __future__ import annotations

import time
from typing import Any

import torch

import pd_dflash
from pd_dflash.engine import nvml
from pd_dflash.engine.interface import Engine, EngineContext
from pd_dflash.engine.probe import measure_h2d_bytes_per_second
from pd_dflash.engine.reference.admission import DeficitAdmission
from pd_dflash.engine.reference.decode import (
    AdmitAll,
    AutoregressiveDecoding,
    Request,
    TargetModel,
    run_requests,
)
from pd_dflash.engine.reference.expert_cache import ExpertCache
from pd_dflash.engine.reference.link import CudaLink, HostLink
from pd_dflash.engine.reference.metrics import CellMeasurement, LinkFacts, assemble
from pd_dflash.engine.reference.models import load_model, make_prompts
from pd_dflash.engine.reference.offload import OffloadRuntime, install_offload
from pd_dflash.engine.reference.options import ReferenceOptions
from pd_dflash.engine.reference.prefetch import ActivationAwarePrefetcher
from pd_dflash.engine.reference.presets.catalog import get_preset
from pd_dflash.engine.reference.presets.drafters import load_drafter
from pd_dflash.engine.reference.route_prefetch import RouteAheadPrefetcher
from pd_dflash.engine.reference.speculative import BlockDrafterSource, EarlyExitDrafter, SpeculativeDecoding
from pd_dflash.engine.scheduling import TokenDeficitScheduler, TwoDimDeficitScheduler
from pd_dflash.errors import InputError
from pd_dflash.schema import EngineResult, Status
from pd_dflash.spec import Cell


class ReferenceEngine(Engine):
    def __init__(self, ctx: EngineContext) -> None:
        super().__init__(ctx)
        start = time.perf_counter()
        self.options = ReferenceOptions.model_validate(ctx.model.engine_options)
        self.device = _device(ctx.device)
        if self.device.type == "cpu":
            torch.set_num_threads(max(1, int(ctx.hardware.cpus_per_runner)))
        elif self.options.emulated_h2d_gbps is not None:
            raise InputError(
                "link emulation is for the CPU engine; a CUDA device has a real link",
                where="models[].engine_options.emulated_h2d_gbps",
            )
        self.loaded = load_model(
            ctx.model.id,
            ctx.model.preset,
            seed=self.options.train_seed,
            cache_dir=self.options.cache_dir,
            dtype=self.options.dtype,
        )
        model = self.loaded.model
        self.compute_dtype = next(model.parameters()).dtype
        self.storage_dtype = self.options.storage_dtype
        if self.storage_dtype == "auto":
            self.storage_dtype = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[
                self.compute_dtype
            ]
        self.store = install_offload(
            model, self.loaded.family, self.storage_dtype, pin=self.device.type == "cuda"
        )
        model.to(self.device)  # everything but the routed experts, which now live in the host store
        self.target = TargetModel(model, self.loaded.family, self.device)
        self.top_k = int(model.config.num_experts_per_tok)
        if self.options.drafter == "early_exit" and self.options.early_exit_layers >= self.target.num_layers:
            raise InputError(
                f"early_exit_layers must be below the target's {self.target.num_layers} layers "
                f"(the drafter is the first d layers), got {self.options.early_exit_layers}",
                where="models[].engine_options.early_exit_layers",
            )
        self.probe_bytes_per_second = (
            measure_h2d_bytes_per_second(self.device) if self.device.type == "cuda" else None
        )
        self._dflash = None  # (BlockDrafter, card): trained/loaded at the first speculative cell
        self.load_seconds = time.perf_counter() - start

    # -- interface ---------------------------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        card = self.loaded.card
        facts = {
            "name": "reference",
            "version": pd_dflash.__version__,
            "model_source": self.loaded.source,
            "model": self.loaded.name,
            "family": self.loaded.family.name,
            "device": str(self.device),
            "dtype": str(self.compute_dtype).replace("torch.", ""),
            "storage_dtype": self.storage_dtype,
            "experts_per_layer": self.store.num_experts,
            "top_k": self.top_k,
            "moe_layers": len(self.store.layer_ids),
            "expert_nbytes": self.store.expert_nbytes,
            "total_expert_bytes": self.store.total_bytes,
            "eviction": self.options.eviction,
            "prefetcher": self.options.prefetcher,
            "load_seconds": self.load_seconds,
            "threads": torch.get_num_threads(),
        }
        if self.loaded.source == "preset":
            facts["model_card"] = {
                k: card.get(k) for k in ("code_version", "seed", "train", "loss", "routing", "cache_hit")
            }
        else:
            facts["model_card"] = card
        if self.probe_bytes_per_second:
            facts["h2d_probe_bytes_per_second"] = self.probe_bytes_per_second
        return facts

    def run_cell(self, cell: Cell) -> EngineResult:
        capacity, refusal = self.cache_capacity(cell)
        if refusal:
            return EngineResult(status=Status.REFUSED, reason=refusal)
        setup = time.perf_counter()
        wl = self.ctx.workload
        warm = self._requests(cell, wl.warmup_rounds, max_new=cell.block_size, stream=1, tag="warmup")
        timed = self._requests(cell, wl.requests, max_new=cell.max_new_tokens, stream=0, tag="r")
        drafter_loaded_here = self._dflash is None
        drafter_load = time.perf_counter()
        decoding, drafter_facts, refusal = self._decoding(cell)
        if refusal:
            return EngineResult(status=Status.REFUSED, reason=refusal)
        drafter_load = time.perf_counter() - drafter_load
        drafter_loaded_here = drafter_loaded_here and self._dflash is not None
        runtime, link_facts = self._runtime(cell, capacity)
        try:
            scheduler, refusal = self._scheduler(cell, runtime, max(len(r.prompt) for r in warm + timed))
            if refusal:
                return EngineResult(status=Status.REFUSED, reason=refusal)
            telemetry_start = nvml.telemetry(0) if self.device.type == "cuda" else None
            setup_seconds = time.perf_counter() - setup
            torch.manual_seed(wl.seed)
            warm_start = time.perf_counter()
            if warm:
                self._serve(cell, warm, runtime, decoding, scheduler)
            runtime.reset_measurement()
            if hasattr(scheduler, "reset"):
                scheduler.reset()
            warm_seconds = time.perf_counter() - warm_start
            t0 = time.perf_counter()
            rounds = self._serve(cell, timed, runtime, decoding, scheduler)
            timed_seconds = time.perf_counter() - t0
            runtime.cache.drain()
            telemetry = None
            if telemetry_start is not None:
                telemetry = {"start": telemetry_start, "end": nvml.telemetry(0)}
            engine = {**self.describe(), **(runtime.prefetcher.describe() if runtime.prefetcher else {})}
            engine["decoding"] = "speculative" if decoding.speculative else "autoregressive"
            engine["drafter"] = drafter_facts
            engine["scheduler"] = scheduler.describe()
            timings = {"setup": setup_seconds, "warmup": warm_seconds, "timed": timed_seconds}
            if drafter_loaded_here:  # trained it, waited on another runner's training, or loaded it
                timings["drafter_load"] = drafter_load
            measurement = CellMeasurement(
                requests=timed,
                rounds=rounds,
                timed_seconds=timed_seconds,
                runtime=runtime,
                link=link_facts,
                engine=engine,
                timings=timings,
                telemetry=telemetry,
                speculative=decoding.speculative,
                block_size=cell.block_size,
            )
            return assemble(measurement, self.ctx.slo)
        finally:
            runtime.close()

    def close(self) -> None:
        self.target = None
        self.loaded = None
        self._dflash = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # -- cell pieces ---------------------------------------------------------------------------------------------
    def cache_capacity(self, cell: Cell) -> tuple[int, str | None]:
        """The cell's expert-cache capacity in bytes, or a refusal (upstream: an offloaded baseline must
        really offload; B3 holds every expert)."""
        total = self.store.total_bytes
        if not cell.offloaded:
            return total, None
        opts, frac = self.options, self.ctx.memory.expert_cache_fraction
        if opts.expert_cache_bytes is not None:
            capacity, given = (
                opts.expert_cache_bytes,
                f"engine_options.expert_cache_bytes={opts.expert_cache_bytes}",
            )
        elif frac is not None:
            capacity, given = int(frac * total), f"memory.expert_cache_fraction={frac}"
        else:
            return 0, (
                f"{cell.baseline} must be offloaded, but no expert-cache capacity is set, so the cache would hold "
                f"every expert ({total} B). Fix: set memory.expert_cache_fraction below 1 (e.g. 0.25) or "
                "models[].engine_options.expert_cache_bytes"
            )
        slots, entries = capacity // self.store.expert_nbytes, self.store.num_entries
        if slots >= entries:
            return 0, (
                f"{cell.baseline} must be offloaded, but {given} gives a cache of {capacity} B that holds all "
                f"{entries} experts ({total} B): nothing would be offloaded. Fix: lower it so the cache holds fewer "
                f"than {entries} experts (< {total} B)"
            )
        if slots < 1:
            return 0, (
                f"{given} gives a cache of {capacity} B, smaller than one expert ({self.store.expert_nbytes} B). "
                "Fix: raise it to at least one expert"
            )
        if cell.baseline == "OURS" and slots < 2:
            return 0, (
                f"{given} gives a cache of one expert slot: route-ahead pins prefetched experts until their layer "
                "runs and needs at least 2 slots. Fix: raise the capacity"
            )
        return capacity, None

    def _decoding(self, cell: Cell):
        """(decoding, drafter facts, refusal) of the cell: AR for B0/B3, the configured drafter otherwise."""
        temperature = self.ctx.workload.temperature
        if not cell.speculative:
            return AutoregressiveDecoding(temperature), None, None
        if self.options.drafter == "early_exit":
            drafter = EarlyExitDrafter(
                self.target, self.options.early_exit_layers, route_ahead=cell.baseline == "OURS"
            )
            return SpeculativeDecoding(drafter, cell.block_size, temperature), drafter.describe(), None
        if self.loaded.source != "preset":
            return (
                None,
                None,
                (
                    "engine_options.drafter=dflash needs a trained DFlash drafter, which the reference engine trains "
                    "for its presets only; for a checkpoint use engine_options.drafter: early_exit"
                ),
            )
        if self._dflash is None:
            self._dflash = load_drafter(
                get_preset(self.loaded.name),
                self.target.model,
                seed=self.options.train_seed,
                steps=self.options.drafter_train_steps,
                cache_dir=self.options.cache_dir,
            )
        drafter, card = self._dflash
        if cell.block_size > drafter.config.block_size:
            return (
                None,
                None,
                (f"block size {cell.block_size} exceeds the DFlash drafter's {drafter.config.block_size}"),
            )
        source = BlockDrafterSource(drafter, self.target, route_ahead=cell.baseline == "OURS")
        facts = {
            **source.describe(),
            "card": {k: card.get(k) for k in ("tau", "train", "params", "cache_hit")},
        }
        return SpeculativeDecoding(source, cell.block_size, temperature), facts, None

    def _runtime(self, cell: Cell, capacity: int) -> tuple[OffloadRuntime, LinkFacts]:
        opts = self.options
        if not cell.offloaded:
            link, facts = None, LinkFacts("none", probe_bytes_per_second=self.probe_bytes_per_second)
        elif self.device.type == "cuda":
            link, facts = (
                CudaLink(self.device),
                LinkFacts("real", probe_bytes_per_second=self.probe_bytes_per_second),
            )
        else:
            link = HostLink(opts.emulated_h2d_gbps, opts.emulated_latency_us)
            facts = LinkFacts(
                link.kind,
                emulated_gbps=opts.emulated_h2d_gbps,
                emulated_latency_us=opts.emulated_latency_us if opts.emulated_h2d_gbps else None,
            )
        cache = ExpertCache(
            self.store, capacity, self.device, self.compute_dtype, policy=opts.eviction, link=link
        )
        prefetcher = None
        if cell.baseline == "OURS":
            prefetcher = RouteAheadPrefetcher(
                self.target,
                self.store.layer_ids,
                self.top_k,
                window=max(1, cache.num_slots // 2),
                cross_round=opts.cross_round_prefetch,
            )
        elif opts.prefetcher == "activation_aware":
            # B3: observe-only, so its prediction quality is on the same scale as the offloaded baselines'.
            prefetcher = ActivationAwarePrefetcher(
                self.store.layer_ids, self.store.num_experts, self.top_k, issue=cell.offloaded
            )
        runtime = OffloadRuntime(self.store, cache, prefetcher)
        runtime.attach(self.target.model)
        return runtime, facts

    def _scheduler(self, cell: Cell, runtime: OffloadRuntime, longest_prompt: int):
        """(scheduler, refusal): none for B0/B1/B3, the token deficit for B2, the 2-D deficit for OURS.

        Defaults (documented in docs/reference-engine.md): tokens budget c·B (every in-flight request can
        verify a full block each step; a prefill longer than that is spread over steps by the deficit), tokens
        cap max(2·budget, longest prompt, B); bytes budget = the cell's expert-cache capacity (a step's
        route-ahead fetch must fit the cache), bytes cap = the largest route-ahead fetch one round can make.
        """
        if cell.baseline not in ("B2", "OURS"):
            return AdmitAll(), None
        opts, b = self.options, cell.block_size
        largest_tokens = max(longest_prompt, b)
        budget_tokens = opts.scheduler_budget_tokens or cell.concurrency * b
        cap_tokens = opts.scheduler_cap_tokens or max(2 * budget_tokens, largest_tokens)
        if cap_tokens < largest_tokens:
            return None, (
                f"engine_options.scheduler_cap_tokens={cap_tokens} is below the largest single demand of this "
                f"cell, {largest_tokens} tokens (the longest prompt or the block size): that round could never "
                f"be admitted. Fix: set it to at least {largest_tokens}"
            )
        if cell.baseline == "B2":
            return DeficitAdmission(TokenDeficitScheduler(budget_tokens, cap_tokens)), None
        e, k, nbytes = self.store.num_experts, self.top_k, self.store.expert_nbytes
        largest_bytes = len(self.store.layer_ids) * min(largest_tokens * k, e) * nbytes
        budget_bytes = opts.scheduler_budget_bytes or runtime.cache.num_slots * nbytes
        cap_bytes = opts.scheduler_cap_bytes or max(budget_bytes, largest_bytes)
        if cap_bytes < largest_bytes:
            return None, (
                f"engine_options.scheduler_cap_bytes={cap_bytes} is below the largest single route-ahead fetch of "
                f"this cell, {largest_bytes} B ({largest_tokens} rows × top-{k} over {e} experts in each of "
                f"{len(self.store.layer_ids)} MoE layers × {nbytes} B): that round could never be admitted. Fix: set "
                f"it to at least {largest_bytes}"
            )
        prefetcher = runtime.prefetcher
        scheduler = TwoDimDeficitScheduler(budget_tokens, budget_bytes, cap_tokens, cap_bytes)
        return DeficitAdmission(
            scheduler,
            fetch_keys=prefetcher.keys,
            is_resident=runtime.cache.contains,
            expert_nbytes=nbytes,
            in_flight=prefetcher.in_flight,
        ), None

    def _requests(self, cell: Cell, n: int, *, max_new: int, stream: int, tag: str) -> list[Request]:
        wl = self.ctx.workload
        if n == 0:
            return []
        prompts = make_prompts(
            self.loaded, wl.prompts, n, wl.prompt_tokens, seed=wl.seed + 1_000_003 * stream
        )
        out = []
        for i, prompt in enumerate(prompts):
            gen = None
            if wl.temperature > 0:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(wl.seed * 1_000_003 + 7919 * stream + i)
            out.append(Request(f"{tag}{i}", prompt, max_new, self.loaded.eos_token_id, gen))
        return out

    def _serve(self, cell: Cell, requests: list[Request], runtime: OffloadRuntime, decoding, scheduler):
        return run_requests(
            self.target,
            requests,
            concurrency=cell.concurrency,
            decoding=decoding,
            hooks=runtime,
            scheduler=scheduler,
        )


def _device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        raise InputError(f"unknown device {name!r}; use 'cpu' or 'cuda:N'", where="device") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"device {name} requested but CUDA is not available here", where="device")
    if device.type not in ("cpu", "cuda"):
        raise InputError(f"the reference engine runs on cpu or cuda, not {device.type}", where="device")
    return device
