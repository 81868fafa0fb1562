"""Mixtral (``model_type: mixtral``): a preset family only (``mini-mixtral``, Mixtral-8x7B's routing shape).

Everything follows the base class's conventions (router ``mlp.gate``, fused SwiGLU experts, every layer an MoE
layer); the engine reads no published Mixtral checkpoint (``architecture`` None: ``config.json`` refuses it).
"""

from __future__ import annotations

from typing import Any

from pd_dflash.engine.reference.families.base import MoEFamily


class Mixtral(MoEFamily):
    name = "mixtral"

    def preset_config(self, common: dict[str, Any], *, experts: int, intermediate: int) -> Any:
        from transformers import MixtralConfig

        return MixtralConfig(**common, num_local_experts=experts, intermediate_size=intermediate)

    def model_class(self) -> type:
        from transformers import MixtralForCausalLM

        return MixtralForCausalLM


FAMILY = Mixtral()
