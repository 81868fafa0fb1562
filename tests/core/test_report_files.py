"""result_matrix.json's layout and merged cost terms (report/matrix_json.py), the report's inputs and
command-line allowances (report/build.py), checked against values written out by hand."""

from __future__ import annotations

import json
import re

import pytest

from pd_dflash.errors import InputError
from pd_dflash.report.aggregate import build_matrix
from pd_dflash.report.build import build_report, effective_gates, open_inputs, write_outputs
from pd_dflash.report.matrix_json import aggregated_row, matrix_json
from pd_dflash.rows import append_row, encode_row
from pd_dflash.schema import CostTerms, Status
from pd_dflash.spec import Gates
from pd_dflash.upstream import REQUIRED_METRICS
from tests.core.helpers import KEY, gate_spec, rows_of


def with_cost_terms(*terms):
    """OURS repeats carrying the given cost terms (one dict per repeat)."""
    return rows_of(gate_spec(repeats=len(terms)), OURS={"cost_terms": lambda r: CostTerms(**terms[r])})


def test_cost_terms_are_merged_over_the_measured_repeats():
    rows = with_cost_terms(
        {"h2d_bytes": 10, "h2d_seconds": 0.5, "h2d_link": "emulated", "h2d_bandwidth_source": "transfers"},
        {"h2d_bytes": 15, "h2d_seconds": 1.0, "h2d_link": "emulated", "h2d_bandwidth_source": "probe"},
        {"h2d_bytes": 20, "h2d_seconds": 1.5, "h2d_link": "emulated"},
    )
    merged = aggregated_row(build_matrix(rows), KEY, "OURS")["cost_terms"]
    assert merged["h2d_bytes"] == 15 and isinstance(merged["h2d_bytes"], int)  # ints stay ints
    assert merged["h2d_seconds"] == 1.0 and merged["h2d_link"] == "emulated"
    assert merged["h2d_bandwidth_source"] == "mixed: probe, transfers"  # text kept only when all agree
    rounded = with_cost_terms({"h2d_bytes": 1}, {"h2d_bytes": 2})
    assert aggregated_row(build_matrix(rounded), KEY, "OURS")["cost_terms"]["h2d_bytes"] == 2  # 1.5 -> 2
    assert "cost_terms" not in aggregated_row(build_matrix(rows_of(gate_spec())), KEY, "B0")  # none stored


def test_a_baseline_without_measured_repeats_has_no_cost_terms():
    rows = rows_of(gate_spec(), status={("OURS", 0): (Status.ERROR, "boom")})
    assert "cost_terms" not in aggregated_row(build_matrix(rows), KEY, "OURS")


def test_result_matrix_json_layout_and_repeats_as_stored():
    rows = rows_of(gate_spec(models=("m", "a")))
    text = matrix_json(build_matrix(rows))
    data = json.loads(text)
    assert list(data) == ["a|B8|c1", "m|B8|c1"]  # sorted keys
    assert text.startswith('{\n  "a|B8|c1": {\n    "B0": {\n') and text.endswith("\n}\n")
    assert re.search(
        r'\n      "repeats": \[\n        \{"model":"a"', text
    )  # each repeat as compact stored text
    ours = data["m|B8|c1"]["OURS"]
    stored = next(r for r in rows if (r.model, r.baseline) == ("m", "OURS"))
    assert ours["repeats"] == [json.loads(encode_row(stored))]
    assert ours["output_tokens_per_second"] == 45.0 and ours["n_repeats"] == 1
    assert matrix_json(build_matrix([])) == "{}\n"


def test_effective_gates_widen_the_spec_with_the_command_line():
    s = gate_spec().model_copy(update={"gates": Gates(allow_blocked=["B3"], min_coverage=0.5)})
    gates = effective_gates(s, ["B2", "B0", "B3"], ["kv_occupancy_bytes"])
    assert gates.allow_blocked == ["B0", "B2", "B3"] and gates.min_coverage == 0.5  # upstream's order
    assert gates.allow_unmeasured == ["kv_occupancy_bytes"]
    again = effective_gates(
        gate_spec().model_copy(update={"gates": Gates(allow_unmeasured=["ttft_seconds"])}),
        allow_unmeasured=["ttft_seconds", "goodput_at_slo"],
    )
    assert again.allow_unmeasured == ["ttft_seconds", "goodput_at_slo"]  # no duplicate
    assert effective_gates(None) == Gates()
    with pytest.raises(InputError) as err:
        effective_gates(None, ["B9"])
    assert (
        str(err.value) == "--allow-blocked: unknown baseline 'B9'; use one of B0, B1, B2, B3, OURS, RA, AR2D"
    )
    with pytest.raises(InputError) as err:
        effective_gates(None, allow_unmeasured=["vibes"])
    assert str(err.value).startswith("--allow-unmeasured: ") and "unknown metric 'vibes'" in str(err.value)


def test_inputs_are_read_from_files_and_directories_with_their_places(tmp_path):
    rows = rows_of(gate_spec())
    (tmp_path / "sweep").mkdir()
    for r in rows[:2]:
        append_row(tmp_path / "sweep" / "rows.jsonl", r)
    whole = tmp_path / "upstream.json"
    whole.write_text(json.dumps([r.to_json_dict() for r in rows[2:]]))
    with open_inputs([tmp_path / "sweep", whole]) as (briefs, sources):
        assert [b.baseline for b in briefs] == ["B0", "B1", "B3", "OURS"]
        assert sources == [
            f"{tmp_path / 'sweep' / 'rows.jsonl'}:1",
            f"{tmp_path / 'sweep' / 'rows.jsonl'}:2",
            f"{whole}[0]",
            f"{whole}[1]",
        ]
        assert briefs[1].fetch() == encode_row(rows[1]).decode().rstrip("\n")  # re-read from its line
        assert briefs[3].fetch() == rows[3].to_json_dict()  # a whole-JSON row is kept
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(InputError) as err, open_inputs([empty]):
        pass
    assert str(err.value) == f"{empty}: holds no rows: nothing to report"


def test_build_report_and_write_outputs_give_the_same_files(tmp_path):
    rows = rows_of(gate_spec())
    verdict, files = build_report(rows, Gates(), spec=gate_spec())
    assert sorted(files) == ["result_matrix.csv", "result_matrix.json", "result_matrix.md", "verdict.json"]
    assert verdict["complete"] is True and verdict["exit_code"] == 0
    assert json.loads(files["verdict.json"])["overall"]["verdict"] == "GO"
    written = write_outputs(rows, tmp_path, Gates(), spec=gate_spec())
    assert written == verdict
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(files)  # no plots unless asked for
    for name, content in files.items():
        assert (tmp_path / name).read_text() == content
    incomplete, _ = build_report(rows[1:], Gates(), spec=gate_spec())
    assert incomplete["complete"] is False and incomplete["exit_code"] == 1
    nothing, _ = build_report([], Gates())
    assert nothing["complete"] is False and nothing["exit_code"] == 1 and nothing["groups"] == {}


def test_one_repeats_text_cost_terms_are_kept():
    rows = with_cost_terms({"h2d_link": "emulated", "h2d_bytes": 3})
    merged = aggregated_row(build_matrix(rows), KEY, "OURS")["cost_terms"]
    assert merged == {"h2d_link": "emulated", "h2d_bytes": 3}


def test_a_report_names_rows_by_the_sources_it_is_given():
    rows = rows_of(gate_spec())
    failed = rows[1].model_copy(
        update={
            **dict.fromkeys(
                ["output_tokens_per_second", "acceptance_length_a", "ttft_seconds", "per_round_latency_seconds",
                 "goodput_at_slo", "expert_cache_hit_rate", "route_ahead_prefetch_coverage", "wasted_prefetch_bytes",
                 "expert_occupancy_bytes", "kv_occupancy_bytes"]
            ),
            "status": Status.ERROR,
            "reason": "boom",
        }
    )  # fmt: skip
    sources = ["a.jsonl:1", *(f"b.jsonl:{i}" for i in range(1, len(rows) + 1))]
    _, files = build_report([failed, *rows], Gates(), spec=gate_spec(), sources=sources)
    assert "- superseded failed row a.jsonl:1 by b.jsonl:2" in files["result_matrix.md"].splitlines()


def test_write_outputs_creates_the_directory_plots_included_and_uses_the_sources(tmp_path):
    rows = rows_of(gate_spec())
    failed = rows[1].model_copy(
        update={**dict.fromkeys(REQUIRED_METRICS), "status": Status.ERROR, "reason": "x"}
    )
    out = tmp_path / "a" / "b"
    sources = ["old:1", *(f"new:{i}" for i in range(1, len(rows) + 1))]
    write_outputs([failed, *rows], out, Gates(), plots=True, sources=sources)
    assert "- superseded failed row old:1 by new:2" in (out / "result_matrix.md").read_text().splitlines()
    assert [p.suffix for p in (out / "plots").iterdir()] and all(
        p.suffix == ".png" for p in (out / "plots").iterdir()
    )


def test_a_text_value_shaped_like_a_repeat_placeholder_is_written_as_is():
    """Repeats are spliced in through placeholders; a row's own text (here its draft) must never be taken for
    one, whatever it reads."""
    rows = [r.model_copy(update={"draft": "None-0"}) for r in rows_of(gate_spec())]
    data = json.loads(matrix_json(build_matrix(rows)))
    ours = data[KEY]["OURS"]
    assert ours["draft"] == "None-0"
    assert [r["draft"] for r in ours["repeats"]] == ["None-0"]


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
def test_result_matrix_json_never_holds_nan_or_infinity():
    """Two finite repeats of 1.5e308 tokens/s overflow to an infinite mean: result_matrix.json is then refused
    (a ValueError) or written as strict JSON, never with the non-standard token ``Infinity``."""
    rows = rows_of(gate_spec(repeats=2), OURS={"output_tokens_per_second": 1.5e308})

    def no_constant(token: str):
        raise AssertionError(f"result_matrix.json holds {token}")

    try:
        text = matrix_json(build_matrix(rows))
    except ValueError as exc:
        assert "not JSON compliant" in str(exc)
    else:
        json.loads(text, parse_constant=no_constant)
