"""Run-time checks on a measurement: it ran the configuration it is labelled with, or the row says why not.

Postconditions raise :class:`~pd_dflash.engine.interface.Refused` (a measurement of another configuration is not
reported under this one's name; of kind "documented": the library's behaviour, docs/moe-infinity.md, not the
spec's); ``flags`` returns warnings for library-side risks that leave the metrics honest
but the configuration slower than it should be.
"""

from __future__ import annotations

from pd_dflash.engine.interface import Refused
from pd_dflash.engine.moe_infinity.cells import CellPlan
from pd_dflash.engine.moe_infinity.measure import Observation
from pd_dflash.schema import Status
from pd_dflash.spec import Cell

#: Model-runner rows per emitted token above which an autoregressive step is flagged (one is the norm: every
#: emitted token comes from one row of one forward).
MAX_ROWS_PER_TOKEN = 1.5


def _verify_rounds(obs: Observation) -> int:
    rounds = obs.rounds
    return len(rounds.committed) + rounds.missing_accept if rounds is not None else 0


def _check_speculative(cell: Cell, plan: CellPlan, obs: Observation) -> None:
    tokens, requests = sum(t.tokens for t in obs.run.traces), len(obs.run.traces)
    if plan.speculative and obs.rounds is not None and not _verify_rounds(obs) and tokens > requests:
        raise Refused(  # more than each request's first token, yet no verify round
            Status.REFUSED,
            f"the serving engine generated {tokens} tokens without a single DFlash verify round (it fell back "
            f"to autoregressive decoding); refusing to report that as {cell.baseline}",
            kind="documented",
        )


def _check_route_ahead(cell: Cell, plan: CellPlan, obs: Observation) -> None:
    stats = obs.stats
    if plan.route_ahead is False and stats and (stats.get("predicted_experts") or 0) > 0:
        raise Refused(
            Status.REFUSED,
            f"route-ahead was switched off for {cell.baseline}, yet RouteAheadStats counted "
            f"{stats['predicted_experts']} predicted experts: the switch did not take on this build",
            kind="documented",
        )
    rounds = _verify_rounds(obs)
    if plan.route_ahead and stats is not None and rounds and not stats.get("steps"):
        raise Refused(
            Status.REFUSED,
            f"route-ahead recorded nothing over {rounds} verify rounds: RouteAheadStats saw no MoE layer at the "
            "verify's route-ahead seam (gpt-oss experts never reach MoE-Infinity's expert executor, or the "
            "sessions fed a recorder the adapter could not reach), so OURS's coverage and waste would be "
            "vacuous",
            kind="documented",
        )


def _check_sessions_in_flight(cell: Cell, plan: CellPlan, obs: Observation) -> None:
    peak = obs.loop.peak_speculative_sessions
    expected = min(cell.concurrency, len(obs.run.traces))
    if plan.serving_path == "spec_sessions" and cell.concurrency > 1 and peak is not None and peak < expected:
        raise Refused(
            Status.REFUSED,
            f"concurrency {cell.concurrency}: at most {peak} persistent speculative sessions were in flight "
            f"(ContinuousBatchingEngine.speculative_sessions), so {expected} requests were not decoded "
            f"speculatively together; refusing to report that as {cell.baseline} at c={cell.concurrency}",
            kind="documented",
        )


def postconditions(cell: Cell, plan: CellPlan, obs: Observation) -> None:
    """Refuse a measurement that did not run the configuration it is labelled with."""
    _check_speculative(cell, plan, obs)
    _check_route_ahead(cell, plan, obs)
    _check_sessions_in_flight(cell, plan, obs)


def model_executions(plan: CellPlan, obs: Observation) -> tuple[dict | None, list[str]]:
    """Model-runner executions per emitted token (facts), and the flag for a step that runs a batch twice.

    In one post-#173 ``serving/engine.py`` a standard step appears to run its batch through the model three
    times (``_execute_batch``, ``_execute_and_commit`` and again in ``_step_standard``), which would cut B0
    throughput without any error. Autoregressive cells emit one token per model-runner row, so more rows than
    tokens show it.
    """
    executions = obs.loop.executions
    tokens = sum(t.tokens for t in obs.run.traces)
    if executions is None or not tokens:
        return None, []
    ratio = executions.rows / tokens
    facts = {"executions": executions.calls, "rows": executions.rows, "rows_per_emitted_token": ratio}
    if plan.speculative or ratio <= MAX_ROWS_PER_TOKEN:
        return facts, []
    return facts, [
        f"model_runner executed {ratio:.2f} sequence rows per emitted token (expected 1): the serving engine "
        "ran each batch through the model more than once per step, so output_tokens_per_second understates "
        "this configuration (a library-side cost, not the configuration's)"
    ]


def route_ahead_observer(plan: CellPlan, obs: Observation) -> list[str]:
    """Route-ahead OFF: the check that it stayed off needs the verify seam to have recorded something."""
    stats = obs.stats
    if plan.route_ahead is False and stats is not None and _verify_rounds(obs) and not stats.get("steps"):
        return [
            "route-ahead OFF could not be verified: RouteAheadStats saw no MoE layer at the verify's route-ahead "
            "seam during the timed loop"
        ]
    return []
