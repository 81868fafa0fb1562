"""Independent repeats (issue 29 items 1, 5 and 8): every repeat its own sample seed, shared by the
configurations of the repeat; aggregation that cannot overflow and writes no NaN or inf; a schema error that
says how to fix an unquoted YAML date."""

from __future__ import annotations

import json
import math

import pytest
import yaml

from pd_dflash.cli import main
from pd_dflash.report import build_report
from pd_dflash.report.aggregate import build_matrix, scaled_moments, summary_stats
from pd_dflash.schema import Row, parse_row
from pd_dflash.spec import Gates, expand, parse_spec, sample_seed
from pd_dflash.sweep.resume import row_mismatch
from tests.core.helpers import KEY, gate_spec, rows_of, spec_data

# -- sample seeds ---------------------------------------------------------------------------------------------


def test_each_repeat_has_its_own_sample_and_every_configuration_of_it_the_same():
    spec = gate_spec(repeats=3)
    by_repeat: dict[int, set[int]] = {}
    for cell in expand(spec):
        by_repeat.setdefault(cell.repeat, set()).add(cell.sample_seed)
    assert all(len(seeds) == 1 for seeds in by_repeat.values())  # paired within a repeat
    seeds = [next(iter(by_repeat[r])) for r in range(3)]
    assert seeds[0] == spec.workload.seed and len(set(seeds)) == 3  # independent across repeats
    assert seeds == [sample_seed(spec.workload.seed, r) for r in range(3)]
    assert sample_seed(7, 1) != sample_seed(8, 1) and 0 <= sample_seed(7, 1) < 2**31


def test_the_sample_seed_is_in_the_row_and_keeps_the_cell_ids():
    spec = gate_spec(repeats=2)
    rows = rows_of(spec)
    assert [r.sample_seed for r in rows] == [c.sample_seed for c in expand(spec)]
    again = parse_spec({**spec.model_dump(mode="json", exclude_none=True)})
    assert [c.cell_id for c in expand(again)] == [c.cell_id for c in expand(spec)]
    stored = json.loads(json.dumps(rows[1].to_json_dict()))
    assert parse_row(stored, where="t").sample_seed == rows[1].sample_seed


def test_a_row_of_another_sample_is_not_its_cells():
    spec = gate_spec(repeats=2)
    cells = {(c.baseline, c.repeat): c for c in expand(spec)}
    rows = {(r.baseline, r.repeat): r for r in rows_of(spec)}
    first, second = rows[("B1", 0)], rows[("B1", 1)]
    assert row_mismatch(first, cells[("B1", 0)]) is None
    assert "sample_seed" in row_mismatch(second.model_copy(update={"sample_seed": 5}), cells[("B1", 1)])
    # rows from before independent repeats: repeat 0 drew the spec's seed, as now; repeat 1 copied it
    assert row_mismatch(first.model_copy(update={"sample_seed": None}), cells[("B1", 0)]) is None
    assert "sample_seed" in row_mismatch(second.model_copy(update={"sample_seed": None}), cells[("B1", 1)])


# -- overflow and non-finite numbers -----------------------------------------------------------------------------


def test_scaled_moments_do_not_overflow():
    assert scaled_moments([1.7e308, 1.7e308]) == (1.7e308, 0.0)
    mean, std = scaled_moments([0.0, 1.7e308])
    assert mean == 0.85e308 and std == pytest.approx(1.7e308 / math.sqrt(2))
    assert scaled_moments([-1.7e308, 1.7e308])[1] == math.inf  # beyond the float range
    assert scaled_moments([3.0]) == (3.0, None) and scaled_moments([0.0, 0.0]) == (0.0, 0.0)
    assert scaled_moments([1.0, 2.0, 6.0]) == (3.0, pytest.approx(2.6457513110645907))


def test_an_interval_beyond_the_float_range_is_absent_and_says_so():
    s = summary_stats(1e308, 1e308, 2)
    assert s["ci95_low"] is None and s["std"] is None and "float range" in s["no_interval"]


def test_rows_whose_mean_overflows_give_a_finite_report():
    """Two repeats of 1.7e308 tokens/s (finite, valid) used to end in "Out of range float values are not JSON
    compliant" with no matrices; the means are exact, nothing written holds NaN or inf."""
    s = gate_spec(repeats=2)
    huge = {"output_tokens_per_second": 1.7e308, "goodput_at_slo": 1.7e308, "expert_occupancy_bytes": 1.7e308}
    tiny = {"output_tokens_per_second": lambda r: (1e-300, 2e-300)[r]}
    verdict, files = build_report(rows_of(s, OURS=huge, B1=huge, B3=huge, B0=tiny), Gates(), spec=s)
    for name in ("result_matrix.json", "verdict.json"):
        json.loads(files[name], parse_constant=pytest.fail)  # NaN, Infinity, -Infinity
    matrix = json.loads(files["result_matrix.json"])
    assert matrix[KEY]["OURS"]["output_tokens_per_second"] == 1.7e308
    speedup = verdict["groups"][KEY]["gates"]["speedup_over_b0"]
    assert speedup["status"] == "pass" and "beyond the float range" in speedup["summary"]
    assert speedup["per_baseline"]["OURS"] is None


def test_a_spread_beyond_the_float_range_is_inconclusive_not_a_crash():
    s = gate_spec(repeats=2)
    rows = rows_of(s, OURS={"output_tokens_per_second": lambda r: (0.0, 1.7e308)[r]})
    verdict, files = build_report(rows, Gates(), spec=s)
    json.loads(files["verdict.json"], parse_constant=pytest.fail)
    stats = build_matrix(rows).stats[(KEY, "OURS")]["output_tokens_per_second"]
    assert stats["mean"] == 0.85e308 and stats["ci95_high"] is None and stats["no_interval"]
    assert verdict["groups"][KEY]["confidence"]["ordering"]["status"] != "PASS"


def test_the_report_command_prints_no_nan(tmp_path, capsys):
    s = gate_spec(repeats=2)
    rows = rows_of(s, OURS={"output_tokens_per_second": 1.7e308})
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r.to_json_dict(), allow_nan=False) + "\n" for r in rows))
    code = main(["report", str(path), "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert code in (0, 1) and "NaN" not in out and "Infinity" not in out
    assert Row.model_validate(rows[0].to_json_dict())


# -- how to fix a schema error ---------------------------------------------------------------------------------


def test_an_unquoted_yaml_date_says_to_quote_it(tmp_path, capsys):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec_data()) + "workload:\n  chat_date: 2025-08-05\n")
    code = main(["plan", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and "workload.chat_date" in err, err
    assert 'quote it, e.g. chat_date: "2025-08-05"' in err and "Traceback" not in err


@pytest.mark.parametrize(("value", "hint"), [("yes", "as a boolean"), ("1.5", "a number, unquoted")])
def test_an_unquoted_yes_or_number_where_text_is_wanted_says_to_quote_it(tmp_path, capsys, value, hint):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(spec_data()).replace("name: t\n", f"name: {value}\n"))
    code = main(["plan", str(path)])
    err = capsys.readouterr().err
    assert code == 2 and "name" in err and hint in err and "quote it to keep it text" in err, err


def test_plots_of_values_near_the_float_range_are_drawn_without_them():
    s = gate_spec(repeats=2)
    rows = rows_of(s, OURS={"output_tokens_per_second": 1.7e308}, B3={"output_tokens_per_second": 1.7e308})
    _, files = build_report(rows, Gates(), spec=s, plots=True)
    assert any(name.startswith("plots/") and name.endswith("tokens_per_second.png") for name in files)
