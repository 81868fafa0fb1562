"""Every configuration of ``pd_dflash/baselines.py`` through the reference engine: the engine builds what the
table says (decoding, prefetcher, admission, offload), and all of them give one output (lossless)."""

from __future__ import annotations

import pytest

from pd_dflash.baselines import ORDER, configuration
from pd_dflash.schema import Row, Status
from pd_dflash.spec import expand
from tests.engine.reference.helpers import make_engine, make_spec

SCHEDULER_KIND = {"all": "none", "token_deficit": "token_deficit", "two_dim_deficit": "two_dim_deficit"}


@pytest.fixture(scope="module")
def rows(micro):
    spec = make_spec(baselines=ORDER, concurrency=(2,), options={"emulated_h2d_gbps": 2.0})
    engine = make_engine(spec)
    try:
        return {c.baseline: Row.from_result(c, engine.run_cell(c)) for c in expand(spec)}
    finally:
        engine.close()


@pytest.mark.parametrize("name", ORDER)
def test_the_engine_runs_each_configuration_as_its_table_entry_says(rows, name):
    c, row = configuration(name), rows[name]
    assert row.status == Status.OK, row.warnings
    assert row.engine["decoding"] == c.decoding
    assert row.engine["scheduler"]["kind"] == SCHEDULER_KIND[c.admission]
    assert row.engine["prefetcher"] == c.prefetcher
    assert row.engine["expert_cache"]["resident"] is not c.offloaded
    # Prediction counts only where prefetches were issued (a resident configuration only observes).
    assert (row.route_ahead is not None) == c.offloaded
    if c.admission == "two_dim_deficit":
        assert "expert_bytes" in row.engine["scheduler"]["dimensions"]


def test_every_configuration_gives_the_same_tokens(rows):
    digests = {name: row.engine["output_digest"] for name, row in rows.items()}
    assert len(set(digests.values())) == 1, digests
