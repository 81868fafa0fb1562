"""The drafters a runner has loaded, and the one a speculative cell drafts with (the ``Drafter`` seam).

Drafters stay loaded across a runner's cells: a preset's DFlash drafter per block size (trained and cached on
first use, ``presets/drafters.py``), a checkpoint's published ``models[].draft`` once (``dflash/published.py``),
or the early-exit self-drafter (no weights of its own). The first cell that loads one says how long it took.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from pd_dflash.engine.reference.decoding.speculative import EarlyExitDrafter
from pd_dflash.engine.reference.decoding.target import TargetModel
from pd_dflash.engine.reference.dflash.published import Loaded, load_published_drafter, published_source
from pd_dflash.engine.reference.models import LoadedModel
from pd_dflash.engine.reference.options import ReferenceOptions
from pd_dflash.engine.reference.presets.catalog import get_preset
from pd_dflash.engine.reference.presets.drafters import load_drafter
from pd_dflash.engine.reference.seams import Drafter
from pd_dflash.spec import ModelSpec


class Drafters:
    """Holds the drafters loaded so far (a preset's by block size, key None: the checkpoint's published one)."""

    def __init__(
        self, target: TargetModel, loaded: LoadedModel, model: ModelSpec, options: ReferenceOptions
    ) -> None:
        self.target, self.loaded, self.model, self.options = target, loaded, model, options
        self.loaded_drafters: dict[int | None, Loaded] = {}
        #: Seconds the last ``drafter`` call spent training or loading (None when it was loaded before).
        self.last_load_seconds: float | None = None

    def drafter(self, block_size: int, *, route_ahead: bool) -> tuple[Drafter, dict[str, Any]]:
        """The drafter of a speculative cell of ``block_size`` (leaving the route-ahead proxy when asked) and its
        facts for the row."""
        loaded_before, start = len(self.loaded_drafters), time.perf_counter()
        drafter, facts = self._drafter(block_size, route_ahead)
        seconds = time.perf_counter() - start
        self.last_load_seconds = seconds if len(self.loaded_drafters) > loaded_before else None
        return drafter, facts

    def _drafter(self, block_size: int, route_ahead: bool) -> tuple[Drafter, dict[str, Any]]:
        opts = self.options
        if opts.drafter == "early_exit":
            early = EarlyExitDrafter(self.target, opts.early_exit_layers, route_ahead=route_ahead)
            return early, early.describe()
        if self.loaded.source != "preset":  # a published DFlash drafter (models[].draft)
            if None not in self.loaded_drafters:
                where = Path(self.loaded.card.get("checkpoint", self.loaded.name)) / "config.json"
                self.loaded_drafters[None] = load_published_drafter(
                    self.model.draft, self.target.model, target_where=str(where), cache_dir=opts.cache_dir
                )
            source = published_source(self.loaded_drafters[None], block_size, route_ahead=route_ahead)
            return source, source.facts
        if (
            block_size not in self.loaded_drafters
        ):  # a preset's drafter of this block size, trained on first use
            self.loaded_drafters[block_size] = load_drafter(
                get_preset(self.loaded.name),
                self.target.model,
                block_size=block_size,
                seed=opts.train_seed,
                steps=opts.drafter_train_steps,
                cache_dir=opts.cache_dir,
            )
        source = published_source(self.loaded_drafters[block_size], block_size, route_ahead=route_ahead)
        return source, source.facts
