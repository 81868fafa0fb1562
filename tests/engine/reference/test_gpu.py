"""CUDA path: real copy streams, pinned host store, GPU-measured stalls. Skipped cleanly without CUDA."""

from __future__ import annotations

import pytest
import torch

from pd_dflash.engine.interface import EngineContext
from pd_dflash.engine.registry import engine_class
from pd_dflash.schema import Row, Status
from pd_dflash.spec import expand
from tests.engine.reference.test_engine import make_spec

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


def test_cuda_offloaded_equals_resident_and_measures_real_transfers(micro):
    spec = make_spec(concurrency=[1, 4])
    ctx = EngineContext.for_model(spec, device="cuda:0")
    engine = engine_class("reference")(ctx)
    assert engine.store.parts[engine.store.layer_ids[0]][0].is_pinned()
    rows = {(c.baseline, c.concurrency): Row.from_result(c, engine.run_cell(c)) for c in expand(spec)}
    for c in (1, 4):
        b0, b3 = rows[("B0", c)], rows[("B3", c)]
        assert b0.status == b3.status == Status.OK
        assert b0.engine["output_digest"] == b3.engine["output_digest"]
        assert b0.cost_terms.h2d_link == "real" and b0.cost_terms.h2d_bandwidth_source == "probe"
        assert b0.cost_terms.h2d_bytes > 0 and b0.cost_terms.h2d_seconds > 0
        assert b0.hide_inequality is not None and b3.hide_inequality is not None
    engine.close()


def test_cuda_emulation_is_rejected():
    spec = make_spec(options={"emulated_h2d_gbps": 1.0})
    ctx = EngineContext.for_model(spec, device="cuda:0")
    from pd_dflash.errors import InputError

    with pytest.raises(InputError, match="emulation"):
        engine_class("reference")(ctx)
