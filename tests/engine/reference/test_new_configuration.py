"""Adding a configuration: one that recombines parts is one table entry (``baselines.py``); one with a new part
is one entry plus one factory module (``oldest_first.py`` here), registered in ``cell.py``'s table of its field.
A table value without a factory is refused when the spec is checked (plan time), naming the baseline and field."""

from __future__ import annotations

import dataclasses

import pytest

from pd_dflash import baselines
from pd_dflash.engine.reference import cell as parts
from pd_dflash.engine.registry import check
from pd_dflash.errors import InputError
from pd_dflash.schema import Status
from pd_dflash.spec import expand
from tests.engine.reference.helpers import make_engine, make_spec
from tests.engine.reference.oldest_first import oldest_first

#: B4 recombines existing parts: OURS's decoding and route-ahead prefetcher with B2's token deficit.
B4 = dataclasses.replace(
    baselines.configuration("RA"), name="B4", description="throwaway", admission="token_deficit"
)


def register(monkeypatch, configuration):
    monkeypatch.setitem(baselines.BY_NAME, configuration.name, configuration)


def run_as(engine, spec, configuration):
    """One cell of the spec run as ``configuration`` (the cell's identity is a validated spec's: B2's)."""
    (cell,) = [c for c in expand(spec) if c.baseline == "B2"]
    return engine.run_cell(cell.model_copy(update={"baseline": configuration.name}))


@pytest.fixture(scope="module")
def engine(micro):
    spec = make_spec(baselines=("B2",), concurrency=(2,), options={"emulated_h2d_gbps": 2.0})
    engine = make_engine(spec)
    yield spec, engine
    engine.close()


def test_a_recombination_is_one_table_entry(engine, monkeypatch):
    spec, eng = engine
    register(monkeypatch, B4)
    result = run_as(eng, spec, B4)
    assert result.status == Status.OK, result.warnings
    assert result.engine["decoding"] == "speculative"
    assert result.engine["prefetcher"] == "route_ahead"
    assert result.engine["scheduler"]["kind"] == "token_deficit"
    assert result.engine["expert_cache"]["resident"] is False


def test_a_new_part_is_one_entry_and_one_factory_module(engine, monkeypatch):
    spec, eng = engine
    b5 = dataclasses.replace(
        baselines.configuration("B1"), name="B5", description="throwaway", admission="oldest_first"
    )
    register(monkeypatch, b5)
    with pytest.raises(InputError, match="B5's admission 'oldest_first' has no factory"):
        parts.check_configurations(["B5"])
    monkeypatch.setitem(parts.ADMISSIONS, "oldest_first", oldest_first)
    parts.check_configurations(["B5"])
    result = run_as(eng, spec, b5)
    assert result.status == Status.OK, result.warnings
    assert result.engine["scheduler"]["kind"] == "oldest_first"
    # The loop honoured the new part: one request per verify forward although c = 2.
    assert result.engine["batch"]["requests_per_forward_max"] == 1


def test_a_value_without_a_factory_fails_when_the_spec_is_checked(monkeypatch):
    monkeypatch.delitem(parts.PREFETCHERS, "route_ahead")
    with pytest.raises(InputError, match="OURS's prefetcher 'route_ahead' has no factory") as raised:
        check(make_spec(baselines=("B0", "OURS")))
    assert raised.value.where == "baselines"


def test_every_table_value_has_a_factory():
    parts.check_configurations(baselines.ORDER)
    assert set(parts.PREFETCHERS) >= {c.prefetcher for c in baselines.CONFIGURATIONS}
