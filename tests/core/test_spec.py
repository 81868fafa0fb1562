"""Sweep spec: strict validation (errors name the field), expansion, stable cell ids, plan."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pd_dflash.engine.registry import check
from pd_dflash.errors import InputError
from pd_dflash.plan import plan
from pd_dflash.spec import expand, load_spec, parse_spec
from tests.core.helpers import base_spec

REPO = Path(__file__).resolve().parents[2]


def test_phase_a_plan_counts():
    spec = load_spec(REPO / "jobs" / "phase_a.yaml")
    planned = plan(spec)
    # 2 models x (B1, B2, B3, OURS x 2 block sizes + B0) x 6 concurrency x 3-6 adaptive repeats (expanded to 6):
    # B3 is speculative with every expert resident, measured per block size (as upstream ran it)
    assert len(planned["cells"]) == 2 * (4 * 2 + 1) * 6 * 6 == 648
    assert planned["counts"]["adaptive_repeats"]["cells_at_min"] == 2 * (4 * 2 + 1) * 6 * 3 == 324
    assert planned["counts"]["saved_by_block_dedup"] == 2 * 1 * 1 * 6 * 6
    assert planned["counts"]["report_rows_per_repeat"] == 2 * 5 * 2 * 6
    per = planned["counts"]["per_model_baseline"]["openai/gpt-oss-20b"]
    assert per == {"B0": 36, "B1": 72, "B2": 72, "B3": 72, "OURS": 72}


def test_plan_cli_json_has_cells_and_counts():
    out = subprocess.run(
        [sys.executable, "-m", "pd_dflash", "plan", str(REPO / "jobs" / "phase_a.yaml"), "--json"],
        capture_output=True,
        text=True,
        check=True,
    )
    data = json.loads(out.stdout)
    assert set(data) >= {"cells", "counts"}
    assert data["counts"]["total"] == 648 and data["counts"]["adaptive_repeats"]["cells_at_min"] == 324


def test_expansion_is_deterministic_and_ids_are_unique():
    spec = parse_spec(base_spec())
    a, b = expand(spec), expand(parse_spec(base_spec()))
    assert [c.cell_id for c in a] == [c.cell_id for c in b]
    assert len({c.cell_id for c in a}) == len(a)
    assert len({c.identity for c in a}) == len(a)


def test_block_independent_baselines_are_measured_once():
    cells = expand(parse_spec(base_spec()))
    b0 = [c for c in cells if c.baseline == "B0"]
    assert len(b0) == 2 * 2  # concurrency x repeats, not x block sizes
    assert all(c.block_size == 8 and c.block_sizes_covered == (8, 16) for c in b0)
    # auto max_new_tokens follows the largest block the row stands for
    assert all(c.max_new_tokens == 64 for c in b0)
    b1 = [c for c in cells if c.baseline == "B1"]
    assert {(c.block_size, c.max_new_tokens) for c in b1} == {(8, 32), (16, 64)}
    assert all(c.draft == "" for c in b0) and all(c.draft == "micro-dflash" for c in b1)


def test_cell_id_changes_with_measurement_fields_only():
    ids = {c.identity: c.cell_id for c in expand(parse_spec(base_spec()))}
    same = {
        c.identity: c.cell_id
        for c in expand(parse_spec(base_spec(name="other", gates={"min_coverage": 0.1})))
    }
    assert ids == same
    seeded = {c.identity: c.cell_id for c in expand(parse_spec(base_spec(workload={"seed": 7})))}
    assert not set(ids.values()) & set(seeded.values())


def test_fingerprint_ignores_gates_and_name_but_not_axes():
    fp = parse_spec(base_spec()).fingerprint()
    assert parse_spec(base_spec(name="x", gates={"max_waste_ratio": 0.1})).fingerprint() == fp
    assert parse_spec(base_spec(concurrency=[1])).fingerprint() != fp


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"baselines": []}, "baselines"),
        ({"baselines": ["B0", "B0"]}, "baselines"),
        ({"baselines": ["B7"]}, "baselines.0"),
        ({"block_sizes": [1]}, "block_sizes.0"),
        ({"block_sizes": [8, 8]}, "block_sizes"),
        ({"concurrency": [0]}, "concurrency.0"),
        ({"concurrency": []}, "concurrency"),
        ({"repeats": 0}, "repeats"),
        ({"models": []}, "models"),
        ({"memory": {"device_memory_ratio": 0.9}}, "memory.device_memory_ratio"),
        ({"memory": {"device_memory_ratio": 0.95}}, "memory.device_memory_ratio"),
        ({"surprise": 1}, "surprise"),
        ({"workload": {"requests": 0}}, "workload.requests"),
        ({"workload": {"max_new_tokens": "lots"}}, "workload.max_new_tokens"),
        ({"engine": "tensorrt"}, "engine"),
        (
            {"models": [{"id": "m", "engine_options": {"warp_drive": True}}]},
            "models.0.engine_options.warp_drive",
        ),
        ({"models": [{"id": "m"}, {"id": "m"}]}, "models"),
    ],
)
def test_bad_spec_names_the_field(over, field):
    with pytest.raises(InputError) as err:
        check(parse_spec(base_spec(**over)))
    assert field in str(err.value)


def test_bad_spec_cli_exits_2_and_writes_nothing(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(base_spec(block_sizes=[1, 8])))
    out = subprocess.run(
        [sys.executable, "-m", "pd_dflash", "plan", str(bad)], capture_output=True, text=True
    )
    assert out.returncode == 2
    assert "block_sizes.0" in out.stderr and str(bad) in out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.yaml"]


def test_yaml_is_loaded_safely(tmp_path):
    evil = tmp_path / "evil.yaml"
    evil.write_text("!!python/object/apply:os.system ['echo pwned']\n")
    with pytest.raises(InputError, match=str(evil)):
        load_spec(evil)


def test_unreadable_and_malformed_specs(tmp_path):
    with pytest.raises(InputError, match="cannot read spec"):
        load_spec(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("name: [unclosed\n")
    with pytest.raises(InputError, match="invalid YAML"):
        load_spec(broken)
    listy = tmp_path / "list.yaml"
    listy.write_text("- 1\n")
    with pytest.raises(InputError, match="mapping"):
        load_spec(listy)
