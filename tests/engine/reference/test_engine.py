"""``ReferenceEngine`` through the Engine interface: rows the schema accepts, refusals, real concurrency."""

from __future__ import annotations

import pytest

from pd_dflash.engine.interface import Refused
from pd_dflash.schema import Row, Status
from pd_dflash.spec import expand
from tests.engine.reference.helpers import WORKLOAD, make_engine, make_spec


@pytest.fixture(scope="module")
def micro_engine(micro):
    spec = make_spec(options={"emulated_h2d_gbps": 2.0, "emulated_latency_us": 5.0})
    engine = make_engine(spec)
    yield spec, engine
    engine.close()


@pytest.fixture(scope="module")
def micro_rows(micro_engine):
    spec, engine = micro_engine
    return {(c.baseline, c.concurrency): (c, engine.run_cell(c)) for c in expand(spec)}


@pytest.mark.parametrize("baseline", ["B0", "B3"])
@pytest.mark.parametrize("concurrency", [1, 4])
def test_run_cell_returns_a_valid_row(micro_rows, baseline, concurrency):
    cell, result = micro_rows[(baseline, concurrency)]
    row = Row.from_result(cell, result)
    assert row.status == Status.OK, row.warnings
    if baseline == "B0":  # AR: one token per round, measured
        assert row.acceptance_length_a == 1.0 and row.acceptance_histogram == {
            1: sum(row.acceptance_histogram.values())
        }
    else:  # B3: speculative with every expert resident (upstream's B3)
        assert 1.0 < row.acceptance_length_a <= cell.block_size and row.t_draft_seconds > 0
    assert row.generated_tokens == WORKLOAD["requests"] * WORKLOAD["max_new_tokens"]
    assert row.output_tokens_per_second > 0 and row.goodput_at_slo == pytest.approx(
        row.output_tokens_per_second
    )
    assert (
        row.latency["ttft_seconds"].n == WORKLOAD["requests"]
        and row.ttft_seconds == row.latency["ttft_seconds"].mean
    )
    assert row.latency["tpot_seconds"].n == WORKLOAD["requests"]
    assert 0.0 <= row.route_ahead_prefetch_coverage <= 1.0
    if baseline == "B3":  # observe-only prefetcher: coverage, but no prediction counts (nothing prefetched)
        assert row.route_ahead is None and "prediction" not in row.engine
    else:
        assert row.route_ahead["actual_experts"] > 0
    assert row.kv_occupancy_bytes > 0 and row.t_verify_seconds > 0
    batch = row.engine["batch"]
    assert (
        batch["requests_per_forward_max"] == concurrency
    )  # c requests really in flight, one batched forward
    ec = row.engine["expert_cache"]
    assert row.expert_occupancy_bytes <= ec["capacity_bytes"]
    if baseline == "B3":
        assert row.expert_cache_hit_rate == 1.0 and row.cost_terms.h2d_link == "none"
        assert row.cost_terms.h2d_bytes == 0 and row.wasted_prefetch_bytes == 0.0
        assert row.expert_occupancy_bytes == ec["total_expert_bytes"]
        assert row.hide_inequality is None and any("hide_inequality" in w for w in row.warnings)
    else:
        assert row.expert_cache_hit_rate < 1.0 and row.cost_terms.h2d_link == "emulated"
        assert row.cost_terms.emulated_h2d_gbps == 2.0 and row.cost_terms.h2d_bandwidth_source == "transfers"
        assert row.expert_occupancy_bytes <= 0.25 * ec["total_expert_bytes"]
        assert row.cost_terms.h2d_bytes == row.cost_terms.h2d_transfers * ec["expert_nbytes"]
        assert ec["demand_bytes"] + ec["prefetch_bytes"] == row.cost_terms.h2d_bytes
        assert row.wasted_prefetch_bytes == row.route_ahead["wasted_prefetch_bytes"]
        hide = row.hide_inequality
        assert hide is not None and hide.total_expert_bytes == ec["total_expert_bytes"]


def test_offloaded_and_resident_generate_the_same_tokens(micro_rows):
    for c in (1, 4):
        b0, b3 = micro_rows[("B0", c)][1], micro_rows[("B3", c)][1]
        assert b0.engine["output_digest"] == b3.engine["output_digest"]


def test_refuses_an_offloaded_baseline_that_would_hold_every_expert(micro):
    engine = make_engine(make_spec(memory={}))  # no capacity given: nothing would be offloaded
    cells = {c.baseline: c for c in expand(make_spec(memory={}, concurrency=[1]))}
    with pytest.raises(Refused) as refused:
        engine.run_cell(cells["B0"])
    assert refused.value.status == Status.REFUSED
    assert "offloaded" in refused.value.reason and "Fix" in refused.value.reason
    assert engine.run_cell(cells["B3"]).status == Status.OK  # B3 is resident by definition
    total = engine.store.total_bytes
    full = make_engine(make_spec(options={"expert_cache_bytes": total}, concurrency=[1]))
    with pytest.raises(Refused) as r:
        full.run_cell(cells["B0"])
    assert r.value.status == Status.REFUSED and "holds all" in r.value.reason


def test_slo_goodput_counts_only_requests_meeting_every_slo(micro_engine):
    spec = make_spec(concurrency=[1], slo={"ttft_ms": 1e-6})  # no request can meet it
    engine = make_engine(spec)
    result = engine.run_cell(next(c for c in expand(spec) if c.baseline == "B3"))
    assert result.goodput_at_slo == 0.0 and result.output_tokens_per_second > 0
