"""The two ablation configurations of ``pd_dflash/baselines.py`` end to end: `pd-dflash run` on a local Ray cluster
measures RA (route-ahead without the 2-D scheduler) and AR2D (the AR prefetcher with the 2-D scheduler) beside
B1 and OURS, the report places them in their groups, and no Phase-A gate reads them."""

from __future__ import annotations

import importlib.util
import json

import pytest

from pd_dflash.schema import Status
from tests.sweep.helpers import run_cli, stored_rows, write_spec

pytestmark = [
    pytest.mark.ray,
    pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="the reference engine needs torch"),
]

SPEC = {
    "name": "ablation-configurations",
    "engine": "reference",
    "models": [{"id": "micro", "preset": "micro", "engine_options": {"emulated_h2d_gbps": 1.0}}],
    "baselines": ["B0", "B1", "OURS", "RA", "AR2D"],
    "block_sizes": [4],
    "concurrency": [2],
    "repeats": 1,
    "workload": {"requests": 2, "warmup_rounds": 1, "prompt_tokens": 8, "max_new_tokens": 8},
    "memory": {"expert_cache_fraction": 0.25},
    "hardware": {"accelerator_type": "RTX-PRO-6000", "cpus_per_runner": 1, "device": "cpu"},
    "local": {"fake_gpus": 1, "object_store_mb": 100},
}


def test_ablation_configurations_run_and_report_beside_phase_a(tmp_path):
    path = write_spec(tmp_path / "spec.yaml", SPEC)
    out = tmp_path / "out"
    proc = run_cli("run", str(path), "--out", str(out), "--no-progress", timeout=600)
    assert proc.returncode in (0, 1), proc.stdout + proc.stderr  # 1: a gate may fail on this noisy machine
    rows = {r.baseline: r for r in stored_rows(out)}
    assert sorted(rows) == sorted(SPEC["baselines"]), proc.stdout + proc.stderr
    assert all(r.status == Status.OK for r in rows.values()), {b: r.reason for b, r in rows.items()}
    ra, ar2d = rows["RA"], rows["AR2D"]
    assert ra.engine["prefetcher"] == "route_ahead" and ra.engine["scheduler"]["kind"] == "none"
    assert ra.route_ahead["predicted_experts"] > 0
    assert ar2d.engine["prefetcher"] == "activation_aware"
    assert ar2d.engine["scheduler"]["kind"] == "two_dim_deficit"
    assert ar2d.engine["scheduler"]["dimensions"] == ["tokens", "expert_bytes"]
    assert len({r.engine["output_digest"] for r in rows.values()}) == 1  # lossless: the same tokens
    matrix = json.loads((out / "result_matrix.json").read_text())
    assert sorted(matrix["micro|B4|c2"]) == ["AR2D", "B0", "B1", "OURS", "RA"]
    verdict = json.loads((out / "verdict.json").read_text())
    speedup = verdict["groups"]["micro|B4|c2"]["gates"]["speedup_over_b0"]
    assert set(speedup.get("per_baseline", {})) <= {"B1", "B2", "B3", "OURS"}
