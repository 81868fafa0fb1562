"""What the engine needs to know about each transformers 5.x MoE family.

Experts are fused 3-D tensors (``experts.gate_up_proj[e]`` is one expert's contiguous slice). Each family's
expert compute mirrors its *eager* experts forward operation for operation — ``expert_fn`` for one expert's
tensors, ``grouped_fn`` over the cache's slot pool for every routed (token, k) pair of a layer at once
(``grouped.py``: one grouped GEMM per projection) — so offloaded experts give the same bits as the model's own
eager path (tested against ``generate``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from pd_dflash.engine.reference.grouped import GroupedFn

ExpertFn = Callable[[torch.Tensor, list[torch.Tensor]], torch.Tensor]


@dataclass(frozen=True)
class MoEFamily:
    name: str
    #: Attribute of the MoE block holding the router (``gate``; ``router`` for gpt-oss).
    router_attr: str
    #: Per-expert tensors of the experts module, in payload order.
    tensor_names: tuple[str, ...]
    #: The MoE block's forward returns ``(hidden, router_scores)`` instead of ``hidden``.
    mlp_returns_tuple: bool = False

    def experts_module(self, layer: nn.Module) -> nn.Module | None:
        """The layer's experts module, or None for a dense layer (e.g. Qwen3 ``mlp_only_layers``)."""
        mlp = getattr(layer, "mlp", None)
        if mlp is None or not hasattr(mlp, self.router_attr):
            return None
        return getattr(mlp, "experts", None)

    def expert_fn(self, experts: nn.Module) -> ExpertFn:
        """One expert's output on its tokens, from that expert's tensors (``tensor_names`` order)."""
        if self.name == "gpt_oss":
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
        act = experts.act_fn

        def fused_expert(x: torch.Tensor, w: list[torch.Tensor]) -> torch.Tensor:
            gate_up_w, down_w = w
            gate, up = F.linear(x, gate_up_w).chunk(2, dim=-1)
            return F.linear(act(gate) * up, down_w)

        return fused_expert

    def grouped_fn(self, experts: nn.Module) -> GroupedFn:
        """``expert_fn`` over sorted rows and the slot pool: ``mm(x, w)`` multiplies each row by its slot's
        ``w``, ``slots`` indexes per-slot vectors (gpt-oss's biases). Pool tensors are in ``tensor_names`` order."""
        if self.name == "gpt_oss":
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
        act = experts.act_fn

        def fused_grouped(x, pool, mm, slots):
            gate_up_w, down_w = pool  # [slots, 2I, H], [slots, H, I]: F.linear's layout
            gate, up = mm(x, gate_up_w.transpose(-2, -1)).chunk(2, dim=-1)
            return mm(act(gate) * up, down_w.transpose(-2, -1))

        return fused_grouped

    def mlp(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = block(x)
        return out[0] if self.mlp_returns_tuple and isinstance(out, tuple) else out


FAMILIES: dict[str, MoEFamily] = {
    "qwen3_moe": MoEFamily("qwen3_moe", "gate", ("gate_up_proj", "down_proj")),
    "mixtral": MoEFamily("mixtral", "gate", ("gate_up_proj", "down_proj")),
    "gpt_oss": MoEFamily(
        "gpt_oss",
        "router",
        ("gate_up_proj", "gate_up_proj_bias", "down_proj", "down_proj_bias"),
        mlp_returns_tuple=True,
    ),
}


def family_of(config) -> MoEFamily:
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise ValueError(
            f"model_type {model_type!r} is not supported by the reference engine "
            f"(supported: {', '.join(FAMILIES)})"
        )
    return FAMILIES[model_type]


def num_experts(config) -> int:
    return int(getattr(config, "num_experts", None) or config.num_local_experts)
