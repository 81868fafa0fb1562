"""``routed_rows``: every accepted input form gives the same rows, and every rejected one names what is wrong
(the full message: it is what a caller wiring a new router reads)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

from pd_dflash.engine.route_ahead import routed_rows
from tests.helpers import exactly

ROWS = (frozenset({0, 2}), frozenset({1}))


class DimOnly:
    """A tensor-like with a dtype and ``dim()`` but no ``ndim`` attribute."""

    def __init__(self, data, dtype="torch.int64"):
        self.data, self.dtype = data, dtype

    def dim(self) -> int:
        return 2 if isinstance(self.data[0], list) else 1

    def tolist(self):
        return self.data


@pytest.mark.parametrize(
    "routed",
    [
        [[True, False, True], [False, True, False]],
        [[0, 2], [1]],
        torch.tensor([[True, False, True], [False, True, False]]),
        torch.tensor([[0, 2], [1, 1]]),
        np.array([[True, False, True], [False, True, False]]),
        np.array([[0, 2], [1, 1]], dtype=np.int32),
        [np.array([0, 2]), np.array([1])],
        [torch.tensor([True, False, True]), torch.tensor([False, True, False])],
        DimOnly([[0, 2], [1, 1]]),
        DimOnly([[True, False, True], [False, True, False]], dtype="torch.bool"),
    ],
    ids=["bool-lists", "id-lists", "bool-tensor", "id-tensor", "bool-array", "id-array", "array-rows", "tensor-rows", "dim-only-ids",
         "dim-only-mask"],
)  # fmt: skip
def test_every_accepted_form_gives_the_same_rows(routed):
    assert routed_rows(routed) == ROWS


def test_a_float_tensor_needs_an_explicit_kind():
    f = torch.tensor([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]])
    message = "routed is a float tensor: pass kind='mask' for a [tokens, experts] mask or kind='ids'"
    with pytest.raises(ValueError, match=exactly(message)):
        routed_rows(f)
    assert routed_rows(f, "mask") == ROWS
    assert routed_rows(torch.tensor([[0.0, 2.0], [1.0, 1.0]]), "ids") == ROWS
    assert routed_rows([[1, 0, 1], [0, 1, 0]], "mask") == ROWS  # truthy entries of an explicit mask


@pytest.mark.parametrize(
    ("routed", "kind", "message"),
    [
        (torch.tensor([True, False]), "auto", "router mask must be 2-D [tokens, experts], got 1-D"),
        (
            torch.zeros(2, 2, 2, dtype=torch.bool),
            "auto",
            "router mask must be 2-D [tokens, experts], got 3-D",
        ),
        (torch.tensor([0, 1]), "auto", "routed expert ids must be 2-D [tokens, top_k], got 1-D"),
        (
            torch.tensor([[1.0]]).reshape(1, 1, 1),
            "mask",
            "router mask must be 2-D [tokens, experts], got 3-D",
        ),
        (torch.tensor([0.0, 1.0]), "ids", "routed expert ids must be 2-D [tokens, top_k], got 1-D"),
        (DimOnly([0, 1]), "auto", "routed expert ids must be 2-D [tokens, top_k], got 1-D"),
        (5, "auto", "routed must be a 2-D mask or a sequence of per-token expert ids, got int"),
        ("ab", "auto", "routed must be a 2-D mask or a sequence of per-token expert ids, got str"),
        (
            [[0], 3],
            "auto",
            "routed must be 2-D: row 1 is a int, not a sequence (a 1-D mask or a flat id list is not accepted)",
        ),
        (
            [[0], "ab"],
            "auto",
            "routed must be 2-D: row 1 is a str, not a sequence (a 1-D mask or a flat id list is not accepted)",
        ),
        ([[True, 1]], "auto", "routed mixes bools and ids; pass kind='mask' or kind='ids'"),
        ([[True], [False, True]], "mask", "router mask must be 2-D and rectangular, got row widths [1, 2]"),
        ([[[True]], [[False]]], "mask", "router mask must be 2-D, got a deeper nesting"),
        ([[0], [[1]]], "ids", "routed expert ids must be 2-D, row 1 nests deeper"),
        ([[0], [-1]], "ids", "routed expert id -1 in row 1 is not a non-negative integer"),
        ([[1.5]], "ids", "routed expert id 1.5 in row 0 is not a non-negative integer"),
        ([[0], [True]], "ids", "routed expert id True in row 1 is not a non-negative integer"),
        ([[0]], "bits", "routed kind must be 'auto', 'mask' or 'ids', got 'bits'"),
    ],
)
def test_rejected_inputs_name_the_problem(routed, kind, message):
    with pytest.raises(ValueError, match=exactly(message)):
        routed_rows(routed, kind)


def test_a_tensor_like_without_a_dimension_count_is_refused():
    shapeless = SimpleNamespace(dtype="torch.int64", tolist=lambda: [[0, 2], [1, 1]])  # no ndim, no dim()
    with pytest.raises(
        ValueError, match=exactly("routed expert ids must be 2-D [tokens, top_k], got None-D")
    ):
        routed_rows(shapeless)


def test_an_empty_routing_has_no_rows_and_empty_rows_route_nothing():
    assert routed_rows([]) == ()
    assert routed_rows([[], []]) == (frozenset(), frozenset())
    assert routed_rows([[0], []]) == (frozenset({0}), frozenset())
    assert routed_rows([[2.0, 0]], "ids") == (frozenset({0, 2}),)  # whole floats are ids


# -- the counters add up over layers and steps, whatever their order ---------------------------------------------


def test_a_step_sums_every_layer_even_when_a_later_layer_wastes_nothing():
    from pd_dflash.engine.route_ahead import RouteAheadStats

    stats = RouteAheadStats()
    stats.begin_step()
    nbytes = dict.fromkeys(range(8), 10)
    stats.observe_layer(0, [5, 6, 0], [[0], [1]], nbytes)  # U_keep(1 row) = {0}: wasted {5, 6}
    stats.observe_layer(1, [0], [[0], [2]], nbytes)  # wasted nothing
    summary = stats.commit_step(1)
    assert (summary.predicted, summary.actual, summary.covered, summary.kept, summary.wasted) == (
        4,
        4,
        2,
        2,
        2,
    )
    assert (summary.predicted_bytes, summary.kept_bytes, summary.wasted_bytes) == (40, 20, 20)
    # A second step that keeps everything adds to the totals rather than replacing them.
    stats.begin_step()
    stats.observe_layer(0, [1], [[1]], nbytes)
    stats.commit_step(1)
    assert (stats.kept_experts, stats.wasted_experts, stats.steps) == (3, 2, 2)
    assert (stats.predicted_prefetch_bytes, stats.kept_prefetch_bytes, stats.wasted_prefetch_bytes) == (
        50,
        30,
        20,
    )


def test_commit_step_needs_exactly_one_of_rows_or_spans():
    from pd_dflash.engine.route_ahead import RouteAheadStats

    message = "commit_step needs exactly one of kept_rows or kept_spans"
    with pytest.raises(ValueError, match=exactly(message)):
        RouteAheadStats().commit_step()


def test_fresh_statistics_are_zero_with_no_bytes_and_need_no_begin_step():
    from pd_dflash.engine.route_ahead import RouteAheadStats

    fresh = RouteAheadStats().as_dict()
    assert fresh == {
        "steps": 0,
        "layers_observed": 0,
        "predicted_experts": 0,
        "actual_experts": 0,
        "covered_experts": 0,
        "kept_experts": 0,
        "wasted_experts": 0,
        "coverage": 1.0,
        "waste_ratio": 0.0,
        "predicted_prefetch_bytes": None,
        "kept_prefetch_bytes": None,
        "wasted_prefetch_bytes": None,
    }
    stats = RouteAheadStats()
    stats.observe_layer(
        0, torch.tensor([1]), torch.tensor([[0.0, 1.0]]), kind="mask"
    )  # the kind is passed on
    assert stats.commit_step(1).covered == 1 and stats.steps == 1


class bool_:  # numpy < 2 names its bool scalar type ``bool_`` (numpy 2 calls it ``bool``)
    """A stand-in for a numpy 1.x bool scalar: this venv has numpy 2, whose scalar is already named ``bool``."""

    def __init__(self, value: bool) -> None:
        self.value = value

    def __bool__(self) -> bool:
        return self.value


def test_numpy_1_bool_scalars_are_a_mask():
    t, f = bool_(True), bool_(False)
    assert routed_rows([[t, f, t], [f, t, f]]) == ROWS
    with pytest.raises(
        ValueError, match=exactly("routed mixes bools and ids; pass kind='mask' or kind='ids'")
    ):
        routed_rows([[t, 1]])


def test_predicted_ids_are_read_through_tolist():
    """The module takes tensors duck-typed through ``.tolist()``: a predicted set that offers only that (no
    iteration) is read, and its ids counted once each."""
    from pd_dflash.engine.route_ahead import RouteAheadStats

    predicted = SimpleNamespace(tolist=lambda: [2, 0, 2, 5])  # P = {0, 2, 5}
    stats = RouteAheadStats()
    stats.observe_layer(0, predicted, [[0, 2], [1]])  # A = {0, 1, 2}; U_keep(1 row) = {0, 2}
    summary = stats.commit_step(1)
    assert (summary.predicted, summary.actual, summary.covered, summary.kept, summary.wasted) == (
        3,
        3,
        2,
        2,
        1,
    )
