"""What the installed MoE-Infinity build can express, found by introspection (never by version strings).

MoE-Infinity's serving and speculative-decoding surface moved a lot across its development branches (verify
budgets in the serving scheduler, the per-round speculator seam, persistent speculative sessions; docs/moe-infinity.md).
The adapter runs a configuration only when the build can express it,
and otherwise returns a BLOCKED/REFUSED row that names the missing piece; it never substitutes another path.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import inspect
from dataclasses import asdict, dataclass
from types import ModuleType
from typing import Any

#: Keyword arguments of the serving scheduler that carry the 2-D verify budgets (PR #165's path).
VERIFY_BUDGET_KEYS = (
    "verify_token_budget",
    "verify_expert_byte_budget",
    "verify_token_deficit_cap",
    "verify_expert_byte_deficit_cap",
)
#: The per-round speculator seam the serving engine drives (draft → admit → verify).
SESSION_SEAM = ("begin_session", "draft_round", "verify_round")
#: The verify-time hook that binds the route-ahead prefetcher (``DFlashSpeculator._verify_target_block``
#: opens ``route_ahead_context(self._resolve_route_ahead_prefetcher(), stats)``).
ROUTE_AHEAD_SEAM = "_resolve_route_ahead_prefetcher"


@dataclass(frozen=True)
class Build:
    version: str | None
    #: The imported package announced itself as a stand-in (``moe_infinity.__fake__``), e.g. the test fake.
    fake: bool
    #: The serving scheduler accepts the four verify budgets (token-deficit and 2-D deficit scheduling).
    verify_scheduler: bool
    #: ``DFlashSpeculator`` exposes begin_session / draft_round / verify_round.
    session_seam: bool
    #: ``ContinuousBatchingEngine`` keeps several speculative sessions in flight (``speculative_sessions``, the
    #: post-#173 "persistent serving sessions"); without it a speculative request runs to completion inside one
    #: ``step()`` and a multi-request batch silently takes the autoregressive path.
    persistent_sessions: bool
    #: The route-ahead prefetcher is bound through an overridable hook, so it can be switched off (B1).
    route_ahead_switch: bool
    #: The library emits the ``dflash_draft`` / ``target_verify`` NVTX push/pop ranges itself (PR #171).
    library_nvtx: bool
    #: The FP4 expert path (``moe_infinity._v4_fp4``) imports (upstream requires it on RTX PRO 6000).
    fp4: bool
    #: ``ArcherConfig`` has ``kv_cache_memory_ratio``, whose ``__post_init__`` auto-sets 0.15 and cuts
    #: ``device_memory_ratio`` to fit (so the adapter pins the ratio by setting the KV share explicitly).
    archer_kv_ratio: bool = False

    @property
    def serving_generation(self) -> str:
        """ "post-#173" (persistent speculative sessions: the concurrency sweep works) or "pre-#173" (c = 1 only)."""
        return "post-#173" if self.persistent_sessions else "pre-#173"

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _optional(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _accepts(cls: Any, names: tuple[str, ...]) -> bool:
    try:
        params = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        return False
    return all(n in params for n in names)


def _version(package: ModuleType) -> str | None:
    version = getattr(package, "__version__", None)
    if isinstance(version, str):
        return version
    from importlib import metadata

    for dist in ("moe-infinity", "moe_infinity"):
        try:
            return metadata.version(dist)
        except metadata.PackageNotFoundError:
            continue
    return None


def _archer_fields() -> set[str]:
    config = _optional("moe_infinity.utils.config")
    cls = getattr(config, "ArcherConfig", None)
    return {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()


def detect(package: ModuleType) -> Build:
    """Introspect an imported ``moe_infinity`` package (call after the runner applied the spec's env)."""
    scheduler = _optional("moe_infinity.serving.scheduler")
    serving = _optional("moe_infinity.serving.engine")
    spec_decode = _optional("moe_infinity.spec_decode")
    scheduler_cls = getattr(scheduler, "Scheduler", None)
    engine_cls = getattr(serving, "ContinuousBatchingEngine", None)
    speculator_cls = getattr(spec_decode, "DFlashSpeculator", None)
    return Build(
        version=_version(package),
        fake=bool(getattr(package, "__fake__", False)),
        verify_scheduler=scheduler_cls is not None and _accepts(scheduler_cls, VERIFY_BUDGET_KEYS),
        session_seam=speculator_cls is not None
        and all(callable(getattr(speculator_cls, n, None)) for n in SESSION_SEAM),
        persistent_sessions=engine_cls is not None and hasattr(engine_cls, "speculative_sessions"),
        route_ahead_switch=speculator_cls is not None
        and callable(getattr(speculator_cls, ROUTE_AHEAD_SEAM, None)),
        library_nvtx=_has_module("moe_infinity.spec_decode._nvtx"),
        fp4=_has_module("moe_infinity._v4_fp4"),
        archer_kv_ratio="kv_cache_memory_ratio" in _archer_fields(),
    )
