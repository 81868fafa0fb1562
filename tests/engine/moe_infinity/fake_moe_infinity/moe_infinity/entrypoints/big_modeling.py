"""Fake ``MoE``: validates the load config, sizes the expert cache from ``device_memory_ratio``."""

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

#: MoE-Infinity's native engine keeps process-global state: a second load in one process fails.
_NATIVE = {"loads": 0}
#: At or above this ratio every expert fits on the "device" (upstream: gpt-oss offloads only below 0.9).
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


class MoE:
    def __init__(self, model_name_or_path: str, config: dict) -> None:
        if not isinstance(config, dict) or "offload_path" not in config:
            raise ValueError("config needs offload_path")
        ratio = float(config.get("device_memory_ratio", 0.9))
        if not 0.0 <= ratio <= 1.0:
            raise ValueError(f"device_memory_ratio must lie in [0, 1], got {ratio}")
        if _NATIVE["loads"]:
            raise RuntimeError("fake native engine: process-global state does not survive a second load")
        _NATIVE["loads"] += 1
        Path(config["offload_path"]).mkdir(parents=True, exist_ok=True)
        total = LAYERS * EXPERTS
        if "offload" not in FEATURES or (ratio >= RESIDENT_RATIO and "resident_fit" in FEATURES):
            capacity = total
        else:
            capacity = max(TOP_K_CAPACITY, int(total * ratio * 0.5))
        self.engine = OffloadEngine(capacity)
        self.model = FakeModel(self.engine)
        self.engine_config = SimpleNamespace(
            speculative_prefetch=bool(config.get("speculative_prefetch", False)), **config
        )
        record("MoE", model=model_name_or_path, config=dict(config), pid=os.getpid())
        write_record(
            f"load-{os.getpid()}-{_NATIVE['loads']}.json",
            {"model": model_name_or_path, "config": config, "fake": moe_infinity.__fake__},
        )
