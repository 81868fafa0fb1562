"""From what the timed loop observed to the cell's trace: MoE-Infinity's readings vetted, with their sources.

The metrics themselves are derived once, for both engines, by ``pd_dflash.engine.measurement.engine_result``
from the :class:`~pd_dflash.engine.measurement.CellTrace` built here (definitions in docs/metrics.md). What stays
here is observation: which accessor a value came from, and whether a reading stands. A metric the build cannot
measure is None in the trace with its reason (the row is PARTIAL), never 0.0, and a 0.0 from one of
MoE-Infinity's wrappers counts only when the native getter behind it is present and nothing in the cell
contradicts it. Before the trace is built, ``checks.postconditions`` refuses a measurement that did not run the
configuration it is labelled with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pd_dflash.engine import nvml
from pd_dflash.engine.measurement import CellTrace, ExpertCacheTrace, LinkFacts, PrefetchTrace, Rounds
from pd_dflash.engine.moe_infinity import checks
from pd_dflash.engine.moe_infinity import metrics as m
from pd_dflash.engine.moe_infinity.cells import CellPlan
from pd_dflash.engine.moe_infinity.loading import Loaded
from pd_dflash.engine.moe_infinity.measure import Observation
from pd_dflash.spec import Cell
from pd_dflash.upstream import REQUIRED_METRICS


@dataclass
class Derived:
    """One derived value, where it came from, and what the row must say about it."""

    value: Any = None
    sources: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)
    #: Why each metric this derivation could not observe is absent (``CellTrace.absent``).
    absent: dict[str, str] = field(default_factory=dict)


def rounds(plan: CellPlan, cell: Cell, obs: Observation) -> Derived:
    """The verify rounds as the trace holds them: commits clipped as upstream (min(accept + 1, B)), none observed
    for an autoregressive cell (τ = 1 by construction), a request's chunk gaps as the round times, and the
    verify rounds of a c = 1 speculative loop that ran inside one serving step (no per-round stream)."""
    log, out = obs.rounds, Derived()
    committed = None
    if plan.speculative:
        committed = m.clip_commits(log.committed if log else [], cell.block_size)
        if not committed:
            out.absent["acceptance_length_a"] = m.ABSENT["acceptance_length_a"]
    gaps = [g for t in obs.run.traces for g in t.chunk_gaps()]
    untimed = 0
    if not gaps and plan.speculative and cell.concurrency == 1 and log and log.committed:
        # The request ran inside one serving step (no per-round stream); at c=1 the loop is sequential.
        untimed = len(log.committed)
        out.sources["per_round_latency_seconds"] = "timed loop / observed verify rounds (no per-round stream)"
    elif not gaps:
        out.absent["per_round_latency_seconds"] = (
            "per_round_latency_seconds absent: no request received tokens in two serving steps"
        )
    if log is not None and log.missing_accept:
        out.warnings.append(f"{log.missing_accept} verify results carried no accept count (not counted)")
    out.value = Rounds(
        committed=committed,
        seconds=gaps,
        verify_seconds=log.verify_seconds if log else [],
        draft_seconds=log.draft_seconds if log else None,
        untimed=untimed,
    )
    return out


def prefetch_metrics(plan: CellPlan, obs: Observation) -> Derived:
    """Coverage and wasted bytes of the configuration's prefetcher (docs/metrics.md, metrics 7 and 8).

    OURS: route-ahead, from RouteAheadStats (fed through the sessions' route recorders). B0-B3: MoE-Infinity's
    AR prefetcher, whose predictions no accessor exposes, so coverage is absent; wasted bytes come from the
    native waste counter (timed-loop delta) where the build has one, for OURS too when its statistics carried no
    byte sizes.
    """
    stats, out = obs.stats, Derived((None, None))
    coverage = wasted = None
    if not plan.route_ahead:
        out.warnings.append(m.ABSENT["route_ahead_prefetch_coverage"])
    elif stats is None:
        out.warnings.append(m.NO_ROUTE_AHEAD_STATS)
    else:
        coverage = float(stats["coverage"])
        out.sources["route_ahead_prefetch_coverage"] = "RouteAheadStats.coverage"
        if not stats.get("actual_experts"):
            out.warnings.append(m.VACUOUS_COVERAGE)
        if stats.get("wasted_prefetch_bytes") is not None:
            wasted = int(stats["wasted_prefetch_bytes"])
            out.sources["wasted_prefetch_bytes"] = "RouteAheadStats.wasted_prefetch_bytes"
    if wasted is None:
        native = native_waste(obs)
        wasted = native.value
        out.sources.update(native.sources)
        out.warnings += native.warnings
    out.value = (coverage, wasted)
    return out


def native_waste(obs: Observation) -> Derived:
    """Wasted prefetch bytes over the timed loop from MoE-Infinity's native counter (absent without one)."""
    getter = obs.native_getters.get("wasted_prefetch_bytes")
    before, after = obs.baseline.wasted_before, obs.wasted_after
    if after is None or before is None:
        return Derived(warnings=[m.ABSENT["wasted_prefetch_bytes"]])
    if getter is None:  # the wrapper's 0.0 stands for a missing native counter
        return Derived(warnings=[m.vet_zero("wasted_prefetch_bytes", 0.0, None, None)])
    source = f"{getter} via expert_prefetcher.wasted_prefetch_bytes (timed-loop delta)"
    return Derived(round(max(after - before, 0.0)), {"wasted_prefetch_bytes": source})


def native_metrics(obs: Observation) -> Derived:
    """Hit rate and expert occupancy from MoE-Infinity's accessors: absent when missing or an unproven 0.0."""
    out, tokens = Derived({}), sum(t.tokens for t in obs.run.traces)
    evidence = {
        "expert_cache_hit_rate": f"although the timed loop routed {tokens} tokens through the experts",
        "expert_occupancy_bytes": f"although experts were on the device to compute {tokens} tokens",
    }
    for name, (value, source) in (
        ("expert_cache_hit_rate", obs.hit),
        ("expert_occupancy_bytes", obs.occupancy),
    ):
        rejected = m.vet_zero(name, value, obs.native_getters.get(name), evidence[name] if tokens else None)
        if rejected:
            out.warnings.append(rejected)
            value = None
        elif value is None:
            out.warnings.append(m.ABSENT[name] + (f" ({source})" if source else ""))
        else:
            out.sources[name] = source or ""
        out.value[name] = round(value) if value is not None and name.endswith("_bytes") else value
    return out


def kv_occupancy(plan: CellPlan, obs: Observation) -> Derived:
    """Peak KV bytes the serving engine held: the paged cache, or for speculative sessions their private caches.

    A speculative commit appends no paged KV (``update_after_step(new_decode_seq_ids=[])``): the paged cache of a
    speculative sequence holds its prompt blocks only, while the target's KV lives in the session's private cache.
    """
    paged, sessions = obs.paged_kv_bytes, obs.loop.sessions
    private = sessions.private_kv_peak_tokens if sessions is not None else None
    if not plan.speculative:
        if paged is not None:
            return Derived(
                paged, {"kv_occupancy_bytes": "serving PagedKVCache: peak blocks in use x block bytes"}
            )
        value, source = obs.native_kv
        if value is None:
            return Derived(warnings=[m.ABSENT["kv_occupancy_bytes"]])
        return Derived(round(value), {"kv_occupancy_bytes": source or ""})
    facts = {"paged_kv_prompt_only_peak_bytes": paged} if paged is not None else {}
    if private:
        source = "speculative sessions' private target caches: peak of their summed get_seq_length() x KV bytes per token"
        return Derived(private * obs.token_kv_bytes, {"kv_occupancy_bytes": source}, facts=facts)
    if paged is None:
        return Derived(warnings=[m.ABSENT["kv_occupancy_bytes"]], facts=facts)
    label = (
        "kv_occupancy_bytes counts the paged prompt blocks only: MoE-Infinity keeps a speculative request's target "
        "KV in a private cache this serving path does not expose, so the value is not comparable with B0"
    )
    return Derived(paged, {"kv_occupancy_bytes": "serving PagedKVCache (prompt blocks only)"}, [label], facts)


def exposed_fetch(obs: Observation, hit_rate: float | None, offloaded_experts: int) -> Derived:
    """Reset before the timed loop, or a delta over it; a counter unreadable before gives no delta.

    ``get_exposed_fetch_seconds`` reads 0.0 when fetches bypass its timer, so 0.0 stands only where nothing had
    to be fetched on demand: nothing offloaded, or an expert cache that never missed.
    """
    after, base = obs.exposed_after, obs.baseline
    if after is None or not (base.exposed_reset or base.exposed_before is not None):
        return Derived(warnings=[m.ABSENT["exposed_fetch_seconds"]])
    value = max(after if base.exposed_reset else after - base.exposed_before, 0.0)
    if offloaded_experts <= 0 or hit_rate == 1.0:
        return Derived(value)
    evidence = (
        f"although the expert cache missed (hit rate {hit_rate:.3f}: every miss is an on-demand fetch)"
        if hit_rate is not None
        else "with no hit rate to show that nothing was fetched on demand"
    )
    rejected = m.vet_zero("exposed_fetch_seconds", value, "OffloadEngine.get_exposed_fetch_seconds", evidence)
    return Derived(warnings=[rejected]) if rejected else Derived(value)


def _concurrency_warnings(cell: Cell, observed: int, requests: int) -> list[str]:
    if observed >= min(cell.concurrency, requests):
        return []
    return [
        f"concurrency {cell.concurrency} requested, but at most {observed} requests were observed in flight "
        "(between their first and last token)"
    ]


def _facts(facts: dict[str, Any], cell: Cell, plan: CellPlan, obs: Observation, sources, extra) -> dict:
    out = {
        **facts,
        "configuration": {
            "route_ahead": plan.route_ahead,
            "verify_budgets": plan.verify_budgets,
            "serving_path": plan.serving_path,
            "max_batch_size": cell.concurrency,
            "block_size": cell.block_size,
        },
        "observed_max_in_flight": m.observed_max_in_flight(obs.run.traces),
        "serving_steps": obs.run.steps,
        "metric_sources": sources,
    }
    if obs.bindings:
        out["route_ahead_bindings"] = dict(obs.bindings)
    if obs.stats is not None and not plan.route_ahead:
        out["route_ahead_observer"] = obs.stats  # route-ahead off: what the verify seam saw (predicted = 0)
    rounds, sessions = obs.rounds, obs.loop.sessions
    if rounds is not None and rounds.demand_bytes:
        out["mean_verify_demand_bytes"] = sum(rounds.demand_bytes) / len(rounds.demand_bytes)
    if sessions is not None and sessions.sessions:
        out["speculative_sessions"] = {
            "opened": len(sessions.sessions),
            "route_recorders_teed": sessions.teed,
        }
    if obs.loop.peak_speculative_sessions is not None:
        out["peak_speculative_sessions"] = obs.loop.peak_speculative_sessions
    return {**out, **extra}


def split_absences(derived: list[Derived], values: dict[str, Any]) -> tuple[list[str], dict[str, str]]:
    """The helpers' warnings as notes and absence reasons: a warning that starts with the name of a metric left
    None in ``values`` is why that metric is absent (every reason keeps the metric's name first, ``metrics.py``)."""
    notes: list[str] = []
    absent: dict[str, str] = {k: v for d in derived for k, v in d.absent.items()}
    for d in derived:
        for w in d.warnings:
            name = next(
                (k for k in REQUIRED_METRICS if k in values and values[k] is None and w.startswith(k)), None
            )
            if name is None:
                notes.append(w)
            else:
                absent[name] = f"{absent[name]}; {w}" if name in absent else w
    return notes, absent


def cell_trace(
    loaded: Loaded, facts: dict, cell: Cell, plan: CellPlan, obs: Observation, h2d, cuda
) -> CellTrace:
    """The cell's trace from the observation (``measurement.engine_result`` turns it into the row)."""
    checks.postconditions(cell, plan, obs)
    timed, loop = [t.timing() for t in obs.run.traces], rounds(plan, cell, obs)
    prefetch, native, kv = prefetch_metrics(plan, obs), native_metrics(obs), kv_occupancy(plan, obs)
    exposed = exposed_fetch(obs, native.value["expert_cache_hit_rate"], loaded.num_offloaded)
    executions, execution_warnings = checks.model_executions(plan, obs)
    coverage, wasted = prefetch.value
    values = {
        **native.value,
        "route_ahead_prefetch_coverage": coverage,
        "wasted_prefetch_bytes": int(wasted) if wasted is not None else None,
        "kv_occupancy_bytes": kv.value,
    }
    h2d_absent = Derived(warnings=[m.ABSENT["measured_h2d_bytes_per_second"]] if h2d is None else [])
    observed = Derived(
        warnings=_concurrency_warnings(cell, m.observed_max_in_flight(obs.run.traces), len(timed))
    )
    notes, absent = split_absences([loop, prefetch, native, kv, exposed, h2d_absent, observed], values)
    sources = {**loop.sources, **prefetch.sources, **native.sources, **kv.sources}
    extra = {**kv.facts, **({"model_runner": executions} if executions else {})}
    start = obs.telemetry_start
    end = nvml.telemetry(0) if cuda else None
    return CellTrace(
        requests=timed,
        rounds=loop.value,
        timed_seconds=obs.run.elapsed,
        cache=ExpertCacheTrace(
            hit_rate=values["expert_cache_hit_rate"],
            peak_occupancy_bytes=values["expert_occupancy_bytes"],
            exposed_fetch_seconds=exposed.value,
        ),
        prefetch=PrefetchTrace(
            coverage=coverage,
            wasted_bytes=values["wasted_prefetch_bytes"],
            route_ahead=obs.stats if plan.route_ahead else None,
        ),
        kv_peak_bytes=kv.value,
        link=LinkFacts(
            kind=("real" if cell.offloaded else "none") if cuda else None, probe_bytes_per_second=h2d
        ),
        engine=_facts(facts, cell, plan, obs, sources, extra),
        telemetry={"start": start, "end": end} if start or end else None,
        timings=obs.timings,
        warnings=[
            *loaded.warnings,
            *obs.baseline.warnings,
            *notes,
            *checks.route_ahead_observer(plan, obs),
            *execution_warnings,
        ],
        absent=absent,
    )
