"""The one interface every MoE family implements: what the engine, the checkpoint checks, the presets and the
tiny checkpoints need to know about a transformers 5.x MoE family, and nothing else.

Experts are fused 3-D tensors (``experts.gate_up_proj[e]`` is one expert's contiguous slice). Each family's
expert compute mirrors its *eager* experts forward operation for operation — ``expert_fn`` for one expert's
tensors, ``grouped_fn`` over the cache's slot pool for every routed (token, k) pair of a layer at once
(``offload/grouped.py``: one grouped GEMM per projection) — so offloaded experts give the same bits as the model's own
eager path (tested against ``generate``).

The defaults here are the transformers MoE conventions most families share (router ``gate``, fused SwiGLU
experts ``gate_up_proj`` + ``down_proj``, every layer an MoE layer, ``sliding_window`` on every layer when
set); a family module overrides what differs. torch and transformers are imported inside the methods that
compute, so the checkpoint and preset facts stay readable without torch (``pd-dflash plan`` reads them).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

from pd_dflash.engine.reference.families.layouts import ExpertLayout, Part
from pd_dflash.errors import InputError

if TYPE_CHECKING:
    import torch
    from torch import nn

    from pd_dflash.engine.reference.offload.grouped import GroupedFn

    ExpertFn = Callable[[torch.Tensor, list[torch.Tensor]], torch.Tensor]


@dataclass(frozen=True)
class LayoutDims:
    """The ``config.json`` sizes an expert layout is computed from."""

    hidden: int
    layers: int
    experts: int
    intermediate: int


class MoEFamily(ABC):
    """One model family (one instance, ``FAMILY``, per module of this package; ``families.FAMILIES`` by name)."""

    #: transformers' ``model_type`` (the registry key).
    name: ClassVar[str]
    #: ``config.json: architectures[0]`` of the published checkpoints the engine reads; None: presets only.
    architecture: ClassVar[str | None] = None
    #: Attribute of the MoE block holding the router.
    router_attr: ClassVar[str] = "gate"
    #: Per-expert tensors of the experts module, in payload order.
    tensor_names: ClassVar[tuple[str, ...]] = ("gate_up_proj", "down_proj")
    #: The MoE block's forward returns ``(hidden, router_scores)`` instead of ``hidden``.
    mlp_returns_tuple: ClassVar[bool] = False
    #: ``config.json`` key of one expert's intermediate width.
    intermediate_key: ClassVar[str] = "intermediate_size"
    #: ``quantization_config.quant_method`` values its published checkpoints use (unquantized always reads).
    quant_methods: ClassVar[tuple[str, ...]] = ()
    #: Released for chat only: prompted through its chat template whatever its model id says.
    chat_only: ClassVar[bool] = False
    #: A decoder layer's attention tensors besides the q/k/v/o weights; an MoE layer's router tensors.
    attention_tensors: ClassVar[tuple[str, ...]] = ()
    router_tensors: ClassVar[tuple[str, ...]] = ("mlp.gate.weight",)
    #: Name of its tiny real-layout checkpoint (``write_tiny``), None without one.
    tiny_name: ClassVar[str | None] = None

    # -- the model (torch) ------------------------------------------------------------------------------------

    def experts_module(self, layer: nn.Module) -> nn.Module | None:
        """The layer's experts module, or None for a dense layer (e.g. Qwen3 ``mlp_only_layers``)."""
        mlp = getattr(layer, "mlp", None)
        if mlp is None or not hasattr(mlp, self.router_attr):
            return None
        return getattr(mlp, "experts", None)

    def expert_fn(self, experts: nn.Module) -> ExpertFn:
        """One expert's output on its tokens, from that expert's tensors (``tensor_names`` order): the fused
        SwiGLU of transformers' default experts (``act(gate) * up``, then down)."""
        from torch.nn import functional as F

        act = experts.act_fn

        def fused_expert(x: torch.Tensor, w: list[torch.Tensor]) -> torch.Tensor:
            gate_up_w, down_w = w
            gate, up = F.linear(x, gate_up_w).chunk(2, dim=-1)
            return F.linear(act(gate) * up, down_w)

        return fused_expert

    def grouped_fn(self, experts: nn.Module) -> GroupedFn:
        """``expert_fn`` over sorted rows and the slot pool: ``mm(x, w)`` multiplies each row by its slot's
        ``w``, ``slots`` indexes per-slot vectors (biases). Pool tensors are in ``tensor_names`` order."""
        act = experts.act_fn

        def fused_grouped(x, pool, mm, slots):
            gate_up_w, down_w = pool  # [slots, 2I, H], [slots, H, I]: F.linear's layout
            gate, up = mm(x, gate_up_w.transpose(-2, -1)).chunk(2, dim=-1)
            return mm(act(gate) * up, down_w.transpose(-2, -1))

        return fused_grouped

    def mlp(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor:
        out = block(x)
        return out[0] if self.mlp_returns_tuple and isinstance(out, tuple) else out

    def attention_windows(self, config: Any) -> list[int | None]:
        """Each decoder layer's attention window (None: full causal), by transformers' rule for the family:
        here every layer slides when ``sliding_window`` is set."""
        return [getattr(config, "sliding_window", None)] * config.num_hidden_layers

    # -- the published checkpoint (torch-free) ------------------------------------------------------------------

    def layout_dims(self, config: dict[str, Any], where: str) -> LayoutDims:
        try:
            return LayoutDims(
                hidden=int(config["hidden_size"]),
                layers=int(config["num_hidden_layers"]),
                # Published Qwen3-MoE configs say num_experts; transformers 5 writes num_local_experts.
                experts=int(config.get("num_experts") or config["num_local_experts"]),
                intermediate=int(config[self.intermediate_key]),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise InputError(f"missing or invalid field {exc}", where=where) from None

    def moe_layers(self, config: dict[str, Any], dims: LayoutDims) -> tuple[int, ...]:
        """The decoder layers with routed experts."""
        return tuple(range(dims.layers))

    def expert_parts(
        self, dims: LayoutDims, fdtype: str, method: str | None, where: str
    ) -> tuple[str, tuple[Part, ...]]:
        """(storage name, the parts of one expert's payload) of its published checkpoints."""
        raise NotImplementedError(f"{self.name} has no published checkpoint layout")

    def expert_layout(
        self, config: dict[str, Any], dims: LayoutDims, fdtype: str, method: str | None, where: str
    ) -> ExpertLayout:
        """Its checkpoints' expert layout (``families.expert_layout`` checks the architecture and the
        quantization method first)."""
        assert self.architecture is not None, self.name
        storage, parts = self.expert_parts(dims, fdtype, method, where)
        moe = self.moe_layers(config, dims)
        return ExpertLayout(self.architecture, self.name, storage, moe, dims.experts, parts)

    def non_expert_tensors(self, config: dict[str, Any], layout: ExpertLayout) -> list[str]:
        """The non-expert tensors every checkpoint of this family must hold (the plan-time completeness check;
        the loader also checks every parameter of the built model)."""
        names = ["model.embed_tokens.weight", "model.norm.weight"]
        if not config.get("tie_word_embeddings", False):
            names.append("lm_head.weight")
        attn = ["q_proj.weight", "k_proj.weight", "v_proj.weight", "o_proj.weight", *self.attention_tensors]
        for i in range(int(config["num_hidden_layers"])):
            p = f"model.layers.{i}"
            names += [f"{p}.input_layernorm.weight", f"{p}.post_attention_layernorm.weight"]
            names += [f"{p}.self_attn.{a}" for a in attn]
            if i in layout.moe_layers:
                names += [f"{p}.{r}" for r in self.router_tensors]
        return names

    # -- presets and tiny checkpoints -----------------------------------------------------------------------

    @abstractmethod
    def preset_config(self, common: dict[str, Any], *, experts: int, intermediate: int) -> Any:
        """A preset's transformers config: ``common`` (the fields every family's config takes) plus the
        family's own (``presets/catalog.build_config``)."""

    @abstractmethod
    def model_class(self) -> type:
        """transformers' ``*ForCausalLM`` class of the family."""

    def write_tiny(self, path: Path, seed: int = 0, **overrides: Any) -> dict[str, Any]:
        """Write the family's tiny random checkpoint (``tiny_name``) in its published layout into ``path``;
        ``overrides`` replace config fields. Returns card facts (``checkpoints/tiny.materialise``)."""
        raise NotImplementedError(f"{self.name} has no tiny checkpoint")
