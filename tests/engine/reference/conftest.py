"""Shared fixtures of the reference-engine tests: the trained ``micro`` preset (cached under $PD_DFLASH_CACHE,
see tests/conftest.py). Builders (tiny models, specs, stores, ...) live in helpers.py."""

from __future__ import annotations

import pytest
import torch

from pd_dflash.engine.reference.presets.catalog import get_preset
from pd_dflash.engine.reference.presets.training import load_preset


@pytest.fixture(scope="session")
def micro():
    """(trained micro model, card); tests must deepcopy before mutating."""
    torch.set_num_threads(1)
    return load_preset(get_preset("micro"))
