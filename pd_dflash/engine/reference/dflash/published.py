"""The engine's side of a published DFlash drafter: find ``models[].draft`` (a directory, a hub id in the HF
cache, or ``tiny-real-dflash``), load it once per runner on the target, and build each speculative cell's
drafter seam from it (``published_source`` also serves a preset's trained drafters, which are in the same layout:
``presets/drafters.py``). A drafter that is missing or does not fit its target refuses the speculative cells (B0
still runs); ``pd-dflash plan`` has already refused it when the files were visible there (``config.check_drafter``).
"""

from __future__ import annotations

from typing import Any

from torch import nn

from pd_dflash.engine.interface import Refused
from pd_dflash.engine.reference.dflash.config import TINY_DRAFTER, resolve_drafter
from pd_dflash.engine.reference.dflash.load import load_dflash_drafter
from pd_dflash.engine.reference.dflash.model import DFlashDrafter
from pd_dflash.engine.reference.dflash.source import DFlashSource
from pd_dflash.errors import InputError
from pd_dflash.schema import Status

Loaded = tuple[DFlashDrafter, dict[str, Any]]


def load_published_drafter(
    draft: str, model: nn.Module, *, target_where: str, cache_dir: str | None
) -> Loaded:
    """The drafter ``models[].draft`` names, loaded on ``model`` (its device, dtype, embedding and lm_head)."""
    if not draft:
        raise Refused(
            Status.REFUSED,
            "speculative cells on a checkpoint need a DFlash drafter, but models[].draft is empty. Fix: name a "
            "published DFlash drafter (a hub id in HF_HOME or a directory), `tiny-real-dflash` (a random one, "
            "machinery only), or set models[].engine_options.drafter: early_exit",
        )
    if draft == TINY_DRAFTER:
        from pd_dflash.engine.reference.artifacts import cache_root
        from pd_dflash.engine.reference.dflash.tiny import tiny_drafter_for

        directory = tiny_drafter_for(model.config.to_dict(), cache_root(cache_dir))
    else:
        resolved, tried = resolve_drafter(draft)
        if resolved is None:
            raise Refused(
                Status.REFUSED,
                f"models[].draft: DFlash drafter {draft!r} not found on this box (looked in {', '.join(tried)}); "
                "download it into HF_HOME or give a local directory",
            )
        directory = resolved
    try:
        drafter, facts = load_dflash_drafter(directory, model, target_where=target_where)
    except InputError as exc:
        raise Refused(Status.REFUSED, str(exc)) from None
    return drafter, {"draft": draft, **facts}


def published_source(loaded: Loaded, block_size: int, *, route_ahead: bool) -> DFlashSource:
    """The drafter seam over this drafter for a cell of ``block_size`` (leaving the route-ahead proxy on each
    block when asked); a block above the drafter's trained block size runs, with a warning for the row
    (``source.facts["warnings"]``)."""
    drafter, facts = loaded
    source = DFlashSource(drafter, facts, route_ahead=route_ahead)
    trained = drafter.config.block_size
    if block_size > trained:
        source.facts["warnings"] = [
            f"block size {block_size} is above the DFlash drafter's trained block size {trained} "
            f"({facts['checkpoint']}/config.json: dflash_config.block_size); it runs, but the drafts beyond position "
            f"{trained - 1} come from mask positions it was never trained on"
        ]
    return source
