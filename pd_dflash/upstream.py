"""Names and constants fixed by upstream's Phase-A design (the PD-DFlash change in ``shared/upstream``).

Everything that must match upstream byte for byte lives here, once: the baselines and their descriptions, the
ten ``REQUIRED_METRICS`` in upstream order, ``RouteAheadStats.as_dict()`` keys, the NVTX range names, the CSV
header and the configurations a complete group needs. The rest of the package imports them from here.
"""

from __future__ import annotations

#: Upstream's description strings, kept verbatim (what each configuration does: ``baselines.py``).
BASELINE_DESCRIPTIONS: dict[str, str] = {
    "B0": "AR MoE on MoE-Infinity, offloaded, no speculative decoding",
    "B1": "DFlash with unchanged AR prefetcher",
    "B2": "DFlash with token-deficit scheduler and no expert-byte coupling",
    "B3": "target experts resident, no offload upper bound",
    "OURS": "DFlash with route-ahead prefetch and the 2-D co-designed scheduler",
}
#: Upstream's configurations of a complete group (``evaluate_matrix`` loops over these only).
UPSTREAM_BASELINES: tuple[str, ...] = ("B0", "B1", "B2", "B3")
#: The one configuration upstream's ``validate_result_matrix`` excuses when its status is UNAVAILABLE_CAPACITY (the
#: all-resident bound, which may not fit).
CAPACITY_EXEMPT = "B3"
#: Upstream refuses an offloaded ratio at or above this: the model would not offload.
OFFLOAD_RATIO_LIMIT = 0.9

#: Upstream's metric tuple, in upstream order. Units: tok/s, tokens/round, s, s, tok/s, ratio, ratio, bytes,
#: bytes, bytes.
REQUIRED_METRICS: tuple[str, ...] = (
    "output_tokens_per_second",
    "acceptance_length_a",
    "ttft_seconds",
    "per_round_latency_seconds",
    "goodput_at_slo",
    "expert_cache_hit_rate",
    "route_ahead_prefetch_coverage",
    "wasted_prefetch_bytes",
    "expert_occupancy_bytes",
    "kv_occupancy_bytes",
)
RATIO_METRICS = frozenset({"expert_cache_hit_rate", "route_ahead_prefetch_coverage"})
#: Upstream ``RouteAheadStats.as_dict()`` keys, in upstream order (the last three are None without bytes).
ROUTE_AHEAD_KEYS: tuple[str, ...] = (
    "steps",
    "layers_observed",
    "predicted_experts",
    "actual_experts",
    "covered_experts",
    "kept_experts",
    "wasted_experts",
    "coverage",
    "waste_ratio",
    "predicted_prefetch_bytes",
    "kept_prefetch_bytes",
    "wasted_prefetch_bytes",
)
#: Upstream's NVTX range names (push/pop ranges; nsys renders them as ``:name``).
NVTX_RANGES: tuple[str, ...] = (
    "dflash_draft",
    "route_ahead_router",
    "route_ahead_issue",
    "target_verify",
    "expert_h2d",
)
#: Upstream's CSV header, exactly.
UPSTREAM_CSV_COLUMNS: tuple[str, ...] = (
    "model",
    "block_size",
    "concurrency",
    "baseline",
    "status",
    *REQUIRED_METRICS,
)
