"""Pinned by torch's own definition: ``Tensor.is_pinned()`` asks the driver about a tensor's *storage* start, so
every view the host store hands out must have its storage start inside a ``cudaHostRegister``-ed range. The CUDA
runtime is replaced by a recorder (the one part that needs a GPU; the GPU check's preflight and pinning steps
read ``is_pinned()`` on the device)."""

from __future__ import annotations

import gc
import sys

import pytest
import torch

from pd_dflash.engine.reference.checkpoints.check import check_checkpoint
from pd_dflash.engine.reference.checkpoints.loader import LayerPinner
from pd_dflash.engine.reference.checkpoints.store import arena_layers
from pd_dflash.engine.reference.checkpoints.tiny import materialise
from pd_dflash.engine.reference.offload.store import PAGE, HostArena, HostExpertStore
from tests.conftest import REPO


class RecordingCudart:
    """What ``cudaHostRegister``/``cudaHostUnregister`` were asked, in order (both succeed)."""

    def __init__(self) -> None:
        self.registered: list[tuple[int, int]] = []
        self.unregistered: list[int] = []

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:
        self.registered.append((ptr, nbytes))
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:
        self.unregistered.append(ptr)
        return 0


@pytest.fixture
def cudart(monkeypatch):
    fake = RecordingCudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    return fake


def assert_pinned_by_storage(views: list[torch.Tensor], arena: HostArena, cudart: RecordingCudart) -> None:
    """Each view's storage start lies in a registered range, and the ranges tile the arena exactly."""
    assert views
    for v in views:
        start = v.untyped_storage().data_ptr()
        assert any(p <= start < p + n for p, n in cudart.registered), (start, cudart.registered)
        assert any(p <= v.data_ptr() < p + n for p, n in cudart.registered)
    end = arena.buffer.data_ptr()
    assert end % PAGE == 0
    for ptr, nbytes in sorted(cudart.registered):
        assert ptr == end and ptr % PAGE == 0
        end = ptr + nbytes
    assert end == arena.buffer.data_ptr() + arena.nbytes


def assert_unregistered_once(cudart: RecordingCudart) -> None:
    gc.collect()
    assert sorted(cudart.unregistered) == sorted(p for p, _ in cudart.registered)


def test_every_view_of_a_pinned_host_store_has_its_storage_start_registered(cudart):
    torch.manual_seed(0)
    layers = {i: [torch.randn(4, 6, 3), torch.randn(4, 3, 5), torch.randn(4, 5)] for i in range(3)}
    store = HostExpertStore(layers, storage="fp8", pin=True)
    views = [t for layer in store.layer_ids for t in store.parts[layer]]
    views += [s for layer in store.layer_ids for s in store.scales[layer] if s is not None]
    views += [
        t for layer in store.layer_ids for e in range(store.num_experts) for t in store.payload(layer, e)
    ]
    assert_pinned_by_storage(views, store.arena, cudart)
    store.arena.pin()  # a second pin registers nothing more
    assert len(cudart.registered) == 1 and cudart.unregistered == []
    del store, views
    assert_unregistered_once(cudart)


@pytest.mark.parametrize("name", ["tiny-real-qwen3-moe", "tiny-real-gpt-oss"])
def test_each_checkpoint_layer_pinned_on_its_own_leaves_every_expert_view_registered(cudart, name):
    layout = check_checkpoint(materialise(name)).layout
    arena, layers = arena_layers(layout)
    pinner = LayerPinner(arena, layers)
    for layer in reversed(list(layers)):  # any order: the ranges tile the arena once all are in
        pinner.pin(layer)
    rows = [layers[layer][e] for layer in layers for e in range(layout.num_experts)]
    assert len(cudart.registered) == len(layers)
    assert_pinned_by_storage(rows, arena, cudart)
    del arena, layers, pinner, rows
    assert_unregistered_once(cudart)


def test_a_range_outside_the_arena_or_off_a_page_is_refused_before_the_driver_sees_it(cudart):
    arena = HostArena(4 * PAGE)
    for offset, nbytes in ((100, PAGE), (0, 5 * PAGE), (-PAGE, PAGE)):
        with pytest.raises(ValueError, match="page-aligned range"):
            arena.pin_range(offset, nbytes, "a test range")
    assert cudart.registered == []


def test_the_gpu_checks_committed_pages_start_their_own_storage_on_a_page():
    sys.path.insert(0, str(REPO / "benchmarks"))
    import gpu_steps

    view, seconds = gpu_steps.committed(3 * PAGE + 5)
    assert view.untyped_storage().data_ptr() == view.data_ptr() and view.data_ptr() % PAGE == 0
    assert view.numel() == 3 * PAGE + 5 and int(view.min()) == 1 and seconds >= 0
