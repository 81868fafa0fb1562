"""Device identity, telemetry and hardware validation through NVML (package ``nvidia-ml-py``, module ``pynvml``).

Without a driver (CPU machines, fake Ray GPUs) every function degrades to ``None`` / a recorded note: NVML raises
``NVMLError_LibraryNotFound`` there, a subclass of ``NVMLError``. No torch here.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Any

_initialised: bool | None = None


def _nvml():
    """The initialised ``pynvml`` module, or None when NVML is unavailable."""
    global _initialised
    try:
        import pynvml
    except ImportError:
        return None
    if _initialised is None:
        try:
            pynvml.nvmlInit()
            _initialised = True
        except pynvml.NVMLError:
            _initialised = False
    return pynvml if _initialised else None


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def visible_device_handle(position: int = 0):
    """NVML handle of the ``position``-th device this process may use.

    Ray assigns GPUs through ``CUDA_VISIBLE_DEVICES`` (indices or UUIDs); NVML ignores that variable and counts
    every device, so map through it. Runners set ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` so CUDA and NVML agree.
    """
    pynvml = _nvml()
    if pynvml is None:
        return None
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    try:
        if not visible:
            return pynvml.nvmlDeviceGetHandleByIndex(position)
        if position >= len(visible):
            return None
        entry = visible[position]
        if entry.startswith(("GPU-", "MIG-")):
            return pynvml.nvmlDeviceGetHandleByUUID(entry.encode())
        return pynvml.nvmlDeviceGetHandleByIndex(int(entry))
    except (pynvml.NVMLError, ValueError):
        return None


def _safe(fn, *args, default=None):
    pynvml = _nvml()
    try:
        return fn(*args)
    except pynvml.NVMLError:
        return default


def device_identity(position: int = 0) -> dict[str, Any] | None:
    """Name, UUID, compute capability, memory, driver, PCIe link (current and max) and max clocks."""
    pynvml = _nvml()
    handle = visible_device_handle(position)
    if pynvml is None or handle is None:
        return None
    cc = _safe(pynvml.nvmlDeviceGetCudaComputeCapability, handle)
    mem = _safe(pynvml.nvmlDeviceGetMemoryInfo, handle)
    cuda = _safe(pynvml.nvmlSystemGetCudaDriverVersion)
    return {
        "name": _text(_safe(pynvml.nvmlDeviceGetName, handle, default="")),
        "uuid": _text(_safe(pynvml.nvmlDeviceGetUUID, handle, default="")),
        "compute_capability": list(cc) if cc else None,
        "memory_total_bytes": int(mem.total) if mem else None,
        "driver_version": _text(_safe(pynvml.nvmlSystemGetDriverVersion, default="")),
        "cuda_driver_version": f"{cuda // 1000}.{cuda % 1000 // 10}" if cuda else None,
        "pcie": {
            "gen_current": _safe(pynvml.nvmlDeviceGetCurrPcieLinkGeneration, handle),
            "gen_max": _safe(pynvml.nvmlDeviceGetMaxPcieLinkGeneration, handle),
            "width_current": _safe(pynvml.nvmlDeviceGetCurrPcieLinkWidth, handle),
            "width_max": _safe(pynvml.nvmlDeviceGetMaxPcieLinkWidth, handle),
        },
        "clocks_max_mhz": {
            "sm": _safe(pynvml.nvmlDeviceGetMaxClockInfo, handle, pynvml.NVML_CLOCK_SM),
            "mem": _safe(pynvml.nvmlDeviceGetMaxClockInfo, handle, pynvml.NVML_CLOCK_MEM),
        },
    }


def telemetry(position: int = 0) -> dict[str, Any] | None:
    """A snapshot for a row's ``telemetry.start`` / ``telemetry.end``: clocks, power, temperature, memory, PCIe."""
    pynvml = _nvml()
    handle = visible_device_handle(position)
    if pynvml is None or handle is None:
        return None
    power = _safe(pynvml.nvmlDeviceGetPowerUsage, handle)
    mem = _safe(pynvml.nvmlDeviceGetMemoryInfo, handle)
    util = _safe(pynvml.nvmlDeviceGetUtilizationRates, handle)
    return {
        "time": time.time(),
        "clocks_mhz": {
            "sm": _safe(pynvml.nvmlDeviceGetClockInfo, handle, pynvml.NVML_CLOCK_SM),
            "mem": _safe(pynvml.nvmlDeviceGetClockInfo, handle, pynvml.NVML_CLOCK_MEM),
        },
        "power_w": power / 1000.0 if power is not None else None,
        "temperature_c": _safe(pynvml.nvmlDeviceGetTemperature, handle, pynvml.NVML_TEMPERATURE_GPU),
        "memory_used_bytes": int(mem.used) if mem else None,
        "utilization": {"gpu": util.gpu, "memory": util.memory} if util else None,
        "pcie": {
            "gen_current": _safe(pynvml.nvmlDeviceGetCurrPcieLinkGeneration, handle),
            "width_current": _safe(pynvml.nvmlDeviceGetCurrPcieLinkWidth, handle),
        },
    }


@dataclass(frozen=True)
class DeviceCheck:
    ok: bool
    note: str
    identity: dict[str, Any] | None


def validate_device(expected_name: str | None, compute_capability: tuple[int, int] | None, position: int = 0):
    """Check the device against the spec's hardware requirement (name substring, compute capability).

    With no NVML (a CPU machine, or Ray's fake GPUs) the check is skipped and the note says so; the caller
    records the note in every row.
    """
    identity = device_identity(position)
    if identity is None:
        return DeviceCheck(True, "device not validated: NVML unavailable (CPU machine or fake GPU)", None)
    problems = []
    if expected_name and expected_name.lower() not in identity["name"].lower():
        problems.append(f"name {identity['name']!r} does not contain {expected_name!r}")
    if compute_capability and identity["compute_capability"] != list(compute_capability):
        problems.append(
            f"compute capability {tuple(identity['compute_capability'] or ())} != {tuple(compute_capability)}"
        )
    if problems:
        return DeviceCheck(False, "device rejected: " + "; ".join(problems), identity)
    return DeviceCheck(True, f"device validated: {identity['name']} {identity['uuid']}", identity)
