"""`pd-dflash run` on the tiny real-layout targets (jobs/tiny_real.yaml, its axes reduced for suite time): the
checkpoints are generated into the engine cache, streamed through the real-checkpoint loader, and every cell of
both targets is measured OK on a local Ray cluster; the report is written. Plus: the shipped spec and
jobs/phase_a_reference.yaml plan without any weights present."""

from __future__ import annotations

import importlib.util
import json

import pytest
import yaml

from pd_dflash.schema import Status
from pd_dflash.spec import expand, parse_spec
from tests.conftest import REPO
from tests.sweep.helpers import run_cli, stored_rows, write_spec

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="the reference engine needs torch"
)


def shipped(name: str) -> dict:
    return yaml.safe_load((REPO / "jobs" / name).read_text())


@pytest.mark.ray
def test_tiny_real_spec_runs_every_cell_of_both_targets(tmp_path):
    data = shipped("tiny_real.yaml")
    # The shipped spec's models, options, workload kind and memory; fewer axes and requests (suite time).
    data.update(block_sizes=[8], concurrency=[2], repeats=1)
    data["workload"].update(requests=4, max_new_tokens=8)
    data["local"] = {"fake_gpus": 1, "object_store_mb": 100}
    path = write_spec(tmp_path / "spec.yaml", data)
    out = tmp_path / "out"
    proc = run_cli("run", str(path), "--out", str(out), "--no-progress", timeout=900)
    rows = stored_rows(out)
    spec = parse_spec(data)
    assert sorted(r.cell_id for r in rows) == sorted(c.cell_id for c in expand(spec)), (
        proc.stdout + proc.stderr
    )
    for row in rows:
        assert row.status == Status.OK, (row.model, row.baseline, row.concurrency, row.reason, row.warnings)
    assert {r.model for r in rows} == {"tiny-real-qwen3-moe", "tiny-real-gpt-oss"}
    storage = {r.model: r.engine["storage_dtype"] for r in rows}
    assert storage == {"tiny-real-qwen3-moe": "bf16", "tiny-real-gpt-oss": "mxfp4"}
    for model in storage:  # lossless: every configuration of one (model, c) generates the same tokens
        digests = {r.engine["output_digest"] for r in rows if r.model == model}
        assert len(digests) == 1, (model, digests)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    matrix = json.loads((out / "result_matrix.json").read_text())
    assert "tiny-real-gpt-oss|B8|c2" in matrix and (out / "result_matrix.md").exists()


@pytest.mark.parametrize("name", ["phase_a_reference.yaml", "tiny_real.yaml"])
def test_shipped_real_target_specs_plan_without_weights(tmp_path, name):
    env = {"HF_HOME": str(tmp_path / "empty-hf-home"), "PD_DFLASH_CACHE": str(tmp_path / "empty-cache")}
    proc = run_cli("plan", str(REPO / "jobs" / name), "--json", env=env, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    planned = json.loads(proc.stdout)
    # 2 models x (B1, B2, B3, OURS x 2 block sizes + B0) x 6 c x 3 repeats: B3 per block size (issue 11); Phase A's
    # repeats are adaptive, 3-6, and expand to 6 (docs/metrics.md §7f)
    per_3 = 2 * (4 * 2 + 1) * 6 * 3
    assert (
        planned["counts"]["total"]
        == (2 * per_3 if name == "phase_a_reference.yaml" else per_3)
        == (648 if name == "phase_a_reference.yaml" else 324)
    )
    assert planned["counts"]["blocked"] == 0
    models = {c["model"] for c in planned["cells"]}
    assert len(models) == 2
