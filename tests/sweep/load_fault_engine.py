"""An engine whose model load fails on every try for the models that ask for it (the driver's give-up path)."""

from __future__ import annotations

import time

from pd_dflash.engine.interface import Engine, EngineContext, Refused
from pd_dflash.engine.registry import EngineTraits
from pd_dflash.errors import InputError
from pd_dflash.schema import Status
from tests.sweep.engines import FixedDurationEngine, FixedDurationOptions

ENTRY_POINT = "tests.sweep.load_fault_engine:LoadFaultEngine"


class LoadFaultOptions(FixedDurationOptions):
    #: Raise from the constructor (the runner's model load), every time.
    fail_load: bool = False
    #: Raise a deterministic input error from the constructor: "input" (InputError) or "refused" (Refused).
    bad_input: str | None = None
    #: Only on the node with this id (after a second more than the others take: a box that lacks the input).
    bad_input_node: str | None = None


class LoadFaultEngine(FixedDurationEngine):
    traits = EngineTraits(
        entry_point=ENTRY_POINT, options_model="tests.sweep.load_fault_engine:LoadFaultOptions"
    )

    def __init__(self, ctx: EngineContext) -> None:
        Engine.__init__(self, ctx)
        self.options = LoadFaultOptions.model_validate(ctx.model.engine_options)
        time.sleep(self.options.load_seconds)
        if self.options.bad_input_node is not None:
            import ray

            if ray.get_runtime_context().get_node_id() == self.options.bad_input_node:
                time.sleep(1.0)
                raise InputError(f"/data/{ctx.model.id} does not exist on this box", where="models[].path")
        if self.options.bad_input == "input":
            raise InputError(f"/nowhere/{ctx.model.id} does not exist on this box", where="models[].path")
        if self.options.bad_input == "refused":
            raise Refused(Status.UNAVAILABLE_CAPACITY, f"{ctx.model.id} needs 2 TB of host memory")
        if self.options.fail_load:
            raise RuntimeError(f"injected load failure for {ctx.model.id}")
