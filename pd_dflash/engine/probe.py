"""`pd-dflash probe`: device identity through NVML and a measured host→device bandwidth.

On CUDA the bandwidth is measured as upstream's probe measures it: a pinned 256 MiB host buffer, one
warm-up copy, then 20 non-blocking copies timed between synchronizations; bytes / elapsed. Without a GPU it says
so and measures a host memcpy bandwidth instead (the reference engine's CPU path copies host to host).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from pd_dflash.engine import nvml

PROBE_BYTES = 256 * 2**20
PROBE_COPIES = 20


def measure_h2d_bytes_per_second(
    device: str | torch.device = "cuda", nbytes: int = PROBE_BYTES, copies: int = PROBE_COPIES
) -> float | None:
    """Pinned host→device copy bandwidth in bytes/s, or None without CUDA."""
    if not torch.cuda.is_available():
        return None
    device = torch.device(device)
    host = torch.empty(nbytes // 2, dtype=torch.float16, pin_memory=True)
    dev = torch.empty_like(host, device=device)
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(copies):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    elapsed = max(time.perf_counter() - start, 1e-9)
    return nbytes * copies / elapsed


def measure_host_copy_bytes_per_second(nbytes: int = 64 * 2**20, copies: int = 5) -> float:
    """Host memcpy bandwidth in bytes/s (what a CPU engine's un-emulated expert copy runs at)."""
    src = torch.ones(nbytes // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)
    start = time.perf_counter()
    for _ in range(copies):
        dst.copy_(src)
    elapsed = max(time.perf_counter() - start, 1e-9)
    return nbytes * copies / elapsed


def probe() -> dict[str, Any]:
    identity = nvml.device_identity(0)
    h2d = measure_h2d_bytes_per_second()
    result: dict[str, Any] = {"device": identity, "cuda_available": torch.cuda.is_available()}
    if h2d is not None:
        result["h2d"] = {
            "bytes_per_second": h2d,
            "gbps": h2d / 1e9,
            "method": f"pinned {PROBE_BYTES // 2**20} MiB x {PROBE_COPIES} non-blocking copies",
        }
    else:
        host = measure_host_copy_bytes_per_second()
        result["note"] = "no CUDA device: no host-to-device link to measure; host memcpy bandwidth reported"
        result["host_copy"] = {
            "bytes_per_second": host,
            "gbps": host / 1e9,
            "method": "64 MiB x 5 host copies",
        }
    return result


def probe_main(args: argparse.Namespace) -> int:
    result = probe()
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
        return 0
    dev = result["device"]
    print(
        f"device: {dev['name']} ({dev['uuid']}), cc {dev['compute_capability']}"
        if dev
        else "device: none (NVML unavailable)"
    )
    if dev:
        p = dev["pcie"]
        print(
            f"  driver {dev['driver_version']}, PCIe gen {p['gen_current']}/{p['gen_max']} x{p['width_current']}/{p['width_max']}"
        )
    if "h2d" in result:
        print(f"h2d: {result['h2d']['gbps']:.2f} GB/s ({result['h2d']['method']})")
    else:
        print(result["note"])
        print(f"host copy: {result['host_copy']['gbps']:.2f} GB/s ({result['host_copy']['method']})")
    return 0
