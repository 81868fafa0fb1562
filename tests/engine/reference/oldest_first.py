"""A throwaway admission for ``test_new_configuration.py``: the one factory module a configuration with a new
part needs (the part and its factory; the configuration itself is one table entry). It verifies the oldest
pending block alone each step, so every verify forward holds one request."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pd_dflash.engine.reference.cell import PartInputs
from pd_dflash.engine.reference.decoding.target import Block
from pd_dflash.engine.reference.seams import Admission, Key, Prefetcher


class OldestFirst:
    name = "oldest_first"

    def __init__(self) -> None:
        self.steps = 0

    def select(self, blocks: list[Block]) -> list[Block]:
        self.steps += 1
        return [min(blocks, key=lambda b: b.ready_step)] if blocks else []

    def reset(self) -> None:
        self.steps = 0

    def describe(self) -> dict[str, Any]:
        return {"kind": self.name, "steps": self.steps}


def oldest_first(
    inputs: PartInputs, prefetcher: Prefetcher | None, is_resident: Callable[[Key], bool]
) -> Admission:
    return OldestFirst()
