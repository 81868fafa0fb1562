"""The link's rate as the engine knows it before a cell runs: what OURS's byte-rate budget (``admission.py``) and
cost-aware verify width (``verify_width.py``) price bytes with. Pure (no torch)."""

from __future__ import annotations

from pd_dflash.engine.reference.options import ReferenceOptions
from pd_dflash.spec import Cell


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
