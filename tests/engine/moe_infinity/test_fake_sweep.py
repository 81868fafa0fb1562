"""End to end: `pd-dflash run` with ``engine: moe_infinity`` on a local Ray cluster, against the fake package.

This proves the wiring (runner env before import, one model load per runner process, B3's own load, rows that
say the engine was a fake) on a spec of ``jobs/phase_a.yaml``'s shape, and the two things the real library would
otherwise hide: OURS coverage measured through the sessions' route recorders, and B3 at the ratio MoE-Infinity
applied. The numbers are checked for consistency (each metric against the row's raw terms, each matrix value
against its rows), not for their size.
"""

from __future__ import annotations

import json
import os

import pytest
import yaml

from pd_dflash.engine.moe_infinity.metrics import VACUOUS_COVERAGE
from pd_dflash.rows import read_rows
from pd_dflash.schema import Status
from pd_dflash.spec import expand, parse_spec
from tests.engine.moe_infinity.fakes import FAKE_ROOT, REPO, spec_data
from tests.row_checks import assert_matrix_matches_rows, assert_row_consistent
from tests.sweep.helpers import run_cli

pytestmark = [pytest.mark.slow, pytest.mark.ray]


def _phase_a_shaped(tmp_path, tokenizer_dir) -> dict:
    """jobs/phase_a.yaml's baselines, block sizes, memory ratios, gates and run-time environment, on the fake model."""
    phase_a = yaml.safe_load((REPO / "jobs" / "phase_a.yaml").read_text())
    data = spec_data(
        tmp_path,
        tokenizer_dir,
        workload={"requests": 4, "warmup_rounds": 1, "max_new_tokens": 16, "prompt_tokens": 10},
        concurrency=[1, 2],
        hardware={"device": "cpu", "accelerator_type": "RTX-PRO-6000", "cpus_per_runner": 0},
        local={"fake_gpus": 2, "num_cpus": 2, "object_store_mb": 100},
    )
    data.update({k: phase_a[k] for k in ("baselines", "block_sizes", "memory", "gates")})
    data["env"] = {**phase_a["env"], "HF_HOME": str(tmp_path / "hf"), "MOE_DISABLE_CUDA_GRAPHS": "1"}
    return data


def test_local_sweep_with_the_fake_gives_a_full_matrix(tmp_path, tokenizer_dir):
    data = _phase_a_shaped(tmp_path, tokenizer_dir)
    spec_path, out, records = tmp_path / "spec.yaml", tmp_path / "out", tmp_path / "records"
    spec_path.write_text(yaml.safe_dump(data, sort_keys=False))
    env = {
        "PYTHONPATH": os.pathsep.join(p for p in (str(FAKE_ROOT), os.environ.get("PYTHONPATH")) if p),
        "FAKE_MOE_INFINITY_RECORD_DIR": str(records),
    }
    proc = run_cli("run", str(spec_path), "--out", str(out), "--no-progress", env=env, timeout=540)
    assert proc.returncode in (0, 1), proc.stderr[-3000:]  # 1: the gates' verdict, not a failure to run

    spec = parse_spec(data)
    rows, torn = read_rows(out / "rows.jsonl")
    assert torn is None
    assert {r.cell_id for r in rows} == {c.cell_id for c in expand(spec)}
    assert len(rows) == len(expand(spec)) == 18  # B0 once per c; B1, B2, B3, OURS per block size
    for row in rows:
        assert_row_consistent(row, spec)  # every metric agrees with the row's own raw terms
        assert row.generated_tokens == 4 * 16  # ignore_eos: every request generates max_new_tokens
        assert row.engine["name"] == "moe_infinity" and row.engine["fake"] is True, row.engine
        assert row.engine["version"] == "0.0.0+fake"
        if row.baseline == "OURS":  # coverage from the sessions' route recorders, never vacuous
            assert row.status is Status.OK, row.warnings
            assert row.route_ahead["steps"] > 0 and row.route_ahead["actual_experts"] > 0
            assert VACUOUS_COVERAGE not in row.warnings
            assert row.route_ahead_prefetch_coverage == row.route_ahead["coverage"]
            assert row.wasted_prefetch_bytes == row.route_ahead["wasted_prefetch_bytes"]
            assert row.acceptance_length_a > 1.0
        else:  # MoE-Infinity does not expose what its AR prefetcher predicted: coverage absent, never 0.0
            assert row.status is Status.PARTIAL and row.missing_metrics() == ["route_ahead_prefetch_coverage"]
        assert row.engine["observed_max_in_flight"] == row.concurrency
        assert row.engine["load_group"] == ("resident" if row.baseline == "B3" else "shared")

    # One model load per runner process; B3 in its own process at the resident ratio, as MoE-Infinity applied it.
    loads = sorted(records.glob("load-*.json"))
    ratios = sorted(json.loads(p.read_text())["config"]["device_memory_ratio"] for p in loads)
    assert ratios == [0.85, 0.98]
    applied = {
        p.name.split("-")[1]: json.loads(p.read_text())["applied"]["device_memory_ratio"] for p in loads
    }
    for row in rows:
        assert row.engine["device_memory_ratio"] == applied[str(row.runner["pid"])]
        if row.baseline == "B3":
            assert row.engine["device_memory_ratio"] == data["memory"]["resident_memory_ratio"]
    pids = {p.name.split("-")[1] for p in loads}
    assert len(pids) == 2 and all(p.name.endswith("-1.json") for p in loads)
    assert {str(r.runner["pid"]) for r in rows} == pids
    # The spec's environment was in place when each runner process imported moe_infinity.
    imports = [json.loads(p.read_text()) for p in records.glob("import-*.json")]
    assert {str(i["pid"]) for i in imports} >= pids
    for record in imports:
        if str(record["pid"]) in pids:
            assert (
                record["environ"]["MOE_DISABLE_CUDA_GRAPHS"] == "1"
                and record["environ"]["HF_HUB_OFFLINE"] == "1"
            )

    matrix = assert_matrix_matches_rows(out, rows)  # every matrix value is its rows' mean
    assert sorted(matrix) == [f"fake/tiny-moe|B{b}|c{c}" for b in (16, 8) for c in (1, 2)]
    assert all(sorted(group) == ["B0", "B1", "B2", "B3", "OURS"] for group in matrix.values())
