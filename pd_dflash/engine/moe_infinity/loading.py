"""Loading one MoE-Infinity model into a runner process: device check, ``MoE(...)``, drafter, tokenizer.

MoE-Infinity's native engine keeps process-global state that does not survive a second in-process load, so a
runner process holds exactly one load (``_PROCESS_LOAD``); the orchestrator restarts the runner on a model
switch. A device the spec's hardware requirement rejects is not an error: the load is skipped and every cell of
the runner is refused with the reason.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

from pd_dflash.engine import nvml
from pd_dflash.engine.interface import EngineContext
from pd_dflash.engine.moe_infinity import metrics as m
from pd_dflash.engine.moe_infinity.features import Build, detect
from pd_dflash.engine.moe_infinity.options import MoEInfinityOptions
from pd_dflash.errors import InputError

#: Run-time environment the runner applies from ``spec.env`` before MoE-Infinity is imported; recorded as seen.
IMPORT_ENV_KEYS = (
    "HF_HOME",
    "HF_HUB_OFFLINE",
    "TRANSFORMERS_OFFLINE",
    "TRANSFORMERS_CACHE",
    "CUDA_VISIBLE_DEVICES",
    "MOE_DISABLE_FUSED_KERNELS",
    "MOE_DISABLE_CUDA_GRAPHS",
    "MOE_INFINITY_MXFP4_DEQUANT",
)
_BUILD_TIME = "MoE-Infinity reads it only at build time (setup.py compiles the extensions with it)"
#: Variables that do nothing in a runner, and why (MoE-Infinity's setup.py and docs/environment-variables.md).
INEFFECTIVE_ENV = {
    "MOE_ENABLE_SM120": f"{_BUILD_TIME}: build with it to get sm_120 kernels",
    "MOE_ENABLE_SM90": _BUILD_TIME,
    "NVTX_DISABLE": _BUILD_TIME,
    "CUTLASS_DIR": _BUILD_TIME,
    "MOE_PREFETCH_ISSUE_MODE": "no MoE-Infinity code reads it (upstream's BM5 script set it)",
}
#: ``ArcherConfig``'s default native KV share (its ``__post_init__`` auto-sets it when the field is 0.0).
NATIVE_KV_RATIO = 0.15

#: What this process loaded ("model (group load)"); a second load is refused (one model per process).
_PROCESS_LOAD: str | None = None


@dataclass
class DeviceCheck:
    """The device the runner sees, against the spec's hardware requirement."""

    facts: dict[str, Any]
    #: Why the device is rejected (every cell is then refused), or None.
    refusal: str | None = None
    #: Probed host→device bytes/s (CUDA only).
    h2d: float | None = None


@dataclass
class Loaded:
    """One MoE-Infinity model as this runner loaded it, and the facts every row records."""

    moe: Any
    speculator: Any
    tokenizer: Any
    build: Build
    num_offloaded: int
    draft_block_size: int | None
    #: The device memory ratio MoE-Infinity applied (``MoE.engine_config``), None when it cannot be read.
    applied_ratio: float | None = None
    facts: dict[str, Any] = field(default_factory=dict)
    #: What every row of this load must say (ineffective environment, a ratio other than the requested one).
    warnings: list[str] = field(default_factory=list)


def check_device(ctx: EngineContext) -> DeviceCheck:
    """Exactly one visible CUDA device matching the spec's hardware requirement; probe H2D once."""
    if not ctx.device.startswith("cuda"):
        return DeviceCheck({"device_check": f"device {ctx.device}: not a CUDA device, nothing validated"})
    import torch

    from pd_dflash.engine.probe import measure_h2d_bytes_per_second

    if not torch.cuda.is_available():
        raise RuntimeError(f"device {ctx.device} requested but CUDA is not available in this runner")
    count = torch.cuda.device_count()
    if count != 1:
        raise RuntimeError(
            f"MoE-Infinity runners need exactly one visible CUDA device, found {count}: the runner must see "
            "only the GPU Ray assigned to it (CUDA_VISIBLE_DEVICES=<one id>)"
        )
    hw = ctx.hardware
    check = nvml.validate_device(hw.expected_gpu_name, hw.compute_capability)
    name, capability = torch.cuda.get_device_name(0), tuple(torch.cuda.get_device_capability(0))
    problems = [] if check.ok else [check.note]
    if hw.compute_capability and capability != tuple(hw.compute_capability):
        problems.append(
            f"torch reports compute capability {capability}, spec requires {hw.compute_capability}"
        )
    if hw.expected_gpu_name and hw.expected_gpu_name.lower() not in name.lower():
        problems.append(f"torch reports {name!r}, spec requires a name containing {hw.expected_gpu_name!r}")
    facts = {
        "device_check": check.note,
        "device_identity": check.identity,
        "torch_device": [name, list(capability)],
    }
    if problems:
        refusal = (
            "device rejected by the spec's hardware requirement: "
            + "; ".join(dict.fromkeys(problems))
            + " (set hardware.gpu_name / hardware.compute_capability to run on another GPU)"
        )
        return DeviceCheck(facts, refusal=refusal)
    h2d = measure_h2d_bytes_per_second(ctx.device)
    return DeviceCheck({**facts, "h2d_probe_bytes_per_second": h2d}, h2d=h2d)


def _claim_process(ctx: EngineContext) -> None:
    global _PROCESS_LOAD
    if _PROCESS_LOAD is not None:
        raise RuntimeError(
            f"MoE-Infinity already loaded {_PROCESS_LOAD} in this process (pid {os.getpid()}); its native "
            "engine keeps process-global state that does not survive a second in-process load, so pd-dflash "
            "runs one MoE-Infinity model per runner process (restart the runner to load another)"
        )
    if not ctx.model.offload_dir:
        raise InputError(
            "MoE-Infinity needs models[].offload_dir (where it stores offloaded experts)",
            where=f"models[{ctx.model.id}].offload_dir",
        )
    _PROCESS_LOAD = f"{ctx.model.id} ({ctx.load_group} load)"


def _environment() -> tuple[dict[str, Any], list[str]]:
    """The run-time variables as the import sees them, and a warning per variable that cannot take effect."""
    ineffective = {k: why for k, why in INEFFECTIVE_ENV.items() if k in os.environ}
    facts: dict[str, Any] = {
        "import_environment": {k: os.environ[k] for k in IMPORT_ENV_KEYS if k in os.environ}
    }
    if ineffective:
        facts["ineffective_environment"] = ineffective
    return facts, [f"{k} is set but has no effect at run time: {why}" for k, why in ineffective.items()]


def _import_moe_infinity() -> tuple[Build, dict[str, Any]]:
    """Import MoE-Infinity (after the runner applied spec.env) and describe the build."""
    imported_before = "moe_infinity" in sys.modules
    import moe_infinity  # after the runner applied spec.env (HF_HOME, offline flags)

    build = detect(moe_infinity)
    facts: dict[str, Any] = {"version": build.version, "fake": build.fake, "features": build.as_dict()}
    facts["serving_generation"] = build.serving_generation
    if imported_before:
        facts["import_note"] = "moe_infinity was imported before the engine; spec.env may not apply"
    return build, facts


def _load_config(options: MoEInfinityOptions, offload_dir: str, ratio: float, build: Build) -> dict[str, Any]:
    """MoE-Infinity's load config. On builds whose ``ArcherConfig`` splits device memory with a native KV share,
    the share is set explicitly (its default 0.15 where it fits, else what is left), so ``__post_init__`` cannot
    cut ``device_memory_ratio`` (it would turn B3's 0.98 into 0.85)."""
    config = {**options.moe_config, "offload_path": offload_dir, "device_memory_ratio": ratio}
    kv = round(min(NATIVE_KV_RATIO, 1.0 - ratio), 6)
    if build.archer_kv_ratio and kv > 0:
        config["kv_cache_memory_ratio"] = kv
    return config


def _applied_ratios(moe: Any, requested: float) -> tuple[float | None, dict[str, Any], list[str]]:
    """The ratio the library applied (``MoE.engine_config``), the facts recording it, a warning if it differs."""
    config = getattr(moe, "engine_config", None)
    applied = getattr(config, "device_memory_ratio", None)
    if isinstance(applied, bool) or not isinstance(applied, (int, float)):
        note = "MoE.engine_config.device_memory_ratio is not readable: the requested ratio is recorded"
        return None, {"device_memory_ratio": requested, "memory_ratio_note": note}, []
    facts: dict[str, Any] = {
        "device_memory_ratio": float(applied),
        "requested_device_memory_ratio": requested,
    }
    kv = getattr(config, "kv_cache_memory_ratio", None)
    if isinstance(kv, (int, float)) and not isinstance(kv, bool):
        facts["kv_cache_memory_ratio"] = float(kv)
    if abs(applied - requested) <= 1e-9:
        return float(applied), facts, []
    differs = f"MoE-Infinity applied device_memory_ratio={applied}, not the requested {requested}"
    return float(applied), facts, [differs]


def _load_speculator(moe: Any, draft: str, options: MoEInfinityOptions) -> Any:
    import torch
    from moe_infinity.spec_decode import DFlashSpeculator

    speculator = DFlashSpeculator(moe, draft, dtype=getattr(torch, options.draft_dtype))
    enable = getattr(speculator, "enable_route_ahead_stats", None)
    if callable(enable):
        enable()
    return speculator


def nvtx_placement(build: Build) -> dict[str, str]:
    """Who emits each upstream range: MoE-Infinity itself (its ``spec_decode/_nvtx.py``), this adapter, or nobody."""
    around = "adapter, around DFlashSpeculator.{}".format
    library = build.library_nvtx
    return {
        "dflash_draft": "library" if library else around("draft_round"),
        "target_verify": "library" if library else around("verify_round"),
        "route_ahead_router": "library (gpt-oss router) when the build emits it; inside the forward, "
        "not placeable by the adapter",
        "route_ahead_issue": "inside MoE-Infinity's prefetcher; only the library can emit it",
        "expert_h2d": "inside MoE-Infinity's native copy engine; only the library can emit it",
    }


def load(ctx: EngineContext, options: MoEInfinityOptions, ratio: float) -> Loaded:
    """``MoE(model, config)`` at ``ratio``, the DFlash speculator (shared load only) and the tokenizer."""
    _claim_process(ctx)
    model = ctx.model
    facts, warnings = _environment()
    build, build_facts = _import_moe_infinity()
    facts.update(build_facts)
    from moe_infinity import MoE

    start = time.perf_counter()
    moe = MoE(model.id, _load_config(options, model.offload_dir, ratio, build))
    applied, ratio_facts, ratio_warnings = _applied_ratios(moe, ratio)
    num_offloaded = m.offloaded_experts(moe.engine)
    facts.update(ratio_facts)
    facts.update(num_offloaded_experts=num_offloaded, total_expert_bytes=m.total_expert_bytes(moe.engine))
    speculator, draft_block_size = None, None
    if model.draft:  # every configuration but B0 is speculative, B3 on the resident load included
        speculator = _load_speculator(moe, model.draft, options)
        draft_block_size = int(speculator.config.block_size)
        facts.update(draft=model.draft, draft_block_size=draft_block_size)
    from transformers import AutoTokenizer

    source = options.tokenizer or model.id
    tokenizer = AutoTokenizer.from_pretrained(
        source, trust_remote_code=options.trust_remote_code, local_files_only=True
    )
    facts.update(load_seconds=time.perf_counter() - start, nvtx=nvtx_placement(build))
    loaded = Loaded(moe, speculator, tokenizer, build, num_offloaded, draft_block_size, applied, facts)
    loaded.warnings = warnings + ratio_warnings
    return loaded
