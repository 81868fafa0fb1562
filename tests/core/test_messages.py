"""Small pure helpers whose output people read: counts and sizes in error messages, lookups by id."""

from __future__ import annotations

import pytest

from pd_dflash.schema import _digits
from pd_dflash.spec import parse_spec
from pd_dflash.spec_inputs import how_many as _how_many


def test_a_count_is_exact_below_a_quadrillion_and_an_order_of_magnitude_above():
    assert _how_many(0) == "0" and _how_many(1234) == "1,234"
    assert _how_many(10**15 - 1) == "999,999,999,999,999"
    assert _how_many(10**15) == "about 10^15"  # 50 bits x 0.30103 = 15.05
    assert _how_many(10**20) == "about 10^20"  # 67 bits: 20.17
    assert _how_many(10**5000) == "about 10^5000"  # printing it would fail (Python's 4,300-digit limit)


def test_the_digits_of_a_huge_integer_are_estimated_from_its_bits():
    assert _digits(2**63) == "about 20"  # 64 bits x 0.30103 = 19.27 -> 19 + 1
    assert _digits(-(10**100)) == "about 101"  # 333 bits: 100.2 -> 100 + 1
    assert _digits(10**5000) == "about 5001"


def test_a_model_is_found_by_its_id():
    spec = parse_spec(
        {
            "name": "t",
            "engine": "reference",
            "models": [
                {"id": "a", "preset": "micro", "draft": "micro-dflash"},
                {"id": "b", "preset": "micro", "draft": "micro-dflash"},
            ],
            "baselines": ["B0"],
            "block_sizes": [8],
            "concurrency": [1],
        }
    )
    assert spec.model("b") is spec.models[1] and spec.model("a") is spec.models[0]
    with pytest.raises(KeyError) as err:
        spec.model("c")
    assert err.value.args == ("c",)
