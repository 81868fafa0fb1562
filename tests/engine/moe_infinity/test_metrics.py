"""The adapter's per-request traces feed the shared request metrics (``pd_dflash.engine.request_metrics``)."""

from __future__ import annotations

from pd_dflash.engine import request_metrics
from pd_dflash.engine.moe_infinity.metrics import RequestTrace, observed_max_in_flight
from pd_dflash.spec import SLO


def _trace(rid: str, submitted: float, chunks: list[tuple[int, float]], tokens: int) -> RequestTrace:
    return RequestTrace(
        request_id=rid,
        submitted=submitted,
        tokens=tokens,
        first_token=chunks[0][1],
        finished=chunks[-1][1],
        chunks=chunks,
    )


def test_one_token_request_has_no_tpot_and_passes_a_tpot_slo():
    one = _trace("a", 0.0, [(0, 0.5)], tokens=1)
    many = _trace("b", 0.0, [(0, 0.5), (1, 1.5)], tokens=5)
    timings = [one.timing(), many.timing()]
    assert timings[0].ttft == 0.5 and timings[0].tpot is None  # vLLM: TPOT only for more than one token
    assert timings[1].tpot == (1.5 - 0.5) / 4
    assert request_metrics.latency_samples(timings)["tpot_seconds"] == [0.25]
    # A 1 ms TPOT SLO: the one-token request passes, the other (250 ms per token) does not.
    assert request_metrics.goodput(timings, SLO(tpot_ms=1.0), 2.0) == 1 / 2.0


def test_observed_max_in_flight_counts_requests_between_first_and_last_chunk():
    traces = [
        _trace("a", 0.0, [(0, 0.1), (2, 0.3)], 2),
        _trace("b", 0.0, [(1, 0.2), (3, 0.4)], 2),
        _trace("c", 0.0, [(3, 0.4)], 1),
    ]
    assert observed_max_in_flight(traces) == 2
