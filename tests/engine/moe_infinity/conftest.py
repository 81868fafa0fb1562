from __future__ import annotations

import pytest

from tests.engine.moe_infinity.fakes import SMALL, make_spec, make_tokenizer


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tokenizer"))


@pytest.fixture
def spec(tmp_path, tokenizer_dir):
    """The fake model's sweep with the short ``SMALL`` workload (the contract tests' usual spec)."""
    return make_spec(tmp_path, tokenizer_dir, **SMALL)
