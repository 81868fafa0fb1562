"""Per-cell setup: what a configuration needs from the loaded build (refusals), and what it switches (the plan).

Each check raises :class:`~pd_dflash.engine.interface.Refused` with the missing piece named; the runner turns
it into the row. Upstream's refusal rule holds (offloaded cells with no offloaded expert are refused with the
fix), and a B3 that does not fit resident is UNAVAILABLE_CAPACITY.
"""

from __future__ import annotations

from dataclasses import dataclass

from pd_dflash.baselines import configuration
from pd_dflash.engine.interface import EngineContext, Refused
from pd_dflash.engine.moe_infinity import metrics as m
from pd_dflash.engine.moe_infinity.features import ROUTE_AHEAD_SEAM
from pd_dflash.engine.moe_infinity.loading import Loaded
from pd_dflash.engine.moe_infinity.options import MoEInfinityOptions
from pd_dflash.schema import Status
from pd_dflash.spec import Cell

#: Upstream's "unbounded" expert-byte budget for B2 (its value was not visible; any bound above M works).
B2_UNBOUNDED_EXPERT_BYTES = 1 << 62


@dataclass(frozen=True)
class CellPlan:
    speculative: bool
    #: True/False: the route-ahead prefetcher hook is bound / switched off; None: not speculative.
    route_ahead: bool | None
    #: The four verify budgets passed to the serving scheduler, or None (scheduler's verify gate off).
    verify_budgets: dict[str, int] | None
    #: "ar_batched", "spec_sessions" (per-round driver) or "spec_whole_request" (one generate per request).
    serving_path: str


def _sessions(loaded: Loaded) -> bool:
    """The build drives speculative decoding round by round through the verify-round scheduler."""
    return loaded.build.verify_scheduler and loaded.build.session_seam


def _check_load_group(ctx: EngineContext, cell: Cell) -> None:
    if cell.offloaded == (ctx.load_group == "resident"):
        raise RuntimeError(
            f"{cell.baseline} cell sent to the {ctx.load_group} load: the registry marks MoE-Infinity "
            "separate_resident_load, so B3 needs its own load and the offloaded baselines the shared one"
        )


def _check_applied_ratio(loaded: Loaded, cell: Cell, requested: float) -> None:
    """B3 means every expert resident at the resident ratio: a ratio the library cut is not B3."""
    applied = loaded.applied_ratio
    if cell.offloaded or applied is None or abs(applied - requested) <= 1e-9:
        return
    kv = loaded.facts.get("kv_cache_memory_ratio")
    raise Refused(
        Status.REFUSED,
        f"B3 needs every expert resident at resident_memory_ratio={requested}, but MoE-Infinity applied "
        f"device_memory_ratio={applied} (ArcherConfig reserves kv_cache_memory_ratio={kv} for its native KV cache "
        "and cuts the device ratio so that both sum to at most 1); set memory.resident_memory_ratio below 1.0 so "
        "the adapter can pin it",
    )


def _check_offload(loaded: Loaded, cell: Cell, requested: float) -> None:
    """Upstream's refusal rule, and B3's capacity (at the ratio MoE-Infinity applied)."""
    ratio = loaded.applied_ratio if loaded.applied_ratio is not None else requested
    if cell.offloaded and loaded.num_offloaded <= 0:
        raise Refused(
            Status.REFUSED,
            f"{cell.baseline} must run with offloaded experts, but MoE-Infinity offloaded none at "
            f"device_memory_ratio={ratio}; lower memory.device_memory_ratio (below 0.9, e.g. 0.85) so experts "
            "are offloaded",
        )
    if not cell.offloaded and loaded.num_offloaded > 0:
        raise Refused(
            Status.UNAVAILABLE_CAPACITY,
            f"B3 needs every expert resident, but {loaded.num_offloaded} experts stay offloaded at "
            f"resident_memory_ratio={ratio}: the model does not fit this device",
        )


def _check_drafter(loaded: Loaded, cell: Cell) -> None:
    if loaded.speculator is None:
        raise Refused(Status.REFUSED, f"{cell.baseline} needs a DFlash drafter: models[].draft is empty")
    if loaded.draft_block_size is not None and cell.block_size > loaded.draft_block_size:
        raise Refused(
            Status.REFUSED,
            f"block size {cell.block_size} exceeds the drafter's block size {loaded.draft_block_size}",
        )


def _check_verify_scheduler(loaded: Loaded, cell: Cell) -> None:
    build = loaded.build
    if configuration(cell.baseline).admission == "all" or _sessions(loaded):
        return
    missing = [] if build.verify_scheduler else ["verify budgets in the serving Scheduler"]
    missing += [] if build.session_seam else ["DFlashSpeculator begin_session/draft_round/verify_round"]
    raise Refused(
        Status.BLOCKED_UNTIL_2D_SCHEDULER,
        f"{cell.baseline} needs MoE-Infinity's verify-round scheduler; this build lacks {' and '.join(missing)}",
    )


def _check_route_ahead_switch(loaded: Loaded, cell: Cell) -> None:
    """A configuration without route-ahead (B1/B2/B3) needs it switchable off; one with it (OURS) needs a
    prefetcher to bind."""
    b = cell.baseline
    if not configuration(b).route_ahead:
        if not loaded.build.route_ahead_switch:
            raise Refused(
                Status.REFUSED,
                f"{b} needs DFlash with route-ahead prefetch OFF, but this MoE-Infinity build has no "
                f"DFlashSpeculator.{ROUTE_AHEAD_SEAM} hook to switch it off: {b} would silently use OURS's "
                "prefetch path",
                kind="documented",  # a build feature (docs/moe-infinity.md)
            )
        if getattr(getattr(loaded.moe, "engine_config", None), "speculative_prefetch", False):
            raise Refused(
                Status.REFUSED,
                f"{b} needs route-ahead OFF, but the load config has speculative_prefetch on: the expert "
                "executor would still prefetch routed experts during verify",
            )
    elif getattr(loaded.moe.engine, "expert_prefetcher", None) is None:
        raise Refused(
            Status.REFUSED,
            f"{b} needs route-ahead, but the offload engine exposes no expert_prefetcher",
            kind="documented",
        )


def _check_concurrency(ctx: EngineContext, loaded: Loaded, cell: Cell) -> None:
    sessions, build = _sessions(loaded), loaded.build
    if cell.concurrency > 1 and not build.persistent_sessions:
        raise Refused(
            Status.REFUSED,
            f"concurrency {cell.concurrency}: this MoE-Infinity build predates persistent speculative sessions "
            "(pre-#173: ContinuousBatchingEngine has no speculative_sessions), so a speculative request runs to "
            "completion inside one serving step and a multi-request batch would silently decode "
            "autoregressively; only c=1 can be measured. The concurrency sweep needs a post-#173 build "
            "(docs/moe-infinity.md)",
            kind="documented",
        )
    if cell.concurrency > 1 and not sessions:
        raise Refused(
            Status.REFUSED,
            f"concurrency {cell.concurrency}: persistent speculative sessions need the verify-round scheduler "
            "and DFlashSpeculator's begin_session/draft_round/verify_round, which this build lacks, and a "
            "multi-request batch would silently decode autoregressively; only c=1 can be measured",
            kind="documented",
        )
    if not sessions and ctx.workload.temperature > 0:
        raise Refused(
            Status.REFUSED,
            "the whole-request speculative path of this build is greedy-only (temperature 0)",
            kind="documented",
        )


def gate(ctx: EngineContext, loaded: Loaded, cell: Cell, ratio: float) -> None:
    """Raise Refused when the loaded build cannot run ``cell`` as labelled (RuntimeError for a routing bug)."""
    _check_load_group(ctx, cell)
    _check_applied_ratio(loaded, cell, ratio)
    _check_offload(loaded, cell, ratio)
    if not cell.speculative:
        return
    _check_drafter(loaded, cell)
    _check_verify_scheduler(loaded, cell)
    _check_route_ahead_switch(loaded, cell)
    _check_concurrency(ctx, loaded, cell)


def budgets(tokens: int, token_cap: int, expert_bytes: int, byte_cap: int) -> dict[str, int]:
    return {
        "verify_token_budget": int(tokens),
        "verify_token_deficit_cap": int(token_cap),
        "verify_expert_byte_budget": int(expert_bytes),
        "verify_expert_byte_deficit_cap": int(byte_cap),
    }


def _ours_byte_budget(options: MoEInfinityOptions, h2d: float | None) -> int:
    if options.expert_byte_budget != "h2d_window":
        return int(options.expert_byte_budget)
    if h2d is None:
        raise Refused(
            Status.REFUSED,
            "OURS's expert_byte_budget 'h2d_window' needs the probed host-to-device bandwidth, and there is no "
            "CUDA device to probe; set engine_options.expert_byte_budget to a byte count",
        )
    return max(1, int(h2d * options.expert_byte_window_seconds))


def plan(options: MoEInfinityOptions, loaded: Loaded, cell: Cell, h2d: float | None) -> CellPlan:
    """What the cell switches: speculator, route-ahead, verify budgets, serving path."""
    config, bs, c = configuration(cell.baseline), cell.block_size, cell.concurrency
    if not cell.speculative:
        return CellPlan(False, None, None, "ar_batched")
    if config.admission == "all":  # B3: B1's speculative path on the resident load (upstream's B3)
        if not _sessions(loaded):
            return CellPlan(True, False, None, "spec_whole_request")
        unbounded = B2_UNBOUNDED_EXPERT_BYTES
        return CellPlan(True, False, budgets(bs * c, bs * c, unbounded, unbounded), "spec_sessions")
    choice = options.verify_token_budget
    tokens = bs if choice == "block" else bs * c if choice == "block_x_concurrency" else int(choice)
    if config.admission == "token_deficit":
        unbounded = B2_UNBOUNDED_EXPERT_BYTES
        return CellPlan(True, False, budgets(tokens, max(tokens, bs), unbounded, unbounded), "spec_sessions")
    byte_budget = _ours_byte_budget(options, h2d)
    # The cap must cover the largest single demand (a verify routing every expert, M bytes).
    byte_cap = max(byte_budget, m.total_expert_bytes(loaded.moe.engine) or 0)
    return CellPlan(
        True, config.route_ahead, budgets(tokens, max(tokens, bs), byte_budget, byte_cap), "spec_sessions"
    )
