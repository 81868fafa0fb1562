"""Bytes per expert for every storage dtype: the stored payload (numel x element size, fp8 scales included),
worked out by hand for one hand-built layer, and checked against the bytes of the tensors a transfer copies.

One MoE layer of 4 experts with a 3-D gate_up [4, 6, 8], a 3-D down [4, 8, 3] and a 2-D bias [4, 6]: per expert
48 + 24 + 6 = 78 values.
"""

from __future__ import annotations

import pytest
import torch

from pd_dflash.engine.reference.offload.store import STORAGE_DTYPES, HostExpertStore

EXPECTED = {
    "fp32": 78 * 4,
    "bf16": 78 * 2,
    "fp16": 78 * 2,
    # fp8: the 3-D weights at 1 B a value plus one fp32 scale each; the bias (2-D) is kept in bf16, no scale.
    "fp8": (48 + 24) * 1 + 2 * 4 + 6 * 2,
}


def layers(n_layers: int = 2) -> dict[int, list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return {
        layer: [
            torch.randn(4, 6, 8, generator=g),
            torch.randn(4, 8, 3, generator=g),
            torch.randn(4, 6, generator=g),
        ]
        for layer in range(n_layers)
    }


def test_every_storage_dtype_is_listed():
    assert set(STORAGE_DTYPES) == set(EXPECTED)


@pytest.mark.parametrize("storage", sorted(EXPECTED))
def test_bytes_per_expert_are_the_stored_payload(storage):
    store = HostExpertStore(layers(), storage)
    assert store.expert_nbytes == EXPECTED[storage]
    # What a transfer of expert (1, 2) copies is exactly that many bytes.
    copied = sum(t.numel() * t.element_size() for t in store.payload(1, 2))
    assert copied == EXPECTED[storage]
    # M and the per-layer map RouteAheadStats gets: the same stored bytes, never an average or a count.
    assert store.num_entries == 8 and store.total_bytes == 8 * EXPECTED[storage]
    assert store.nbytes_map(0) == dict.fromkeys(range(4), EXPECTED[storage])


def test_an_unknown_storage_dtype_is_refused():
    with pytest.raises(ValueError, match="storage dtype must be one of fp32, bf16, fp16, fp8, got 'int4'"):
        HostExpertStore(layers(), "int4")
