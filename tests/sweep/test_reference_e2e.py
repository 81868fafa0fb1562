"""Local mode end to end with the reference engine (micro preset, trained once and cached): `pd-dflash run`
starts its own single-node Ray cluster, a runner trains/loads the model and measures every cell — Phase A's five
configurations and the two ablation configurations of ``pd_dflash/baselines.py`` (RA: route-ahead without the
2-D scheduler; AR2D: the AR prefetcher with the 2-D scheduler), which the report places in their groups and no
Phase-A gate reads. One sweep serves both tests (one cluster start, one model load)."""

from __future__ import annotations

import importlib.util
import json

import pytest

from pd_dflash.schema import MEASURED_STATUSES, Status, parse_row
from pd_dflash.spec import expand, parse_spec
from pd_dflash.upstream import REQUIRED_METRICS
from tests.row_checks import assert_matrix_matches_rows, assert_row_consistent
from tests.sweep.helpers import run_cli, stored_rows, write_spec

pytestmark = [
    pytest.mark.ray,
    pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="the reference engine needs torch"),
]

SPEC = {
    "name": "reference-micro",
    "engine": "reference",
    "models": [
        {
            "id": "micro",
            "preset": "micro",
            "draft": "micro-dflash",
            "engine_options": {"emulated_h2d_gbps": 1.0},
        }
    ],
    "baselines": ["B0", "B1", "B2", "B3", "OURS", "RA", "AR2D"],
    "block_sizes": [4],
    "concurrency": [1, 2],
    "repeats": 1,
    "workload": {"requests": 2, "warmup_rounds": 1, "prompt_tokens": 8, "max_new_tokens": 8},
    "memory": {"expert_cache_fraction": 0.25},
    "hardware": {"accelerator_type": "RTX-PRO-6000", "cpus_per_runner": 1, "device": "cpu"},
    "local": {"fake_gpus": 1, "object_store_mb": 100},
}


ALL = ["AR2D", "B0", "B1", "B2", "B3", "OURS", "RA"]


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    """(the finished `pd-dflash run`, its results directory), run once for this module."""
    tmp = tmp_path_factory.mktemp("reference-e2e")
    path = write_spec(tmp / "spec.yaml", SPEC)
    out = tmp / "out"
    return run_cli("run", str(path), "--out", str(out), "--no-progress", timeout=600), out


def test_local_run_with_the_reference_engine_gives_a_complete_matrix_of_valid_rows(sweep):
    proc, out = sweep
    spec = parse_spec(SPEC)
    rows = stored_rows(out)
    assert sorted(r.cell_id for r in rows) == sorted(c.cell_id for c in expand(spec)), (
        proc.stdout + proc.stderr
    )
    for i, row in enumerate(rows):
        parse_row(row.to_json_dict(), where=f"row {i}")
        # Every configuration is measured (B0..B3 and OURS), with its runner and environment recorded.
        assert row.status in MEASURED_STATUSES, (row.baseline, row.status, row.reason)
        assert row.engine["name"] == "reference" and row.runner["device"] == "cpu"
        assert row.environment["packages"]["torch"]
        present = [m for m in REQUIRED_METRICS if getattr(row, m) is not None]
        assert row.status == Status.PARTIAL or present == list(REQUIRED_METRICS)
        # Each metric agrees with the row's own raw terms (tokens / seconds, histogram mean, counters...).
        assert_row_consistent(row, spec)
        assert row.generated_tokens == spec.workload.requests * row.max_new_tokens
        if row.baseline == "B0":  # the one autoregressive configuration
            assert row.acceptance_length_a == 1.0 and row.t_router_seconds is None
        if row.baseline == "B3":  # resident: its prefetcher only observes, so no prediction counts
            assert row.route_ahead is None and "prediction" not in row.engine
            assert row.route_ahead_prefetch_coverage is not None and row.wasted_prefetch_bytes == 0.0
        if row.baseline == "OURS":
            assert row.route_ahead["actual_experts"] > 0 and row.route_ahead["predicted_experts"] > 0
            assert row.wasted_prefetch_bytes == row.route_ahead["wasted_prefetch_bytes"]
    assert sorted({r.baseline for r in rows}) == ALL
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Every matrix value is the value of the row placed in its group (one repeat: the row's own number).
    matrix = assert_matrix_matches_rows(out, rows)
    assert sorted(matrix) == ["micro|B4|c1", "micro|B4|c2"]
    assert all(sorted(group) == ALL for group in matrix.values())
    verdict = json.loads((out / "verdict.json").read_text())
    assert verdict["complete"] is True and verdict["overall"]["verdict"] in ("GO", "NO-GO", "INCONCLUSIVE")
    assert verdict["overall"]["line"] in (out / "result_matrix.md").read_text()


def test_ablation_configurations_run_and_report_beside_phase_a(sweep):
    proc, out = sweep
    rows = {r.baseline: r for r in stored_rows(out) if r.concurrency == 2}
    assert sorted(rows) == ALL, proc.stdout + proc.stderr
    assert all(r.status == Status.OK for r in rows.values()), {b: r.reason for b, r in rows.items()}
    ra, ar2d = rows["RA"], rows["AR2D"]
    assert ra.engine["prefetcher"] == "route_ahead" and ra.engine["scheduler"]["kind"] == "none"
    assert ra.route_ahead["predicted_experts"] > 0
    assert ar2d.engine["prefetcher"] == "activation_aware"
    assert ar2d.engine["scheduler"]["kind"] == "two_dim_deficit"
    assert ar2d.engine["scheduler"]["dimensions"] == ["tokens", "expert_bytes"]
    assert len({r.engine["output_digest"] for r in rows.values()}) == 1  # lossless: the same tokens
    verdict = json.loads((out / "verdict.json").read_text())
    speedup = verdict["groups"]["micro|B4|c2"]["gates"]["speedup_over_b0"]
    assert set(speedup.get("per_baseline", {})) <= {"B1", "B2", "B3", "OURS"}  # no gate reads RA or AR2D
