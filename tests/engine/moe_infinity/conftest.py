from __future__ import annotations

import pytest

from tests.engine.moe_infinity.fakes import make_tokenizer


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tokenizer"))
