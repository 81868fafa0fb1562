"""Chunked pinning during a checkpoint load (CPU-runnable parts): each MoE layer's pages are handed to
``cudaHostRegister`` once, as soon as that layer's last read has landed, in page-aligned disjoint ranges that
cover the arena; a failure names the layer and the figures. ``pin_range`` itself (the CUDA call) is replaced by a
recorder here, the one part that needs a GPU (it runs in scripts/gpu_check.sh's configurations and GPU tests)."""

from __future__ import annotations

import pytest
import torch

from pd_dflash.engine.interface import Refused
from pd_dflash.engine.reference.checkpoints.check import check_checkpoint
from pd_dflash.engine.reference.checkpoints.loader import LayerPinner, build_skeleton
from pd_dflash.engine.reference.checkpoints.reads import LoadProgress, expert_reads, parameter_reads, read_all
from pd_dflash.engine.reference.checkpoints.store import arena_layers
from pd_dflash.engine.reference.checkpoints.tiny import materialise
from pd_dflash.engine.reference.offload.store import PAGE

CPU = torch.device("cpu")


def load_recording(name: str, fail_at: int | None = None):
    """Read the tiny checkpoint ``name`` with a pinner whose registrations are recorded (and fail at the
    ``fail_at``-th layer): (pinner, layers, arena, what each call saw)."""
    checked = check_checkpoint(materialise(name))
    model, _ = build_skeleton(checked, torch.float32)
    reads = expert_reads(checked) + parameter_reads(checked, model, CPU, torch.float32)
    arena, layers = arena_layers(checked.layout)
    progress = LoadProgress(name, sum(r.entry.nbytes for r in reads))
    seen = []

    def record(offset: int, nbytes: int, what: str) -> float:
        if fail_at is not None and len(seen) == fail_at:
            raise RuntimeError(f"pinning {what} ({nbytes:,} B) failed (cudaHostRegister error 2)")
        layer = next(k for k, v in layers.items() if v.data_ptr() - arena.buffer.data_ptr() == offset)
        seen.append((offset, nbytes, layer, layers[layer].clone(), progress.done))
        return 0.25

    arena.pin_range = record
    pinner = LayerPinner(arena, layers)
    read_all(reads, checked, layers, progress, filled=pinner.pin)
    return pinner, layers, arena, seen, progress


@pytest.mark.parametrize("name", ["tiny-real-qwen3-moe", "tiny-real-gpt-oss"])
def test_each_layer_is_pinned_once_as_soon_as_it_is_filled_and_the_ranges_tile_the_arena(name):
    pinner, layers, arena, seen, progress = load_recording(name)
    assert sorted(pinner.done) == sorted(layers) and len(pinner.done) == len(set(pinner.done))
    assert pinner.seconds == pytest.approx(0.25 * len(layers)) and pinner.pinned_bytes == arena.nbytes
    end = 0
    for offset, nbytes, layer, at_pin, _ in sorted(seen, key=lambda s: s[0]):
        assert offset == end and offset % PAGE == 0 and nbytes >= layers[layer].numel()
        assert torch.equal(at_pin, layers[layer])  # the layer's bytes were final when it was pinned
        end = offset + nbytes
    assert end == arena.nbytes
    assert seen[0][4] < progress.total  # the first layer was pinned during the load, not after it


def test_a_failed_registration_names_the_layer_and_what_was_pinned_before():
    with pytest.raises(Refused) as caught:
        load_recording("tiny-real-qwen3-moe", fail_at=1)
    reason = str(caught.value)
    assert "MoE layer" in reason and "after 1 of" in reason and "cudaHostRegister error 2" in reason
    assert "Fix:" in reason
