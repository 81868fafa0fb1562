"""Shared fixtures of the reference-engine tests: the trained ``micro`` preset (cached under $PD_DFLASH_CACHE,
see tests/conftest.py). Builders (tiny models, specs, stores, ...) live in helpers.py."""

from __future__ import annotations

import pytest
import torch

from pd_dflash.engine.reference.presets.catalog import get_preset
from pd_dflash.engine.reference.presets.training import load_preset

# Re-exported for the test files that still import it from here (test_speculative, test_dflash_*, test_checkpoint:
# other branches own them); new code imports tests.engine.reference.helpers.
from tests.engine.reference.helpers import tiny_model  # noqa: F401


@pytest.fixture(scope="session")
def micro():
    """(trained micro model, card); tests must deepcopy before mutating."""
    torch.set_num_threads(1)
    return load_preset(get_preset("micro"))
