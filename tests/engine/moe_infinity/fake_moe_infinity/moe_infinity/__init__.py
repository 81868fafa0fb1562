"""A fake ``moe_infinity`` (see ../README.md): the real library's surface over a toy deterministic MoE, on CPU.

Every behaviour that decides what the adapter's rows say mirrors a named function of the real library (the
comments cite repository, path and commit, read from the public source); the rest is a toy.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__fake__ = True
__version__ = "0.0.0+fake"

#: The environment as this package saw it when it was imported (the runner must apply spec.env before).
IMPORT_ENVIRON = dict(os.environ)

#: Parts of the surface a build may lack (FAKE_MOE_INFINITY_DISABLE removes them).
_SURFACE = {
    # native getters behind the Python wrappers (the wrappers themselves always exist and return 0.0)
    "hit_rate",
    "occupancy",
    "wasted_bytes",
    "exposed_fetch",
    "clear_counts",
    # speculative decoding and serving generations
    "route_ahead_stats",
    "verify_scheduler",
    "session_seam",
    "persistent_sessions",
    "route_ahead_seam",
    # ArcherConfig.kv_cache_memory_ratio and its __post_init__ arithmetic (builds before the native KV split lack it)
    "kv_ratio_field",
    # load and serving
    "offload",
    "resident_fit",
    "kv_allocator",
}
#: Faults a build may show (FAKE_MOE_INFINITY_FAULTS turns them on).
_FAULTS = {
    "ignore_route_ahead_switch",  # the verify binds the engine's prefetcher whatever the hook returns
    "ar_fallback",  # speculative requests silently decode autoregressively
    "experts_bypass_executor",  # gpt-oss: no MoE layer reaches the route-ahead executor seam
    "standard_step_reexecutes",  # a standard serving step runs the batch through the model three times
    "hit_counters_stalled",  # the native hit counters report 0.0 although experts are accessed
}


def _names(var: str) -> set[str]:
    return {n.strip() for n in os.environ.get(var, "").split(",") if n.strip()}


FEATURES = _SURFACE - _names("FAKE_MOE_INFINITY_DISABLE")
FAULTS = _FAULTS & _names("FAKE_MOE_INFINITY_FAULTS")
_unknown = (_names("FAKE_MOE_INFINITY_DISABLE") - _SURFACE) | (_names("FAKE_MOE_INFINITY_FAULTS") - _FAULTS)
if _unknown:
    raise ValueError(f"unknown fake moe_infinity knobs: {sorted(_unknown)}")
#: Every call the adapter made into the fake, in order (dicts with a "call" key).
CALLS: list[dict] = []


def record(call: str, **details) -> None:
    CALLS.append({"call": call, **details})


def write_record(name: str, payload: dict) -> None:
    target = os.environ.get("FAKE_MOE_INFINITY_RECORD_DIR")
    if target:
        Path(target).mkdir(parents=True, exist_ok=True)
        (Path(target) / name).write_text(json.dumps(payload, sort_keys=True))


write_record(f"import-{os.getpid()}.json", {"pid": os.getpid(), "environ": IMPORT_ENVIRON})

from moe_infinity.entrypoints.big_modeling import MoE  # noqa: E402
from moe_infinity.utils import ArcherConfig  # noqa: E402

__all__ = ["CALLS", "FAULTS", "FEATURES", "IMPORT_ENVIRON", "ArcherConfig", "MoE"]
