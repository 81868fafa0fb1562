"""A custom engine in a module of its own, so a test can tell whether the driver process imported it.

It declares a baseline it does not implement and a separate load for B3, so the driver needs its traits (which
preflight brings back from a box) to plan and schedule.
"""

from __future__ import annotations

from pd_dflash.baselines import ORDER
from pd_dflash.engine.registry import EngineTraits
from tests.sweep.engines import FixedDurationEngine

ENTRY_POINT = "tests.sweep.probe_engine:ProbeEngine"


class ProbeEngine(FixedDurationEngine):
    traits = EngineTraits(
        entry_point=ENTRY_POINT,
        options_model="tests.sweep.engines:FixedDurationOptions",
        supported_baselines=frozenset(ORDER) - {"B2"},
        unsupported_reason={"B2": "the probe engine has no token-deficit scheduler"},
        separate_resident_load=True,
    )
