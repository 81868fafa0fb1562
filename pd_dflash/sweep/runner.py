"""The runner actor: one per GPU, one loaded model, every cell of that model.

The driver creates it with the GPU, CPU and accelerator resources of the spec and ``max_restarts=0``; a model
switch kills the process (GPU memory and engine state are only truly freed with it). The spec's environment is
set before the engine is imported, the device is checked against the spec's hardware (NVML), and every row
records which runner, device and software measured it. An engine exception becomes an ERROR row with the
traceback; the runner itself only dies when its process does.

The runner is where a row is validated: it is the one place that receives untrusted data (what an engine,
possibly a custom one, returned), and the only one that can still turn a result the row contract or JSON cannot
carry into this cell's ERROR row. The validated ``Row`` then crosses Ray as it is (pickled), and the driver and
the collector take it as validated (docs/orchestrator.md, "Runners").
"""

from __future__ import annotations

import os
import time
import traceback
from typing import Any

import ray

from pd_dflash.engine import registry
from pd_dflash.engine.interface import EngineContext, Refused
from pd_dflash.errors import InputError
from pd_dflash.schema import Row, Status
from pd_dflash.spec import Cell, Hardware, SweepSpec
from pd_dflash.sweep.manifest import environment_manifest
from pd_dflash.sweep.store import utc_now

#: Reasons are short; the traceback goes to errors/<cell_id>.txt.
REASON_LIMIT = 500


class DeviceMismatch(RuntimeError):
    """The GPU Ray gave this runner is not the hardware the spec asks for (wrong box or wrong resource)."""


def short(text: str, limit: int = REASON_LIMIT) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def input_refusal(exc: BaseException) -> tuple[Status, str] | None:
    """(status, named reason) when a model load failed on a deterministic input error — the engine raised
    ``InputError`` (a path that is not there or not a checkpoint, CUDA asked for on a box without it) or
    ``Refused``: the same load fails the same way again, so it is not retried. None for any other failure."""
    for error in (getattr(exc, "cause", None), exc):  # a RayTaskError carries the engine's exception as cause
        if isinstance(error, Refused):
            return error.status, short(error.reason)
        if isinstance(error, InputError):
            return Status.REFUSED, short(error.args[0] if error.args else str(error))
    return None


def check_device(hardware: Hardware, gpu_ids: list[str]) -> tuple[bool, str, dict[str, Any] | None]:
    """(ok, note, identity) of the runner's device through NVML; no NVML device means fake GPUs: a note."""
    try:
        from pd_dflash.engine import nvml
    except ImportError as exc:
        return True, f"device not validated: pd_dflash.engine.nvml is unavailable ({exc})", None
    try:
        check = nvml.validate_device(hardware.expected_gpu_name, hardware.compute_capability)
    except Exception as exc:
        return True, f"device not validated: NVML check failed ({type(exc).__name__}: {exc})", None
    if check.identity is None:
        return True, f"{check.note} (Ray GPU ids {gpu_ids})", None
    if hardware.device == "cpu":  # a CPU sweep only borrows the GPU slot: its model does not matter
        return True, f"engine runs on the CPU; GPU slot not validated ({check.note})", check.identity
    return bool(check.ok), check.note, check.identity


def resolve_device(hardware: Hardware, identity: dict[str, Any] | None) -> str:
    """The EngineContext device: Ray makes the assigned GPU the only visible one, so it is ``cuda:0``."""
    if hardware.device == "cpu":
        return "cpu"
    if hardware.device == "cuda":
        return "cuda:0"
    return "cuda:0" if identity is not None else "cpu"


class Runner:
    """A Ray actor class (see ``RunnerActor``); plain methods so tests can read it as code."""

    def __init__(self, spec: SweepSpec, box: str) -> None:
        # CUDA and NVML must number devices alike (nvml.visible_device_handle); the spec's env comes first
        # of all, before anything imports the engine.
        os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
        os.environ.update(spec.env)
        self.spec = spec
        ctx = ray.get_runtime_context()
        gpu_ids = [str(g) for g in ctx.get_accelerator_ids().get("GPU", [])]
        ok, note, identity = check_device(spec.hardware, gpu_ids)
        self.device_ok, self.device_note = ok, note
        self.info: dict[str, Any] = {
            "box": box,
            "node_id": ctx.get_node_id(),
            "node_ip": ray.util.get_node_ip_address(),
            "gpu_ids": gpu_ids,
            "pid": os.getpid(),
            "actor_id": ctx.get_actor_id(),
            "device": resolve_device(spec.hardware, identity),
            "device_note": note,
        }
        if identity is not None:
            self.info["device_identity"] = identity
        self.environment = environment_manifest(spec.env)
        self.engine = None
        self.describe: dict[str, Any] = {}
        self.cells_served = 0

    def load(self, model_id: str, load_group: str) -> dict[str, Any]:
        """Construct the engine for one model (the expensive part); returns the load time and runner facts."""
        if not self.device_ok:
            raise DeviceMismatch(f"box {self.info['box']} GPU {self.info['gpu_ids']}: {self.device_note}")
        engine_cls = registry.engine_class(self.spec.engine)
        ctx = EngineContext.for_model(self.spec, model_id, device=self.info["device"], load_group=load_group)
        started = time.perf_counter()
        self.engine = engine_cls(ctx)
        seconds = time.perf_counter() - started
        self.describe = dict(self.engine.describe() or {})
        self.info.update(model=model_id, load_group=load_group, model_load_seconds=round(seconds, 6))
        return {"load_seconds": seconds, "runner": dict(self.info)}

    def run(self, cell: Cell, attempt: int) -> dict[str, Any]:
        """Measure one cell; returns its validated row (an ERROR row when the engine raised or returned what a
        row cannot hold)."""
        if self.engine is None:
            raise RuntimeError("run() before load()")
        self.cells_served += 1
        runner = {**self.info, "cells_served": self.cells_served}
        started_at, wall0, t0 = utc_now(), time.time(), time.perf_counter()
        error_text = None
        bookkeeping = {
            "attempt": attempt,
            "sweep": self.spec.name,
            "runner": runner,
            "environment": self.environment,
            "started_at": started_at,
        }
        try:
            try:
                result = self.engine.run_cell(cell)
            except Refused as refusal:  # the one place a refusal becomes a row
                result = refusal.result()
            except InputError as exc:  # a bad input met while running: the same every time, so not an ERROR
                result = Refused(Status.REFUSED, short(str(exc))).result()
            seconds = time.perf_counter() - t0
            result = result.model_copy(update={"engine": {**self.describe, **result.engine}})
            row = Row.from_result(cell, result, **bookkeeping, finished_at=utc_now())
            row.to_json_dict()  # facts JSON cannot carry fail here, as this cell's error, not in the collector
        except Exception as exc:
            seconds = time.perf_counter() - t0
            error_text = traceback.format_exc()
            reason = short(f"{type(exc).__name__}: {exc}")
            row = Row.without_metrics(cell, Status.ERROR, reason, **bookkeeping, finished_at=utc_now())
        return {
            "row": row,
            "error": error_text,
            "seconds": seconds,
            "started": wall0,
            "finished": wall0 + seconds,
        }


RunnerActor = ray.remote(max_restarts=0, max_task_retries=0)(Runner)
