"""Fake ``ArcherConfig``: the load config, with the real ratio arithmetic of ``__post_init__``.

Mirrors TorchMoE/MoE-Infinity@0bfebf51a126613ca73e45426e9952b29ea46c51 ``moe_infinity/utils/config.py``
``ArcherConfig.__post_init__``: with the native engine on (the default), a ``kv_cache_memory_ratio`` of 0.0 is
auto-set to 0.15, and when that makes ``device_memory_ratio + kv_cache_memory_ratio > 1`` the device ratio is cut
to ``1 - 0.15``; a final sum above 1 raises. ``load_from_json`` rejects unknown keys, as ``HfArgumentParser
.parse_dict`` does. A build without ``kv_ratio_field`` (before the native KV split) has neither the field nor the
arithmetic.
"""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass

from moe_infinity import FEATURES


@dataclass
class _ArcherConfigBeforeKVSplit:
    offload_path: str = ""
    trace_capacity: int = 1000
    device_memory_ratio: float = 0.9
    host_memory_ratio: float = 0.9
    num_threads: int = 4
    speculative_prefetch: bool = False
    use_native_engine: bool = True

    @classmethod
    def load_from_json(cls, config_json: dict):
        unknown = sorted(set(config_json) - {f.name for f in dataclasses.fields(cls)})
        if unknown:
            raise ValueError(f"Some keys are not used by the HfArgumentParser: {unknown}")
        return cls(**config_json)

    def __post_init__(self) -> None:
        if not 0.0 <= self.device_memory_ratio <= 1.0:
            raise ValueError(f"device_memory_ratio must be in [0, 1], got {self.device_memory_ratio}")


@dataclass
class _ArcherConfigWithKVSplit(_ArcherConfigBeforeKVSplit):
    kv_cache_memory_ratio: float = 0.0

    def __post_init__(self) -> None:
        corrected = False
        if self.use_native_engine and self.kv_cache_memory_ratio == 0.0:
            self.kv_cache_memory_ratio = 0.15
            corrected = True
            warnings.warn(
                "kv_cache_memory_ratio was 0.0 with use_native_engine=True; auto-set to 0.15.", stacklevel=2
            )
        if corrected and self.device_memory_ratio + self.kv_cache_memory_ratio > 1.0:
            self.device_memory_ratio = max(0.0, 1.0 - self.kv_cache_memory_ratio)
            warnings.warn(
                f"device_memory_ratio auto-adjusted to {self.device_memory_ratio:.2f}", stacklevel=2
            )
        for name in ("device_memory_ratio", "kv_cache_memory_ratio"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {getattr(self, name)}")
        if self.device_memory_ratio + self.kv_cache_memory_ratio > 1.0:
            raise ValueError(
                f"device_memory_ratio ({self.device_memory_ratio}) + kv_cache_memory_ratio "
                f"({self.kv_cache_memory_ratio}) > 1.0"
            )


ArcherConfig = _ArcherConfigWithKVSplit if "kv_ratio_field" in FEATURES else _ArcherConfigBeforeKVSplit
