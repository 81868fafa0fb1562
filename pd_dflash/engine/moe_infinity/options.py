"""Options of the MoE-Infinity adapter (``models[].engine_options`` when ``engine: moe_infinity``).

Pure pydantic (no torch, no moe_infinity): ``plan`` and the driver validate these before anything starts.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

#: Keys the adapter sets itself in MoE-Infinity's load config / the serving config; options may not override.
ADAPTER_MOE_KEYS = frozenset({"offload_path", "device_memory_ratio", "kv_cache_memory_ratio"})
ADAPTER_SERVING_KEYS = frozenset(
    {
        "dtype",
        "block_size",
        "num_layers",
        "num_kv_heads",
        "head_dim",
        "num_kv_blocks",
        "max_batch_size",
        "eos_token_id",
        "device_memory_ratio",
        "verify_token_budget",
        "verify_token_deficit_cap",
        "verify_expert_byte_budget",
        "verify_expert_byte_deficit_cap",
    }
)


class MoEInfinityOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    #: Tokenizer for the prompts (HF id or local directory, read offline); default: the model id.
    tokenizer: str | None = None
    #: Let the tokenizer run code shipped with the checkpoint (transformers' ``trust_remote_code``). Off unless a
    #: spec turns it on for a model whose tokenizer needs it. (MoE-Infinity itself loads the target and the DFlash
    #: drafter with ``trust_remote_code=True``; the adapter cannot change that.)
    trust_remote_code: bool = False
    #: Every request generates exactly ``max_new_tokens`` (vLLM's ``ignore_eos``), so baselines compare equal work.
    ignore_eos: bool = True
    #: dtype the DFlash drafter is loaded in.
    draft_dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    #: Verify-token budget per scheduling pass for B2 and OURS. "block" = B, upstream's
    #: ``build_b2_serving_config``; "block_x_concurrency" = B·c (every in-flight request may verify each pass).
    verify_token_budget: Literal["block", "block_x_concurrency"] | Annotated[int, Field(ge=1)] = "block"
    #: OURS's expert-byte budget per scheduling pass: a byte count, or "h2d_window" = the probed host→device
    #: bandwidth × ``expert_byte_window_seconds`` (the bytes the link moves while a block is drafted).
    expert_byte_budget: Literal["h2d_window"] | Annotated[int, Field(ge=1)] = "h2d_window"
    #: Default ≈ upstream's measured draft + router window per round (its BM4 run of offloaded gpt-oss-20b, B=16:
    #: 0.127 s of drafting and 0.141 s of routers over 11 rounds, about 24 ms per round).
    expert_byte_window_seconds: Annotated[float, Field(gt=0.0, allow_inf_nan=False)] = 0.02
    #: Extra MoE-Infinity load-config keys (ArcherConfig: num_threads, trace_capacity, ...).
    moe_config: dict[str, Any] = Field(default_factory=dict)
    #: Extra ContinuousBatchingEngine config keys (e.g. max_tokens_per_step).
    serving_config: dict[str, Any] = Field(default_factory=dict)

    @field_validator("moe_config")
    @classmethod
    def _moe_config(cls, v: dict[str, Any]) -> dict[str, Any]:
        clash = sorted(ADAPTER_MOE_KEYS & v.keys())
        if clash:
            raise ValueError(
                f"{', '.join(clash)} come from the spec (models[].offload_dir, memory.*), not from moe_config"
            )
        return v

    @field_validator("serving_config")
    @classmethod
    def _serving_config(cls, v: dict[str, Any]) -> dict[str, Any]:
        clash = sorted(ADAPTER_SERVING_KEYS & v.keys())
        if clash:
            raise ValueError(
                f"{', '.join(clash)} are set by the adapter per cell (block size, concurrency, baseline)"
            )
        return v
