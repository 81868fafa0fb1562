"""Real-shape byte accounting on meta tensors (nothing allocated): the host store built for the published
configs of the two Phase-A targets holds exactly the bytes the checkpoints store per routed expert."""

from __future__ import annotations

import torch

from pd_dflash.engine.reference.checkpoints.store import CheckpointExpertStore, meta_layers
from pd_dflash.engine.reference.families import expert_layout

#: Qwen/Qwen3-Coder-30B-A3B-Instruct config.json (the fields that size the experts).
QWEN3_CODER_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "hidden_size": 2048,
    "moe_intermediate_size": 768,
    "intermediate_size": 6144,
    "num_hidden_layers": 48,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "head_dim": 128,
    "vocab_size": 151936,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
#: openai/gpt-oss-20b config.json (the fields that size the experts), MXFP4 as published.
GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"],
    "model_type": "gpt_oss",
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "num_hidden_layers": 24,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "vocab_size": 201088,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "mxfp4"},
}


def meta_store(config) -> CheckpointExpertStore:
    layout = expert_layout(config)
    parts = meta_layers(layout)
    assert all(t.is_meta for t in parts.values())
    return CheckpointExpertStore(layout, parts)


def test_qwen3_coder_expert_bytes():
    store = meta_store(QWEN3_CODER_30B_A3B)
    assert store.storage == "bf16"
    assert store.expert_nbytes == 9_437_184 == 3 * 2048 * 768 * 2
    assert len(store.layer_ids) == 48 and store.num_experts == 128
    assert store.total_bytes == 57_982_058_496  # 57.98 GB of routed experts
    # The same bytes as transformers' own fused bf16 expert parameters of one layer (built on meta).
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = {
        k: v
        for k, v in QWEN3_CODER_30B_A3B.items()
        if k not in ("architectures", "model_type", "torch_dtype")
    }
    cfg["num_hidden_layers"] = 1
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**cfg)).to(torch.bfloat16)
    experts = model.model.layers[0].mlp.experts
    fused = sum(p.numel() * p.element_size() for p in experts.parameters())
    assert fused == 128 * store.expert_nbytes


def test_gpt_oss_20b_mxfp4_expert_bytes():
    store = meta_store(GPT_OSS_20B)
    assert store.storage == "mxfp4"
    h = i = 2880
    blocks = 2 * i * h // 2 + h * i // 2  # two FP4 codes per byte
    scales = 2 * i * h // 32 + h * i // 32  # one E8M0 byte per 32 weights
    biases = (2 * i + h) * 2  # bf16, as stored
    assert store.expert_nbytes == blocks + scales + biases == 13_236_480
    assert len(store.layer_ids) == 24 and store.num_experts == 32
    assert store.total_bytes == 10_165_616_640  # 10.17 GB of routed experts
    # Dequantised to bf16 the same expert is 3.76 x larger (what an engine that expands MXFP4 would move).
    dense = (h * 2 * i + i * h) * 2 + biases
    assert dense == 49_783_680 and round(dense / store.expert_nbytes, 2) == 3.76
