"""Where a sweep runs: join a cluster (``--address``, ``$RAY_ADDRESS``, an already connected Ray) or start
local mode, a real single-node Ray cluster with fake GPUs (Ray's own ``local_mode`` no longer exists)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import ray

from pd_dflash.spec import SweepSpec
from pd_dflash.sweep import preflight
from pd_dflash.sweep.driver import Outcome, RunOptions, SweepDriver
from pd_dflash.sweep.sink import NAMESPACE
from pd_dflash.sweep.store import check_resumable, probe_writable


def local_cluster_args(spec: SweepSpec) -> dict[str, Any]:
    """``ray.init`` arguments of local mode: a single-node cluster with fake GPUs and the spec's resources."""
    hw = spec.hardware
    gpus = spec.local.fake_gpus
    resources: dict[str, float] = {}
    if hw.accelerator_type:
        resources[f"{preflight.ACCELERATOR_PREFIX}{hw.accelerator_type}"] = 1
    if hw.custom_resource:
        resources[hw.custom_resource] = gpus
    runners = gpus // hw.gpus_per_cell
    cpus = spec.local.num_cpus or max(1, int(-(-runners * hw.cpus_per_runner // 1)))
    return {
        "num_cpus": cpus,
        "num_gpus": gpus,
        "resources": resources,
        "include_dashboard": False,
        "object_store_memory": spec.local.object_store_mb * 2**20,
        "namespace": NAMESPACE,
        "log_to_driver": False,
    }


def run_sweep(spec: SweepSpec, options: RunOptions, *, address: str | None = None) -> Outcome:
    """Run a sweep: join ``address`` (or $RAY_ADDRESS, or an already connected Ray), else start local mode."""
    options.out_dir = os.path.abspath(options.out_dir)
    owns_ray = False
    if not ray.is_initialized():
        address = address or os.environ.get("RAY_ADDRESS")
        if address:
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=False)
        else:
            # Local mode: this process is the head box, so OUT can be checked before a cluster is started.
            out = Path(options.out_dir)
            probe_writable(out)
            check_resumable(out, spec, options.mode)
            # address="local": always start our own cluster, never join one another process left running.
            ray.init(address="local", **local_cluster_args(spec))
        owns_ray = True
    try:
        return SweepDriver(spec, options).run()
    finally:
        if owns_ray:
            ray.shutdown()
