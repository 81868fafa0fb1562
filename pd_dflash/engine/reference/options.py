"""Options of the reference engine (``models[].engine_options`` when ``engine: reference``). Pure pydantic."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

PositiveInt = Annotated[int, Field(ge=1)]


class ReferenceOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    #: Drafter used by the speculative baselines: a DFlash drafter (a preset's trained one per block size, or a
    #: checkpoint's published ``models[].draft``) or an early-exit self-drafter (first ``early_exit_layers`` target
    #: layers + the target head).
    drafter: Literal["dflash", "early_exit"] = "dflash"
    early_exit_layers: PositiveInt = 1
    #: Distillation steps of a preset's DFlash drafters (default: the preset's budget; part of their cache key).
    drafter_train_steps: PositiveInt | None = None
    #: CPU link emulation: each host→device expert transfer takes bytes/BW + latency of wall time.
    emulated_h2d_gbps: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] | None = None
    emulated_latency_us: Annotated[float, Field(ge=0.0, allow_inf_nan=False)] = 0.0
    #: Expert-cache eviction: the round plan (every configuration; docs/reference-engine.md "Offload"), or
    #: plain LRU / LFU (ablations).
    eviction: Literal["plan", "lru", "lfu"] = "plan"
    #: Device expert-cache capacity in bytes for offloaded cells (overrides memory.expert_cache_fraction).
    expert_cache_bytes: PositiveInt | None = None
    #: Compute dtype of the target ("auto": a preset's fp32, a checkpoint's own dtype).
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    #: Seed of a preset's training (part of the preset cache key).
    train_seed: int = 0
    #: How expert weights are stored in the host store and moved ("auto" = the compute dtype; fp8 = e4m3
    #: with a per-expert scale, dequantised once when it lands in a device cache slot).
    storage_dtype: Literal["auto", "fp32", "bf16", "fp16", "fp8"] = "auto"
    #: OURS's predictor is route-ahead ∪ history (what the request's rows routed in its last verify, issued
    #: while the next block is drafted); false = route-ahead alone (an ablation).
    route_ahead_history: bool = True
    #: OURS: verify a prefix of the drafted block when the next row's new experts cost more link time than its
    #: expected accepted token saves (lossless; needs a known link rate); "full" verifies every row.
    verify_width: Literal["cost_aware", "full"] = "cost_aware"
    #: Deficit schedulers (B2: tokens; OURS: tokens and expert bytes). Budgets are per scheduling step (one
    #: batched verify); caps bound the carried deficit and must be ≥ the largest single demand.
    #: Defaults: tokens budget = c·B, tokens cap = max(2·budget, longest prompt, B); bytes budget = a rate,
    #: the link's bytes per second of wall time between steps (absent without a known link rate; a value here
    #: fixes it per step instead), bytes cap = the largest route-ahead fetch one round can make.
    scheduler_budget_tokens: PositiveInt | None = None
    scheduler_cap_tokens: PositiveInt | None = None
    scheduler_budget_bytes: PositiveInt | None = None
    scheduler_cap_bytes: PositiveInt | None = None
    #: Directory for trained presets and drafters (default: $PD_DFLASH_CACHE or ~/.cache/pd-dflash).
    cache_dir: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _no_prefetcher(cls, data: Any) -> Any:
        """The prefetcher is the configuration's (``baselines.py``), not an option: say so instead of "extra"."""
        if isinstance(data, dict) and "prefetcher" in data:
            raise ValueError(
                "prefetcher is no engine option: each configuration names its prefetcher in pd_dflash/baselines.py "
                "(prefetcher: none there is an on-demand-only configuration); drop engine_options.prefetcher"
            )
        return data
