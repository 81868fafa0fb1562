"""Shared fixtures of the reference-engine tests: the trained ``micro`` preset (cached under $PD_DFLASH_CACHE,
see tests/conftest.py) and tiny random-weight models of each MoE family (for numerics, not for routing)."""

from __future__ import annotations

import copy

import pytest
import torch

from pd_dflash.engine.reference.presets.catalog import get_preset
from pd_dflash.engine.reference.presets.training import load_preset


@pytest.fixture(scope="session")
def micro():
    """(trained micro model, card); tests must deepcopy before mutating."""
    torch.set_num_threads(1)
    return load_preset(get_preset("micro"))


def tiny_model(family: str, seed: int = 0, **overrides):
    """A random-weight model of ``family`` (fp32, eval), small enough to build in milliseconds."""
    from transformers import (
        GptOssConfig,
        GptOssForCausalLM,
        MixtralConfig,
        MixtralForCausalLM,
        Qwen3MoeConfig,
        Qwen3MoeForCausalLM,
    )

    common = dict(
        vocab_size=64,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        num_experts_per_tok=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    torch.manual_seed(seed)
    if family == "qwen3_moe":
        model = Qwen3MoeForCausalLM(
            Qwen3MoeConfig(**common, num_experts=8, moe_intermediate_size=16, intermediate_size=64)
        )
    elif family == "gpt_oss":
        model = GptOssForCausalLM(
            GptOssConfig(
                **common,
                num_local_experts=8,
                intermediate_size=16,
                sliding_window=8,  # shorter than the sequences: the sliding masks really matter
                rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
            )
        )
    elif family == "mixtral":
        model = MixtralForCausalLM(MixtralConfig(**common, num_local_experts=8, intermediate_size=16))
    else:
        raise ValueError(family)
    return model.eval()


def eager_copy(model):
    ref = copy.deepcopy(model)
    ref.set_experts_implementation("eager")
    return ref


def record_figure(test: str, **values) -> None:
    """Append a GPU test's measured figures to ``$PD_DFLASH_GPU_FIGURES`` (JSON lines) when it is set: the GPU
    check puts them in its summary, so a run records what it measured, not only pass/fail."""
    import json
    import os

    path = os.environ.get("PD_DFLASH_GPU_FIGURES")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": test, **values}, default=str) + "\n")
