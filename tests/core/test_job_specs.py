"""Every spec under jobs/ plans as `pd-dflash plan` loads it (``registry.load_checked_spec``), so a spec that a
schema or configuration change breaks fails here, not when someone runs it. The CPU benchmark specs (sweeps that
replaced benchmark scripts, recorded in docs/reference-engine.md) also stay small enough to rerun on a laptop."""

from __future__ import annotations

from pathlib import Path

import pytest

from pd_dflash.engine.registry import load_checked_spec
from pd_dflash.spec import expand

JOBS = Path(__file__).resolve().parents[2] / "jobs"
#: Specs whose figures docs/reference-engine.md records next to their command; each runs in minutes on 2 cores.
CPU_BENCHMARKS = {"engine_ar.yaml": 8, "engine_spec.yaml": 36, "ablation_cache_link.yaml": 72}


@pytest.mark.parametrize("path", sorted(JOBS.glob("*.yaml")), ids=lambda p: p.name)
def test_every_job_spec_plans(path):
    cells = expand(load_checked_spec(path))
    assert cells and len({c.cell_id for c in cells}) == len(cells)


@pytest.mark.parametrize(("name", "cells"), sorted(CPU_BENCHMARKS.items()))
def test_the_cpu_benchmark_specs_stay_small_and_on_the_cpu(name, cells):
    spec = load_checked_spec(JOBS / name)
    assert spec.hardware.device == "cpu"
    assert len(expand(spec)) == cells
