"""Local mode end to end with the reference engine (micro preset, trained once and cached): `pd-dflash run`
starts its own single-node Ray cluster, a runner trains/loads the model and measures every cell."""

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
    "baselines": ["B0", "B1", "B2", "B3", "OURS"],
    "block_sizes": [4],
    "concurrency": [1, 2],
    "repeats": 1,
    "workload": {"requests": 2, "warmup_rounds": 1, "prompt_tokens": 8, "max_new_tokens": 8},
    "memory": {"expert_cache_fraction": 0.25},
    "hardware": {"accelerator_type": "RTX-PRO-6000", "cpus_per_runner": 1, "device": "cpu"},
    "local": {"fake_gpus": 1, "object_store_mb": 100},
}


def test_local_run_with_the_reference_engine_gives_a_complete_matrix_of_valid_rows(tmp_path):
    path = write_spec(tmp_path / "spec.yaml", SPEC)
    out = tmp_path / "out"
    proc = run_cli("run", str(path), "--out", str(out), "--no-progress", timeout=600)
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
    assert {r.baseline for r in rows} == {"B0", "B1", "B2", "B3", "OURS"}
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Every matrix value is the value of the row placed in its group (one repeat: the row's own number).
    matrix = assert_matrix_matches_rows(out, rows)
    assert sorted(matrix) == ["micro|B4|c1", "micro|B4|c2"]
    assert all(sorted(group) == ["B0", "B1", "B2", "B3", "OURS"] for group in matrix.values())
    verdict = json.loads((out / "verdict.json").read_text())
    assert verdict["complete"] is True and verdict["overall"]["verdict"] in ("GO", "NO-GO", "INCONCLUSIVE")
    assert verdict["overall"]["line"] in (out / "result_matrix.md").read_text()
