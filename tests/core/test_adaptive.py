"""Adaptive repeats: the spec form, the plan, and the report's per-group looks (docs/metrics.md §7f)."""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import yaml

from pd_dflash.errors import InputError
from pd_dflash.plan import plan, render_plan
from pd_dflash.report.build import build_report
from pd_dflash.schema import Row, Status
from pd_dflash.spec import cell_count, expand, parse_spec
from pd_dflash.stopping import DECIDED, MAX_REACHED
from tests.core.helpers import base_spec, jittered

ADAPTIVE = {"min": 2, "max": 4}


def adaptive_spec(**over):
    data = base_spec(baselines=["B0", "B1", "B3", "OURS"], repeats=dict(ADAPTIVE))
    data.update(over)
    return parse_spec(data)


@pytest.mark.parametrize(
    "repeats, message",
    [
        ({"min": 1, "max": 4}, "repeats.adaptive.min: Input should be greater than or equal to 2"),
        ({"min": 3, "max": 2}, "repeats.adaptive: min (3) must not exceed max (2)"),
        ({"min": 2, "max": 33}, "repeats.adaptive.max: Input should be less than or equal to 32"),
        ({"min": 2, "max": 4, "step": 1}, "repeats.adaptive.step: Extra inputs are not permitted"),
        ({"min": 2, "max": 4, "until": "forever"}, "repeats.adaptive.until: Input should be 'decided'"),
        ({"min": 2}, "repeats.adaptive.max: Field required"),
        ({"min": 2.0, "max": 4}, "repeats.adaptive.min: Input should be a valid integer"),
        (True, "repeats.fixed: Input should be a valid integer"),
        (0, "repeats.fixed: Input should be greater than or equal to 1"),
    ],
)
def test_bad_repeats_are_refused_naming_the_field(repeats, message):
    with pytest.raises(InputError) as err:
        parse_spec(base_spec(repeats=repeats))
    assert message in str(err.value)


def test_the_cli_refuses_a_bad_adaptive_form_with_exit_2(tmp_path):
    path = tmp_path / "spec.yaml"
    path.write_text(yaml.safe_dump(base_spec(repeats={"min": 2, "max": 4, "unti": "decided"})))
    out = subprocess.run(
        [sys.executable, "-m", "pd_dflash", "plan", str(path)], capture_output=True, text=True
    )
    assert out.returncode == 2 and "repeats.adaptive.unti" in out.stderr


def test_an_adaptive_spec_expands_every_repeat_to_max_with_the_ids_a_fixed_max_has():
    s = adaptive_spec()
    fixed = parse_spec({**base_spec(baselines=["B0", "B1", "B3", "OURS"]), "repeats": 4})
    assert s.adaptive and (s.min_repeats, s.max_repeats) == (2, 4) and fixed.adaptive is None
    assert [c.cell_id for c in expand(s)] == [c.cell_id for c in expand(fixed)]
    assert len(expand(s)) == cell_count(s) == 2 * cell_count(s, 2)
    assert s.fingerprint() != adaptive_spec(repeats={"min": 2, "max": 5}).fingerprint()  # bounds are the spec


def test_max_cells_bounds_the_max():
    cells_at_max = cell_count(adaptive_spec())
    adaptive_spec(max_cells=cells_at_max)
    with pytest.raises(InputError, match=f"expands to {cells_at_max} cells at its max of 4 repeats"):
        adaptive_spec(max_cells=cells_at_max - 1)


def test_plan_shows_the_bounds_and_the_cells_at_min_and_at_max():
    s = adaptive_spec()
    planned = plan(s)
    a = planned["counts"]["adaptive_repeats"]
    effects = a["decidable_effect_sd"]
    assert {k: v for k, v in a.items() if k != "decidable_effect_sd"} == {
        "min": 2,
        "max": 4,
        "until": "decided",
        "cells_at_min": 28,
        "cells_at_max": 56,
    }
    # t(k - 1, 1 - 0.05/3) / sqrt(k): t(1, 0.98333) = tan(pi/2 * 0.98333) = 38.19 (df = 1 is Cauchy)
    assert effects[2] == pytest.approx(math.tan(math.pi / 2 * (1 - 0.05 / 3)) / math.sqrt(2), rel=1e-9)
    assert effects[2] > effects[3] > effects[4]
    text = render_plan(s, planned)
    assert "x 2-4 repeats (adaptive)" in text
    assert "adaptive repeats: min 2, max 4, until decided: 28 cells at min, 56 at max" in text
    assert "from its threshold (Bonferroni over the looks): 2: 27, 3: 4.42, 4: 2.43" in text
    assert "adaptive_repeats" not in plan(parse_spec(base_spec()))["counts"]


# -- the report ------------------------------------------------------------------------------------------------
def rows_until(spec, repeats_of, coverage):
    """Rows of every cell a group's first ``repeats_of[c]`` repeats need (B0 once, at the most its groups need);
    OURS coverage at repeat r is ``coverage[c][r]``."""
    rows = []
    for cell in expand(spec):
        if cell.repeat >= repeats_of[cell.concurrency]:
            continue
        over = {}
        if cell.baseline == "OURS":
            over["route_ahead_prefetch_coverage"] = coverage[cell.concurrency][cell.repeat]
        rows.append(Row.from_result(cell, jittered(cell.baseline, cell.repeat, **over)))
    return rows


CLEAR = [0.95, 0.96, 0.94, 0.95]  # decided at the look after 3 repeats (df = 1 is too wide at 2)
AT_THRESHOLD = [0.7, 0.9, 0.75, 0.85]  # never decided


def test_the_report_names_each_groups_repeats_looks_and_why_it_stopped():
    s = adaptive_spec(block_sizes=[8], concurrency=[1, 4])
    rows = rows_until(s, {1: 4, 4: 4}, {1: CLEAR, 4: AT_THRESHOLD})
    verdict, files = build_report(rows, s.gates, spec=s)
    clear, open_ = verdict["groups"]["micro|B8|c1"], verdict["groups"]["micro|B8|c4"]
    assert clear["adaptive"]["stop"] == DECIDED and clear["adaptive"]["repeats"] < 4
    assert "INCONCLUSIVE" not in {g["status"] for g in clear["confidence"].values()}
    assert open_["adaptive"]["stop"] == MAX_REACHED and open_["adaptive"]["repeats"] == 4
    assert open_["confidence"]["coverage"]["status"] == "INCONCLUSIVE"
    looks = open_["adaptive"]["looks"]
    assert [look["repeats"] for look in looks] == [2, 3, 4]
    assert all(look["gates"]["coverage"] == "INCONCLUSIVE" for look in looks)
    a = verdict["adaptive"]
    assert (
        a["groups_stopped"] == {"decided": 1, "max reached": 1, "cell failures": 0} and not a["groups_open"]
    )
    assert (a["cells_at_fixed_max"], a["cells_at_min"]) == (32, 16)
    assert a["cells_run"] == len(rows) == 32  # rows of repeats the decided group never asked for count too
    assert (
        "adaptive, " in verdict["overall"]["line"] and "Bonferroni over 3 looks" in verdict["overall"]["line"]
    )
    md = files["result_matrix.md"]
    assert "## Adaptive repeats" in md and "| micro\\|B8\\|c4 | 4 | max reached |" in md
    assert "95% intervals" not in md
    assert json.loads(files["verdict.json"])["adaptive"]["rule"].startswith("Bonferroni")


def test_a_group_that_stopped_early_is_judged_on_its_own_repeats_only():
    """Rows of repeats beyond a decided group's last look (here all four) do not change its decision."""
    s = adaptive_spec(block_sizes=[8], concurrency=[1])
    fewer, _ = build_report(rows_until(s, {1: 3}, {1: CLEAR}), s.gates, spec=s)
    more, _ = build_report(rows_until(s, {1: 4}, {1: [*CLEAR[:3], 0.5]}), s.gates, spec=s)
    assert fewer["groups"]["micro|B8|c1"]["adaptive"] == more["groups"]["micro|B8|c1"]["adaptive"]


def test_a_failed_cell_stops_its_group_and_a_group_without_its_min_repeats_is_not_stopped():
    s = adaptive_spec(block_sizes=[8], concurrency=[1, 4])
    rows = rows_until(s, {1: 2, 4: 1}, {1: AT_THRESHOLD, 4: AT_THRESHOLD})
    rows = [
        Row.without_metrics(expand(s)[0].model_copy(), Status.ERROR, "boom")
        if r.identity == expand(s)[0].identity
        else r
        for r in rows
    ]
    verdict, _ = build_report(rows, s.gates, spec=s)
    failed = verdict["groups"]["micro|B8|c1"]["adaptive"]
    assert failed["stop"] == "cell failures" and failed["looks"][0]["incomplete"]
    waiting = verdict["groups"]["micro|B8|c4"]
    assert waiting["adaptive"] == {"repeats": 0, "stop": None, "looks": []}
    assert waiting["confidence"]["coverage"] == {
        "status": "INCONCLUSIVE",
        "summary": "no look yet: the group's first 2 repeats have not all landed",
    }
    assert verdict["adaptive"]["groups_open"] == 1  # the driver's exit code says a sweep is not finished
