"""A test engine that signals the driver from inside a cell, once per sweep: the driver is then blocked in its
``ray.wait`` for the running cell (it submitted the cell ``before_s`` earlier and waits up to ``poll_s``), so the
signal lands inside that Ray call, deterministically. The cell then goes on for ``after_s`` and succeeds."""

from __future__ import annotations

import os
import signal
import time
from typing import Annotated

from pydantic import Field

from pd_dflash.engine.interface import Engine, EngineContext
from pd_dflash.engine.registry import EngineTraits
from pd_dflash.schema import EngineResult
from pd_dflash.spec import Cell
from tests.sweep.engines import FixedDurationEngine, FixedDurationOptions

ENTRY_POINT = "tests.sweep.signal_engine:SignalEngine"


class SignalOptions(FixedDurationOptions):
    #: The driver's pid and the signal to send it (by name); 0: never.
    signal_pid: int = 0
    signal_name: str = "SIGTERM"
    #: Created exclusively by the cell that signals: one signal per sweep, whichever runner gets there first.
    marker: str | None = None
    before_s: Annotated[float, Field(ge=0.0)] = 0.5
    after_s: Annotated[float, Field(ge=0.0)] = 1.0


def signal_once(pid: int, name: str, marker: str | None) -> bool:
    """Send ``name`` to ``pid`` unless ``marker`` exists (it is created first): True when this call sent it."""
    if not pid:
        return False
    if marker is not None:
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
        except FileExistsError:
            return False
    os.kill(pid, signal.Signals[name])
    return True


class SignalEngine(FixedDurationEngine):
    traits = EngineTraits(entry_point=ENTRY_POINT, options_model="tests.sweep.signal_engine:SignalOptions")

    def __init__(self, ctx: EngineContext) -> None:
        Engine.__init__(self, ctx)
        self.options = SignalOptions.model_validate(ctx.model.engine_options)
        time.sleep(self.options.load_seconds)

    def run_cell(self, cell: Cell) -> EngineResult:
        opts = self.options
        if opts.signal_pid and not (opts.marker and os.path.exists(opts.marker)):
            time.sleep(opts.before_s)  # the driver has long been back in its ray.wait for this cell
            if signal_once(opts.signal_pid, opts.signal_name, opts.marker):
                time.sleep(opts.after_s)
        return super().run_cell(cell)
