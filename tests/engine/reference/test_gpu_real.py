"""CUDA: the tiny real-layout targets with a pinned host store, MXFP4 moved as stored and dequantised on the
device, a small expert cache's tokens equal to a near-full one's. Skipped cleanly without CUDA."""

from __future__ import annotations

import pytest
import torch

from pd_dflash.engine.interface import EngineContext
from pd_dflash.engine.registry import engine_class
from pd_dflash.schema import Row, Status
from pd_dflash.spec import expand
from tests.engine.reference.helpers import make_spec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("name", ["tiny-real-qwen3-moe", "tiny-real-gpt-oss"])
def test_tiny_real_target_on_cuda(name):
    """B3 needs the target's drafter (``draft``); B0 with a 25 % cache and with a 90 % one: the same decoding at the
    same shapes, so the same tokens (B0 against B3 differ in row counts: never compared token for token)."""
    model = {"id": name, "draft": "tiny-real-dflash"}
    spec = make_spec(model=model, hardware={"device": "cuda", "cpus_per_runner": 1})
    engine = engine_class("reference")(EngineContext.for_model(spec, device="cuda:0"))
    store = engine.store
    layer_bytes = store.parts[store.layer_ids[0]][0]
    assert layer_bytes.is_pinned() and layer_bytes.dtype == torch.uint8
    assert all(p.device.type == "cuda" for p in engine.target.model.parameters())
    if name == "tiny-real-gpt-oss":  # one expert's stored bytes moved to the device and dequantised there
        assert store.storage == "mxfp4"
        weights = store.dequantize([layer_bytes[0].to("cuda:0")], engine.compute_dtype)
        assert all(w.device.type == "cuda" for w in weights)
    rows = {(c.baseline, c.concurrency): Row.from_result(c, engine.run_cell(c)) for c in expand(spec)}
    engine.close()
    near = make_spec(
        baselines=("B0",),
        model=model,
        memory={"expert_cache_fraction": 0.9},
        hardware={"device": "cuda", "cpus_per_runner": 1},
    )
    engine = engine_class("reference")(EngineContext.for_model(near, device="cuda:0"))
    cached = {c.concurrency: Row.from_result(c, engine.run_cell(c)) for c in expand(near)}
    for c in (1, 4):
        b0, b3 = rows[("B0", c)], rows[("B3", c)]
        assert b0.status == b3.status == cached[c].status == Status.OK, (b0.reason, b3.reason)
        assert b0.engine["output_digest"] == cached[c].engine["output_digest"]
        assert b0.cost_terms.h2d_link == "real" and b0.cost_terms.h2d_bytes % store.expert_nbytes == 0
    engine.close()
