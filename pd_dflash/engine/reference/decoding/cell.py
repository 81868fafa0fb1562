"""One cell's decoding as its configuration names it: autoregressive, or speculative with the configured drafter.

Drafters stay loaded across a runner's cells: a preset's DFlash drafter per block size (trained and cached on
first use, ``presets/drafters.py``), a checkpoint's published ``models[].draft`` once (``dflash/published.py``),
or the early-exit self-drafter (no weights of its own). The first cell that loads one says how long it took.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from pd_dflash.baselines import configuration
from pd_dflash.engine.reference.decoding.speculative import EarlyExitDrafter, SpeculativeDecoding
from pd_dflash.engine.reference.decoding.target import AutoregressiveDecoding, TargetModel
from pd_dflash.engine.reference.dflash.published import load_published_drafter, published_decoding
from pd_dflash.engine.reference.models import LoadedModel
from pd_dflash.engine.reference.options import ReferenceOptions
from pd_dflash.engine.reference.presets.catalog import get_preset
from pd_dflash.engine.reference.presets.drafters import load_drafter
from pd_dflash.engine.reference.seams import Decoding
from pd_dflash.spec import Cell, ModelSpec


class CellDecodings:
    """Builds each cell's decoding; holds the drafters loaded so far (a preset's by block size, key None: the
    checkpoint's published one)."""

    def __init__(
        self,
        target: TargetModel,
        loaded: LoadedModel,
        model: ModelSpec,
        options: ReferenceOptions,
        temperature: float,
    ) -> None:
        self.target, self.loaded, self.model, self.options = target, loaded, model, options
        self.temperature = temperature
        self.drafters: dict[int | None, tuple[Any, dict[str, Any]]] = {}

    def for_cell(self, cell: Cell) -> tuple[Decoding, dict[str, Any] | None, float | None]:
        """(decoding, drafter facts, seconds spent training or loading the drafter — None when it was loaded
        before this cell)."""
        loaded_before = len(self.drafters)
        start = time.perf_counter()
        decoding, facts = self._decoding(cell)
        seconds = time.perf_counter() - start
        return decoding, facts, (seconds if len(self.drafters) > loaded_before else None)

    def _decoding(self, cell: Cell) -> tuple[Decoding, dict[str, Any] | None]:
        temperature, opts = self.temperature, self.options
        if not cell.speculative:
            return AutoregressiveDecoding(temperature), None
        if opts.drafter == "early_exit":
            route_ahead = configuration(cell.baseline).route_ahead
            drafter = EarlyExitDrafter(self.target, opts.early_exit_layers, route_ahead=route_ahead)
            return SpeculativeDecoding(drafter, cell.block_size, temperature), drafter.describe()
        if self.loaded.source != "preset":  # a published DFlash drafter (models[].draft)
            if None not in self.drafters:
                where = Path(self.loaded.card.get("checkpoint", self.loaded.name)) / "config.json"
                self.drafters[None] = load_published_drafter(
                    self.model.draft, self.target.model, target_where=str(where), cache_dir=opts.cache_dir
                )
            return published_decoding(self.drafters[None], cell, temperature)
        if (
            cell.block_size not in self.drafters
        ):  # a preset's drafter of this block size, trained on first use
            self.drafters[cell.block_size] = load_drafter(
                get_preset(self.loaded.name),
                self.target.model,
                block_size=cell.block_size,
                seed=opts.train_seed,
                steps=opts.drafter_train_steps,
                cache_dir=opts.cache_dir,
            )
        return published_decoding(self.drafters[cell.block_size], cell, temperature)
