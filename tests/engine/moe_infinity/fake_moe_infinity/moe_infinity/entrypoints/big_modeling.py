"""Fake ``MoE``: the load config through ``ArcherConfig``, an expert cache sized by the ratio it applied.

Mirrors TorchMoE/MoE-Infinity@0690efefe42477164031e6020c986650d9f89e6a ``moe_infinity/entrypoints/big_modeling.py``
``MoE.__init__``: ``engine_config = ArcherConfig.load_from_json(config)`` (so the ratio arithmetic of
``ArcherConfig.__post_init__`` applies before anything is sized) and ``self.engine_config = engine_config``.
Whether experts are offloaded follows ``_gpt_oss_offload_enabled`` (TorchMoE/MoE-Infinity@0690efef...
``moe_infinity/runtime/model_offload.py``): offload only below a device ratio of 0.9, judged on the APPLIED ratio.
"""

from __future__ import annotations

import os
from pathlib import Path
from types import SimpleNamespace

import moe_infinity
from moe_infinity import FEATURES, record, write_record
from moe_infinity._world import (
    EXPERTS,
    HEAD_DIM,
    HEADS,
    HIDDEN,
    KV_HEADS,
    LAYERS,
    VOCAB,
    forward_pause,
    route,
)
from moe_infinity.runtime import OffloadEngine
from moe_infinity.utils import ArcherConfig

#: MoE-Infinity's native engine keeps process-global state: a second load in one process fails.
_NATIVE = {"loads": 0}
#: ``_GPT_OSS_RESIDENT_RATIO``: at or above this applied ratio every expert stays on the device.
RESIDENT_RATIO = 0.9
#: The smallest cache: one top-2 set per layer.
TOP_K_CAPACITY = 2 * LAYERS


class FakeModel:
    """The HF-module stand-in: a config, a dtype, and a forward that routes tokens through the cache."""

    def __init__(self, engine: OffloadEngine) -> None:
        self.config = SimpleNamespace(
            num_hidden_layers=LAYERS,
            num_attention_heads=HEADS,
            num_key_value_heads=KV_HEADS,
            head_dim=HEAD_DIM,
            hidden_size=HIDDEN,
            vocab_size=VOCAB,
            eos_token_id=VOCAB - 1,
        )
        self.dtype = "bfloat16"
        self.device = "cpu"
        self._engine = engine

    def forward_tokens(self, tokens: list[int]) -> None:
        for token in tokens:
            for layer in range(LAYERS):
                for expert in route(token, layer):
                    self._engine.access(layer, expert)
        forward_pause()


def _capacity(applied_ratio: float) -> int:
    total = LAYERS * EXPERTS
    if "offload" not in FEATURES or (applied_ratio >= RESIDENT_RATIO and "resident_fit" in FEATURES):
        return total
    return max(TOP_K_CAPACITY, int(total * applied_ratio * 0.5))


class MoE:
    def __init__(self, model_name_or_path: str, config: dict) -> None:
        if not isinstance(config, dict) or "offload_path" not in config:
            raise ValueError("config needs offload_path")
        if _NATIVE["loads"]:
            raise RuntimeError("fake native engine: process-global state does not survive a second load")
        engine_config = ArcherConfig.load_from_json(dict(config))
        _NATIVE["loads"] += 1
        Path(config["offload_path"]).mkdir(parents=True, exist_ok=True)
        self.engine = OffloadEngine(_capacity(engine_config.device_memory_ratio))
        self.model = FakeModel(self.engine)
        self.engine_config = engine_config
        applied = {
            "device_memory_ratio": engine_config.device_memory_ratio,
            "kv_cache_memory_ratio": getattr(engine_config, "kv_cache_memory_ratio", None),
        }
        record("MoE", model=model_name_or_path, config=dict(config), applied=applied, pid=os.getpid())
        write_record(
            f"load-{os.getpid()}-{_NATIVE['loads']}.json",
            {
                "model": model_name_or_path,
                "config": config,
                "applied": applied,
                "fake": moe_infinity.__fake__,
            },
        )
