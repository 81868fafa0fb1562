"""Qwen3-MoE (``model_type: qwen3_moe``, ``Qwen3MoeForCausalLM``): Qwen3-Coder-30B-A3B's family.

- experts: transformers' fused SwiGLU (the base class's), router ``mlp.gate``, q/k RMS norms in attention;
- dense layers: ``mlp_only_layers`` and ``decoder_sparse_step`` say which layers have no routed experts;
- published layout (hub, bf16): ``mlp.experts.{e}.{gate,up,down}_proj.weight``, read into the parts
  ``gate_up_proj [2I, H]`` (gate rows, then up rows: transformers' fused layout) and ``down_proj [H, I]``;
- chat: ChatML (``<|im_start|>role ... <|im_end|>``); an instruct id is prompted through it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pd_dflash.engine.reference.families.base import LayoutDims, MoEFamily
from pd_dflash.engine.reference.families.layouts import Part
from pd_dflash.engine.reference.families.tiny_files import COMMON, write_tokenizer

_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}"
)


class Qwen3Moe(MoEFamily):
    name = "qwen3_moe"
    architecture = "Qwen3MoeForCausalLM"
    intermediate_key = "moe_intermediate_size"
    attention_tensors = ("q_norm.weight", "k_norm.weight")
    tiny_name = "tiny-real-qwen3-moe"

    def moe_layers(self, config: dict[str, Any], dims: LayoutDims) -> tuple[int, ...]:
        step = int(config.get("decoder_sparse_step", 1) or 1)
        dense = set(config.get("mlp_only_layers") or [])
        return tuple(
            i for i in range(dims.layers) if i not in dense and dims.experts > 0 and (i + 1) % step == 0
        )

    def expert_parts(
        self, dims: LayoutDims, fdtype: str, method: str | None, where: str
    ) -> tuple[str, tuple[Part, ...]]:
        inter, hidden = dims.intermediate, dims.hidden
        parts = (
            Part(
                "gate_up_proj",
                (2 * inter, hidden),
                fdtype,
                pieces=(("gate_proj.weight", inter), ("up_proj.weight", inter)),
            ),
            Part("down_proj", (hidden, inter), fdtype, pieces=(("down_proj.weight", hidden),)),
        )
        return fdtype.lower(), parts

    def preset_config(self, common: dict[str, Any], *, experts: int, intermediate: int) -> Any:
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(
            **common,
            num_experts=experts,
            moe_intermediate_size=intermediate,
            intermediate_size=4 * common["hidden_size"],
            norm_topk_prob=True,
        )

    def model_class(self) -> type:
        from transformers import Qwen3MoeForCausalLM

        return Qwen3MoeForCausalLM

    def write_tiny(
        self, path: Path, seed: int = 0, *, max_shard_size: str = "200KB", **overrides: Any
    ) -> dict[str, Any]:
        """A ``Qwen3MoeForCausalLM`` saved by transformers' ``save_pretrained`` in bf16 (the hub layout),
        sharded with an index like the real one. ``overrides`` replace config fields, e.g. a real routing
        geometry (``num_hidden_layers``, ``num_experts``, ``num_experts_per_tok``:
        ``benchmarks/engine_overhead.py``)."""
        import torch
        from transformers import GenerationConfig, Qwen3MoeConfig, Qwen3MoeForCausalLM

        path.mkdir(parents=True, exist_ok=True)
        ids = write_tokenizer(path, _SPECIALS, CHAT_TEMPLATE, eos="<|im_end|>")
        fields = dict(
            COMMON,
            num_experts=8,
            moe_intermediate_size=32,
            intermediate_size=128,
            norm_topk_prob=True,
            max_position_embeddings=4096,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0},
            pad_token_id=ids["<|endoftext|>"],
        )
        config = Qwen3MoeConfig(**{**fields, **overrides})
        torch.manual_seed(seed)
        model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
        model.generation_config = GenerationConfig(pad_token_id=ids["<|endoftext|>"])
        model.save_pretrained(str(path), max_shard_size=max_shard_size)  # sharded + index, like the hub
        return {"layout": "qwen3-moe hub layout, bf16", "seed": seed}


FAMILY = Qwen3Moe()
