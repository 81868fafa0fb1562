"""From what the timed loop observed to the row: the ten metrics, cost terms, facts and warnings.

Metric definitions are in docs/metrics.md; per-request TTFT, TPOT and goodput use the shared rules of
``pd_dflash.engine.request_metrics``. A metric the build cannot measure is absent with a warning (the row is
PARTIAL), never 0.0, and a 0.0 from one of MoE-Infinity's wrappers counts only when the native getter behind it
is present and nothing in the cell contradicts it. Before any metric is derived, ``checks.postconditions``
refuses a measurement that did not run the configuration it is labelled with.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pd_dflash.engine import nvml, request_metrics
from pd_dflash.engine.interface import EngineContext
from pd_dflash.engine.moe_infinity import checks
from pd_dflash.engine.moe_infinity import metrics as m
from pd_dflash.engine.moe_infinity.cells import CellPlan
from pd_dflash.engine.moe_infinity.loading import Loaded
from pd_dflash.engine.moe_infinity.measure import Observation
from pd_dflash.engine.moe_infinity.serving import RoundLog
from pd_dflash.schema import CostTerms, EngineResult, Status
from pd_dflash.spec import Cell


@dataclass
class Derived:
    """One derived value, where it came from, and what the row must say about it."""

    value: Any = None
    sources: dict[str, str] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)


def acceptance(plan: CellPlan, rounds: RoundLog | None, block_size: int) -> Derived:
    """τ and its histogram from the verify rounds; autoregressive cells commit one token per round."""
    if not plan.speculative:
        return Derived((1.0, None))
    a, histogram = m.acceptance(rounds.committed if rounds else [], block_size)
    return Derived((a, histogram), warnings=[m.ABSENT["acceptance_length_a"]] if a is None else [])


def per_round_latency(plan: CellPlan, cell: Cell, obs: Observation) -> Derived:
    gaps = [g for t in obs.run.traces for g in t.chunk_gaps()]
    if gaps:
        return Derived(sum(gaps) / len(gaps))
    rounds = obs.rounds
    if plan.speculative and cell.concurrency == 1 and rounds and rounds.committed:
        # The request ran inside one serving step (no per-round stream); at c=1 the loop is sequential.
        return Derived(
            obs.run.elapsed / len(rounds.committed),
            sources={
                "per_round_latency_seconds": "timed loop / observed verify rounds (no per-round stream)"
            },
        )
    return Derived(
        warnings=["per_round_latency_seconds absent: no request received tokens in two serving steps"]
    )


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


def _round_samples(rounds: RoundLog | None) -> tuple[dict[str, list[float]], list[str]]:
    if rounds is None:
        return {}, []
    samples = {"draft_seconds": rounds.draft_seconds, "verify_seconds": rounds.verify_seconds}
    missing = rounds.missing_accept
    return samples, [f"{missing} verify results carried no accept count (not counted)"] if missing else []


def per_request(ctx: EngineContext, obs: Observation) -> Derived:
    """Throughput, mean TTFT, goodput and the latency distributions over the timed requests."""
    run = obs.run
    timings = [t.timing() for t in run.traces]
    tokens = sum(t.tokens for t in timings)
    ttfts = [t.ttft for t in timings if t.ttft is not None]
    round_samples, round_warnings = _round_samples(obs.rounds)
    samples = {
        **request_metrics.latency_samples(timings),
        "round_seconds": [g for t in run.traces for g in t.chunk_gaps()],
        **round_samples,
    }
    value = {
        "output_tokens_per_second": tokens / run.elapsed,
        "ttft_seconds": sum(ttfts) / len(ttfts) if ttfts else None,
        "goodput_at_slo": request_metrics.goodput(timings, ctx.slo, run.elapsed),
        "latency": request_metrics.latency_stats(samples),
        "requests": len(timings),
        "generated_tokens": tokens,
    }
    return Derived(value, warnings=round_warnings)


def _cost_terms(
    cell: Cell, coverage, wasted, exposed: float | None, h2d: float | None, cuda: bool
) -> CostTerms:
    return CostTerms(
        route_ahead_coverage=coverage,
        wasted_prefetch_bytes=int(wasted) if wasted is not None else None,
        measured_h2d_bytes_per_second=h2d,
        h2d_bandwidth_source="probe" if h2d is not None else None,
        h2d_link=("real" if cell.offloaded else "none") if cuda else None,
        exposed_fetch_seconds=exposed,
    )


def assemble(
    ctx: EngineContext, loaded: Loaded, facts: dict, cell: Cell, plan: CellPlan, obs: Observation, h2d, cuda
) -> EngineResult:
    """The row's metrics from the observation; PARTIAL when any metric is absent."""
    checks.postconditions(cell, plan, obs)
    requests = per_request(ctx, obs)
    accept, per_round = acceptance(plan, obs.rounds, cell.block_size), per_round_latency(plan, cell, obs)
    prefetch, native, kv = prefetch_metrics(plan, obs), native_metrics(obs), kv_occupancy(plan, obs)
    exposed = exposed_fetch(obs, native.value["expert_cache_hit_rate"], loaded.num_offloaded)
    executions, execution_warnings = checks.model_executions(plan, obs)
    (a, histogram), (coverage, wasted), req = accept.value, prefetch.value, requests.value
    observed = m.observed_max_in_flight(obs.run.traces)
    warnings = [
        *loaded.warnings,
        *obs.baseline.warnings,
        *accept.warnings,
        *per_round.warnings,
        *prefetch.warnings,
        *native.warnings,
        *kv.warnings,
        *exposed.warnings,
        *([m.ABSENT["measured_h2d_bytes_per_second"]] if h2d is None else []),
        *_concurrency_warnings(cell, observed, req["requests"]),
        *requests.warnings,
        *checks.route_ahead_observer(plan, obs),
        *execution_warnings,
    ]
    values = {
        "output_tokens_per_second": req["output_tokens_per_second"],
        "acceptance_length_a": a,
        "ttft_seconds": req["ttft_seconds"],
        "per_round_latency_seconds": per_round.value,
        "goodput_at_slo": req["goodput_at_slo"],
        "expert_cache_hit_rate": native.value["expert_cache_hit_rate"],
        "route_ahead_prefetch_coverage": coverage,
        "wasted_prefetch_bytes": wasted,
        "expert_occupancy_bytes": native.value["expert_occupancy_bytes"],
        "kv_occupancy_bytes": kv.value,
    }
    sources = {**per_round.sources, **prefetch.sources, **native.sources, **kv.sources}
    extra = {**kv.facts, **({"model_runner": executions} if executions else {})}
    rounds, start = obs.rounds, obs.telemetry_start
    end = nvml.telemetry(0) if cuda else None
    return EngineResult(
        **values,
        status=Status.OK if all(v is not None for v in values.values()) else Status.PARTIAL,
        warnings=warnings,
        cost_terms=_cost_terms(cell, coverage, wasted, exposed.value, h2d, cuda),
        t_draft_seconds=sum(rounds.draft_seconds) if rounds and rounds.draft_seconds else None,
        t_verify_seconds=sum(rounds.verify_seconds) if rounds and rounds.verify_seconds else None,
        latency=req["latency"],
        acceptance_histogram=histogram,
        route_ahead=obs.stats if plan.route_ahead else None,
        requests=req["requests"],
        generated_tokens=req["generated_tokens"],
        timed_seconds=obs.run.elapsed,
        engine=_facts(facts, cell, plan, obs, sources, extra),
        telemetry={"start": start, "end": end} if start or end else None,
        timings=obs.timings,
    )
