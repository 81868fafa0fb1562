"""A fake ``moe_infinity`` (see ../README.md): the documented surface over a toy deterministic MoE, on CPU."""

from __future__ import annotations

import json
import os
from pathlib import Path

__fake__ = True
__version__ = "0.0.0+fake"

#: The environment as this package saw it when it was imported (the runner must apply spec.env before).
IMPORT_ENVIRON = dict(os.environ)

_SURFACE = {
    "hit_rate",
    "occupancy",
    "clear_counts",
    "exposed_fetch",
    "wasted_bytes",
    "route_ahead_stats",
    "verify_scheduler",
    "session_seam",
    "persistent_sessions",
    "route_ahead_seam",
    "offload",
    "resident_fit",
    "kv_allocator",
}


def _names(var: str) -> set[str]:
    return {n.strip() for n in os.environ.get(var, "").split(",") if n.strip()}


FEATURES = _SURFACE - _names("FAKE_MOE_INFINITY_DISABLE")
FAULTS = _names("FAKE_MOE_INFINITY_FAULTS")
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

__all__ = ["CALLS", "FAULTS", "FEATURES", "IMPORT_ENVIRON", "MoE"]
