"""A row crosses Ray once, validated once: where the runner builds it from what the engine returned (the one
boundary that receives untrusted data). These cells come from an engine that returns what the row contract or
JSON cannot carry, and one that echoes a secret inside a tuple: each cell still ends as exactly one stored row,
a clear ERROR row for the malformed ones, and the secret never reaches the results directory."""

from __future__ import annotations

import os

import pytest

from pd_dflash.engine.interface import Engine
from pd_dflash.engine.registry import EngineTraits
from pd_dflash.schema import EngineResult, Status
from pd_dflash.spec import Cell
from tests.sweep.engines import synthetic_result
from tests.sweep.helpers import run_cli, spec_data, stored_rows, write_spec

pytestmark = pytest.mark.ray

SECRET_ENV = "PD_DFLASH_TEST_SECRET"
SECRET = "s3cr3t-value-0123456789"


class MalformedEngine(Engine):
    """B0: a valid result whose facts hold the secret inside a tuple; B1: a hit rate above 1 (built without
    validation, as a careless engine might); OURS: facts JSON cannot carry."""

    traits = EngineTraits(entry_point="tests.sweep.test_row_crossing:MalformedEngine")

    def run_cell(self, cell: Cell) -> EngineResult:
        result = synthetic_result(cell, self.ctx.workload.requests, 0.05)
        if cell.baseline == "B0":
            facts = {**result.engine, "seen": ("env", os.environ.get(SECRET_ENV, ""))}
            return result.model_copy(update={"engine": facts})
        if cell.baseline == "B1":
            return EngineResult.model_construct(**{**dict(result), "expert_cache_hit_rate": 1.5})
        return result.model_copy(update={"engine": {**result.engine, "handle": object()}})


def test_malformed_results_become_one_error_row_each_and_secrets_stay_out(tmp_path, ray_tmp):
    data = spec_data(
        engine="tests.sweep.test_row_crossing:MalformedEngine",
        models=[{"id": "m1"}],
        concurrency=[1],
        env={SECRET_ENV: SECRET},
    )
    out = tmp_path / "out"
    proc = run_cli(
        "run",
        str(write_spec(tmp_path / "spec.yaml", data)),
        "--out",
        str(out),
        "--no-progress",
        env={"RAY_TMPDIR": ray_tmp},
    )
    assert proc.returncode == 1, proc.stderr  # two cells failed
    rows = stored_rows(out)
    assert sorted(r.baseline for r in rows) == ["B0", "B1", "OURS"]  # one row per cell, none lost or doubled
    by = {r.baseline: r for r in rows}
    assert by["B0"].status == Status.OK and by["B0"].engine["seen"] == ["env", f"<env {SECRET_ENV}>"]
    assert by["B1"].status == Status.ERROR and "expert_cache_hit_rate" in by["B1"].reason
    assert by["OURS"].status == Status.ERROR and "serializ" in by["OURS"].reason.lower()
    assert "rejected" not in proc.stderr  # the collector took every row it was sent
    for path in out.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path
