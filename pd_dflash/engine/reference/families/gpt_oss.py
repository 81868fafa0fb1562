"""gpt-oss (``model_type: gpt_oss``, ``GptOssForCausalLM``): gpt-oss-20b's family.

- experts: biased, interleaved gate/up columns, a clamped GLU (``alpha``, ``limit``), ``x @ w`` orientation;
  router ``mlp.router`` (weight + bias), the MoE block returns ``(hidden, router_scores)``;
- attention: q/k/v/o biases and per-head ``sinks``; layers alternate sliding and full attention
  (``layer_types``);
- published layout (MXFP4): ``mlp.experts.{gate_up,down}_proj_{blocks,scales,bias}``, each ``[E, ...]``; the
  parts are the six tensors as stored (FP4 blocks + E8M0 scales + bf16 biases). A gpt-oss checkpoint saved
  dense (``gate_up_proj [E, H, 2I]`` ...) is read as stored too;
- chat: released for chat only (the harmony format), so every gpt-oss target is prompted through its template.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pd_dflash.engine.reference.families.base import LayoutDims, MoEFamily
from pd_dflash.engine.reference.families.layouts import MXFP4_GROUP, Part
from pd_dflash.engine.reference.families.tiny_files import COMMON, save_sharded, write_tokenizer
from pd_dflash.errors import InputError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from pd_dflash.engine.reference.families.base import ExpertFn
    from pd_dflash.engine.reference.offload.grouped import GroupedFn

_SPECIALS = ["<|endoftext|>", "<|start|>", "<|message|>", "<|end|>", "<|return|>", "<|channel|>"]
HARMONY_TEMPLATE = (
    "{%- for message in messages %}<|start|>{{ message.role }}<|message|>{{ message.content }}<|end|>"
    "{%- endfor %}{%- if add_generation_prompt %}<|start|>assistant{%- endif %}"
)
#: As in openai/gpt-oss-20b's config.json.
QUANTIZATION = {
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
    "quant_method": "mxfp4",
}
#: As published: yarn over a 4096-token original window.
_ROPE = {
    "rope_type": "yarn",
    "rope_theta": 150000.0,
    "factor": 32.0,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    "original_max_position_embeddings": 4096,
    "truncate": False,
}


class GptOss(MoEFamily):
    name = "gpt_oss"
    architecture = "GptOssForCausalLM"
    router_attr = "router"
    tensor_names = ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias")
    mlp_returns_tuple = True
    quant_methods = ("mxfp4",)
    chat_only = True
    attention_tensors = ("q_proj.bias", "k_proj.bias", "v_proj.bias", "o_proj.bias", "sinks")
    router_tensors = ("mlp.router.weight", "mlp.router.bias")
    tiny_name = "tiny-real-gpt-oss"

    def expert_fn(self, experts: nn.Module) -> ExpertFn:
        import torch

        alpha, limit = float(experts.alpha), float(experts.limit)

        def gpt_oss_expert(x: torch.Tensor, w: list[torch.Tensor]) -> torch.Tensor:
            gate_up_w, gate_up_b, down_w, down_b = w
            gate_up = x @ gate_up_w + gate_up_b
            gate, up = gate_up[..., ::2], gate_up[..., 1::2]
            gate = gate.clamp(min=None, max=limit)
            up = up.clamp(min=-limit, max=limit)
            glu = gate * torch.sigmoid(gate * alpha)
            return ((up + 1) * glu) @ down_w + down_b

        return gpt_oss_expert

    def grouped_fn(self, experts: nn.Module) -> GroupedFn:
        import torch

        alpha, limit = float(experts.alpha), float(experts.limit)

        def gpt_oss_grouped(x, pool, mm, slots):
            gate_up_w, gate_up_b, down_w, down_b = pool
            gate_up = mm(x, gate_up_w) + gate_up_b[slots]
            gate, up = gate_up[..., ::2], gate_up[..., 1::2]
            gate = gate.clamp(min=None, max=limit)
            up = up.clamp(min=-limit, max=limit)
            glu = gate * torch.sigmoid(gate * alpha)
            return mm((up + 1) * glu, down_w) + down_b[slots]

        return gpt_oss_grouped

    def attention_windows(self, config: Any) -> list[int | None]:
        """Sliding layers (``layer_types``) use ``sliding_window``; the others attend to everything."""
        types = config.layer_types[: config.num_hidden_layers]
        return [config.sliding_window if t == "sliding_attention" else None for t in types]

    def expert_parts(
        self, dims: LayoutDims, fdtype: str, method: str | None, where: str
    ) -> tuple[str, tuple[Part, ...]]:
        hidden, inter = dims.hidden, dims.intermediate
        if method != "mxfp4":
            return fdtype.lower(), (
                Part("gate_up_proj", (hidden, 2 * inter), fdtype),
                Part("gate_up_proj_bias", (2 * inter,), fdtype),
                Part("down_proj", (inter, hidden), fdtype),
                Part("down_proj_bias", (hidden,), fdtype),
            )
        if hidden % MXFP4_GROUP or inter % MXFP4_GROUP:
            raise InputError(
                f"hidden_size {hidden} and intermediate_size {inter} must be multiples of {MXFP4_GROUP} for MXFP4",
                where=where,
            )
        g_h, g_i = hidden // MXFP4_GROUP, inter // MXFP4_GROUP
        return "mxfp4", (
            Part("gate_up_proj_blocks", (2 * inter, g_h, 16), "U8"),
            Part("gate_up_proj_scales", (2 * inter, g_h), "U8"),
            Part("gate_up_proj_bias", (2 * inter,), fdtype),
            Part("down_proj_blocks", (hidden, g_i, 16), "U8"),
            Part("down_proj_scales", (hidden, g_i), "U8"),
            Part("down_proj_bias", (hidden,), fdtype),
        )

    def preset_config(self, common: dict[str, Any], *, experts: int, intermediate: int) -> Any:
        from transformers import GptOssConfig

        # The real model's sliding window is 128 over alternating layers; keep the pattern.
        return GptOssConfig(
            **common,
            num_local_experts=experts,
            intermediate_size=intermediate,
            sliding_window=128,
            rope_parameters={"rope_type": "default", "rope_theta": 10_000.0},
        )

    def model_class(self) -> type:
        from transformers import GptOssForCausalLM

        return GptOssForCausalLM

    def write_tiny(self, path: Path, seed: int = 0, **overrides: Any) -> dict[str, Any]:
        """A ``GptOssForCausalLM`` as OpenAI publishes it: random non-expert weights from the model class (bf16),
        random MXFP4 codes and scales for the experts (``*_blocks`` uint8 ``[E, R, G, 16]``, ``*_scales`` uint8
        ``[E, R, G]``), ``quantization_config`` as published, the published rope (yarn). ``overrides`` replace
        config fields (layers alternate sliding and full attention, as published)."""
        import torch
        from transformers import GenerationConfig, GptOssConfig, GptOssForCausalLM

        path.mkdir(parents=True, exist_ok=True)
        ids = write_tokenizer(path, _SPECIALS, HARMONY_TEMPLATE, eos="<|return|>")
        layers = int(overrides.get("num_hidden_layers", COMMON["num_hidden_layers"]))
        alternating = [("sliding_attention", "full_attention")[i % 2] for i in range(layers)]
        fields = dict(
            COMMON,
            num_local_experts=8,
            intermediate_size=64,
            sliding_window=8,
            layer_types=alternating,
            max_position_embeddings=131072,
            rope_parameters=dict(_ROPE),
            pad_token_id=ids["<|endoftext|>"],
        )
        config = GptOssConfig(**{**fields, **overrides})
        torch.manual_seed(seed)
        model = GptOssForCausalLM(config).to(torch.bfloat16)
        gen = torch.Generator().manual_seed(seed + 1)
        state = {}
        for name, tensor in model.state_dict().items():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                state.update(_random_mxfp4(name, tensor.shape, gen))
            else:
                state[name] = tensor.contiguous()
        config_dict = config.to_dict()
        config_dict.update(
            architectures=[self.architecture], quantization_config=QUANTIZATION, dtype="bfloat16"
        )
        (path / "config.json").write_text(json.dumps(config_dict, indent=2, sort_keys=True) + "\n")
        GenerationConfig(pad_token_id=ids["<|endoftext|>"]).save_pretrained(str(path))
        save_sharded(state, path)
        return {"layout": "gpt-oss as published: MXFP4 experts, bf16 rest", "seed": seed}


def _random_mxfp4(name: str, dense_shape: torch.Size, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Blocks and scales for an ``[E, in, out]`` dense expert tensor: stored ``[E, out, in/32, 16]`` + scales
    ``[E, out, in/32]`` (the published orientation), scales around 2^-6 so activations stay O(1)."""
    import torch

    experts, fan_in, fan_out = dense_shape
    groups = fan_in // MXFP4_GROUP
    blocks = torch.randint(0, 256, (experts, fan_out, groups, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(119, 124, (experts, fan_out, groups), generator=gen, dtype=torch.uint8)
    return {f"{name}_blocks": blocks, f"{name}_scales": scales}


FAMILY = GptOss()
