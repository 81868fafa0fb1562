"""Route-ahead counters on hand-built masks (issue 4 acceptance): each set-math rule of upstream's
``RouteAheadStats`` (docs/reference-engine.md, "Route-ahead statistics")."""

from __future__ import annotations

import pytest
import torch

from pd_dflash.engine.route_ahead import RouteAheadStats, RouteAheadStepSummary, routed_rows
from pd_dflash.schema import EngineResult
from pd_dflash.upstream import ROUTE_AHEAD_KEYS

T, F = True, False

# 3 token rows (anchor + 2 drafts) over 6 experts.
MASK = [
    [T, T, F, F, F, F],  # anchor -> {0, 1}
    [F, T, T, F, F, F],  # draft 1 -> {1, 2}
    [F, F, F, T, F, T],  # draft 2 -> {3, 5}
]


def test_set_math_single_layer_with_partial_acceptance():
    stats = RouteAheadStats()
    stats.begin_step()
    # P = {0, 1, 3, 4}; A = {0,1,2,3,5}; U_keep(2 rows) = {0,1,2}
    stats.observe_layer(0, [0, 1, 3, 4], MASK)
    s = stats.commit_step(2)
    assert s == RouteAheadStepSummary(layers=1, predicted=4, actual=5, covered=3, kept=3, wasted=2)
    assert stats.coverage == pytest.approx(3 / 5)
    assert stats.waste_ratio == pytest.approx(2 / 4)
    assert not stats.vacuous


def test_sums_over_layers_and_steps_are_ratios_of_sums():
    stats = RouteAheadStats()
    stats.begin_step()
    stats.observe_layer(0, [0, 1], MASK)  # A=5, covered 2, U_keep(all)={0,1,2,3,5}, wasted 0
    stats.observe_layer(1, [7], [[T, F], [F, T], [F, F]])  # A={0,1}, covered 0, wasted {7}
    s1 = stats.commit_step(3)
    assert (s1.layers, s1.predicted, s1.actual, s1.covered, s1.kept, s1.wasted) == (2, 3, 7, 2, 7, 1)
    stats.begin_step()
    stats.observe_layer(0, [3, 5], MASK)
    s2 = stats.commit_step(1)  # U_keep = {0,1}: both predicted wasted, both covered
    assert (s2.predicted, s2.actual, s2.covered, s2.kept, s2.wasted) == (2, 5, 2, 2, 2)
    d = stats.as_dict()
    assert d["steps"] == 2 and d["layers_observed"] == 3
    assert d["coverage"] == pytest.approx((2 + 2) / (7 + 5))  # not the mean of per-step coverages
    assert d["waste_ratio"] == pytest.approx((1 + 2) / (3 + 2))


def test_kept_rows_is_clamped():
    for kept_rows, expect_kept in [(-3, 0), (0, 0), (99, 5)]:
        stats = RouteAheadStats()
        stats.begin_step()
        stats.observe_layer(0, [0, 4], MASK)
        s = stats.commit_step(kept_rows)
        assert s.kept == expect_kept
        # with nothing kept every predicted expert is waste; with all kept only 4 (never routed) is
        assert s.wasted == (2 if expect_kept == 0 else 1)


def test_waste_never_reduces_coverage():
    stats = RouteAheadStats()
    stats.begin_step()
    stats.observe_layer(0, [0, 1, 2, 3, 5], MASK)  # predicts exactly A
    stats.commit_step(0)  # everything rejected: all prefetched bytes are waste
    assert stats.coverage == 1.0 and stats.waste_ratio == 1.0 and not stats.vacuous


def test_vacuous_coverage_is_flagged():
    stats = RouteAheadStats()
    assert stats.vacuous and stats.coverage == 1.0 and stats.waste_ratio == 0.0
    stats.begin_step()
    stats.observe_layer(0, [], [[F, F], [F, F]])  # a layer where nothing was routed
    stats.commit_step(1)
    assert stats.steps == 1 and stats.actual_experts == 0
    assert stats.coverage == 1.0 and stats.vacuous  # upstream's value, but flagged
    stats.begin_step()
    stats.observe_layer(0, [], MASK)  # predicted nothing: coverage is a real 0
    stats.commit_step(1)
    assert not stats.vacuous and stats.coverage == 0.0 and stats.waste_ratio == 0.0


def test_step_without_layers_leaves_counters_untouched():
    stats = RouteAheadStats()
    stats.begin_step()
    assert stats.commit_step(3) == RouteAheadStepSummary()
    assert stats.steps == 0 and stats.as_dict()["layers_observed"] == 0


def test_begin_step_drops_an_aborted_step():
    stats = RouteAheadStats()
    stats.begin_step()
    stats.observe_layer(0, [0], MASK)  # verify aborted before commit
    stats.begin_step()
    stats.observe_layer(1, [9], MASK)
    s = stats.commit_step(3)
    assert s.layers == 1 and s.predicted == 1 and s.covered == 0
    assert stats.layers_observed == 1


def test_bytes_over_predicted_set_only():
    nbytes = {0: 10, 1: 20, 2: 40, 3: 80, 4: 160, 5: 320}
    stats = RouteAheadStats()
    stats.begin_step()
    stats.observe_layer(0, [0, 1, 3, 4], MASK, expert_nbytes=nbytes)
    s = stats.commit_step(2)  # U_keep = {0,1,2}
    assert s.predicted_bytes == 10 + 20 + 80 + 160
    assert s.kept_bytes == 10 + 20  # P ∩ U_keep, not U_keep (expert 2 was not prefetched)
    assert s.wasted_bytes == 80 + 160
    assert s.predicted_bytes == s.kept_bytes + s.wasted_bytes
    d = stats.as_dict()
    assert (d["predicted_prefetch_bytes"], d["kept_prefetch_bytes"], d["wasted_prefetch_bytes"]) == (
        270,
        30,
        240,
    )


def test_bytes_none_until_a_step_with_bytes():
    stats = RouteAheadStats()
    stats.begin_step()
    stats.observe_layer(0, [0, 4], MASK)
    s = stats.commit_step(1)
    assert s.predicted_bytes is s.kept_bytes is s.wasted_bytes is None
    assert stats.predicted_prefetch_bytes is None and stats.as_dict()["wasted_prefetch_bytes"] is None
    stats.begin_step()
    stats.observe_layer(0, [0, 4], MASK, expert_nbytes={0: 7})  # 4 missing from the map: counts 0
    stats.observe_layer(1, [0, 4], MASK)  # a layer without a map in a step with bytes: counts 0
    s = stats.commit_step(1)
    assert (s.predicted_bytes, s.kept_bytes, s.wasted_bytes) == (7, 7, 0)
    stats.begin_step()
    stats.observe_layer(0, [4], MASK)
    stats.commit_step(1)  # a later byte-less step keeps the totals
    assert stats.as_dict()["predicted_prefetch_bytes"] == 7


def test_as_dict_keys_in_upstream_order_and_row_accepts_it():
    stats = RouteAheadStats()
    stats.begin_step()
    stats.observe_layer(0, [0], MASK, expert_nbytes={0: 1})
    stats.commit_step(1)
    d = stats.as_dict()
    assert tuple(d) == ROUTE_AHEAD_KEYS
    result = EngineResult(
        status="PARTIAL", warnings=["only route-ahead stats in this test"], route_ahead=d
    )  # the row validates and keeps it verbatim
    assert result.route_ahead == d and tuple(result.route_ahead) == ROUTE_AHEAD_KEYS


def test_mask_must_be_2d():
    stats = RouteAheadStats()
    stats.begin_step()
    with pytest.raises(ValueError, match="2-D"):
        stats.observe_layer(0, [0], torch.zeros(6, dtype=torch.bool))
    with pytest.raises(ValueError, match="2-D"):
        stats.observe_layer(0, [0], torch.zeros(2, 3, 6, dtype=torch.bool))
    with pytest.raises(ValueError, match="2-D"):
        stats.observe_layer(0, [0], [T, F, T])
    with pytest.raises(ValueError, match="rectangular"):
        stats.observe_layer(0, [0], [[T, F], [T]])
    with pytest.raises(ValueError, match="float"):
        stats.observe_layer(0, [0], torch.zeros(3, 6))


def test_tensor_mask_ids_and_lists_agree():
    mask = torch.tensor(MASK)
    topk = torch.tensor([[0, 1], [1, 2], [3, 5]])
    expected = routed_rows(MASK)
    assert routed_rows(mask) == expected
    assert routed_rows(topk) == expected
    assert routed_rows([[0, 1], [2, 1], [5, 3]]) == expected
    assert routed_rows(torch.tensor(MASK, dtype=torch.float32), kind="mask") == expected
    assert routed_rows(torch.tensor(MASK).numpy()) == expected
    assert routed_rows([list(row) for row in torch.tensor(MASK).numpy()]) == expected  # numpy bool scalars
    for routed in (mask, topk):
        stats = RouteAheadStats()
        stats.begin_step()
        stats.observe_layer(0, torch.tensor([0, 1, 3, 4]), routed)
        assert stats.commit_step(2) == RouteAheadStepSummary(1, 4, 5, 3, 3, 2)


def test_layer_observed_twice_raises():
    stats = RouteAheadStats()
    stats.begin_step()
    stats.observe_layer(0, [0], MASK)
    with pytest.raises(ValueError, match="twice"):
        stats.observe_layer(0, [0], MASK)


def test_kept_spans_for_a_batched_verify():
    # Two requests of 3 rows each in one batched verify: request 0 keeps 1 row, request 1 keeps 3.
    mask = [*MASK, [T, F, F, F, F, F], [F, F, F, F, T, F], [F, F, F, F, F, F]]
    stats = RouteAheadStats()
    stats.begin_step()
    stats.observe_layer(0, [0, 1, 2, 3, 4], mask)
    s = stats.commit_step(kept_spans=[(0, 1), (3, 6)])  # U_keep = {0,1} ∪ {0,4}
    assert (s.actual, s.kept, s.covered, s.wasted) == (6, 3, 5, 2)
    with pytest.raises(ValueError, match="exactly one"):
        stats.commit_step()
    with pytest.raises(ValueError, match="exactly one"):
        stats.commit_step(1, kept_spans=[(0, 1)])
