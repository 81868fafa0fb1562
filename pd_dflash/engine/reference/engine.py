"""``ReferenceEngine``: pd-dflash's own offloaded-MoE engine behind the ``Engine`` interface.

Load once (model + host expert store + device), then per cell: resolve its configuration once (``cell.py``),
build its expert cache (bounded and linked for offloaded configurations, fully resident otherwise), its decoding,
prefetcher and admission (``cell.py``'s factories, keyed by its entry in ``pd_dflash/baselines.py``), warm up,
measure the timed requests with continuous batching at the cell's concurrency, and assemble the row (a resident
configuration's AR prefetcher only observes: its rows carry no prediction counts).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch

import pd_dflash
from pd_dflash.engine import measurement, nvml
from pd_dflash.engine.interface import Engine, EngineContext, Refused
from pd_dflash.engine.probe import measure_h2d_bytes_per_second
from pd_dflash.engine.reference import cell as parts
from pd_dflash.engine.reference.cell import ConfiguredCell, PartInputs, configured
from pd_dflash.engine.reference.decoding.loop import RoundRecord, run_requests
from pd_dflash.engine.reference.decoding.target import Request, TargetModel
from pd_dflash.engine.reference.drafters import Drafters
from pd_dflash.engine.reference.models import load_model, make_prompts
from pd_dflash.engine.reference.offload.cell import Offload, expert_cache_capacity
from pd_dflash.engine.reference.offload.memory import (
    device_available_bytes,
    host_available_bytes,
    module_bytes,
    require,
    require_cell_device_memory,
)
from pd_dflash.engine.reference.offload.runtime import OffloadRuntime, install_offload
from pd_dflash.engine.reference.offload.store import HostExpertStore
from pd_dflash.engine.reference.options import ReferenceOptions
from pd_dflash.engine.reference.positions import refuse_beyond_positions
from pd_dflash.engine.reference.prompts import prompt_facts
from pd_dflash.engine.reference.requirements import require_transformers
from pd_dflash.engine.reference.seams import Admission, Decoding
from pd_dflash.engine.reference.trace import CellMeasurement, LinkFacts, cell_trace
from pd_dflash.errors import InputError
from pd_dflash.schema import EngineResult, Status
from pd_dflash.spec import Cell


@dataclass
class _CellSetup:
    """One cell's pieces, built before its warm-up."""

    configured: ConfiguredCell
    warm: list[Request]
    timed: list[Request]
    decoding: Decoding
    drafter_facts: dict[str, Any] | None
    #: Seconds this cell spent training or loading the DFlash drafter (None when it was loaded before).
    drafter_load_seconds: float | None
    runtime: OffloadRuntime
    link: LinkFacts
    admission: Admission
    telemetry_start: dict[str, Any] | None
    setup_seconds: float


class ReferenceEngine(Engine):
    def __init__(self, ctx: EngineContext) -> None:
        super().__init__(ctx)
        require_transformers()  # before anything calls the cache= API (requirements.py)
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
            path=ctx.model.path,
            device=self.device,
            storage=self.options.storage_dtype,
            host_available_bytes=self.host_available_bytes(),
            device_available_bytes=self.device_available_bytes(),
        )
        model = self.loaded.model
        self.compute_dtype = next(model.parameters()).dtype
        #: A load that does not fit (the host store, the device weights): every cell is refused with its figures.
        self.load_refusal: Refused | None = self.loaded.refusal
        self.store: HostExpertStore | None = self.loaded.store  # a checkpoint's, streamed into it at load
        self.storage_dtype = self.loaded.storage or self.options.storage_dtype
        if self.loaded.source == "preset":
            if self.storage_dtype == "auto":
                self.storage_dtype = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}[
                    self.compute_dtype
                ]
            try:
                self.store = self._host_store(model)
                model.to(self.device)  # everything but the routed experts, which now live in the host store
            except Refused as refusal:
                self.load_refusal = refusal
        self.target = TargetModel(model, self.loaded.family, self.device)
        self.top_k = int(model.config.num_experts_per_tok)
        if self.options.drafter == "early_exit" and self.options.early_exit_layers >= self.target.num_layers:
            raise InputError(
                f"early_exit_layers must be below the target's {self.target.num_layers} layers "
                f"(the drafter is the first d layers), got {self.options.early_exit_layers}",
                where="models[].engine_options.early_exit_layers",
            )
        self.probe_bytes_per_second = (
            measure_h2d_bytes_per_second(self.device)
            if self.device.type == "cuda" and self.load_refusal is None
            else None
        )
        self.drafters = Drafters(self.target, self.loaded, ctx.model, self.options)
        #: What each cell's offload is built from (None when the load was refused: no cell runs).
        self.offload: Offload | None = None
        if self.store is not None:
            self.offload = Offload(
                self.target,
                self.store,
                self.options,
                self.device,
                self.compute_dtype,
                self.top_k,
                self.probe_bytes_per_second,
            )
        self.load_seconds = time.perf_counter() - start

    def _host_store(self, model) -> HostExpertStore:
        """The host store (its memory checked first), then the device check of the non-expert weights."""
        store = install_offload(
            model,
            self.loaded.family,
            self.storage_dtype,
            pin=self.device.type == "cuda",
            host_available_bytes=self.host_available_bytes(),
        )
        fix = "a GPU with more free memory (another process may hold some)"
        require("the non-expert weights", module_bytes(model), self.device_available_bytes(), fix, "device")
        return store

    def host_available_bytes(self) -> int | None:
        """Host memory available now (``offload/memory.py``); a subclass may inject a figure."""
        return host_available_bytes()

    def device_available_bytes(self) -> int | None:
        """Device memory torch can still allocate (None on the CPU); a subclass may inject a figure."""
        return device_available_bytes(self.device)

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
            "top_k": self.top_k,
            "eviction": self.options.eviction,
            "load_seconds": self.load_seconds,
            "threads": torch.get_num_threads(),
        }
        if (st := self.store) is not None:
            facts.update(experts_per_layer=st.num_experts, moe_layers=len(st.layer_ids))
            facts.update(expert_nbytes=st.expert_nbytes, total_expert_bytes=st.total_bytes)
            facts["host_arena_bytes"] = st.arena.nbytes
        if self.load_refusal is not None:
            facts["load_refused"] = self.load_refusal.reason
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
        """Setup (a configuration the engine must not run raises ``Refused`` here) → warm-up → the timed
        requests → the row."""
        if self.load_refusal is not None:
            raise self.load_refusal
        cc = configured(cell)
        with self._setup(cc, self._capacity(cc)) as setup:
            warm_seconds = self._warm_up(cell, setup)
            rounds, timed_seconds = self._timed(cell, setup)
            measured = self._measurement(setup, rounds, warm_seconds, timed_seconds)
            result = measurement.engine_result(cell_trace(measured), self.ctx.slo)
            result.warnings.extend((setup.drafter_facts or {}).get("warnings", []))
            return result

    def close(self) -> None:
        for name in ("target", "loaded", "drafters"):  # the model, its drafters and their memory
            self.__dict__.pop(name, None)
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # -- the steps of a cell -----------------------------------------------------------------------------------
    @contextmanager
    def _setup(self, cc: ConfiguredCell, capacity: int) -> Iterator[_CellSetup]:
        """The cell's requests and parts (the drafter loads at the first speculative cell), its expert cache and
        runtime; the cache and its link are closed when the cell ends."""
        start, cell, offload = time.perf_counter(), cc.cell, self._offload()
        wl = self.ctx.workload
        warm = self._requests(cell, wl.warmup_rounds, max_new=cell.block_size, stream=1, tag="warmup")
        timed = self._requests(cell, wl.requests, max_new=cell.max_new_tokens, stream=0, tag="r")
        config = self.target.model.config
        refuse_beyond_positions(
            cell, warm + timed, getattr(config, "max_position_embeddings", None), self.ctx.model.id
        )
        inputs = PartInputs(
            cell=cell,
            configuration=cc.configuration,
            options=self.options,
            target=self.target,
            store=offload.store,
            top_k=self.top_k,
            temperature=wl.temperature,
            drafters=self.drafters,
            link_bytes_per_second=self.link_bytes_per_second(cell),
            longest_prompt=max(len(r.prompt) for r in warm + timed),
        )
        decoding, drafter_facts = parts.decoding(inputs)  # on the device before the check
        drafter_load = self.drafters.last_load_seconds if decoding.speculative else None
        available, where = self.device_available_bytes(), "device"
        if available is None:  # the CPU engine: its expert cache and KV cache are host memory
            available, where = self.host_available_bytes(), "host"
        require_cell_device_memory(
            cell,
            cc.configuration,
            offload.store,
            capacity,
            self.target.model.config,
            self.compute_dtype,
            tokens=max(len(r.prompt) + r.max_new_tokens for r in warm + timed) + cell.block_size,
            available=available,
            where=where,
        )
        prefetcher = parts.prefetcher(inputs)
        runtime, link = offload.runtime(cell, cc.configuration, capacity, prefetcher)
        try:
            yield _CellSetup(
                configured=cc,
                warm=warm,
                timed=timed,
                decoding=decoding,
                drafter_facts=drafter_facts,
                drafter_load_seconds=drafter_load,
                runtime=runtime,
                link=link,
                admission=parts.admission(inputs, prefetcher, runtime.cache.contains),
                telemetry_start=nvml.telemetry(0) if self.device.type == "cuda" else None,
                setup_seconds=time.perf_counter() - start,
            )
        finally:
            self.target.sync_hook = None
            runtime.close()

    def _warm_up(self, cell: Cell, setup: _CellSetup) -> float:
        """Serve the warm-up requests, then reset the counters and statistics (cache contents and prefetch
        history stay warm); returns its seconds."""
        torch.manual_seed(cell.sample_seed)
        start = time.perf_counter()
        if setup.warm:
            self._serve(cell, setup.warm, setup)
        setup.runtime.reset_measurement()
        setup.admission.reset()
        return time.perf_counter() - start

    def _timed(self, cell: Cell, setup: _CellSetup) -> tuple[list[RoundRecord], float]:
        """Serve the timed requests: their rounds and the timed wall time (first admission → last completion)."""
        start = time.perf_counter()
        rounds = self._serve(cell, setup.timed, setup)
        seconds = time.perf_counter() - start
        setup.runtime.cache.drain()
        return rounds, seconds

    def _measurement(
        self, setup: _CellSetup, rounds: list[RoundRecord], warm_seconds: float, timed_seconds: float
    ) -> CellMeasurement:
        """What the cell measured, with the engine and cell facts the row carries."""
        runtime = setup.runtime
        telemetry = None
        if setup.telemetry_start is not None:
            telemetry = {"start": setup.telemetry_start, "end": nvml.telemetry(0)}
        prefetcher = runtime.prefetcher
        engine = {**self.describe(), "prefetcher": setup.configured.configuration.prefetcher}
        engine.update(prefetcher.describe() if prefetcher is not None else {})
        engine["decoding"] = "speculative" if setup.decoding.speculative else "autoregressive"
        engine["drafter"] = setup.drafter_facts
        engine["scheduler"] = setup.admission.describe()  # the row's key for the admission (docs/metrics.md)
        engine["prompts"] = prompt_facts(self.ctx.workload, self.loaded.chat, setup.timed)
        timings = {"setup": setup.setup_seconds, "warmup": warm_seconds, "timed": timed_seconds}
        # Only in the cell that trained the drafter, waited on another runner's training, or loaded it.
        if setup.drafter_load_seconds is not None:
            timings["drafter_load"] = setup.drafter_load_seconds
        return CellMeasurement(
            requests=setup.timed,
            rounds=rounds,
            timed_seconds=timed_seconds,
            runtime=runtime,
            link=setup.link,
            engine=engine,
            timings=timings,
            telemetry=telemetry,
            speculative=setup.decoding.speculative,
        )

    # -- cell pieces ---------------------------------------------------------------------------------------------
    def cache_capacity(self, cell: Cell) -> int:
        """The cell's expert-cache capacity in bytes (``offload/cell.expert_cache_capacity``)."""
        return self._capacity(configured(cell))

    def _capacity(self, cc: ConfiguredCell) -> int:
        store = self._offload().store
        return expert_cache_capacity(cc.cell, cc.configuration, store, self.options, self.ctx.memory)

    def _offload(self) -> Offload:
        """What every cell's offload is built from (a refused load has none: its refusal is raised)."""
        if self.offload is None:
            raise self.load_refusal or RuntimeError("the engine loaded no expert store")
        return self.offload

    def link_bytes_per_second(self, cell: Cell) -> float | None:
        """The link's rate for this cell as known before it runs (``offload/cell.py``)."""
        return self._offload().link_bytes_per_second(cell)

    def _requests(self, cell: Cell, n: int, *, max_new: int, stream: int, tag: str) -> list[Request]:
        wl, seed = self.ctx.workload, cell.sample_seed  # the repeat's sample: prompts, order, sampling
        if n == 0:
            return []
        try:
            prompts = make_prompts(
                self.loaded, wl.prompts, n, wl.prompt_tokens, seed + 1_000_003 * stream, wl.chat_date
            )
        except InputError as exc:  # e.g. an instruct target's tokenizer without a chat template
            raise Refused(Status.REFUSED, str(exc)) from None
        out = []
        for i, prompt in enumerate(prompts):
            gen = None
            if wl.temperature > 0:
                gen = torch.Generator(device=self.device)
                gen.manual_seed(seed * 1_000_003 + 7919 * stream + i)
            out.append(Request(f"{tag}{i}", prompt, max_new, self.loaded.eos_token_ids, gen))
        return out

    def _serve(self, cell: Cell, requests: list[Request], setup: _CellSetup) -> list[RoundRecord]:
        return run_requests(
            self.target,
            requests,
            concurrency=cell.concurrency,
            decoding=setup.decoding,
            hooks=setup.runtime,
            admission=setup.admission,
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
