"""Engines for orchestrator tests and benchmarks: no torch, no model, clearly synthetic metrics.

``FixedDurationEngine`` sleeps a configured time per cell (and per model load) and returns a valid OK result;
``FaultEngine`` misbehaves on chosen cells: it kills its own process, hangs, or raises, and can echo environment
variables into what it reports (as a careless engine would echo a token). Both append a line
``<cell_id> <pid>`` to the file named by $PD_DFLASH_TEST_RECORD (set through the spec's ``env``) when a cell
starts, so tests can prove which cells ran where.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from pd_dflash.engine.interface import Engine, EngineContext
from pd_dflash.engine.registry import EngineTraits
from pd_dflash.schema import EngineResult
from pd_dflash.spec import Cell

RECORD_ENV = "PD_DFLASH_TEST_RECORD"
SYNTHETIC = {"name": "fixed-duration", "synthetic": True}


def record_start(cell: Cell) -> None:
    path = os.environ.get(RECORD_ENV)
    if path:
        with open(path, "a") as fh:
            fh.write(f"{cell.cell_id} {os.getpid()}\n")
            fh.flush()
            os.fsync(fh.fileno())


def synthetic_result(cell: Cell, requests: int, seconds: float) -> EngineResult:
    """Every metric present and plausible, flagged synthetic in ``engine`` and ``warnings``."""
    tokens = requests * cell.max_new_tokens
    seconds = max(seconds, 1e-6)
    tau = min(2.0, float(cell.block_size)) if cell.speculative else 1.0
    rounds = max(1.0, tokens / tau / cell.concurrency)
    return EngineResult(
        output_tokens_per_second=tokens / seconds,
        acceptance_length_a=tau,
        ttft_seconds=seconds / rounds,
        per_round_latency_seconds=seconds / rounds,
        goodput_at_slo=requests / seconds,
        expert_cache_hit_rate=0.5,
        route_ahead_prefetch_coverage=0.5,
        wasted_prefetch_bytes=0,
        expert_occupancy_bytes=1024,
        kv_occupancy_bytes=1024,
        warnings=["synthetic metrics from a test engine: they measure nothing"],
        requests=requests,
        generated_tokens=tokens,
        timed_seconds=seconds,
        engine=dict(SYNTHETIC),
    )


class FixedDurationOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    #: Seconds per cell before the factors below.
    seconds: Annotated[float, Field(ge=0.0)] = 0.2
    #: Seconds the model "load" (engine construction) sleeps.
    load_seconds: Annotated[float, Field(ge=0.0)] = 0.0
    #: Multiplier per baseline (default 1).
    baseline_factor: dict[str, float] = Field(default_factory=dict)
    #: duration *= concurrency ** concurrency_exponent * (block_size / 8) ** block_exponent
    concurrency_exponent: float = 0.0
    block_exponent: float = 0.0

    def duration(self, cell: Cell) -> float:
        return (
            self.seconds
            * self.baseline_factor.get(cell.baseline, 1.0)
            * cell.concurrency**self.concurrency_exponent
            * (cell.block_size / 8) ** self.block_exponent
        )


class FixedDurationEngine(Engine):
    traits = EngineTraits(
        entry_point="tests.sweep.engines:FixedDurationEngine",
        options_model="tests.sweep.engines:FixedDurationOptions",
    )

    def __init__(self, ctx: EngineContext) -> None:
        super().__init__(ctx)
        self.options = FixedDurationOptions.model_validate(ctx.model.engine_options)
        time.sleep(self.options.load_seconds)

    def run_cell(self, cell: Cell) -> EngineResult:
        record_start(cell)
        seconds = self.options.duration(cell)
        started = time.perf_counter()
        time.sleep(seconds)
        return synthetic_result(cell, self.ctx.workload.requests, time.perf_counter() - started)

    def describe(self) -> dict:
        return {**SYNTHETIC, "device": self.ctx.device, "load_group": self.ctx.load_group}


#: What a cell does: succeed, raise, hang forever, or kill its own process; ``*_once`` only on the cell's first
#: try (a marker in ``state_dir`` remembers it), so a retry succeeds.
Behavior = Literal["ok", "raise", "hang", "exit", "raise_once", "hang_once", "exit_once"]


class FaultOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    seconds: Annotated[float, Field(ge=0.0)] = 0.1
    #: ``"<baseline>/c<concurrency>/r<repeat>"`` → behaviour; other cells succeed.
    behaviors: dict[str, Behavior] = Field(default_factory=dict)
    #: Where the ``*_once`` behaviours leave their markers.
    state_dir: str | None = None
    #: Every cell run on this Ray node kills its runner (a broken box, for the circuit breaker).
    bad_node: str | None = None
    #: Environment variables whose values the engine puts into its facts, warnings and exception messages.
    echo_env: list[str] = Field(default_factory=list)


def fault_selector(cell: Cell) -> str:
    return f"{cell.baseline}/c{cell.concurrency}/r{cell.repeat}"


class FaultEngine(Engine):
    traits = EngineTraits(
        entry_point="tests.sweep.engines:FaultEngine", options_model="tests.sweep.engines:FaultOptions"
    )

    def __init__(self, ctx: EngineContext) -> None:
        super().__init__(ctx)
        self.options = FaultOptions.model_validate(ctx.model.engine_options)

    def _first_try(self, cell: Cell) -> bool:
        marker = Path(self.options.state_dir or ".") / f"tried-{cell.cell_id}"
        if marker.exists():
            return False
        marker.write_text(str(os.getpid()))
        return True

    def run_cell(self, cell: Cell) -> EngineResult:
        record_start(cell)
        if self.options.bad_node:
            import ray

            if ray.get_runtime_context().get_node_id() == self.options.bad_node:
                time.sleep(self.options.seconds)
                os._exit(17)
        behavior = self.options.behaviors.get(fault_selector(cell), "ok")
        if behavior.endswith("_once"):
            behavior = behavior[: -len("_once")] if self._first_try(cell) else "ok"
        time.sleep(self.options.seconds)
        if behavior == "exit":
            os._exit(17)
        if behavior == "hang":
            while True:
                time.sleep(3600)
        echoed = {name: os.environ.get(name, "") for name in self.options.echo_env}
        if behavior == "raise":
            raise RuntimeError(
                f"injected failure for {fault_selector(cell)}{' ' + str(echoed) if echoed else ''}"
            )
        result = synthetic_result(cell, self.ctx.workload.requests, self.options.seconds)
        if echoed:
            echo = [f"{k}={v}" for k, v in echoed.items()]
            result = result.model_copy(
                update={
                    "engine": {**result.engine, "env_seen": echoed},
                    "warnings": [*result.warnings, *echo],
                }
            )
        return result


class MissingRequirementEngine(FixedDurationEngine):
    """Importable by the driver, but declares a module no box has (preflight must refuse)."""

    traits = EngineTraits(
        entry_point="tests.sweep.engines:MissingRequirementEngine",
        requires=("pd_dflash_no_such_module",),
    )

    def __init__(self, ctx: EngineContext) -> None:
        Engine.__init__(self, ctx)
        self.options = FixedDurationOptions()


class UnimportableEngine(FixedDurationEngine):
    """Its implementation module fails to import (preflight must refuse before any runner starts)."""

    traits = EngineTraits(entry_point="tests.sweep.unimportable:Engine")
