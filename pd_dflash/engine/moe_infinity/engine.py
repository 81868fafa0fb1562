"""Adapter from the engine interface to MoE-Infinity (``engine: moe_infinity``), for the real GPU runs.

One runner process holds one MoE-Infinity model (``loading``): ``MoE(model, {"offload_path",
"device_memory_ratio"})`` at ``memory.device_memory_ratio`` (shared load: B0, B1, B2, OURS) or
``memory.resident_memory_ratio`` (B3's own load), the DFlash speculator from the draft path with route-ahead
statistics on, the probed host→device bandwidth and the device identity.

Per cell (``cells`` → ``measure`` → ``results``): a ContinuousBatchingEngine with ``max_batch_size = c`` serves
``workload.requests`` requests with c in flight. What each configuration switches (never silently the same as
another):

- B0: no speculator (autoregressive, batched decode).
- B3: B1's speculative path on the resident load (upstream's B3: DFlash with every expert resident).
- B1: DFlash with route-ahead OFF (the verify-time prefetcher hook returns None, so the expert executor keeps
  its unchanged AR prefetch path) and non-binding verify budgets (every pending verify admitted each step).
- B2: DFlash, route-ahead OFF, token-deficit scheduling (upstream's ``build_b2_serving_config``: token budget
  and cap = B, expert bytes unbounded). Upstream ran B2 with the route-ahead seam active only because its
  build could not switch it off; pd-dflash's B2 keeps the AR prefetcher (docs/metrics.md).
- OURS: DFlash, route-ahead ON, the 2-D (tokens, expert bytes) deficit scheduler with a byte budget.

A configuration the installed build cannot express raises ``Refused`` (BLOCKED_UNTIL_2D_SCHEDULER, REFUSED or
UNAVAILABLE_CAPACITY) with the missing piece named (``features.Build``).
"""

from __future__ import annotations

import gc
from typing import Any

from pd_dflash.engine.interface import Engine, EngineContext, Refused
from pd_dflash.engine.measurement import engine_result
from pd_dflash.engine.moe_infinity import cells, loading, measure, trace
from pd_dflash.engine.moe_infinity.options import MoEInfinityOptions
from pd_dflash.schema import EngineResult, Status
from pd_dflash.spec import Cell


class MoEInfinityEngine(Engine):
    """One MoE-Infinity model in this runner process; ``run_cell`` measures one cell through its server."""

    def __init__(self, ctx: EngineContext) -> None:
        super().__init__(ctx)
        self.options = MoEInfinityOptions.model_validate(ctx.model.engine_options)
        self.cuda = ctx.device.startswith("cuda")
        self.ratio = (
            ctx.memory.resident_memory_ratio
            if ctx.load_group == "resident"
            else ctx.memory.device_memory_ratio
        )
        self._facts: dict[str, Any] = {
            "name": "moe_infinity",
            "load_group": ctx.load_group,
            "device": ctx.device,
            "device_memory_ratio": self.ratio,
        }
        device = loading.check_device(ctx)
        self._facts.update(device.facts)
        self.refusal, self.h2d = device.refusal, device.h2d
        self.loaded: loading.Loaded | None = None
        if self.refusal is None:
            self.loaded = loading.load(ctx, self.options, self.ratio)
            self._facts.update(self.loaded.facts)

    def describe(self) -> dict[str, Any]:
        return dict(self._facts)

    def close(self) -> None:
        self.loaded = None
        gc.collect()
        if self.cuda:
            import torch

            torch.cuda.empty_cache()

    def run_cell(self, cell: Cell) -> EngineResult:
        if cell.model != self.ctx.model.id:
            raise ValueError(
                f"cell {cell.cell_id} is for {cell.model}, this runner loaded {self.ctx.model.id}"
            )
        if self.refusal is not None:
            raise Refused(Status.REFUSED, self.refusal)
        loaded = self.loaded
        assert loaded is not None  # no refusal means the model was loaded
        cells.gate(self.ctx, loaded, cell, self.ratio)
        plan = cells.plan(self.options, loaded, cell, self.h2d)
        ratio = loaded.applied_ratio if loaded.applied_ratio is not None else self.ratio
        observation = measure.measure(self.ctx, self.options, loaded, cell, plan, ratio, self.cuda)
        cell_trace = trace.cell_trace(loaded, self.describe(), cell, plan, observation, self.h2d, self.cuda)
        return engine_result(cell_trace, self.ctx.slo)
