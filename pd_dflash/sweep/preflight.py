"""Checks before any actor starts. Ray waits forever for a request no node can satisfy, so nothing is submitted
unless the cluster has what it needs: GPUs, the accelerator type or custom resource and CPUs for at least one
runner, a writable results directory on the head box, and an importable engine on every box that will run.
Every failure is an :class:`~pd_dflash.errors.InputError` (exit 2) saying what is missing and what the
cluster has.
"""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pd_dflash.engine import registry
from pd_dflash.engine.registry import EngineTraits
from pd_dflash.errors import InputError
from pd_dflash.spec import Hardware, ModelSpec, SweepSpec
from pd_dflash.sweep.collector import HEAD_RESOURCE
from pd_dflash.sweep.manifest import environment_manifest
from pd_dflash.sweep.out_names import check_out_names
from pd_dflash.sweep.resume import Mode, check_resumable, probe_writable
from pd_dflash.sweep.runner import short

ACCELERATOR_PREFIX = "accelerator_type:"


class PreflightError(InputError):
    """The cluster or the results directory cannot run this sweep; nothing was started."""


@dataclass
class Box:
    """One node of the cluster as the driver sees it."""

    node_id: str
    ip: str
    label: str
    resources: dict[str, float]
    is_head: bool
    #: Runners that fit on the box (0 when it lacks something; ``lacks`` says what).
    capacity: int = 0
    lacks: list[str] = field(default_factory=list)
    #: Why the box was taken out of rotation (None while it is in).
    out: str | None = None

    def summary(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "ip": self.ip,
            "box": self.label,
            "head": self.is_head,
            "GPU": self.resources.get("GPU", 0.0),
            "CPU": self.resources.get("CPU", 0.0),
            "accelerator_types": accelerator_types(self.resources),
            "runners": self.capacity,
        }


def accelerator_types(resources: dict[str, float]) -> list[str]:
    return sorted(k[len(ACCELERATOR_PREFIX) :] for k in resources if k.startswith(ACCELERATOR_PREFIX))


def runner_options(hardware: Hardware, memory_bytes: int | None = None) -> dict[str, Any]:
    """The Ray resource request of one runner (and of the preflight engine check, which stands in for it);
    ``memory_bytes``: the host memory the engine says the runner needs (``registry.host_memory_bytes``)."""
    options: dict[str, Any] = {"num_gpus": hardware.gpus_per_cell, "num_cpus": hardware.cpus_per_runner}
    if memory_bytes:
        options["memory"] = memory_bytes
    if hardware.accelerator_type:
        options["accelerator_type"] = hardware.accelerator_type
    if hardware.custom_resource:
        options["resources"] = {hardware.custom_resource: 1}
    return options


def describe_request(hardware: Hardware) -> str:
    parts = [f"GPU {hardware.gpus_per_cell:g}", f"CPU {hardware.cpus_per_runner:g}"]
    if hardware.accelerator_type:
        parts.append(f"{ACCELERATOR_PREFIX}{hardware.accelerator_type}")
    if hardware.custom_resource:
        parts.append(f"{hardware.custom_resource} 1")
    return ", ".join(parts)


def box_capacity(
    resources: dict[str, float], hardware: Hardware, memory_bytes: int | None = None
) -> tuple[int, list[str]]:
    """How many runners fit on a node with these total resources, and what it lacks when none does."""
    lacks = []
    if memory_bytes:
        limits_memory = math.floor(resources.get("memory", 0.0) / memory_bytes + 1e-9)
        if limits_memory < 1:
            lacks.append(f"memory {resources.get('memory', 0.0):.3g} B < {memory_bytes:.3g} B per runner")
    limits = [math.floor(resources.get("GPU", 0.0) / hardware.gpus_per_cell + 1e-9)]
    if limits[0] < 1:
        lacks.append(f"GPU {resources.get('GPU', 0.0):g} < {hardware.gpus_per_cell} per runner")
    if hardware.cpus_per_runner > 0:
        limits.append(math.floor(resources.get("CPU", 0.0) / hardware.cpus_per_runner + 1e-9))
        if limits[-1] < 1:
            lacks.append(f"CPU {resources.get('CPU', 0.0):g} < {hardware.cpus_per_runner:g} per runner")
    if hardware.accelerator_type and f"{ACCELERATOR_PREFIX}{hardware.accelerator_type}" not in resources:
        limits.append(0)
        found = accelerator_types(resources)
        lacks.append(
            f"no {ACCELERATOR_PREFIX}{hardware.accelerator_type} (has {', '.join(found) or 'no accelerator type'})"
        )
    if hardware.custom_resource:
        limits.append(math.floor(resources.get(hardware.custom_resource, 0.0) + 1e-9))
        if limits[-1] < 1:
            lacks.append(f"no custom resource {hardware.custom_resource}")
    if memory_bytes:
        limits.append(limits_memory)
    return max(0, min(limits)), lacks


def runner_memory_bytes(spec: SweepSpec) -> int | None:
    """The largest host memory a runner of this sweep needs (the engine's figure over its models), if known."""
    figures = [registry.host_memory_bytes(spec.engine, m) for m in spec.models]
    return max((f for f in figures if f), default=None)


def survey(spec: SweepSpec, nodes: list[dict[str, Any]]) -> list[Box]:
    """The alive nodes as boxes with their runner capacity (labels are IPs, made unique with the node id)."""
    alive = [n for n in nodes if n.get("Alive")]
    memory = runner_memory_bytes(spec)
    ips = [n["NodeManagerAddress"] for n in alive]
    boxes = []
    for node in alive:
        ip = node["NodeManagerAddress"]
        label = ip if ips.count(ip) == 1 else f"{ip}#{node['NodeID'][:6]}"
        resources = dict(node.get("Resources", {}))
        capacity, lacks = box_capacity(resources, spec.hardware, memory)
        boxes.append(
            Box(
                node_id=node["NodeID"],
                ip=ip,
                label=label,
                resources=resources,
                is_head=HEAD_RESOURCE in resources,
                capacity=capacity,
                lacks=lacks,
            )
        )
    return boxes


def cluster_summary(boxes: list[Box]) -> dict[str, Any]:
    return {
        "nodes": [b.summary() for b in boxes],
        "GPU": sum(b.resources.get("GPU", 0.0) for b in boxes),
        "CPU": sum(b.resources.get("CPU", 0.0) for b in boxes),
        "accelerator_types": sorted({t for b in boxes for t in accelerator_types(b.resources)}),
        "runners": sum(b.capacity for b in boxes),
    }


def describe_cluster(boxes: list[Box]) -> str:
    parts = []
    for b in boxes:
        types = ", ".join(accelerator_types(b.resources)) or "none"
        custom = sorted(
            k
            for k in b.resources
            if not k.startswith(("node:", ACCELERATOR_PREFIX))
            and k not in ("CPU", "GPU", "memory", "object_store_memory")
        )
        extra = f", resources {', '.join(custom)}" if custom else ""
        head = " (head)" if b.is_head else ""
        parts.append(
            f"{b.label}{head}: GPU {b.resources.get('GPU', 0):g}, CPU {b.resources.get('CPU', 0):g}, "
            f"accelerator types {types}{extra}"
        )
    return "; ".join(parts) or "no alive node"


def check_resources(spec: SweepSpec, boxes: list[Box]) -> None:
    if sum(b.capacity for b in boxes) >= 1:
        return
    lacking = "; ".join(f"{b.label}: {', '.join(b.lacks)}" for b in boxes if b.lacks)
    raise PreflightError(
        f"no box can host a runner. A runner needs {describe_request(spec.hardware)}. "
        f"Missing: {lacking or 'no alive node'}. The cluster has: {describe_cluster(boxes)}",
        where="preflight",
    )


@ray.remote(num_cpus=0, resources={HEAD_RESOURCE: 0.001}, max_retries=0)
def _check_out_dir(out_dir: str, spec: SweepSpec, mode: Mode) -> str | None:
    from pathlib import Path

    try:
        probe_writable(Path(out_dir))
        check_out_names(Path(out_dir))  # no fixed name followed out of OUT, before any is read
        check_resumable(Path(out_dir), spec, mode)
    except InputError as exc:
        return str(exc)
    return None


def check_out_dir(out_dir: str, spec: SweepSpec, mode: Mode, *, timeout_s: float) -> None:
    """OUT lives on the head box: probe-write it there and check its rows belong to this spec."""
    ref = _check_out_dir.remote(out_dir, spec, mode)
    ready, _ = ray.wait([ref], timeout=timeout_s)
    if not ready:
        ray.cancel(ref, force=True)
        raise PreflightError(f"the results-directory check on the head box did not finish in {timeout_s:g} s")
    error = ray.get(ref)
    if error:
        raise PreflightError(error)


@ray.remote(num_cpus=0, resources={HEAD_RESOURCE: 0.001}, max_retries=0)
def _head_auth_mode() -> str:
    """The token-auth mode of a worker on the head box: what the head's Ray was started with."""
    try:
        from ray._private.authentication.authentication_utils import is_token_auth_enabled
    except ImportError:  # a Ray without token auth (< 2.59) has none
        return "token" if os.environ.get("RAY_AUTH_MODE", "").lower() == "token" else "disabled"
    return "token" if is_token_auth_enabled() else "disabled"


def cluster_auth_mode(*, timeout_s: float) -> str:
    """``token`` or ``disabled``: how the cluster this driver joined authenticates its clients."""
    ref = _head_auth_mode.remote()
    ready, _ = ray.wait([ref], timeout=timeout_s)
    if not ready:
        ray.cancel(ref, force=True)
        raise PreflightError(f"the authentication check on the head box did not finish in {timeout_s:g} s")
    return ray.get(ref)


def check_auth(mode: str, *, insecure: bool) -> str | None:
    """A cluster run needs token authentication, or ``--insecure``: then the warning to show; else None."""
    if mode == "token":
        return None
    risk = (
        f"the cluster runs without token authentication (RAY_AUTH_MODE={mode} on its head): anyone who can reach "
        "its ports can run code on every box and read the results"
    )
    if not insecure:
        raise PreflightError(
            f"{risk}. Start it with RAY_AUTH_MODE=token (docs/running-on-a-cluster.md §1), or pass --insecure "
            "on a network you trust",
            where="preflight",
        )
    return f"WARNING: {risk} (--insecure)"


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def check_engine_importable(
    engine: str, env: dict[str, str], models: list[ModelSpec] | None = None
) -> dict[str, Any]:
    """Run as a task with a runner's resources on each box: can this box import the engine, and do the
    models' ``engine_options`` fit it? Returns the engine's traits, so the driver never imports the engine."""
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    os.environ.update(env)
    try:
        traits = registry.traits(engine)
    except Exception as exc:
        return {"ok": False, "error": f"engine {engine!r}: {short(str(exc))}"}
    missing = [m for m in traits.requires if not _importable(m)]
    if missing:
        hints = [traits.install_hints[m] for m in missing if m in traits.install_hints]
        how = f"; {'; '.join(hints)}" if hints else ""
        return {"ok": False, "error": f"modules not importable: {', '.join(missing)} (engine {engine}){how}"}
    try:
        registry.engine_class(engine)
    except Exception as exc:
        return {
            "ok": False,
            "error": f"cannot import {traits.entry_point}: {type(exc).__name__}: {short(str(exc), 300)}",
        }
    try:
        for i, model in enumerate(models or ()):
            for variant in model.variants():  # a link-rate ablation: each rate (spec.ModelSpec.variants)
                registry.validate_engine_options(engine, variant, where=f"models.{i}")
    except InputError as exc:
        return {"ok": False, "error": short(str(exc))}
    return {"ok": True, "python": environment_manifest()["python"], "traits": traits}


def check_engine(spec: SweepSpec, boxes: list[Box], *, timeout_s: float) -> EngineTraits:
    """Import the engine on every box that can host a runner, with a runner's resources; exit 2 if any fails.

    Returns the engine's traits as a box found them: the driver schedules with them without importing an
    engine from outside the package (only runners and these checks do)."""
    remote = ray.remote(max_retries=0)(check_engine_importable)
    refs = {}
    for box in boxes:
        if box.capacity < 1 or box.out:
            continue
        options = runner_options(spec.hardware)
        refs[box.label] = remote.options(
            **options, scheduling_strategy=NodeAffinitySchedulingStrategy(box.node_id, soft=False)
        ).remote(spec.engine, spec.env, list(spec.models))
    _ready, pending = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s)
    results: dict[str, dict[str, Any]] = {}
    failures = []
    for label, ref in refs.items():
        if ref in pending:
            ray.cancel(ref, force=True)
            failures.append(
                f"{label}: the engine check did not start within {timeout_s:g} s "
                f"(are its GPUs held by another job?)"
            )
            continue
        try:
            result = ray.get(ref)
        except Exception as exc:
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        results[label] = result
        if not result.get("ok"):
            failures.append(f"{label}: {result.get('error')}")
    if failures:
        raise PreflightError(
            "the engine is not usable on every box: " + "; ".join(failures), where="preflight"
        )
    return next(iter(results.values()))["traits"]
