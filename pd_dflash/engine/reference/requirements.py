"""The transformers the engine's forward needs, checked once at engine load.

The engine passes ``cache=`` to ``create_causal_mask`` and to each attention module (``decoding/kv_arena.py``,
``decoding/target.py``): an API of transformers 5.24. On an older release the mask call raises a ``TypeError`` deep in
the first cell, and the attention forward swallows ``cache=`` in ``**kwargs`` and never updates the KV cache (a
silently wrong decode). A box with an older transformers (the lent GPU image ships 5.17) is refused at load,
with the installed and the needed version and the fix, before anything runs.
"""

from __future__ import annotations

from importlib import metadata

from pd_dflash.engine.interface import Refused
from pd_dflash.schema import Status

#: The oldest transformers whose ``create_causal_mask`` and attention modules take ``cache=``.
MIN_TRANSFORMERS = (5, 24)


def _release(version: str) -> tuple[int, ...]:
    """(major, minor) of a version string such as ``5.24.0`` or ``5.25.0.dev0``."""
    parts = []
    for piece in version.split(".")[:2]:
        digits = "".join(c for c in piece if c.isdigit())
        parts.append(int(digits) if digits else 0)
    return tuple(parts)


def transformers_problem(installed: str | None = None) -> str | None:
    """Why the installed transformers cannot run the engine (None when it can)."""
    if installed is None:
        try:
            installed = metadata.version("transformers")
        except metadata.PackageNotFoundError:
            installed = None
    needed = ".".join(map(str, MIN_TRANSFORMERS))
    if installed is None:
        return f"transformers is not installed; the reference engine needs transformers >= {needed}"
    if _release(installed) < MIN_TRANSFORMERS:
        return (
            f"transformers {installed} is installed; the reference engine needs >= {needed} (its attention "
            "and masks take cache=). Fix: pip install 'transformers>=5.24,<6' (a box without network: "
            "scripts/gpu_bundle.sh, docs/gpu-check.md)"
        )
    return None


def require_transformers() -> None:
    """Refuse the engine's load on a transformers that would crash or silently not update the KV cache."""
    problem = transformers_problem()
    if problem is not None:
        raise Refused(Status.REFUSED, problem)
