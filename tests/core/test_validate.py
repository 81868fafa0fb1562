"""`pd-dflash validate` (report/validate.py): every error upstream's ``validate_result_matrix`` would raise, all
collected, with the exact wording, and the group key checked against its rows."""

from __future__ import annotations

import json

import pytest

from pd_dflash.errors import InputError
from pd_dflash.report.validate import key_errors, validate_group, validate_matrix_file
from pd_dflash.upstream import REQUIRED_METRICS

ROW = {"model": "m", "block_size": 8, "concurrency": 2, **dict.fromkeys(REQUIRED_METRICS, 1.0)}
GROUP = {b: dict(ROW, baseline=b) for b in ("B0", "B1", "B2", "B3")}


def test_a_full_group_is_valid():
    assert validate_group(GROUP) == [] and key_errors("m|B8|c2", GROUP) == []


def test_every_error_of_a_group_is_collected():
    group = {
        "B0": {**ROW, "ttft_seconds": -1.0, "kv_occupancy_bytes": True},
        "B1": "not a row",
        "B3": {k: v for k, v in ROW.items() if k != "goodput_at_slo"},
        "OURS": {**ROW, "acceptance_length_a": float("nan")},
    }
    assert validate_group(group) == [
        "missing baselines: B2",
        "B0.ttft_seconds must be a finite, non-negative number; got -1.0",
        "B0.kv_occupancy_bytes must be a finite, non-negative number; got True",
        "B1 must be a row object; got str",
        "B3 missing metric: goodput_at_slo",
        "OURS.acceptance_length_a must be a finite, non-negative number; got nan",
    ]


def test_only_b3_unavailable_capacity_is_exempt():
    assert validate_group({**GROUP, "B3": {"status": "UNAVAILABLE_CAPACITY"}}) == []
    assert (
        validate_group({**GROUP, "B2": {"status": "UNAVAILABLE_CAPACITY"}})[0]
        == "B2 missing metric: output_tokens_per_second"
    )
    assert (
        validate_group({**GROUP, "B3": {"status": "REFUSED"}})[0]
        == "B3 missing metric: output_tokens_per_second"
    )


def test_the_group_key_names_its_rows():
    assert key_errors("m|B8|c2", {"B0": {"model": "x", "block_size": 16, "concurrency": True}, "B1": 3}) == [
        "B0.model is 'x' but the group key says 'm'",
        "B0.block_size is 16 but the group key says 8",
        "B0.concurrency is True but the group key says 2",
    ]
    assert key_errors("m|B8|c1", {"B0": {"concurrency": True}}) == [
        "B0.concurrency is True but the group key says 1"
    ]
    assert key_errors("org/model|x|B16|c32", {"B0": {"model": "org/model|x", "block_size": 16}}) == []
    assert key_errors("m|B8", GROUP) == ["group key 'm|B8' is not model|B<block_size>|c<concurrency>"]
    assert key_errors("m|Bx|c1", {}) == ["group key 'm|Bx|c1' is not model|B<block_size>|c<concurrency>"]


def test_a_matrix_file_is_validated_group_by_group(tmp_path):
    path = tmp_path / "result_matrix.json"
    path.write_text(json.dumps({"m|B8|c2": GROUP, "a|B8|c2": {"B0": dict(ROW, model="a")}}))
    results = validate_matrix_file(path)
    assert list(results) == ["a|B8|c2", "m|B8|c2"]
    assert results["m|B8|c2"] == {"valid": True, "errors": []}
    assert results["a|B8|c2"] == {"valid": False, "errors": ["missing baselines: B1, B2, B3"]}


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("[]", "a result matrix is a JSON object {group_key: {baseline: row}}"),
        ('{"m|B8|c1": []}', "a result matrix is a JSON object {group_key: {baseline: row}}"),
        ("{}", "holds no groups: nothing to validate"),
    ],
)
def test_a_file_that_is_no_matrix_is_refused_naming_it(tmp_path, content, message):
    path = tmp_path / "m.json"
    path.write_text(content)
    with pytest.raises(InputError) as err:
        validate_matrix_file(path)
    assert str(err.value) == f"{path}: {message}"


def test_an_unreadable_matrix_names_the_reason(tmp_path):
    with pytest.raises(InputError) as err:
        validate_matrix_file(tmp_path / "nope.json")
    assert str(err.value) == f"{tmp_path / 'nope.json'}: cannot read matrix: No such file or directory"


def test_checks_go_on_after_a_non_row_and_after_an_exempt_b3():
    assert key_errors("m|B8|c2", {"B0": 3, "B1": {"model": "x"}}) == [
        "B1.model is 'x' but the group key says 'm'"
    ]
    group = {
        "B3": {"status": "UNAVAILABLE_CAPACITY"},
        "B0": ROW,
        "B1": ROW,
        "B2": {**ROW, "ttft_seconds": -1},
    }
    assert validate_group(group) == ["B2.ttft_seconds must be a finite, non-negative number; got -1"]


def test_a_matrix_that_is_not_utf8_or_too_deep_is_named(tmp_path):
    path = tmp_path / "m.json"
    path.write_bytes(b'{"m|B8|c1": \xff}')
    with pytest.raises(InputError) as err:
        validate_matrix_file(path)
    assert str(err.value) == f"{path}: not UTF-8 text (byte 0xff at offset 12)"
    path.write_text("[" * 100 + "]" * 100)
    with pytest.raises(InputError) as err:
        validate_matrix_file(path)
    assert str(err.value) == f"{path}: nested deeper than 64 levels"
