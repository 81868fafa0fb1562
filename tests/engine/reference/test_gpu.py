"""The reference engine's CUDA path end to end. Skipped cleanly without CUDA.

Exact outputs are compared only at equal shapes (a GEMM's result may depend on its shape on a GPU): the same
configuration with a 2-slot cache vs a near-full one, and B1/B2/OURS against each other at c = 1, where every
verify has the same width. fp8 rows are compared among themselves. B0 against B3 (AR against speculative, different
row counts) is compared by logits within a tolerance in benchmarks/gpu_steps.py, never token for token.
"""

from __future__ import annotations

import pytest
import torch

from pd_dflash.engine.interface import EngineContext
from pd_dflash.engine.reference.cell import configured
from pd_dflash.engine.registry import engine_class
from pd_dflash.errors import InputError
from pd_dflash.schema import Row, Status
from pd_dflash.spec import expand, parse_spec
from tests.engine.reference.helpers import WORKLOAD, make_spec, record_figure

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

#: Fractions of micro's 16 experts (2 layers × 8): 2 slots, and all but one.
TWO_SLOTS, NEAR_FULL = 2 / 16, 15 / 16


def cuda_engine(spec):
    return engine_class("reference")(EngineContext.for_model(spec, device="cuda:0"))


def test_cuda_offloaded_equals_resident_and_measures_real_transfers(micro):
    """B0 with 2 slots and B0 with all but one expert cached: the same decoding at the same shapes, so the same
    tokens. B0 (AR, one row per request) is never compared token for token with B3 (speculative, B + 1 rows): on a
    GPU different row counts pick different GEMM kernels (benchmarks/gpu_steps.py compares them by logits)."""
    spec = make_spec(concurrency=[1, 4], memory={"expert_cache_fraction": TWO_SLOTS})
    engine = cuda_engine(spec)
    assert engine.store.parts[engine.store.layer_ids[0]][0].is_pinned()
    rows = {(c.baseline, c.concurrency): Row.from_result(c, engine.run_cell(c)) for c in expand(spec)}
    engine.close()
    near = make_spec(baselines=("B0",), concurrency=[1, 4], memory={"expert_cache_fraction": NEAR_FULL})
    engine = cuda_engine(near)
    cached = {c.concurrency: Row.from_result(c, engine.run_cell(c)) for c in expand(near)}
    for c in (1, 4):
        b0, b3 = rows[("B0", c)], rows[("B3", c)]
        assert b0.status == b3.status == cached[c].status == Status.OK
        assert shape(b0) == shape(cached[c])
        assert b0.engine["output_digest"] == cached[c].engine["output_digest"]
        assert b0.cost_terms.h2d_link == "real" and b0.cost_terms.h2d_bandwidth_source == "probe"
        assert b0.cost_terms.h2d_bytes > 0 and b0.cost_terms.h2d_seconds > 0
        assert b0.hide_inequality is not None and b3.hide_inequality is not None
        assert b0.engine["overlap"]["h2d_link_seconds"] == pytest.approx(b0.cost_terms.h2d_seconds)
    engine.close()


def test_cuda_emulation_is_rejected():
    spec = make_spec(options={"emulated_h2d_gbps": 1.0})
    with pytest.raises(InputError, match="emulation"):
        cuda_engine(spec)


def spec_for(baselines, fraction, options, temperature=0.0):
    return parse_spec(
        {
            "name": "gpu-configurations",
            "engine": "reference",
            "models": [{"id": "micro", "preset": "micro", "engine_options": options}],
            "baselines": list(baselines),
            "block_sizes": [8],
            "concurrency": [1],
            "repeats": 1,
            "workload": {**WORKLOAD, "temperature": temperature},
            "memory": {"expert_cache_fraction": fraction},
            "hardware": {"device": "cuda", "accelerator_type": None, "compute_capability": None},
        }
    )


#: name: (baselines, engine options, temperature)
GROUPS = {
    "lru": (("B1", "B2", "OURS"), {}, 0.0),
    "full_width": (("OURS",), {"verify_width": "full"}, 0.0),  # OURS's history prefetch is always on now
    "lfu": (("B1", "B2", "OURS"), {"eviction": "lfu"}, 0.0),
    "fp8": (("B1", "B2", "OURS"), {"storage_dtype": "fp8"}, 0.0),
    "sampled": (("B1", "OURS"), {}, 1.0),
}


def shape(row: Row) -> tuple:
    """What fixes every forward's shape: rounds, tokens per forward, requests per forward."""
    batch = row.engine["batch"]
    return batch["rounds"], batch["tokens_per_forward_mean"], batch["requests_per_forward_histogram"]


@pytest.fixture(scope="module")
def configuration_rows(micro):
    rows = {}
    for name, (baselines, options, temperature) in GROUPS.items():
        for fraction in (TWO_SLOTS, NEAR_FULL):
            spec = spec_for(baselines, fraction, options, temperature)
            engine = cuda_engine(spec)
            for cell in expand(spec):
                rows[(name, fraction, cell.baseline)] = Row.from_result(cell, engine.run_cell(cell))
            engine.close()
    return rows


@pytest.mark.parametrize("group", list(GROUPS))
def test_every_configuration_runs_on_cuda_with_equal_outputs_at_equal_shapes(configuration_rows, group):
    baselines = GROUPS[group][0]
    for fraction in (TWO_SLOTS, NEAR_FULL):
        for b in baselines:
            row = configuration_rows[(group, fraction, b)]
            assert row.status == Status.OK, (group, fraction, b, row.reason, row.warnings)
            assert row.cost_terms.h2d_link == "real"
            record_figure(
                "configurations",
                group=group,
                fraction=fraction,
                baseline=b,
                tokens_per_second=row.output_tokens_per_second,
                h2d_bytes=row.cost_terms.h2d_bytes,
                h2d_seconds=row.cost_terms.h2d_seconds,
                exposed_fetch_seconds=row.cost_terms.exposed_fetch_seconds,
                hit_rate=row.expert_cache_hit_rate,
            )
        assert configuration_rows[(group, fraction, baselines[0])].engine["expert_cache"]["slots"] == round(
            fraction * 16
        )
    for b in baselines:  # the same configuration, 2 slots vs near-full
        small, large = (configuration_rows[(group, f, b)] for f in (TWO_SLOTS, NEAR_FULL))
        assert shape(small) == shape(large)
        assert small.engine["output_digest"] == large.engine["output_digest"], (group, b)
        assert small.cost_terms.h2d_bytes > large.cost_terms.h2d_bytes
    reference = configuration_rows[(group, TWO_SLOTS, baselines[0])]
    for b in baselines[1:]:  # B1, B2 and OURS at c = 1: the same verify widths, the same tokens
        other = configuration_rows[(group, TWO_SLOTS, b)]
        assert shape(other) == shape(reference)
        assert other.engine["output_digest"] == reference.engine["output_digest"], (group, b)


def big_expert_checkpoint(path, intermediate: int = 4096) -> None:
    """A random-weight Qwen3-MoE whose experts are 48 MiB each (fp32): transfers long enough to observe."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=256,
        hidden_size=1024,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=intermediate,
        intermediate_size=4096,
        max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    Qwen3MoeForCausalLM(config).eval().save_pretrained(str(path))


def test_the_next_draft_starts_before_cross_round_prefetches_finish(tmp_path):
    """No device-wide synchronization: the host ends a round and starts the next draft while the prefetches
    issued at the end of the verify are still on the link."""
    big_expert_checkpoint(tmp_path / "ckpt")
    # OURS issues each request's history (its last verify's experts) at the end of the verify (issue 11).
    options = {"drafter": "early_exit", "early_exit_layers": 1, "route_ahead_history": True}
    spec = parse_spec(
        {
            "name": "gpu-cross-round",
            "engine": "reference",
            "models": [{"id": str(tmp_path / "ckpt"), "engine_options": options}],
            "baselines": ["OURS"],
            "block_sizes": [4],
            "concurrency": [1],
            "repeats": 1,
            "workload": {"requests": 2, "warmup_rounds": 0, "max_new_tokens": 16, "prompt_tokens": 16},
            "memory": {"expert_cache_fraction": 0.5},
            "hardware": {"device": "cuda", "accelerator_type": None, "compute_capability": None},
        }
    )
    engine = cuda_engine(spec)
    cell = expand(spec)[0]
    with engine._setup(configured(cell), engine.cache_capacity(cell)) as setup:
        rounds = engine._serve(cell, setup.timed, setup)
        setup.runtime.cache.drain()
        log = list(setup.runtime.cache.transfer_log)
    engine.close()
    drafts = [start for rec in rounds for kind, start, _ in rec.windows if kind == "draft"]
    prefetches = [(start, end) for start, end, _, demand in log if not demand]
    during = [d for d in drafts if any(s < d < e for s, e in prefetches)]
    record_figure(
        "cross_round", drafts=len(drafts), prefetches=len(prefetches), drafts_during_prefetch=len(during)
    )
    assert drafts and prefetches
    assert during, "every draft started after the link had gone idle: the host waited for the prefetches"
