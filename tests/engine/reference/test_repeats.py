"""Repeats are independent samples of the workload (issue 29): each repeat draws its own prompts, their order and
its sampling seeds from the spec's seed and its index (``Cell.sample_seed``, recorded in the row); the
configurations of one repeat share it, so B0 against B3 stays a paired, lossless comparison."""

from __future__ import annotations

import pytest

from pd_dflash.schema import Row
from pd_dflash.spec import expand
from tests.engine.reference.helpers import WORKLOAD, make_engine, make_spec


@pytest.fixture(scope="module")
def rows(micro):
    spec = make_spec(concurrency=(1,), repeats=2)
    engine = make_engine(spec)
    try:
        return {(c.baseline, c.repeat): Row.from_result(c, engine.run_cell(c)) for c in expand(spec)}
    finally:
        engine.close()


def test_the_configurations_of_a_repeat_share_its_sample(rows):
    for repeat in (0, 1):
        b0, b3 = rows[("B0", repeat)], rows[("B3", repeat)]
        assert b0.sample_seed == b3.sample_seed
        assert b0.engine["output_digest"] == b3.engine["output_digest"]  # lossless on the same prompts


def test_each_repeat_generates_its_own_outputs(rows):
    assert rows[("B0", 0)].sample_seed == WORKLOAD["seed"]  # repeat 0 measures what one repeat always did
    assert rows[("B0", 1)].sample_seed != WORKLOAD["seed"]
    for b in ("B0", "B3"):
        assert rows[(b, 0)].engine["output_digest"] != rows[(b, 1)].engine["output_digest"], b
