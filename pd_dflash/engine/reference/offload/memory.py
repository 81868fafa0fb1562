"""Memory checked before it is allocated: the host (the pinned expert arena) and the device (non-expert weights,
the expert cache, the KV cache). A figure that does not fit is ``Refused`` with the figures and the fix, so it
becomes a REFUSED row, never an out-of-memory ERROR halfway through a cell.

What is available:

- host: from ``/proc/meminfo`` the larger of ``MemAvailable`` and ``MemTotal − used`` (used as ``free(1)`` counts
  it: ``MemTotal − MemFree − Buffers − Cached − SReclaimable + Shmem``; a VM whose memory grows as it is used
  reports a low ``MemAvailable`` for memory it will hand out), lowered to the cgroup's headroom when the process runs under a
  limit (a container, a Ray worker with a memory limit): the limit minus what is in use, where the page cache
  the kernel can reclaim (``memory.stat`` ``inactive_file``) is not in use — a cgroup's usage counts the page
  cache of every file read, so after one 61 GB checkpoint read a second runner would otherwise be refused memory
  that is free for the taking. cgroup v2: ``memory.max − (memory.current − inactive_file)``; v1:
  ``limit_in_bytes − (usage_in_bytes − total_inactive_file)``. None where neither is readable (not Linux);
- device: the CUDA driver's free bytes plus what torch's caching allocator holds reserved but unused (it hands
  that back to this process first); None on the CPU (nothing to check).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from pd_dflash.baselines import Configuration
from pd_dflash.engine.interface import Refused
from pd_dflash.schema import Status
from pd_dflash.spec import Cell

#: Device bytes left free beyond what is counted (activations, cuBLAS workspaces, allocator fragmentation).
DEVICE_HEADROOM_BYTES = 512 * 2**20


CGROUP_ROOT = Path("/sys/fs/cgroup")
#: (limit file, usage file, memory.stat key of the reclaimable page cache) of cgroup v2, then v1.
_CGROUP_FILES = (
    ("memory.max", "memory.current", "memory.stat", "inactive_file"),
    (
        "memory/memory.limit_in_bytes",
        "memory/memory.usage_in_bytes",
        "memory/memory.stat",
        "total_inactive_file",
    ),
)


def host_available_bytes(
    cgroup_root: Path = CGROUP_ROOT, meminfo: Path = Path("/proc/meminfo")
) -> int | None:
    """Host memory this process can still use, in bytes (None where it cannot be read); the paths are
    parameters so a test can inject figures."""
    figures = [meminfo_headroom(meminfo), cgroup_headroom(cgroup_root)]
    known = [f for f in figures if f is not None]
    return min(known) if known else None


def cgroup_headroom(root: Path = CGROUP_ROOT) -> int | None:
    """The cgroup's limit minus its usage without reclaimable page cache (None: no limit, or not readable)."""
    for limit, used, stat, cache_key in _CGROUP_FILES:
        cap, current = _read_int(root / limit), _read_int(root / used)
        if cap is None or current is None or cap >= 2**60:  # "max" or v1's huge value: no limit
            continue
        stats = _read_stat(root / stat)
        reclaimable = stats.get(cache_key, stats.get("inactive_file", 0))
        return max(0, cap - max(0, current - reclaimable))
    return None


def device_available_bytes(device: torch.device) -> int | None:
    """Device memory torch can still allocate on ``device`` (None on the CPU)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device))


def require(what: str, needed: int, available: int | None, fix: str, where: str) -> None:
    """Refuse unless ``needed`` bytes fit in ``available`` (None: not measurable here, nothing to check)."""
    if available is not None and needed > available:
        raise Refused(
            Status.REFUSED,
            f"{what} needs {needed:,} B of {where} memory but only {available:,} B are available "
            f"({needed / 2**30:.2f} GiB > {available / 2**30:.2f} GiB). Fix: {fix}",
        )


def require_cell_device_memory(
    cell: Cell,
    configuration: Configuration,
    store: Any,  # offload/store.HostExpertStore (which imports this module)
    capacity: int,
    config: Any,
    dtype: torch.dtype,
    *,
    tokens: int,
    available: int | None,
    where: str = "device",
) -> None:
    """A cell's expert cache + an upper bound of its KV cache (``tokens`` per request, c requests) + headroom
    must fit in ``available`` bytes of ``where`` ("device"; "host" for the CPU engine, whose device is the host)
    before anything is allocated."""
    slots = min(capacity // store.expert_nbytes, store.num_entries)
    cache = slots * store.device_slot_nbytes(
        dtype, linked=configuration.offloaded
    )  # device bytes, dequantised included
    kv = kv_cache_bytes(config, tokens, cell.concurrency, torch.empty((), dtype=dtype).element_size())
    fix = (
        "lower memory.expert_cache_fraction (or engine_options.expert_cache_bytes), the concurrency or "
        "workload.max_new_tokens"
        if configuration.offloaded
        else "B3 holds every expert on the device: it needs a GPU that holds them all (or fewer KV tokens: "
        "the concurrency, workload.max_new_tokens)"
    )
    require(
        f"{configuration.name} at c = {cell.concurrency}: the expert cache ({cache:,} B, {slots} slots) + the KV "
        f"cache (≤ {kv:,} B) + {DEVICE_HEADROOM_BYTES:,} B of headroom",
        cache + kv + DEVICE_HEADROOM_BYTES,
        available,
        fix,
        where,
    )


def module_bytes(module: torch.nn.Module) -> int:
    """Bytes of a module's parameters and buffers as they are stored now."""
    tensors = [*module.parameters(), *module.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors)


def kv_cache_bytes(config, tokens_per_request: int, requests: int, element_size: int) -> int:
    """An upper bound of the KV cache: every layer keeps K and V of every token (sliding windows keep fewer)."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    per_token = 2 * config.num_hidden_layers * heads * head_dim * element_size
    return per_token * tokens_per_request * requests


def meminfo_headroom(path: Path = Path("/proc/meminfo")) -> int | None:
    """The larger of ``MemAvailable`` and ``MemTotal − used`` (None where /proc/meminfo says neither)."""
    info = {}
    try:
        for line in path.read_text().splitlines():
            key, _, rest = line.partition(":")
            fields = rest.split()
            if fields and fields[0].isdigit():
                info[key] = int(fields[0]) * 1024  # kB
    except OSError:
        return None
    figures = [info.get("MemAvailable")]
    if "MemTotal" in info and "MemFree" in info:
        cache = sum(info.get(k, 0) for k in ("Buffers", "Cached", "SReclaimable")) - info.get("Shmem", 0)
        used = info["MemTotal"] - info["MemFree"] - cache
        figures.append(info["MemTotal"] - max(0, used))
    known = [f for f in figures if f is not None]
    return max(known) if known else None


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().strip())
    except (OSError, ValueError):
        return None


def _read_stat(path: Path) -> dict[str, int]:
    """``memory.stat`` as {key: bytes} (empty where unreadable; malformed lines are skipped)."""
    out = {}
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        key, _, value = line.partition(" ")
        if value.strip().isdigit():
            out[key] = int(value)
    return out
