"""One cell's offload machinery as its configuration names it: the expert cache's capacity (and the refusals that
keep offloaded baselines honest), the link the cache fetches over and its rate as known before the cell runs,
assembled with the cell's prefetcher (built by ``cell.py``) into the cell's ``OffloadRuntime``.

B3 holds every expert. B0/B1/B2/OURS must really offload (as upstream): a capacity that would hold every expert,
or less than one, is refused with the fix to apply. The link's rate is what OURS's byte-rate budget
(``decoding/admission.py``) and cost-aware verify width (``offload/verify_width.py``) price bytes with.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from pd_dflash.baselines import Configuration
from pd_dflash.engine.interface import Refused
from pd_dflash.engine.measurement import LinkFacts
from pd_dflash.engine.reference.offload.cache import ExpertCache
from pd_dflash.engine.reference.offload.cuda_link import CudaLink
from pd_dflash.engine.reference.offload.link import HostLink
from pd_dflash.engine.reference.offload.runtime import OffloadRuntime
from pd_dflash.engine.reference.offload.store import HostExpertStore
from pd_dflash.engine.reference.options import ReferenceOptions
from pd_dflash.engine.reference.seams import Prefetcher
from pd_dflash.schema import Status
from pd_dflash.spec import Cell, Memory

if TYPE_CHECKING:
    from pd_dflash.engine.reference.decoding.target import TargetModel


@dataclass(frozen=True)
class Offload:
    """What a cell's offload is built from: the engine's loaded pieces and its link facts."""

    target: TargetModel
    store: HostExpertStore
    options: ReferenceOptions
    device: torch.device
    compute_dtype: torch.dtype
    top_k: int
    #: The CUDA pinned-copy probe (bytes/s) measured at load; None on the CPU.
    probe_bytes_per_second: float | None

    def link_bytes_per_second(self, cell: Cell) -> float | None:
        """``link_bytes_per_second`` of this device and store."""
        cuda = self.device.type == "cuda"
        probe = self.probe_bytes_per_second
        return link_bytes_per_second(cell, self.options, self.store.expert_nbytes, cuda=cuda, probe=probe)

    def runtime(
        self, cell: Cell, configuration: Configuration, capacity: int, prefetcher: Prefetcher | None
    ) -> tuple[OffloadRuntime, LinkFacts]:
        """The cell's cache (over its link) and runtime with ``prefetcher``, attached to the target."""
        link, facts = self._link(cell, configuration)
        opts = self.options
        cache = ExpertCache(
            self.store, capacity, self.device, self.compute_dtype, policy=opts.eviction, link=link
        )
        runtime = OffloadRuntime(self.store, cache, prefetcher)
        runtime.attach(self.target.model)
        self.target.sync_hook = runtime.synchronize
        return runtime, facts

    def _link(self, cell: Cell, configuration: Configuration) -> tuple[HostLink | CudaLink | None, LinkFacts]:
        probe, opts = self.probe_bytes_per_second, self.options
        if not configuration.offloaded:
            return None, LinkFacts("none", probe_bytes_per_second=probe)
        if self.device.type == "cuda":
            return CudaLink(self.device), LinkFacts("real", probe_bytes_per_second=probe)
        gbps = emulated_gbps(cell, opts)
        link = HostLink(gbps, opts.emulated_latency_us)
        latency = opts.emulated_latency_us if gbps else None
        return link, LinkFacts(link.kind, emulated_gbps=gbps, emulated_latency_us=latency)


def expert_cache_capacity(
    cell: Cell,
    configuration: Configuration,
    store: HostExpertStore,
    options: ReferenceOptions,
    memory: Memory,
) -> int:
    """The cell's expert-cache capacity in bytes. B3 holds every expert; an offloaded baseline must really
    offload (as upstream), so a capacity that holds every expert, or less than one, is ``Refused``."""
    total = store.total_bytes
    if not configuration.offloaded:
        return total
    opts = options
    spec_frac = (
        memory.expert_cache_fraction
    )  # a list is an ablation axis: each cell then carries its own value
    frac = cell.ablation.get("expert_cache_fraction", None if isinstance(spec_frac, list) else spec_frac)
    if opts.expert_cache_bytes is not None:
        capacity, given = (
            opts.expert_cache_bytes,
            f"engine_options.expert_cache_bytes={opts.expert_cache_bytes}",
        )
    elif frac is not None:
        capacity, given = int(frac * total), f"memory.expert_cache_fraction={frac}"
    else:
        raise Refused(
            Status.REFUSED,
            f"{configuration.name} must be offloaded, but no expert-cache capacity is set, so the cache would hold "
            f"every expert ({total} B). Fix: set memory.expert_cache_fraction below 1 (e.g. 0.25) or "
            "models[].engine_options.expert_cache_bytes",
        )
    slots, entries = capacity // store.expert_nbytes, store.num_entries
    if slots >= entries:
        raise Refused(
            Status.REFUSED,
            f"{configuration.name} must be offloaded, but {given} gives a cache of {capacity} B that holds all "
            f"{entries} experts ({total} B): nothing would be offloaded. Fix: lower it so the cache holds fewer "
            f"than {entries} experts (< {total} B)",
        )
    if slots < 1:
        raise Refused(
            Status.REFUSED,
            f"{given} gives a cache of {capacity} B, smaller than one expert ({store.expert_nbytes} B). "
            "Fix: raise it to at least one expert",
        )
    if configuration.route_ahead and slots < 2:
        raise Refused(
            Status.REFUSED,
            f"{given} gives a cache of one expert slot: route-ahead pins prefetched experts until their layer "
            "runs and needs at least 2 slots. Fix: raise the capacity",
        )
    return capacity


def emulated_gbps(cell: Cell, options: ReferenceOptions) -> float | None:
    """The cell's emulated link rate: its ablation value, else the model's option."""
    return cell.ablation.get("emulated_h2d_gbps", options.emulated_h2d_gbps)


def link_bytes_per_second(
    cell: Cell, options: ReferenceOptions, expert_nbytes: int, *, cuda: bool, probe: float | None
) -> float | None:
    """Bytes per second for one expert transfer: the CUDA probe on a GPU, else the emulated rate with its
    per-transfer latency; None for an un-emulated host copy (no device link, no honest rate)."""
    if cuda:
        return probe
    gbps = emulated_gbps(cell, options)
    if gbps:
        return expert_nbytes / (expert_nbytes / (gbps * 1e9) + options.emulated_latency_us * 1e-6)
    return None
