"""How much host memory one reference-engine runner needs, without torch: the sweep tells Ray (``memory``), so
Ray places no more runners on a box than its memory holds (each runner keeps its own pinned expert arena).

A checkpoint is streamed (``checkpoints/loader.py``): its routed experts go into the host arena exactly as
stored (bf16, or MXFP4 blocks + scales + biases), its non-expert weights to the device in the compute dtype —
through host memory, all of them on a CPU device, at most the loader's read-ahead (2 GiB) at a time on CUDA.
The figure is the experts as stored plus the non-expert weights in the compute dtype: the peak on a CPU device,
an upper bound on CUDA. Unknown (None: Ray reserves nothing) for a preset (a few MB), a tiny real-layout
checkpoint (generated on first use, a few hundred KB), and a checkpoint this box cannot see or parse.
"""

from __future__ import annotations

from pd_dflash.engine.reference.checkpoints.check import check_checkpoint
from pd_dflash.engine.reference.checkpoints.files import DTYPE_BYTES
from pd_dflash.engine.reference.checkpoints.resolve import resolve
from pd_dflash.errors import InputError
from pd_dflash.spec import ModelSpec

_OPTION_DTYPES = {"fp32": "F32", "bf16": "BF16", "fp16": "F16"}


def runner_host_memory_bytes(model: ModelSpec) -> int | None:
    """Peak host bytes of a runner loading ``model`` (see the module doc), or None when not known."""
    if model.preset is not None:
        return None
    try:
        found = resolve(model.id, model.path)
        if found.directory is None or found.source == "tiny-real":
            return None
        checked = check_checkpoint(found.directory)
    except InputError:
        return None  # the engine's load names the problem
    experts = checked.layout.total_bytes
    non_expert = sum(f.stat().st_size for f in checked.files.files) - experts  # headers included
    stored = next(p.dtype for p in checked.layout.parts if p.dtype != "U8")
    wanted = _OPTION_DTYPES.get(str(model.engine_options.get("dtype", "auto")), stored)
    return experts + non_expert * DTYPE_BYTES[wanted] // DTYPE_BYTES[stored]
