"""Ablation axes: a list-valued cache fraction or link rate expands into one cell per value, the values travel
in the cell's identity and report group, and a single-valued spec is left exactly as it was."""

from __future__ import annotations

import random

import pytest

from pd_dflash.engine.registry import check
from pd_dflash.errors import InputError
from pd_dflash.plan import plan_summary
from pd_dflash.report.aggregate import build_matrix, group_key
from pd_dflash.report.plots import ours_over_b1
from pd_dflash.schema import Row
from pd_dflash.spec import expand, parse_spec
from tests.core.helpers import LINKS, ablation_spec, base_spec, synth_result


def test_list_axes_expand_into_one_cell_per_combination():
    spec = ablation_spec()
    cells = expand(spec)
    assert len(cells) == 2 * 2 * 3  # baselines x cache fractions x link rates
    settings = {tuple(sorted(c.ablation.items())) for c in cells if c.baseline == "OURS"}
    assert len(settings) == 6
    assert len({c.identity for c in cells}) == len({c.cell_id for c in cells}) == len(cells)
    one = cells[0]
    assert one.identity[:5] == (one.model, one.baseline, one.block_size, one.concurrency, one.repeat)
    assert one.group_model == "micro[expert_cache_fraction=0.25,emulated_h2d_gbps=0.03]"
    counts = plan_summary(spec)["counts"]
    assert counts["total"] == 12 and counts["report_rows_per_repeat"] == 2 * 6


def test_a_single_valued_spec_keeps_its_cell_ids_and_group_key():
    single = expand(parse_spec(base_spec(memory={"expert_cache_fraction": 0.25})))
    assert all(c.ablation == {} and len(c.identity) == 5 and c.group_model == "micro" for c in single)
    listed = expand(parse_spec(base_spec(memory={"expert_cache_fraction": [0.25]})))
    assert {c.cell_id for c in single}.isdisjoint({c.cell_id for c in listed})  # a list is an ablation


def test_each_link_rate_is_checked_as_an_engine_option():
    check(ablation_spec())
    bad = ablation_spec()
    bad.models[0].engine_options["emulated_h2d_gbps"] = [0.05, -1.0]
    with pytest.raises(InputError, match="emulated_h2d_gbps"):
        check(bad)
    dup = ablation_spec()
    dup.models[0].engine_options["emulated_h2d_gbps"] = [0.05, 0.05]
    with pytest.raises(InputError, match="without duplicates"):
        check(dup)
    with pytest.raises(InputError, match="duplicate"):
        ablation_spec(memory={"expert_cache_fraction": [0.25, 0.25]})


def test_the_report_groups_by_the_ablation_and_plots_ours_over_b1():
    rng = random.Random(3)
    rows = []
    for cell in expand(ablation_spec()):
        tps = 100.0 * (1 + cell.ablation["expert_cache_fraction"]) * (2.0 if cell.baseline == "OURS" else 1.0)
        rows.append(
            Row.from_result(cell, synth_result(cell, rng, output_tokens_per_second=tps, goodput_at_slo=tps))
        )
    matrix = build_matrix(rows)
    key = group_key("micro[expert_cache_fraction=0.5,emulated_h2d_gbps=0.1]", 8, 1)
    assert key in matrix.groups and len(matrix.groups) == 6
    assert matrix.rows[key]["OURS"]["ablation"] == {"expert_cache_fraction": 0.5, "emulated_h2d_gbps": 0.1}
    assert matrix.rows[key]["OURS"]["model"] == "micro"
    # Second way: every group's OURS / B1 is 2 by construction, at both cache fractions of every link rate.
    lines = ours_over_b1(matrix)[("micro", 8, 1)]
    assert sorted(lines) == LINKS
    for pts in lines.values():
        assert [f for f, _ in pts] == [0.25, 0.5] and all(r == pytest.approx(2.0) for _, r in pts)


@pytest.mark.parametrize(
    ("memory", "links", "named"),
    [
        ([0.25, 0.2500001], LINKS, "values 0.25 and 0.2500001 in expert_cache_fraction"),
        (
            [0.25, 0.5],
            [0.05, 0.0500000001],
            "values 0.05 and 0.0500000001 in models[micro].engine_options.emulated_h2d_gbps",
        ),
        ([0.25, 0.5], [1.0, 1.0], "duplicate value 1.0 in models[micro].engine_options.emulated_h2d_gbps"),
        ([0.125, 0.125], LINKS, "duplicate value 0.125 in expert_cache_fraction"),
    ],
)
def test_values_equal_at_the_reports_precision_are_refused_at_plan_naming_both(memory, links, named):
    """Two cells whose values print alike (``%g``) would share one report group and identity slot: the report
    would refuse their rows as duplicates after the sweep ran them both."""
    data = base_spec(
        baselines=["B1"], block_sizes=[8], concurrency=[1], memory={"expert_cache_fraction": memory}
    )
    data["models"] = [{**data["models"][0], "engine_options": {"emulated_h2d_gbps": links}}]
    with pytest.raises(InputError, match=r"equal at the report's precision|duplicate value") as info:
        parse_spec(data)
    assert named in str(info.value)


def test_values_that_differ_at_the_reports_precision_make_distinct_groups():
    spec = ablation_spec(memory={"expert_cache_fraction": [0.25, 0.250001]})
    keys = {c.group_model for c in expand(spec)}
    assert len(keys) == len({tuple(sorted(c.ablation.items())) for c in expand(spec)}) == 6
