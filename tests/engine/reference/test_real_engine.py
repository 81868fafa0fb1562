"""The reference engine on the tiny real-layout checkpoints (Qwen3-MoE hub layout in bf16; gpt-oss with MXFP4
experts as published), through the Engine interface, with tiny DFlash drafters in the published layout: all five
configurations generate the tokens transformers' own ``generate`` does (MXFP4 dequantised by transformers), and
rows count stored bytes."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from pd_dflash.engine.reference.models import make_prompts
from pd_dflash.schema import Row, Status
from pd_dflash.spec import expand
from tests.engine.reference.helpers import hf_model, make_engine, make_spec

TARGETS = ["tiny-real-qwen3-moe", "tiny-real-gpt-oss"]


def hf_digest(directory, prompts, max_new, eos):
    """transformers' greedy generate (eager experts), stopping at the engine's end-of-sequence token."""
    model = hf_model(directory)
    model.set_experts_implementation("eager")
    outputs = []
    for p in prompts:
        ids = model.generate(
            torch.tensor([p]),
            max_new_tokens=max_new,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos[0] if eos else None,
        )
        outputs.append(ids[0, len(p) :].tolist())
    return hashlib.sha256(json.dumps(outputs).encode()).hexdigest()[:16]


@pytest.fixture(scope="module", params=TARGETS)
def real_rows(request):
    spec = make_spec(
        baselines=("B0", "B1", "B2", "B3", "OURS"),
        model={
            "id": request.param,
            "draft": "tiny-real-dflash",
            "engine_options": {"emulated_h2d_gbps": 1.0},
        },
    )
    engine = make_engine(spec)
    rows = {(c.baseline, c.concurrency): Row.from_result(c, engine.run_cell(c)) for c in expand(spec)}
    yield request.param, spec, engine, rows
    engine.close()


def test_all_five_configurations_equal_transformers_generate(real_rows):
    _name, spec, engine, rows = real_rows
    for row in rows.values():
        assert row.status == Status.OK, (row.baseline, row.reason, row.warnings)
    digests = {row.engine["output_digest"] for row in rows.values()}
    assert (
        len(digests) == 1
    )  # B0, B1, B2, B3 and OURS at c = 1 and 4: greedy speculative decoding is lossless
    wl = spec.workload
    cell = next(c for c in expand(spec) if c.baseline == "B0")
    prompts = make_prompts(engine.loaded, wl.prompts, wl.requests, wl.prompt_tokens, seed=wl.seed)
    directory = engine.loaded.card["checkpoint"]
    assert digests == {
        hf_digest(directory, prompts, cell.max_new_tokens, sorted(engine.loaded.eos_token_ids) or None)
    }


def test_rows_report_the_stored_expert_bytes(real_rows):
    name, _spec, engine, rows = real_rows
    facts = engine.describe()
    mxfp4 = name == "tiny-real-gpt-oss"
    assert facts["model_source"] == "checkpoint" and facts["storage_dtype"] == ("mxfp4" if mxfp4 else "bf16")
    assert facts["dtype"] == "bfloat16"
    # Stored bytes: tiny gpt-oss (H 64, I 64): blocks + scales of gate_up and down, bf16 biases.
    h = i = 64
    expected = (
        (2 * i * h + h * i) // 2 + (2 * i * h + h * i) // 32 + (2 * i + h) * 2 if mxfp4 else 3 * 64 * 32 * 2
    )
    assert facts["expert_nbytes"] == expected
    b0 = rows[("B0", 1)]
    assert b0.cost_terms.h2d_bytes > 0 and b0.cost_terms.h2d_bytes % expected == 0
    assert b0.engine["model_card"]["load_bytes"] == b0.engine["model_card"]["checkpoint_bytes"]


def test_a_checkpoint_whose_store_does_not_fit_refuses_every_cell_before_reading(tmp_path):
    """The streaming loader checks host memory before it allocates or reads anything: every cell is refused
    with the figures (the model stays the meta skeleton)."""
    from pd_dflash.engine.interface import EngineContext, Refused
    from pd_dflash.engine.reference.engine import ReferenceEngine

    class SmallHost(ReferenceEngine):
        def host_available_bytes(self):
            return 10_000

    spec = make_spec(model={"id": "tiny-real-gpt-oss"}, concurrency=(1,))
    engine = SmallHost(EngineContext.for_model(spec, device="cpu"))
    assert engine.store is None and "load_refused" in engine.describe()
    assert engine.describe()["storage_dtype"] == "mxfp4"
    for cell in expand(spec):
        # 114,688 B: the 110,592 B of experts, each layer's rows starting on a page (store.LayerArena)
        with pytest.raises(Refused, match=r"host expert store \(114,688 B of experts as stored\).*10,000 B"):
            engine.run_cell(cell)
    engine.close()


def test_resident_rows_neither_dequantise_nor_read_the_routing_per_layer(real_rows):
    """B3 (every expert resident; gpt-oss's MXFP4 experts dequantised once, at load): no dequantisation and no
    routing transfer inside the timed rounds; an offloaded AR row reads the routing once per MoE layer per
    forward, plus the forward's end and its token."""
    name, _spec, engine, rows = real_rows
    layers = len(engine.store.layer_ids)
    for (baseline, _c), row in rows.items():
        cache, syncs = row.engine["expert_cache"], row.engine["host_syncs"]
        assert cache["capacity_counts"] == "stored_bytes"
        assert cache["dequantize"] == (
            "once per landing" if name == "tiny-real-gpt-oss" else "none (stored in the compute dtype)"
        )
        if baseline == "B3":
            assert cache["dequantized_landings"] == 0 and "routing" not in syncs["by_site"]
        if baseline == "B0":
            rounds = row.engine["batch"]["rounds"]
            assert syncs["by_site"]["routing"] == rounds * layers
            assert syncs["by_site"]["forward_end"] == rounds
            assert cache["dequantized_landings"] == (
                cache["h2d_transfers"] if name == "tiny-real-gpt-oss" else 0
            )
        assert row.engine["expert_compute"]["path"] in ("grouped_mm", "gathered_bmm")
