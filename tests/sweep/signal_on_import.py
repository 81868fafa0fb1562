"""Importing this module signals the driver when ``$PD_DFLASH_TEST_SIGNAL_ON_IMPORT`` says ``PID:MARKER``
(once: the marker is created exclusively), then holds the import for a second. Preflight imports the engine in
a task on each box while the driver waits for that task, so the signal lands in the driver's wait for it."""

from __future__ import annotations

import os
import time

from pd_dflash.engine.registry import EngineTraits
from tests.sweep.signal_engine import SignalEngine, signal_once

ENTRY_POINT = "tests.sweep.signal_on_import:SignalOnImportEngine"
ENV = "PD_DFLASH_TEST_SIGNAL_ON_IMPORT"

if os.environ.get(ENV):
    _pid, _, _marker = os.environ[ENV].partition(":")
    time.sleep(0.5)  # the driver is in its wait for this task by now
    if signal_once(int(_pid), "SIGTERM", _marker):
        time.sleep(1.0)


class SignalOnImportEngine(SignalEngine):
    traits = EngineTraits(entry_point=ENTRY_POINT, options_model="tests.sweep.signal_engine:SignalOptions")
