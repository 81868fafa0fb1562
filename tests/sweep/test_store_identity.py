"""The store refuses a row whose identity disagrees with its cell id, and loses nothing for it (pure, no Ray)."""

from __future__ import annotations

import pytest

from pd_dflash.errors import InputError
from pd_dflash.spec import expand
from pd_dflash.sweep.store import Mode, SweepStore
from tests.sweep.helpers import make_spec, ok_row, stored_rows


@pytest.fixture
def store(tmp_path):
    s = SweepStore(tmp_path, make_spec(), Mode.RESUME)
    s.open()
    yield s
    s.close()


def cell_of(store, baseline="B1", concurrency=1, model="m1"):
    return next(
        c
        for c in expand(store.spec)
        if (c.model, c.baseline, c.concurrency) == (model, baseline, concurrency)
    )


# Each identity field changed to a value another cell of the same spec has (so the row is valid on its own).
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("model", "m2"),
        ("baseline", "OURS"),
        ("concurrency", 2),
        ("repeat", 1),
        ("block_size", 16),
        ("ablation", {"expert_cache_fraction": 0.5}),  # an ablation value is part of the identity too
    ],
)
def test_a_row_whose_identity_disagrees_with_its_cell_id_is_refused(store, tmp_path, field, value):
    first, cell = cell_of(store, "B0"), cell_of(store)
    assert store.add(ok_row(first))
    size = (tmp_path / "rows.jsonl").stat().st_size
    lying = ok_row(cell).model_copy(update={field: value})
    assert getattr(lying, field) != getattr(cell, field)
    with pytest.raises(InputError) as err:
        store.add(lying)
    assert (
        str(err.value) == f"row identity {lying.identity} does not match cell {cell.cell_id} {cell.identity}"
    )
    # Nothing was written or counted for it; the true row of that cell is still accepted afterwards.
    assert (tmp_path / "rows.jsonl").stat().st_size == size and len(store.rows) == 1
    assert cell.cell_id not in store.stored() and store.counts()["stored"] == 1
    assert store.add(ok_row(cell))
    assert [r.cell_id for r in stored_rows(tmp_path)] == [first.cell_id, cell.cell_id]


def test_a_row_of_another_drafter_under_this_cells_id_is_refused(store, tmp_path):
    cell = cell_of(store)
    lying = ok_row(cell).model_copy(update={"draft": "another-drafter"})
    with pytest.raises(InputError) as err:
        store.add(lying)
    assert (
        str(err.value)
        == f"row draft 'another-drafter' does not match cell {cell.cell_id} draft {cell.draft!r}"
    )
    assert not (tmp_path / "rows.jsonl").exists() or stored_rows(tmp_path) == []


def test_a_row_without_a_known_cell_id_is_refused(store, tmp_path):
    row = ok_row(cell_of(store))
    for cell_id in (None, "0" * 16):
        with pytest.raises(InputError) as err:
            store.add(row.model_copy(update={"cell_id": cell_id}))
        assert str(err.value) == f"row for unknown cell {cell_id!r} (not in spec test-sweep)"
    assert store.rows == [] and store.stored() == {}
