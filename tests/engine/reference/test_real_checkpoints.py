"""Real checkpoint layouts: the tiny checkpoints in the published layouts load (streamed, the model never
materialised on the host) into exactly the weights transformers loads, MXFP4 experts included, bit for bit."""

from __future__ import annotations

import pytest
import torch

from pd_dflash.engine.reference.checkpoints import mxfp4
from pd_dflash.engine.reference.checkpoints.loader import load_checkpoint
from pd_dflash.engine.reference.checkpoints.tiny import materialise
from tests.engine.reference.helpers import hf_model


def test_mxfp4_dequantisation_is_bit_identical_to_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 64, 4, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(
        0, 256, (3, 64, 4), generator=gen, dtype=torch.uint8
    )  # every exponent, inf included
    for dtype in (torch.bfloat16, torch.float32):
        ref = convert_moe_packed_tensors(blocks.clone(), scales.clone(), dtype=dtype)
        ours = torch.stack([mxfp4.dequantize(blocks[e], scales[e], dtype) for e in range(3)])
        assert ours.shape == ref.shape == (3, 128, 64)
        assert torch.equal(ours.view(torch.uint8), ref.view(torch.uint8))  # bits, NaN/inf/-0 included


@pytest.mark.parametrize("name", ["tiny-real-qwen3-moe", "tiny-real-gpt-oss"])
def test_streamed_load_equals_transformers_load(name):
    directory = materialise(name)
    loaded = load_checkpoint(name, str(directory), device=torch.device("cpu"))
    ref = hf_model(directory)
    assert loaded.store.storage == ("mxfp4" if "gpt-oss" in name else "bf16")
    ours = dict(loaded.model.named_parameters())
    theirs = dict(ref.named_parameters())
    assert ours and all(torch.equal(ours[n], theirs[n]) for n in ours)
    assert {n for n in theirs if ".mlp.experts." not in n} == set(ours)  # only the experts left the model
    for layer in loaded.store.layer_ids:
        experts = ref.model.layers[layer].mlp.experts
        for e in range(loaded.store.num_experts):
            weights = loaded.store.dequantize(loaded.store.payload(layer, e), ref.dtype)
            for got, tensor_name in zip(weights, loaded.family.tensor_names, strict=True):
                assert torch.equal(got, getattr(experts, tensor_name)[e]), (layer, e, tensor_name)
    card = loaded.card
    assert card["load_bytes"] == card["checkpoint_bytes"] and card["unused_tensors"] == []
