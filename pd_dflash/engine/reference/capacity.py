"""A cell's device expert-cache capacity, and the refusals that keep offloaded baselines honest.

B3 holds every expert. B0/B1/B2/OURS must really offload (as upstream): a capacity that would hold every expert,
or less than one, is refused with the fix to apply.
"""

from __future__ import annotations

from pd_dflash.baselines import configuration
from pd_dflash.engine.interface import Refused
from pd_dflash.engine.reference.expert_store import HostExpertStore
from pd_dflash.engine.reference.options import ReferenceOptions
from pd_dflash.schema import Status
from pd_dflash.spec import Cell, Memory


def expert_cache_capacity(
    cell: Cell, store: HostExpertStore, options: ReferenceOptions, memory: Memory
) -> int:
    """The cell's expert-cache capacity in bytes. B3 holds every expert; an offloaded baseline must really
    offload (as upstream), so a capacity that holds every expert, or less than one, is ``Refused``."""
    total = store.total_bytes
    if not cell.offloaded:
        return total
    opts = options
    frac = cell.ablation.get("expert_cache_fraction", memory.expert_cache_fraction)  # an ablation cell's own
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
            f"{cell.baseline} must be offloaded, but no expert-cache capacity is set, so the cache would hold "
            f"every expert ({total} B). Fix: set memory.expert_cache_fraction below 1 (e.g. 0.25) or "
            "models[].engine_options.expert_cache_bytes",
        )
    slots, entries = capacity // store.expert_nbytes, store.num_entries
    if slots >= entries:
        raise Refused(
            Status.REFUSED,
            f"{cell.baseline} must be offloaded, but {given} gives a cache of {capacity} B that holds all "
            f"{entries} experts ({total} B): nothing would be offloaded. Fix: lower it so the cache holds fewer "
            f"than {entries} experts (< {total} B)",
        )
    if slots < 1:
        raise Refused(
            Status.REFUSED,
            f"{given} gives a cache of {capacity} B, smaller than one expert ({store.expert_nbytes} B). "
            "Fix: raise it to at least one expert",
        )
    if configuration(cell.baseline).route_ahead and slots < 2:
        raise Refused(
            Status.REFUSED,
            f"{given} gives a cache of one expert slot: route-ahead pins prefetched experts until their layer "
            "runs and needs at least 2 slots. Fix: raise the capacity",
        )
    return capacity
