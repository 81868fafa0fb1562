"""A test engine whose rows pass every gate (``tests.core.helpers.result``) but OURS coverage, which the spec sets
per concurrency level and repeat: the adaptive-repeat runs decide some groups early and leave others open."""

from __future__ import annotations

import time
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from pd_dflash.engine.interface import Engine, EngineContext
from pd_dflash.engine.registry import EngineTraits
from pd_dflash.schema import EngineResult
from pd_dflash.spec import Cell
from tests.core.helpers import jittered
from tests.sweep.engines import record_start


class GateOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    seconds: Annotated[float, Field(ge=0.0)] = 0.2
    #: Concurrency level (as text) → OURS coverage per repeat; other levels keep the helper's 0.875.
    coverage: dict[str, list[float]] = Field(default_factory=dict)


class GateEngine(Engine):
    traits = EngineTraits(
        entry_point="tests.sweep.gate_engine:GateEngine", options_model="tests.sweep.gate_engine:GateOptions"
    )

    def __init__(self, ctx: EngineContext) -> None:
        super().__init__(ctx)
        self.options = GateOptions.model_validate(ctx.model.engine_options)

    def run_cell(self, cell: Cell) -> EngineResult:
        record_start(cell)
        time.sleep(self.options.seconds)
        values = self.options.coverage.get(str(cell.concurrency))
        over = (
            {"route_ahead_prefetch_coverage": values[cell.repeat]}
            if values and cell.baseline == "OURS"
            else {}
        )
        return jittered(cell.baseline, cell.repeat, **over)

    def describe(self) -> dict:
        return {"name": "gate-test", "synthetic": True, "device": self.ctx.device}
