"""Options of the reference engine (``models[].engine_options`` when ``engine: reference``). Pure pydantic."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field


class ReferenceOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    #: Drafter used by the speculative baselines: the trained DFlash-style block drafter or an early-exit
    #: self-drafter (first ``early_exit_layers`` target layers + the target head).
    drafter: Literal["dflash", "early_exit"] = "dflash"
    early_exit_layers: Annotated[int, Field(ge=1)] = 1
    #: CPU link emulation: each host→device expert transfer takes bytes/BW + latency of wall time.
    emulated_h2d_gbps: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] | None = None
    emulated_latency_us: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 0.0
    eviction: Literal["lru", "lfu"] = "lru"
    #: Device expert-cache capacity in bytes for offloaded cells (overrides memory.expert_cache_fraction).
    expert_cache_bytes: Annotated[int, Field(ge=1)] | None = None
    #: The AR prefetcher of B0/B1 ("none" = on-demand fetches only).
    prefetcher: Literal["activation_aware", "none"] = "activation_aware"
    #: Compute dtype of the target ("auto": a preset's fp32, a checkpoint's own dtype).
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    #: Seed of a preset's training (part of the preset cache key).
    train_seed: int = 0
    #: How expert weights are stored in the host store and moved ("auto" = the compute dtype; fp8 = e4m3
    #: with a per-expert scale, dequantized on use).
    storage_dtype: Literal["auto", "fp32", "bf16", "fp16", "fp8"] = "auto"
    #: Route-ahead ablation: also prefetch the next round's likely experts.
    cross_round_prefetch: bool = False
    #: Directory for trained presets (default: $PD_DFLASH_CACHE or ~/.cache/pd-dflash).
    cache_dir: str | None = None
